"""Senders as real node agents connect: one keep-alive connection per agent, each posting its export once a second.

``bench/scale.py --per-agent-connections`` uses this instead of its few client threads: a head then serves as many
connections as a job has agents (2,048 at 16,384 ranks on 8-GPU nodes), which is what a thread-per-connection
server pays for. The connections are spread over a few sender processes (``processes``), forked once the request
bodies are built (copy-on-write: the bodies are not copied), each running one ``selectors`` loop over its
connections: connection ``i`` of ``n`` sends second ``s``'s body ``i`` at ``start + s + i / n`` (spread over the
second, as agents whose clocks differ), or as soon as its previous answer came when it is late (one request in
flight per connection, as an agent's exporter does). A sender never waits on a connection but its own, so a slow
head makes the connections fall behind, not the loop.

Each process reports, per second, when the last of its connections had that second's answer; the parent takes the
latest over processes: how far behind real time each second was acknowledged (``behind``), as ``send_all`` does.
"""

from __future__ import annotations

import heapq
import multiprocessing as mp
import selectors
import socket
import time
from typing import Callable

DEFAULT_PROCESSES = 4


class _Conn:
    """One agent's connection: the next second it sends, the bytes left to send, the answer read so far."""

    __slots__ = ("i", "k", "sock", "second", "out", "inbuf", "need")

    def __init__(self, i: int, k: int, sock: socket.socket):
        self.i, self.k, self.sock = i, k, sock  # i: the agent (body index); k: its place in this process's list
        self.second = 0
        self.out = memoryview(b"")
        self.inbuf = bytearray()
        self.need = -1  # bytes of the answer (head + body) once its head is read; -1: head not complete yet


def _answer_length(buf: bytearray) -> tuple[int, int]:
    """(status, head + body length) of an HTTP/1.1 answer whose head is in ``buf``; (0, -1) while it is not."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return 0, -1
    head = bytes(buf[:end]).decode("iso-8859-1").split("\r\n")
    status = int(head[0].split(" ", 2)[1])
    length = 0
    for line in head[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    return status, end + 4 + length


def _raise_open_files(want: int) -> None:
    try:
        import resource
    except ImportError:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))


def _sender(host: str, port: int, headers: bytes, seconds: list[list[bytes]], mine: list[int], n: int,
            report) -> None:
    """One sender process: opens ``mine``'s connections, says so, waits for the parent's ("go", start), then runs
    them through every second; sends back ("done", last answer per second, errors, its CPU seconds)."""
    _raise_open_files(len(mine) + 64)
    t_connect = time.monotonic()
    conns = []
    for k, i in enumerate(mine):
        s = socket.create_connection((host, port), timeout=60)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(False)
        conns.append(_Conn(i, k, s))
    t_connect = time.monotonic() - t_connect
    report.send(("connected", t_connect))
    _, start = report.recv()  # the parent's go once every process has connected, with the common start
    sel = selectors.DefaultSelector()
    last = [0.0] * len(seconds)
    errors: list[str] = []
    due = [(start + c.i / n, k) for k, c in enumerate(conns)]  # (when, connection) of each connection's next send
    heapq.heapify(due)
    busy = 0  # connections with a request in flight
    cpu0 = time.process_time()
    while due or busy:
        timeout = max(0.0, due[0][0] - time.monotonic()) if due else None
        if not busy and timeout:
            time.sleep(timeout)
            timeout = 0.0
        for key, ev in sel.select(timeout):
            c = key.data
            if ev & selectors.EVENT_WRITE and c.out:
                try:
                    c.out = c.out[c.sock.send(c.out):]
                except BlockingIOError:
                    pass
                if not c.out:
                    sel.modify(c.sock, selectors.EVENT_READ, c)
                continue
            if ev & selectors.EVENT_READ:
                try:
                    chunk = c.sock.recv(65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    errors.append(f"connection {c.i} closed by the head")
                    sel.unregister(c.sock)
                    busy -= 1
                    continue
                c.inbuf += chunk
                status = 200
                if c.need < 0:
                    status, c.need = _answer_length(c.inbuf)
                    if status and status != 200:
                        errors.append(f"HTTP {status}")
                if 0 <= c.need <= len(c.inbuf):  # the whole answer: this second is done on this connection
                    del c.inbuf[:c.need]
                    c.need = -1
                    last[c.second] = max(last[c.second], time.monotonic())
                    sel.unregister(c.sock)
                    busy -= 1
                    c.second += 1
                    if c.second < len(seconds):
                        heapq.heappush(due, (start + c.second + c.i / n, c.k))
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, k = heapq.heappop(due)
            c = conns[k]
            body = seconds[c.second][c.i]
            c.out = memoryview(headers + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            sel.register(c.sock, selectors.EVENT_WRITE, c)
            busy += 1
    cpu = time.process_time() - cpu0
    for c in conns:
        c.sock.close()
    report.send(("done", last, errors, cpu))


def send_per_agent(url: str, token: str, seconds: list[list[bytes]], on_second: Callable[[int], None],
                   processes: int = DEFAULT_PROCESSES, path: str = "/v1/logs",
                   encoding: str = "zstd") -> tuple[list[float], float, float]:
    """Post second ``s``'s body ``i`` over connection ``i`` (one per body of a second: one per agent), from
    ``processes`` forked sender processes; ``on_second(s)`` is called in this process once second ``s`` has passed
    on the clock (not when it was acknowledged). Returns (how far behind real time each second's last answer came
    (s), the senders' CPU seconds, the longest time a process took to open its connections (s)). The bodies are
    compressed as ``encoding`` says (bench/scale.py's ``compress_body``)."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    n = len(seconds[0])
    if any(len(b) != n for b in seconds):
        raise ValueError("every second needs one body per connection")
    headers = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {token}\r\n"
               f"Content-Type: application/x-protobuf\r\nContent-Encoding: {encoding}\r\n").encode()
    processes = max(1, min(processes, n))
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    for p in range(processes):
        here, there = ctx.Pipe()
        mine = list(range(p, n, processes))
        proc = ctx.Process(target=_sender, args=(host, int(port), headers, seconds, mine, n, there),
                           daemon=True, name=f"agent-sender-{p}")
        proc.start()
        there.close()
        pipes.append(here)
        procs.append(proc)
    connect_s = max(pipe.recv()[1] for pipe in pipes)
    start = time.monotonic() + 0.5
    for pipe in pipes:
        pipe.send(("go", start))
    for i in range(len(seconds)):
        wait = start + i + 1 - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        on_second(i)
    last = [0.0] * len(seconds)
    errors: list[str] = []
    cpu = 0.0
    for pipe in pipes:
        _, theirs, e, c = pipe.recv()
        last = [max(a, b) for a, b in zip(last, theirs)]
        errors += e
        cpu += c
    for proc in procs:
        proc.join(30)
    if errors:
        raise SystemExit(f"the head refused requests: {errors[:3]} ({len(errors)} in all)")
    return [max(0.0, t - (start + s + 1)) for s, t in enumerate(last)], cpu, connect_s
