"""The node agent's HTTP endpoint (``--metrics-port``): ``GET /metrics`` (Prometheus text), ``GET /healthz``, the
token-protected ``POST /control`` through which the head asks for an action, and the token-protected
``GET /ops?rank=R&steps=A-B[&comm=ID][&op=KIND][&limit=N]``: a local rank's raw collective records read from its
spool (``node/ops_reader.py``; the query and answer are ``ranksight/ops_query.py``), which the head forwards to
whoever drills down from a folded record. HTTPS with ``--tls-cert`` /
``--tls-key`` (``ranksight.tls``; mutual TLS with ``--tls-client-ca``, which a Prometheus scraper then needs too).

A control request is only written to ``<run>/control/requests/<id>.json`` (atomically): rank 0 of the trainer acts
on it at a step boundary and writes an ack, which ``node.sources.control_acks`` ships back to the head.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import socket
import ssl
import time
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qs, urlsplit

import msgspec
from prometheus_client.exposition import choose_encoder

from node.ops_reader import SpoolIndexes, read_ops
from node.prom import AgentMetrics
from ranksight import schema
from ranksight.http_server import BoundedThreadingHTTPServer, NoDelayHandler
from ranksight.layout import RunDir, atomic_write
from ranksight.ops_query import parse_ops_query

log = logging.getLogger("ranksight.agent")

SAFE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # a request id becomes a file name
MAX_REQUEST_BYTES = 65536


class ControlServer(BoundedThreadingHTTPServer):
    """The endpoint of one agent (``ControlHandler`` answers its requests). ``local_ranks`` is asked at every
    ``/healthz``."""

    max_handlers = 32  # a Prometheus scraper and the head's control requests: a handful at once

    def __init__(self, address: tuple[str, int], *, rd: RunDir, node: int, token: str, metrics: AgentMetrics,
                 local_ranks: Callable[[], list[int]], tls: ssl.SSLContext | None = None,
                 advertise_url: str | None = None):
        super().__init__(address, ControlHandler, tls=tls)
        # What the head is told to use instead of the bound address: a name the TLS certificate holds, or a proxy
        # in front of this endpoint.
        self.advertise_url = advertise_url.rstrip("/") if advertise_url else None
        self.rd = rd
        self.node = node
        self.token = token
        self.metrics = metrics
        self.local_ranks = local_ranks
        self.spool_indexes = SpoolIndexes()  # GET /ops: each local spool's step index, kept between queries

    @property
    def url(self) -> str:
        """Where the head reaches this endpoint: ``advertise_url``, else the bound address; a wildcard bind
        (0.0.0.0, ::) names no address another host could use, so this machine's name stands for it."""
        if self.advertise_url:
            return self.advertise_url
        host, port = self.server_address[:2]
        if host in ("0.0.0.0", "::", ""):
            host = socket.getfqdn()
        if ":" in host:
            host = f"[{host}]"
        return f"{self.scheme}://{host}:{port}"

    def write_request(self, req: schema.ControlRequest) -> Path:
        """Hand a control request to the trainer: ``<run>/control/requests/<id>.json``."""
        if not SAFE_ID.match(req.id):
            raise ValueError("control request id must be 1-64 of [A-Za-z0-9_.-]")
        path = self.rd.control_requests / f"{req.id}.json"
        atomic_write(path, schema.encode(req))
        self.metrics.control.labels(str(self.node), req.action).inc()
        log.info("agent node %d: control request %s (%s) written for the trainer", self.node, req.id, req.action)
        return path

    def token_ok(self, authorization: str) -> bool:
        return authorization.startswith("Bearer ") and hmac.compare_digest(authorization[7:].strip().encode(),
                                                                            self.token.encode())


class ControlHandler(NoDelayHandler):
    server: ControlServer

    def log_message(self, fmt, *args):
        log.debug("agent http: " + fmt, *args)

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        path = self.path.split("?")[0]
        if path == "/metrics":
            # OpenMetrics to a scraper that asks for it (Prometheus does): the only format with exemplars
            encode, ctype = choose_encoder(self.headers.get("Accept") or "")
            self._send(200, encode(self.server.metrics.registry), ctype)
        elif path == "/healthz":
            self._send(200, json.dumps({"ok": True, "node": self.server.node,
                                        "ranks": self.server.local_ranks()}).encode())
        elif path == "/ops":
            self._ops()
        else:
            self._send(404, b'{"error":"not found"}')

    def _authorized(self) -> bool:
        auth = self.headers.get("Authorization") or ""
        if self.server.token_ok(auth):
            return True
        log.warning("agent: %s without a valid token from %s", self.path.split("?")[0], self.client_address[0])
        self._send(401 if not auth else 403, b'{"error":"bearer token required"}')
        return False

    def _ops(self) -> None:
        """``GET /ops``: the raw collective records of one local rank over a step range (the head's drill-down),
        counted by status with the time it took (``ranksight_agent_ops_queries``, ``..._ops_seconds``)."""
        if not self._authorized():
            return
        t0 = time.monotonic()
        status, body = self._ops_answer()
        self._send(status, body)
        node = str(self.server.node)
        self.server.metrics.ops_queries.labels(node, str(status)).inc()
        self.server.metrics.ops_seconds.labels(node).inc(time.monotonic() - t0)

    def _ops_answer(self) -> tuple[int, bytes]:
        srv = self.server
        try:
            q = parse_ops_query({k: v[-1] for k, v in parse_qs(urlsplit(self.path).query).items()})
        except ValueError as e:
            return 400, json.dumps({"error": str(e)}).encode()
        local = srv.local_ranks()
        if q.rank not in local:
            return 404, json.dumps({"error": f"rank {q.rank} is not on node {srv.node} (its ranks: "
                                             f"{_ranks_text(local)})"}).encode()
        try:
            answer = read_ops(srv.spool_indexes.of(srv.rd.spool(q.rank)), q, srv.rd.run_id, srv.node)
        except FileNotFoundError:
            return 404, json.dumps({"error": f"rank {q.rank} has no spool file on node {srv.node}"}).encode()
        except OSError as e:
            log.warning("agent: reading rank %d's spool for /ops failed: %s", q.rank, e)
            return 500, json.dumps({"error": f"reading rank {q.rank}'s spool failed: {e}"}).encode()
        return 200, schema.encode(answer)

    def do_POST(self):
        self.close_connection = True
        if self.path.split("?")[0] != "/control":
            self._send(404, b'{"error":"not found"}')
            return
        if not self._authorized():
            return
        try:
            n = int(self.headers.get("Content-Length") or -1)
            if not 0 <= n <= MAX_REQUEST_BYTES:
                raise ValueError("bad Content-Length")
            req = msgspec.json.decode(self.rfile.read(n), type=schema.ControlRequest)
            path = self.server.write_request(req)
        except (ValueError, msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("agent: bad control request: %s", e)
            self._send(400, json.dumps({"error": str(e)}).encode())
            return
        self._send(202, json.dumps({"written": str(path)}).encode())


def _ranks_text(ranks: list[int]) -> str:
    if not ranks:
        return "none yet"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks[:16])) + (", ..." if len(ranks) > 16 else "")
