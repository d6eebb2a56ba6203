"""The shared HTTP server's own header reading (``ranksight.http_server.read_headers``, used by the head and the
agent's endpoint instead of the email package's feed parser): the same message as ``http.client.parse_headers`` for
every header block, the same errors, and a served request answered as before (431 for too many headers, keep-alive,
a Date header)."""

import http.client
import io
import socket
import threading

import pytest

from ranksight.http_server import (
    BoundedThreadingHTTPServer,
    NoDelayHandler,
    read_headers,
    shutdown_server,
)

BLOCKS = [
    b"Host: a\r\nContent-Length: 5\r\nX-Sp:   lead and trail  \r\n\r\n",
    b"Host: a\r\nX-Fold: one\r\n  two\r\n\r\n",  # a folded (obs-fold) line
    b"Host: a\r\nnocolon\r\nB: c\r\n\r\n",  # the stdlib ends the headers there: the rest is "payload"
    b"A: 1\nB:2\n\n",  # bare LF
    b"Dup: 1\r\nDup: 2\r\n\r\n",
    b"H\xe9: v\xe9\r\n\r\n",  # a non-ASCII name
    b"From x\r\nA: b\r\n\r\n",  # an mbox From line
    b"",  # the peer closed
    b"A: b\r\n",  # closed after a header
    b"A:\r\n\r\n",
    b"A: b\r\r\n\r\n",
    b"A: b\tc\r\n\r\n",
    b"Authorization: Bearer x\r\nContent-Type: application/x-protobuf\r\nContent-Encoding: deflate\r\n\r\nBODY",
]


def _same(a, b) -> bool:
    return (a.items() == b.items() and a.get_payload() == b.get_payload()
            and [type(d) for d in a.defects] == [type(d) for d in b.defects])


@pytest.mark.parametrize("block", BLOCKS)
def test_read_headers_gives_the_stdlibs_message(block):
    a, b = io.BytesIO(block), io.BytesIO(block)
    assert _same(http.client.parse_headers(a), read_headers(b))
    assert a.tell() == b.tell()  # the body starts where it did


@pytest.mark.parametrize("block, error", [
    (b"A: " + b"x" * 70000 + b"\r\n\r\n", http.client.LineTooLong),
    (b"".join(b"H%d: v\r\n" % i for i in range(101)) + b"\r\n", http.client.HTTPException),
])
def test_read_headers_keeps_the_stdlibs_limits(block, error):
    with pytest.raises(error):
        http.client.parse_headers(io.BytesIO(block))
    with pytest.raises(error):
        read_headers(io.BytesIO(block))


class _Echo(NoDelayHandler):
    def log_message(self, *a):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        out = b"%s|%s|%s" % (self.headers.get("X-Fold", "").encode(), self.headers.get("X-A", "").encode(), body)
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


def _exchange(port: int, *raws: bytes) -> list[http.client.HTTPResponse]:
    """Each request in turn on one connection (keep-alive), its response read before the next is sent."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    out = []
    for raw in raws:
        s.sendall(raw)
        r = http.client.HTTPResponse(s)
        r.begin()
        r.body = r.read()
        out.append(r)
    s.close()
    return out


def test_the_server_answers_as_before():
    srv = BoundedThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    port = srv.server_address[1]
    try:
        r1, r2 = _exchange(port, b"POST / HTTP/1.1\r\nHost: x\r\nX-A: 1\r\nContent-Length: 2\r\n\r\nhi",
                           b"POST / HTTP/1.1\r\nHost: x\r\nX-Fold: a\r\n b\r\nContent-Length: 3\r\n\r\nyou")
        assert (r1.status, r1.body) == (200, b"|1|hi") and r1.getheader("Date")
        assert (r2.status, r2.body) == (200, b"a\r\n b||you")  # folded: read by the stdlib's parser, as before
        many = b"POST / HTTP/1.1\r\n" + b"".join(b"H%d: v\r\n" % i for i in range(101)) + b"\r\n"
        assert _exchange(port, many)[0].status == 431
        assert _exchange(port, b"POST / extra HTTP/1.1\r\n\r\n")[0].status == 400  # bad request syntax
    finally:
        shutdown_server(srv)
        srv.server_close()
