"""Keep-alive connections parked between requests (ranksight/parked_http.py): many connections served by a few
threads, pipelined requests, the idle timeout, the handler bound, and the head's server using it."""

import socket
import threading
import time

import pytest

from ranksight import http_server
from ranksight.http_server import NoDelayHandler, serve_in_thread, shutdown_server
from ranksight.parked_http import ParkingHTTPServer


class Echo(NoDelayHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        body = self.path.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class Parking(ParkingHTTPServer):
    request_queue_size = 1024  # as the head's: a test's hundreds of connects are not held back by the backlog


@pytest.fixture
def server():
    srv = Parking(("127.0.0.1", 0), Echo)
    serve_in_thread(srv, "parked-test")
    yield srv
    shutdown_server(srv)
    srv.server_close()


def _get(sock, path: str) -> bytes:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return _answer(sock)


_LEFT: dict[int, bytes] = {}  # bytes read past an answer (the next pipelined answer), per socket


def _answer(sock) -> bytes:
    buf = _LEFT.pop(id(sock), b"")
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(4096)
        assert chunk, "the server closed the connection"
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    n = int([ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")][0])
    while len(rest) < n:
        rest += sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 200"), head
    if rest[n:]:
        _LEFT[id(sock)] = rest[n:]
    return rest[:n]


def test_many_keep_alive_connections_are_served_by_a_few_threads(server):
    assert server.parking
    port = server.server_address[1]
    before = threading.active_count()
    conns = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(300)]
    try:
        for rnd in range(3):
            for i, s in enumerate(conns):
                s.sendall(f"GET /{rnd}/{i} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            for i, s in enumerate(conns):
                assert _answer(s) == f"/{rnd}/{i}".encode()
        # a thread per connection would be 300 more; the pool grows only while every worker is held
        assert threading.active_count() - before < 50, threading.active_count() - before
    finally:
        for s in conns:
            s.close()


def test_pipelined_requests_are_all_answered(server):
    s = socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=30)
    try:
        s.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _answer(s) == b"/a" and _answer(s) == b"/b"  # the second was in the buffer, not on the socket
        assert _get(s, "/c") == b"/c"
    finally:
        s.close()


def test_an_idle_connection_is_closed_and_its_slot_given_back(monkeypatch):
    monkeypatch.setattr(http_server.NoDelayHandler, "timeout", 0.5)
    srv = Parking(("127.0.0.1", 0), Echo)
    srv._slots = threading.BoundedSemaphore(2)  # a bound of 2 connections for this test
    serve_in_thread(srv, "parked-idle")
    port = srv.server_address[1]
    try:
        a = socket.create_connection(("127.0.0.1", port), timeout=30)
        b = socket.create_connection(("127.0.0.1", port), timeout=30)
        assert _get(a, "/a") == b"/a" and _get(b, "/b") == b"/b"
        c = socket.create_connection(("127.0.0.1", port), timeout=30)
        assert c.recv(100).startswith(b"HTTP/1.1 503")  # over the bound
        c.close()
        t0 = time.monotonic()
        assert a.recv(100) == b"" and b.recv(100) == b""  # idle past the timeout: closed by the server
        assert time.monotonic() - t0 < 20
        half = socket.create_connection(("127.0.0.1", port), timeout=30)
        half.sendall(b"GET /never HTTP/1.1\r\n")  # a half-sent request: the read timeout ends it
        assert half.recv(4096) == b""
        ok = socket.create_connection(("127.0.0.1", port), timeout=30)
        assert _get(ok, "/again") == b"/again"  # the slots came back
        for s in (a, b, half, ok):
            s.close()
    finally:
        shutdown_server(srv)
        srv.server_close()


def test_a_connection_closed_by_the_client_gives_its_slot_back(server):
    server._slots = threading.BoundedSemaphore(1)
    port = server.server_address[1]
    for i in range(5):  # with the slot kept, the second connection would be refused
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        assert _get(s, f"/{i}") == f"/{i}".encode()
        s.close()
        deadline = time.monotonic() + 10
        while len(server._conns) and time.monotonic() < deadline:
            time.sleep(0.02)
    assert server.refused_busy == 0


def test_without_parking_a_thread_serves_each_connection():
    class Threaded(ParkingHTTPServer):
        park_connections = False

    srv = Threaded(("127.0.0.1", 0), Echo)
    serve_in_thread(srv, "threaded-test")
    try:
        assert not srv.parking
        s = socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=30)
        assert _get(s, "/t") == b"/t"
        s.close()
    finally:
        shutdown_server(srv)
        srv.server_close()


def test_the_heads_server_parks_its_connections(tmp_path):
    from agent_helpers import TOKEN
    from head.api import make_server
    from head.service import Head

    h = Head(tmp_path / "store", TOKEN, analyzer=None)
    srv = make_server(h, "127.0.0.1", 0)
    serve_in_thread(srv, "head-parked")
    try:
        assert srv.parking
        s = socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=30)
        for _ in range(3):
            s.sendall(b"GET /api/health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b"ok" in _answer(s)
        s.close()
        assert "http" in h.cpu.seconds()  # the workers' CPU is the head's http part
        threaded = make_server(h, "127.0.0.1", 0, park=False)  # ranksight head --thread-per-connection
        assert not threaded.parking
        threaded.server_close()
    finally:
        shutdown_server(srv)
        srv.server_close()
        h.close()


def test_a_stalled_request_does_not_hold_up_the_others():
    class One(Parking):
        min_workers = 1

    srv = One(("127.0.0.1", 0), Echo)
    serve_in_thread(srv, "parked-stall")
    port = srv.server_address[1]
    try:
        stalled = socket.create_connection(("127.0.0.1", port), timeout=30)
        stalled.sendall(b"GET /stalled HTTP/1.1\r\n")  # holds the only worker until the 30 s read timeout
        time.sleep(0.3)
        other = socket.create_connection(("127.0.0.1", port), timeout=30)
        t0 = time.monotonic()
        assert _get(other, "/other") == b"/other"
        assert time.monotonic() - t0 < 10  # another worker took it, well before the stalled read times out
        stalled.close()
        other.close()
    finally:
        shutdown_server(srv)
        srv.server_close()
