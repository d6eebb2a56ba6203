"""The HTTP handler base shared by the head's API and the node agent's endpoint."""

from __future__ import annotations

import socket
from http.server import BaseHTTPRequestHandler


class NoDelayHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive with one send per response.

    Buffered responses (headers + body leave in one send when the handler flushes) and no
    Nagle: two small writes per response otherwise wait on delayed ACKs, milliseconds each.
    """

    protocol_version = "HTTP/1.1"
    wbufsize = -1

    def setup(self):
        super().setup()
        try:
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
