"""The head's HTTP surface: OTLP/HTTP receiver + JSON API, on one stdlib threading server.

    POST /v1/logs                       OTLP logs (protobuf or JSON, gzip ok)             token
    POST /v1/metrics                    OTLP metrics (protobuf or JSON)                   token
    GET  /api/health                    liveness only ({"ok": true})                    no token
    GET  /api/stats                     the head's counters                               token
    GET  /metrics                       the head's Prometheus metrics (head/metrics.py)   token
    GET  /api/runs                      runs in the store and live                        token (every GET below too)
    GET  /api/runs/<id>/ranks           latest step / state / last-seen per rank
    GET  /api/runs/<id>/agents          node agents of the run, last heartbeat
    GET  /api/runs/<id>/steps?since=&rank=&limit=   recent step records (live window)
    GET  /api/runs/<id>/gpus            latest sample per (node, gpu) from the live window
    GET  /api/runs/<id>/traces?rank=&windows=   profiler capture windows, per rank, per-step figures (the last
                                        ``windows``: default 4, at most 32; analyzers/trace_windows.py)
    GET  /api/runs/<id>/findings        the findings, each with its evidence in sentences (served_findings)
    GET  /api/runs/<id>/coverage        which checks can judge the run's live window, and why not
    GET  /api/runs/<id>/actions
    GET  /api/runs/<id>/ops?rank=R&steps=A-B[&comm=ID][&op=KIND][&limit=N]   a rank's raw collective records, from
                                        the agent of its node (head/ops_proxy.py: the drill-down from folded records)
    POST /api/runs/<id>/actions         {"action": "checkpoint"|"profile"|"evict", "node", "steps", "reason", "dry_run"}  token

Every endpoint but ``/api/health`` needs ``Authorization: Bearer <token>`` (401 without, 403 wrong): run data, the
agents' control URLs and the counters are not for whoever can reach the port. ``public_read`` (``ranksight head
--public-read``) opens the GETs again, for a head behind an authenticating proxy, all but ``/ops`` (it makes the
head call a node's agent with the head's token). A bad request gets a 4xx JSON
error and a log line; no request can stop the server.
"""

from __future__ import annotations

import json
import logging
import math
import time
from urllib.parse import parse_qs, urlsplit

from prometheus_client.exposition import choose_encoder

from ranksight.http_server import NoDelayHandler
from ranksight.parked_http import ParkingHTTPServer
from head import receiver as rx
from analyzers import trace_windows
from analyzers.report.sentences import explained
from head.actions import ActionRefused
from head.ops_proxy import forward_ops
from head.receiver import HttpError
from head.store.wal import WalFull
from ranksight import schema, wire_rejections
from ranksight.layout import RunDir
from ranksight.simgpu import THROTTLE_HARMFUL, throttle_names

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


_GPU_FIELDS = ("name", "uuid", "source", "util_pct", "mem_util_pct", "mem_used_bytes", "mem_total_bytes", "power_w",
               "power_limit_w", "temp_c", "sm_clock_mhz", "max_sm_clock_mhz", "mem_clock_mhz", "ecc_sbe", "ecc_dbe",
               "retired_pages", "remapped_rows")


def gpu_states(live, now: float | None = None) -> list[dict]:
    """The latest GPU sample per (node, gpu) in a run's live window, as the API serves it.

    Read-only over the live object: its GPU samples and XID events (``live.gpu``, ``live.xid``,
    under ``live.lock``), after letting it process queued batches (``live.sync``) like its views do.
    ``xid_count`` is the larger of the agent's running count (the sample's ``xid_total``) and the
    distinct XID events in the window; ``throttled`` is true when a harmful reason is set
    (power cap, HW slowdown, SW/HW thermal, power brake). ``ranks``: the manifest's ranks placed
    on that node with that local rank (one GPU per local rank).
    """
    now = time.time() if now is None else now
    sync = getattr(live, "sync", None)
    if callable(sync):
        try:
            sync()
        except Exception:  # serve what is there
            log.exception("gpus: processing queued batches failed")
    with live.lock:
        samples = live.gpu_latest()  # every GPU's newest, however many GPUs (``live.gpu`` holds the newest 7,680)
        xids = list(live.xid)
        manifest = live.manifest
    latest: dict[tuple[int, int], object] = {}
    for s in samples:
        k = (s.node, s.gpu)
        if k not in latest or s.t >= latest[k].t:
            latest[k] = s
    events: dict[tuple[int, int], set] = {}
    last_xid: dict[tuple[int, int], tuple[float, int]] = {}
    for x in xids:
        k = (x.node, x.gpu)
        events.setdefault(k, set()).add((x.code, x.t))
        if k not in last_xid or x.t >= last_xid[k][0]:
            last_xid[k] = (x.t, x.code)
    placement: dict[tuple[int, int], list[int]] = {}
    for p in (manifest.ranks if manifest is not None else []):
        placement.setdefault((p.node, p.local_rank), []).append(p.rank)
    out = []
    for k in sorted(set(latest) | set(events)):
        s = latest.get(k)
        d: dict = {"node": k[0], "gpu": k[1], "host": s.host if s else "", "ranks": sorted(placement.get(k, []))}
        if s is None:  # XID events but no sample yet
            d.update({f: None for f in _GPU_FIELDS})
            sim = any(x.simulated for x in xids if (x.node, x.gpu) == k)
            d.update(t=None, age_s=None, simulated=sim, sm_clock_frac=None, throttle_reasons=0, throttle_names=[],
                     throttled=False, xid_total=0)
        else:
            d.update({f: getattr(s, f) for f in _GPU_FIELDS})
            mask = int(s.throttle_reasons or 0)
            frac = (s.sm_clock_mhz / s.max_sm_clock_mhz if s.sm_clock_mhz is not None and s.max_sm_clock_mhz
                    else None)
            d.update(t=s.t, age_s=max(0.0, now - s.t), simulated=bool(s.simulated), sm_clock_frac=frac,
                     throttle_reasons=mask, throttle_names=throttle_names(mask),
                     throttled=bool(mask & THROTTLE_HARMFUL), xid_total=int(s.xid_total or 0))
        d["xid_count"] = max(d["xid_total"], len(events.get(k, ())))
        d["last_xid"] = last_xid[k][1] if k in last_xid else None
        out.append(d)
    return out


def served_findings(head, run_id: str) -> list[dict]:
    """``GET /api/runs/<id>/findings``: each finding's fields as stored, plus its evidence in sentences
    (``evidence_sentences``) and the evidence no sentence mentions, in words (``evidence_other``: ``[name, value]``
    pairs): the words ``diagnose``'s page uses (``analyzers.report.sentences``), for clients that import no analyzers
    (the TUI)."""
    return [explained(f) for f in head.analysis.findings_of(run_id)]


def run_coverage(head, run_id: str) -> dict:
    """Which checks can judge the run's live window (``analyzers.check_coverage`` on the window the live analysis
    reads): a check that could not run finds nothing, live as post-mortem, and that is not a healthy run.
    ``{"checks": [{check, ran, status, reason}], "checks_not_run": [...]}``; empty before the first step."""
    try:
        from analyzers import check_coverage
    except ImportError:
        raise HttpError(503, "the analyzers are not installed: no live analysis") from None
    data = head.live.run(run_id).run_data(head.analysis.window)
    if data.steps.empty:
        return {"checks": [], "checks_not_run": []}
    cov = check_coverage(data)
    return {"checks": [c.to_dict() for c in cov],
            "checks_not_run": [c.check for c in cov if c.status in ("not_run", "error")]}


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
            kind = "logs" if path == "/v1/logs" else "metrics"
            as_json = rx.is_json(self.headers.get("Content-Type"))  # OTLP/JSON in, OTLP/JSON out
            with rx.inflated(body, self.headers.get("Content-Encoding")) as payload:
                req = rx.parse(kind, payload, self.headers.get("Content-Type"))
                try:
                    if kind == "logs":
                        _, rejected, refused = self.head.ingest.logs(req)
                        out = rx.logs_response(rejected, wire_rejections.rejections_message(refused), as_json=as_json)
                    else:
                        self.head.ingest.metrics(req)
                        out = rx.metrics_response(as_json=as_json)
                except WalFull as e:  # not kept, so not acknowledged: the agent keeps the batch and sends it again
                    raise HttpError(503, str(e)) from None
            self._send(200, out, "application/json" if as_json else "application/x-protobuf")
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
                a = self.head.actions.request(run_id, req, requested_by=f"api:{self.client_address[0]}")
            except ValueError as e:
                raise HttpError(400, str(e)) from None
            except ActionRefused as e:  # the evict policy's limits forbid it; "force": true with a reason overrides
                raise HttpError(409, f"evict refused: {e.reason}; send \"force\": true with a reason to override") from None
            self._json(202 if a.status == "requested" else 200, schema.to_dict(a))
            return
        raise HttpError(404, f"no such endpoint: POST {path}")

    def _get(self):
        url = urlsplit(self.path)
        path = url.path.rstrip("/")
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        head = self.head
        if path == "/api/health":
            self._json(200, {"ok": True})
            return
        if not head.public_read:
            rx.check_token(self.headers, head.token)
        if path == "/api/stats":
            self._json(200, {"stats": head.stats, "runs": len(head.live.runs),
                              "tls_refused": self.server.tls_refused})  # failed handshakes: wrong CA, no cert
            return
        if path == "/metrics":  # the head's own Prometheus metrics (head/metrics.py), token like the API
            encode, ctype = choose_encoder(self.headers.get("Accept") or "")
            self._send(200, encode(head.metrics.registry), ctype)
            return
        if path == "/api/runs":
            self._json(200, head.live.summary())
            return
        parts = path.split("/")
        if len(parts) == 5 and parts[1] == "api" and parts[2] == "runs":
            run_id = self._run_id(parts[1:])
            if run_id not in head.live.runs and not (head.store.root / run_id).is_dir():
                raise HttpError(404, f"unknown run {run_id!r}")  # a GET never creates a run
            what = parts[4]
            if what == "ranks":
                self._json(200, head.live.run(run_id).rank_states())
            elif what == "agents":
                self._json(200, head.live.run(run_id).agent_states())
            elif what == "steps":
                try:
                    since = int(q.get("since", -1))
                    rank = int(q["rank"]) if "rank" in q else None
                    limit = min(int(q.get("limit", 10_000)), 100_000)
                except ValueError:
                    raise HttpError(400, "since, rank and limit must be integers") from None
                recs = head.live.run(run_id).steps_since(since, rank, limit)
                self._json(200, [schema.to_dict(r) for r in recs])
            elif what == "gpus":
                self._json(200, gpu_states(head.live.run(run_id)))
            elif what == "traces":
                try:
                    rank = int(q["rank"]) if "rank" in q else None
                    windows = int(q.get("windows", trace_windows.DEFAULT_WINDOWS))
                except ValueError:
                    raise HttpError(400, "rank and windows must be integers") from None
                if not 1 <= windows <= trace_windows.MAX_WINDOWS:
                    raise HttpError(400, f"windows must be 1..{trace_windows.MAX_WINDOWS}")
                self._json(200, live_trace_windows(head.live.run(run_id), rank, windows))
            elif what == "findings":
                self._json(200, served_findings(head, run_id))
            elif what == "coverage":
                self._json(200, run_coverage(head, run_id))
            elif what == "actions":
                self._json(200, head.actions.current(run_id))
            elif what == "ops":  # forwarded to the agent of the rank's node; its answer passed on as it came
                if head.public_read:
                    # not a read of the head's own data: the head asks a training node's agent with its token, so
                    # the caller needs the token even where --public-read opens the GETs
                    rx.check_token(self.headers, head.token)
                self._send(200, forward_ops(head, run_id, q), "application/json")
            else:
                raise HttpError(404, f"no such endpoint: GET {path}")
            return
        raise HttpError(404, f"no such endpoint: GET {path}")


class HeadServer(ParkingHTTPServer):
    # connections served at once: each node agent keeps one alive (2,048 at 16,384 ranks on 8-GPU nodes without a
    # Collector in between), plus the TUIs, scrapers and CLIs; the rest get 503. Between requests they wait parked in
    # one epoll and a few worker threads serve the requests (ranksight/parked_http.py), not a thread each.
    max_handlers = 4096
    request_queue_size = 1024  # a whole fleet's agents (re)connecting at once, as after a head restart


def make_server(head, bind: str = "127.0.0.1", port: int = 4318, tls=None, park: bool = True) -> HeadServer:
    """The head's server on ``bind:port``; ``tls``: a server ``ssl.SSLContext`` (``ranksight.tls.ServerTls``) for
    HTTPS, None for plain http; ``park``: keep-alive connections parked between requests (ranksight/parked_http.py),
    else a thread per connection."""
    handler = type("BoundHeadHandler", (HeadHandler,), {"head": head})
    server_class = HeadServer if park else type("ThreadedHeadServer", (HeadServer,), {"park_connections": False})
    srv = server_class((bind, port), handler, tls=tls)
    srv.raise_open_files()
    srv.thread_parts = head.cpu  # request handlers: the "http" part of the head's CPU
    return srv


def live_trace_windows(live, rank: int | None = None, windows: int = trace_windows.DEFAULT_WINDOWS) -> list[dict]:
    """``trace_windows`` over a run's live window (``head.live.RunLive``); nodes from the step records, else the
    manifest's placement."""
    summaries = live.trace_summaries(rank)
    with live.lock:
        placement = {p.rank: p.node for p in (live.manifest.ranks if live.manifest is not None else [])}

    def node_of(r: int) -> int | None:
        n = live.rank_node(r)
        return n if n is not None else placement.get(r)

    return trace_windows.trace_windows(summaries, node_of, rank, windows)
