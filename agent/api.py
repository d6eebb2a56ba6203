"""The head's HTTP surface: OTLP/HTTP receiver + JSON API, on one stdlib threading server.

    POST /v1/logs                       OTLP logs (protobuf, gzip ok)   token
    POST /v1/metrics                    OTLP metrics                     token
    GET  /api/health                    liveness and counters
    GET  /api/runs                      runs in the store and live
    GET  /api/runs/<id>/ranks           latest step / state / last-seen per rank
    GET  /api/runs/<id>/agents          node agents of the run, last heartbeat
    GET  /api/runs/<id>/steps?since=&rank=&limit=   recent step records (live window)
    GET  /api/runs/<id>/findings
    GET  /api/runs/<id>/actions
    POST /api/runs/<id>/actions         {"action": "checkpoint"|"profile"|"evict", "node", "steps", "reason", "dry_run"}  token

Reads are open (the server binds 127.0.0.1 by default); anything that writes
needs ``Authorization: Bearer <token>``. A bad request gets a 4xx JSON error and
a log line; no request can stop the server.
"""

from __future__ import annotations

import json
import logging
import math
from http.server import ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from agent.http import NoDelayHandler
from agent import otlp_receiver as rx
from agent.otlp_receiver import HttpError
from ranksight import schema
from ranksight.layout import RunDir

log = logging.getLogger("ranksight.head.http")
MAX_JSON_BODY = 1024 * 1024


def _clean(o):
    """JSON-safe: NaN/inf become null (json.dumps would write invalid JSON)."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


class HeadHandler(NoDelayHandler):
    server_version = "ranksight-head"
    head = None  # set by make_server

    def log_message(self, fmt, *args):  # route access logs to logging at debug level
        log.debug("%s " + fmt, self.client_address[0], *args)

    # -- plumbing -----------------------------------------------------------------
    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj) -> None:
        self._send(status, json.dumps(_clean(obj)).encode(), "application/json")

    def _error(self, e: HttpError) -> None:
        self.head.stats["http_4xx"] += 1
        log.warning("head: %s %s from %s -> %d %s", self.command, self.path, self.client_address[0], e.status, e.reason)
        # A request whose body we did not read must not poison the keep-alive connection.
        self.close_connection = True
        self._json(e.status, {"error": e.reason})

    def _dispatch(self, fn) -> None:
        try:
            fn()
        except HttpError as e:
            self._error(e)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # a bug in a handler answers 500; the server lives on
            log.exception("head: error handling %s %s", self.command, self.path)
            self.close_connection = True
            try:
                self._json(500, {"error": f"internal error: {type(e).__name__}"})
            except OSError:
                pass

    def do_GET(self):
        self._dispatch(self._get)

    def do_POST(self):
        self._dispatch(self._post)

    def do_PUT(self):
        self._dispatch(lambda: (_ for _ in ()).throw(HttpError(405, "method not allowed")))

    do_DELETE = do_PUT

    # -- routes -------------------------------------------------------------------
    def _run_id(self, parts: list[str]) -> str:
        run_id = parts[2]
        try:
            RunDir(self.head.store.root, run_id)
        except ValueError as e:
            raise HttpError(400, str(e)) from None
        return run_id

    def _post(self):
        url = urlsplit(self.path)
        path = url.path.rstrip("/")
        if path in ("/v1/logs", "/v1/metrics"):
            rx.check_token(self.headers, self.head.token)
            body = rx.read_body(self.rfile, self.headers)
            payload = rx.decompress(body, self.headers.get("Content-Encoding"))
            kind = "logs" if path == "/v1/logs" else "metrics"
            req = rx.parse(kind, payload, self.headers.get("Content-Type"))
            if kind == "logs":
                _, rejected, msg = self.head.ingest_logs(req)
                out = rx.logs_response(rejected, msg)
            else:
                self.head.ingest_metrics(req)
                out = rx.metrics_response()
            self._send(200, out, "application/x-protobuf")
            return
        parts = path.split("/")
        if len(parts) == 5 and parts[1] == "api" and parts[2] == "runs" and parts[4] == "actions":
            rx.check_token(self.headers, self.head.token)
            run_id = self._run_id(parts[1:])
            body = rx.read_body(self.rfile, self.headers, MAX_JSON_BODY)
            try:
                req = json.loads(body or b"{}")
            except ValueError:
                raise HttpError(400, "body is not JSON") from None
            if not isinstance(req, dict):
                raise HttpError(400, "body must be a JSON object")
            try:
                a = self.head.request_action(run_id, req, requested_by=f"api:{self.client_address[0]}")
            except ValueError as e:
                raise HttpError(400, str(e)) from None
            self._json(202 if a.status == "requested" else 200, schema.to_dict(a))
            return
        raise HttpError(404, f"no such endpoint: POST {path}")

    def _get(self):
        url = urlsplit(self.path)
        path = url.path.rstrip("/")
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        head = self.head
        if path == "/api/health":
            self._json(200, {"ok": True, "stats": head.stats, "runs": len(head.live)})
            return
        if path == "/api/runs":
            self._json(200, head.runs_summary())
            return
        parts = path.split("/")
        if len(parts) == 5 and parts[1] == "api" and parts[2] == "runs":
            run_id = self._run_id(parts[1:])
            if run_id not in head.live and not (head.store.root / run_id).is_dir():
                raise HttpError(404, f"unknown run {run_id!r}")  # a GET never creates a run
            what = parts[4]
            if what == "ranks":
                self._json(200, head.run_live(run_id).rank_states())
            elif what == "agents":
                self._json(200, head.run_live(run_id).agent_states())
            elif what == "steps":
                try:
                    since = int(q.get("since", -1))
                    rank = int(q["rank"]) if "rank" in q else None
                    limit = min(int(q.get("limit", 10_000)), 100_000)
                except ValueError:
                    raise HttpError(400, "since, rank and limit must be integers") from None
                recs = head.run_live(run_id).steps_since(since, rank, limit)
                self._json(200, [schema.to_dict(r) for r in recs])
            elif what == "findings":
                self._json(200, head.findings_of(run_id))
            elif what == "actions":
                self._json(200, head.actions_of(run_id))
            else:
                raise HttpError(404, f"no such endpoint: GET {path}")
            return
        raise HttpError(404, f"no such endpoint: GET {path}")


class HeadServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


def make_server(head, bind: str = "127.0.0.1", port: int = 4318) -> HeadServer:
    handler = type("BoundHeadHandler", (HeadHandler,), {"head": head})
    return HeadServer((bind, port), handler)
