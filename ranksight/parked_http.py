"""Keep-alive connections parked between requests: thousands of agents' connections served by a few threads.

``BoundedThreadingHTTPServer`` gives each connection a thread for its whole life. A 16,384-rank job's 2,048 node
agents each keep one connection alive and post once a second, so the head ran ~2,048 threads, and every request
woke a different one: the request handlers then spend much of their CPU handing the interpreter lock from thread to
thread (under bench/scale.py --per-agent-connections the same requests cost about twice the CPU they cost over 8
connections). Here a connection between two requests is parked in one ``epoll`` (one-shot: it fires once, then the
connection is armed again after its request); when a request arrives, a pool of worker threads runs the same
``BaseHTTPRequestHandler.handle_one_request`` on it (the same parsing, routes, answers and limits), then parks it
again. The pool starts at ``min_workers`` and grows by one whenever requests wait while no worker took one for
``STALL_S`` (a request that stalls half-sent holds one worker until the read timeout, as it held its own thread
before; the requests behind it get another worker), up to the server's ``max_handlers``, and shrinks back to
``min_workers`` when idle. A parked connection idle for the handler's
``timeout`` is closed, as the thread-per-connection server's read timeout closed it.

Plain HTTP on Linux (``epoll``); under TLS, or elsewhere, the server keeps a thread per connection.
"""

from __future__ import annotations

import logging
import queue
import select
import socket
import threading
import time
from contextlib import nullcontext

from ranksight.http_server import BoundedThreadingHTTPServer, send_busy

log = logging.getLogger("ranksight.http")

_ARM = getattr(select, "EPOLLIN", 0) | getattr(select, "EPOLLONESHOT", 0)
SWEEP_S = 1.0  # how often parked connections are checked for the idle timeout
STALL_S = 0.05  # requests waiting this long while no worker takes one: one more worker


class _Parked:
    __slots__ = ("handler", "sock", "fd", "last", "busy")

    def __init__(self, handler, sock: socket.socket):
        self.handler, self.sock, self.fd = handler, sock, sock.fileno()
        self.last = time.monotonic()
        self.busy = False


class ParkingHTTPServer(BoundedThreadingHTTPServer):
    """``BoundedThreadingHTTPServer`` whose keep-alive connections wait in one ``epoll`` between requests and whose
    requests are served by a pool of worker threads (see the module's docstring). ``park_connections = False`` (or
    TLS, or no ``epoll``): a thread per connection, as the base class."""

    park_connections = True
    min_workers = 4
    worker_idle_s = 30.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.parking = self.park_connections and self.tls is None and hasattr(select, "epoll")
        self._conns: dict[int, _Parked] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pool_lock = threading.Lock()
        self._workers = self._idle = self._pending = 0
        self._last_take = time.monotonic()  # when a worker last took a request
        self._ep = select.epoll() if self.parking else None
        self._poller: threading.Thread | None = None
        self._closing = False

    # -- connections ----------------------------------------------------------------
    def process_request(self, request, client_address):
        if not self.parking:
            return super().process_request(request, client_address)
        if not self._take_slot(request):
            return
        try:
            handler = self.RequestHandlerClass.__new__(self.RequestHandlerClass)
            handler.request, handler.client_address, handler.server = request, client_address, self
            handler.setup()  # the read timeout, no Nagle, the buffered files: once per connection
            c = _Parked(handler, request)
            self._conns[c.fd] = c
            if self._poller is None:
                self._poller = threading.Thread(target=self._poll, daemon=True, name="http-parked")
                self._poller.start()
            self._ep.register(c.fd, _ARM)
        except BaseException:
            self._conns.pop(request.fileno(), None)
            self.shutdown_request(request)
            self._slots.release()
            raise

    def _take_slot(self, request) -> bool:
        """A handler slot for the connection, else a 503 and the connection closed (the base class's bound)."""
        if self._slots.acquire(blocking=False):
            return True
        self.refused_busy += 1
        send_busy(request)
        self.shutdown_request(request)
        return False

    def _close(self, c: _Parked) -> None:
        with self._pool_lock:  # once only, and never a newer connection that got the same descriptor number
            if self._conns.get(c.fd) is not c:
                return
            del self._conns[c.fd]
        try:
            self._ep.unregister(c.fd)
        except (OSError, ValueError):
            pass
        try:
            c.handler.finish()
        except Exception:  # noqa: BLE001 - the peer went away: nothing to flush to it
            pass
        self.shutdown_request(c.sock)
        self._slots.release()

    def _poll(self) -> None:
        """The parking thread: a connection with a request (or its end) goes to a worker; idle ones are closed."""
        swept = time.monotonic()
        with self.thread_parts.running(self.thread_part) if self.thread_parts is not None else nullcontext():
            while not self._closing:
                try:
                    events = self._ep.poll(STALL_S if self._pending else SWEEP_S)
                except (OSError, ValueError):  # closed by server_close
                    return
                for fd, _ in events:
                    c = self._conns.get(fd)
                    if c is not None:
                        c.busy = True
                        self._submit(c)
                now = time.monotonic()
                if self._pending:
                    self._grow_if_stalled(now)
                if now - swept >= SWEEP_S:
                    swept = now
                    for c in list(self._conns.values()):
                        timeout = c.handler.timeout
                        if not c.busy and timeout is not None and now - c.last > timeout:
                            self._close(c)

    # -- workers ---------------------------------------------------------------------
    def _submit(self, c: _Parked) -> None:
        with self._pool_lock:
            self._pending += 1
            grow = self._pending > self._idle and self._workers < self.min_workers
            if grow:
                self._workers += 1
        if grow:
            self._start_worker()
        self._queue.put(c)

    def _start_worker(self) -> None:
        threading.Thread(target=self._work, daemon=True, name="http-worker").start()

    def _grow_if_stalled(self, now: float) -> None:
        """One more worker when requests wait and no worker took one for ``STALL_S``: every worker is held (a
        request that stalls half-sent, a slow answer). A burst the workers are getting through adds none: with one
        interpreter lock more threads would only take turns."""
        with self._pool_lock:
            grow = (self._pending > self._idle and now - self._last_take > STALL_S
                    and self._workers < max(self.min_workers, self.max_handlers))
            if grow:
                self._workers += 1
                self._last_take = now  # the next one only if this one does not help either
        if grow:
            self._start_worker()

    def _work(self) -> None:
        with self.thread_parts.running(self.thread_part) if self.thread_parts is not None else nullcontext():
            while True:
                with self._pool_lock:
                    self._idle += 1
                try:
                    c = self._queue.get(timeout=self.worker_idle_s)
                except queue.Empty:
                    with self._pool_lock:
                        self._idle -= 1
                        if self._workers > self.min_workers or self._closing:
                            self._workers -= 1
                            return
                    continue
                with self._pool_lock:
                    self._idle -= 1
                    self._pending -= 1
                    self._last_take = time.monotonic()
                if c is None:
                    with self._pool_lock:
                        self._workers -= 1
                    return
                self._serve(c)

    def _serve(self, c: _Parked) -> None:
        """The connection's requests while they come (one, unless the client sent the next already), then parked."""
        h = c.handler
        if self._conns.get(c.fd) is not c:  # closed while it waited for a worker (the server closing)
            return
        try:
            while True:
                h.handle_one_request()
                if h.close_connection or self._closing:
                    break
                # a next request already read into the handler's buffer: epoll sees only the socket, so serve it now
                c.sock.setblocking(False)
                try:
                    more = h.rfile.peek(1)
                except OSError:
                    more = b""
                finally:
                    c.sock.settimeout(h.timeout)
                if not more:
                    c.last, c.busy = time.monotonic(), False
                    try:
                        self._ep.modify(c.fd, _ARM)
                    except (OSError, ValueError):  # the server is closing (its epoll closed)
                        break
                    return
        except (OSError, ValueError) as e:  # the peer reset or went away; closed under it by server_close
            log.debug("http: connection from %s ended: %s", h.client_address[0], e)
        except Exception:  # noqa: BLE001 - a bug in a handler ends its connection, never the server
            self.handle_error(c.sock, h.client_address)
        self._close(c)

    def server_close(self) -> None:
        self._closing = True
        super().server_close()
        if self.parking:
            for c in list(self._conns.values()):
                self._close(c)
            with self._pool_lock:
                workers = self._workers
            for _ in range(workers):
                self._queue.put(None)
            try:
                self._ep.close()
            except OSError:
                pass
