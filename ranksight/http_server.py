"""The HTTP server parts shared by the head's API and the node agent's endpoint: the handler base, a server
thread that does not wake up every fraction of a second, and TLS on the accepted connections (``ranksight.tls``)."""

from __future__ import annotations

import email.parser
import http.client
import logging
import re
import socket
import ssl
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("ranksight.http")

# A connection that sends nothing for this long is closed (a request's headers and body included): idle or
# half-sent requests must not hold a handler thread for ever. Agents ship every second and clients poll every few,
# so a live keep-alive connection is never idle this long.
REQUEST_TIMEOUT_S = 30.0


# A header line the stdlib's parser (email.feedparser, compat32) reads as ``name: value`` with nothing else to it
# (no folded continuation, no line it would end the headers at): those are split here directly.
_PLAIN_HEADERS = re.compile(rb"(?:[!-9;-~]+:[^\r\n]*\r?\n)*")
_MAX_HEADER_LINE = 65536  # http.client's _MAXLINE and _MAXHEADERS
_MAX_HEADERS = 100


def read_headers(rfile) -> http.client.HTTPMessage:
    """``http.client.parse_headers(rfile)`` without running the email package's feed parser on every request
    (a fifth of the server's CPU per request at thousands of requests a second): the same limits and errors
    (``LineTooLong``, more than 100 headers), the same message for plain ``name: value`` lines, and anything
    else (a folded line, a line without a colon) parsed by the stdlib itself, exactly as before."""
    lines = []
    while True:
        line = rfile.readline(_MAX_HEADER_LINE + 1)
        if len(line) > _MAX_HEADER_LINE:
            raise http.client.LineTooLong("header line")
        if line in (b"\r\n", b"\n", b""):
            break
        lines.append(line)
        if len(lines) > _MAX_HEADERS:
            raise http.client.HTTPException(f"got more than {_MAX_HEADERS} headers")
    block = b"".join(lines)
    if _PLAIN_HEADERS.fullmatch(block) is None:
        text = (block + line).decode("iso-8859-1")  # with its end, as the stdlib's
        return email.parser.Parser(_class=http.client.HTTPMessage).parsestr(text)
    msg = http.client.HTTPMessage()
    for text in block.decode("iso-8859-1").split("\n")[:-1]:  # each ends in "\n", perhaps "\r\n", nothing else
        name, _, value = text.partition(":")
        msg[name] = value.lstrip(" \t").rstrip("\r")
    msg.set_payload("")
    return msg


class NoDelayHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive with one send per response, and a read timeout (``REQUEST_TIMEOUT_S``).

    Buffered responses (headers + body leave in one send when the handler flushes) and no
    Nagle: two small writes per response otherwise wait on delayed ACKs, milliseconds each.
    """

    protocol_version = "HTTP/1.1"
    wbufsize = -1
    timeout = REQUEST_TIMEOUT_S  # socketserver sets it on the connection: a stalled read raises, the handler ends

    tls_failed = False
    _date: tuple[int, str] = (0, "")

    def date_time_string(self, timestamp=None):
        # the Date header of every response, formatted once a second instead of once a request
        if timestamp is not None:
            return super().date_time_string(timestamp)
        now = int(time.time())
        if self._date[0] != now:
            NoDelayHandler._date = (now, super().date_time_string(now))
        return NoDelayHandler._date[1]

    def parse_request(self):
        """``BaseHTTPRequestHandler.parse_request`` (the same checks and answers) with the headers read by
        ``read_headers``."""
        self.command = None
        self.request_version = version = self.default_request_version
        self.close_connection = True
        requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        self.requestline = requestline
        words = requestline.split()
        if not words:
            return False
        if len(words) >= 3:
            version = words[-1]
            try:
                if not version.startswith("HTTP/"):
                    raise ValueError
                base = version.split("/", 1)[1]
                nums = base.split(".")
                if len(nums) != 2 or not all(c.isdigit() and len(c) <= 10 for c in nums):
                    raise ValueError
                number = int(nums[0]), int(nums[1])
            except (ValueError, IndexError):
                self.send_error(HTTPStatus.BAD_REQUEST, "Bad request version (%r)" % version)
                return False
            if number >= (1, 1) and self.protocol_version >= "HTTP/1.1":
                self.close_connection = False
            if number >= (2, 0):
                self.send_error(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, "Invalid HTTP version (%s)" % base)
                return False
            self.request_version = version
        if not 2 <= len(words) <= 3:
            self.send_error(HTTPStatus.BAD_REQUEST, "Bad request syntax (%r)" % requestline)
            return False
        command, path = words[:2]
        if len(words) == 2:
            self.close_connection = True
            if command != "GET":
                self.send_error(HTTPStatus.BAD_REQUEST, "Bad HTTP/0.9 request type (%r)" % command)
                return False
        self.command, self.path = command, path
        if self.path.startswith("//"):  # gh-87389: no open redirect through a scheme-relative path
            self.path = "/" + self.path.lstrip("/")
        try:
            self.headers = read_headers(self.rfile)
        except http.client.LineTooLong as err:
            self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Line too long", str(err))
            return False
        except http.client.HTTPException as err:
            self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Too many headers", str(err))
            return False
        conntype = self.headers.get("Connection", "").lower()
        if conntype == "close":
            self.close_connection = True
        elif conntype == "keep-alive" and self.protocol_version >= "HTTP/1.1":
            self.close_connection = False
        expect = self.headers.get("Expect", "")
        if (expect.lower() == "100-continue" and self.protocol_version >= "HTTP/1.1"
                and self.request_version >= "HTTP/1.1"):
            if not self.handle_expect_100():
                return False
        return True

    def setup(self):
        super().setup()  # sets the read timeout on the connection: a stalled TLS handshake ends too
        try:
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        if isinstance(self.connection, ssl.SSLSocket):
            # The handshake runs here, in the connection's own thread, not in the accept loop: a client that
            # stalls or fails it holds nothing but its own handler slot.
            try:
                self.connection.do_handshake()
            except OSError as e:  # ssl.SSLError included
                self.tls_failed = True
                if isinstance(e, ssl.SSLError) and not isinstance(e, ssl.SSLEOFError):
                    # a refusal: the client does not trust us, sent no certificate under mutual TLS, spoke http
                    self.server.count_tls_refused()
                    log.info("TLS handshake with %s refused: %s", self.client_address[0], e)
                else:  # closed before a handshake (shutdown_server's wake-up, a port probe): no refusal
                    log.debug("TLS connection from %s closed before its handshake: %s", self.client_address[0], e)

    def handle(self):
        if not self.tls_failed:
            super().handle()

    def finish(self):
        try:
            super().finish()
        except (ssl.SSLError, OSError):
            pass  # the peer went away mid-TLS: nothing left to flush to it


# socketserver's serve_forever wakes every poll_interval to look for a shutdown request (the stdlib default 0.5 s,
# 0.2 s here before: 5 wake-ups a second for nothing). shutdown_server wakes it with a connection instead.
SERVE_POLL_S = 5.0


def serve_in_thread(server, name: str) -> threading.Thread:
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": SERVE_POLL_S}, daemon=True, name=name)
    t.start()
    return t


def shutdown_server(server) -> None:
    """``server.shutdown()`` without waiting out ``SERVE_POLL_S``: a connection to the listening socket wakes its
    ``select()`` so the loop sees the request at once (the handler reads EOF and ends)."""
    t = threading.Thread(target=server.shutdown, daemon=True)
    t.start()
    host, port = server.server_address[:2]
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    deadline = time.monotonic() + SERVE_POLL_S + 1.0
    while t.is_alive() and time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
        except OSError:
            pass
        t.join(0.05)
    t.join()


# files a server process keeps open besides its connections (store parts, the WAL, logs, libraries)
OTHER_FILES = 256


def send_busy(sock) -> None:
    """A 503 that closes the connection, written straight to a socket no handler took (the server is at its bound);
    a connection already gone is no error."""
    try:
        sock.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\n"
                     b"Connection: close\r\n\r\n")
    except OSError:
        pass


class BoundedThreadingHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_handlers`` at once: a connection beyond that is answered 503 at once
    and closed, instead of costing a thread (thousands of idle half-sent requests once held thousands of them).
    ``refused_busy`` counts those.

    ``tls``: an ``ssl.SSLContext`` (server side) to speak HTTPS on every accepted connection (``ranksight.tls``);
    None for plain http. ``tls_refused`` counts the handshakes that failed (no client certificate under mutual TLS,
    a client that does not trust ours, plain http sent to the TLS port)."""

    daemon_threads = True
    allow_reuse_address = True
    max_handlers = 512
    # where the handler threads' CPU is counted (ranksight.thread_cpu.ThreadParts), under the part thread_part
    thread_parts = None
    thread_part = "http"

    def __init__(self, *args, tls: ssl.SSLContext | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(self.max_handlers)
        self.refused_busy = 0
        self.tls = tls
        self.tls_refused = 0
        self._tls_lock = threading.Lock()  # handler threads count refusals concurrently

    def count_tls_refused(self) -> None:
        with self._tls_lock:
            self.tls_refused += 1

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def get_request(self):
        sock, addr = super().get_request()
        if self.tls is not None:
            # No I/O here (the handshake waits for the handler thread), so the accept loop never blocks on a peer.
            try:
                sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            except OSError:
                sock.close()
                raise
        return sock, addr

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.refused_busy += 1
            if not isinstance(request, ssl.SSLSocket):  # under TLS a 503 would need a handshake first: just close
                send_busy(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def raise_open_files(self) -> int:
        """Raise this process's soft limit of open files to hold ``max_handlers`` connections beside its other files
        (many systems start processes at 1,024, fewer than a 16,384-rank job's 2,048 agents), as far as the hard
        limit allows. Returns the soft limit now; logs when it stays too low."""
        want = self.max_handlers + OTHER_FILES
        try:
            import resource
        except ImportError:  # not POSIX
            return want
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < want:
            new = want if hard == resource.RLIM_INFINITY else min(want, hard)
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
                soft = new
            except (ValueError, OSError) as e:
                log.warning("http: cannot raise the open-files limit from %d to %d: %s", soft, new, e)
            if soft < want:
                log.warning("http: the open-files limit (%d; hard %d) holds about %d connections, not %d: raise it "
                            "(ulimit -n, LimitNOFILE=) for a job with more agents", soft, hard,
                            max(0, soft - OTHER_FILES), self.max_handlers)
        return int(soft)

    def process_request_thread(self, request, client_address):
        try:
            if self.thread_parts is None:
                super().process_request_thread(request, client_address)
            else:
                with self.thread_parts.running(self.thread_part):
                    super().process_request_thread(request, client_address)
        finally:
            self._slots.release()
