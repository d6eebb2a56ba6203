"""The head service: receives OTLP from node agents, deduplicates, stores, watches, acts.

    agents --OTLP/HTTP logs+metrics--> Head.ingest_* --> Store (WAL, Parquet) + RunLive (memory)
                                                      --> analyzer hook --> findings table
    API clients --HTTP JSON--> head.api --> Head views / Head.request_action --> agent /control

Threads: the HTTP server (one thread per connection), a flusher (buffers to
Parquet every ``flush_interval``) and an analyzer loop. Shared state is guarded
by the per-run locks in Store/RunLive.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
import uuid
from typing import Any, Callable

import msgspec

from ranksight import wire
from head.findings_book import FindingsBook, latest_per_id
from head.live import DEFAULT_WINDOW, RunLive
from head.store import Store
from ranksight.tables import SPECS, read_table
from ranksight import schema

log = logging.getLogger("ranksight.head")

AnalyzerFn = Callable[[dict[str, Any]], list[schema.Finding]]
# Steps per rank the live analysis looks at (``ranksight head --analyze-window``): a round's cost is
# bounded by ranks x this, however large the API's window (``--window``). Findings are episodes
# (agent/findings_book.py) that keep the earliest onset seen, so an episode older than this window
# keeps its step_start.
DEFAULT_ANALYZE_WINDOW = 256
# With nothing new (no step, collective, event or XID since the last round) a round is skipped, but
# one runs at least this often while the run is not finished: the live hang check judges silence
# against the clock (60 s at least), so it must still look at a run that went quiet.
IDLE_RECHECK_S = 15.0
_TABLE_OF_KIND = {k: t for k, (_, t) in wire.BATCH_KINDS.items() if t}


def resolve_analyzers() -> AnalyzerFn | None:
    """The live analysis hook: ``frames`` (RunLive.frames(): the live window as DataFrames) -> findings.

    EXTENSION POINT: the head calls this once at start; ``Head(analyzer=fn)`` replaces it.
    It wraps ``analyzers.run_all(RunData)``, the same code ``diagnose`` runs post-mortem, on
    the head's sliding window. Without the analyzers package the head runs without live
    analysis (and says so).
    """
    try:
        from analyzers import run_all
        from analyzers.loader import RunData
    except ImportError:
        return None

    def live_analysis(frames: dict[str, Any]) -> list[schema.Finding]:
        data = RunData(run_id=frames["run_id"], manifest=frames.get("manifest"), steps=frames["steps"],
                       collectives=frames["collectives"], events=frames["events"], gpu=frames["gpu"],
                       host=frames["host"], xid=frames["xid"], source="live", now=frames["now"])
        errors: list[str] = []
        found = run_all(data, errors=errors)
        for e in errors:
            log.error("head: analyzer error on run %s: %s", frames["run_id"], e.splitlines()[0])
        return found

    return live_analysis


def tune_gc() -> None:
    """Fewer, cheaper garbage collections for an ingest process.

    The head allocates many short-lived records per request and keeps many long-lived ones
    (dedupe keys, live windows). With the default thresholds the young generation is scanned
    every 700 allocations and the old one far too often; records hold no reference cycles, so
    collecting rarely is safe. Measured in bench/ingest.py.
    """
    import gc

    gc.freeze()  # everything alive at start-up (modules, ...) is never scanned again
    gc.set_threshold(50_000, 20, 100)



def _gpu_simulated(live) -> bool | None:
    """True when the run's recent GPU samples come from the simulator, None when there are none."""
    if live is None or not live.gpu:
        return None
    return any(getattr(g, "simulated", False) for g in list(live.gpu)[-64:])

class Head:
    def __init__(self, store_dir, token: str, *, window: int = DEFAULT_WINDOW, flush_interval: float = 1.0,
                 analyzer: AnalyzerFn | None | str = "auto", analyzer_interval: float = 5.0,
                 flush_rows: int = 50_000, fsync: bool = False, analyze_window: int | None = DEFAULT_ANALYZE_WINDOW,
                 idle_recheck: float = IDLE_RECHECK_S):
        if not token:
            raise ValueError("the head needs a token")
        self.token = token
        self.store = Store(store_dir, flush_rows=flush_rows, fsync=fsync)
        self.window = window
        self.live: dict[str, RunLive] = {}
        self._stores: dict = {}  # run id -> RunStore wired to its live window (head.store.RunStore.on_new)
        self._live_lock = threading.Lock()
        self.flush_interval = flush_interval
        self.analyzer: AnalyzerFn | None = resolve_analyzers() if analyzer == "auto" else analyzer  # type: ignore[assignment]
        self.analyzer_interval = analyzer_interval
        self.analyze_window = analyze_window  # None: the whole live window
        self.idle_recheck = idle_recheck
        self._analysis_marks: dict[str, tuple[tuple, float]] = {}  # run id -> (RunLive.data_mark(), monotonic time)
        self.findings: dict[str, FindingsBook] = {}  # live findings per run: episodes across analysis rounds
        # Called with each analyzer pass's new findings (alerts: dashboards.webhook.WebhookSender.send_findings).
        self.finding_listeners: list[Callable[[list[schema.Finding]], Any]] = []
        # Called with every analysis round's full list of current findings (head.policy_runner.PolicyRunner).
        self.round_hooks: list[Callable[[str, list[schema.Finding], schema.Manifest | None], Any]] = []
        self.actions: dict[str, dict[str, schema.Action]] = {}
        self.metrics_latest: dict[tuple, float] = {}  # (node, metric name, attrs) -> value, from OTLP metrics
        self.stats = {"log_requests": 0, "metric_requests": 0, "records_in": 0, "records_new": 0,
                      "duplicates": 0, "rejected": 0, "http_4xx": 0, "metric_points": 0, "analyzer_errors": 0,
                      "analysis_rounds": 0, "analysis_skipped": 0}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.store.open_existing()
        if self.analyzer is None:
            log.info("head: no analyzers wired (analyzers.run_all not found); live analysis is off")

    # -- runs ---------------------------------------------------------------------
    def run_live(self, run_id: str) -> RunLive:
        rl = self.live.get(run_id)
        if rl is None:
            with self._live_lock:
                rl = self.live.get(run_id)
                if rl is None:
                    rl = self.live[run_id] = RunLive(run_id, self.window)
                    # Views of the live window first process the run's queued packed batches.
                    rl.sync = lambda run_id=run_id: self._sync(run_id)
                    try:
                        rl.manifest = msgspec.json.decode((self.store.root / run_id / "run.json").read_bytes(),
                                                          type=schema.Manifest)
                    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
                        pass
        return rl

    def _sync(self, run_id: str) -> None:
        rs = self.store.runs.get(run_id)
        if rs is not None and rs.pending_rows:
            self._run_store(run_id).process()

    # -- ingest -------------------------------------------------------------------
    def ingest_logs(self, request) -> tuple[int, int, str]:
        """Apply an ExportLogsServiceRequest. Returns (records accepted, log records rejected, message).

        Record batches are grouped per (run, table) so each table's dedupe, write-ahead-log
        write and live-window update happen once per request, not once per log record. Packed
        batches (step records from current agents) are only logged and queued here: the store
        dedupes a whole flush of them at once, vectorized, and feeds the live window through
        ``_on_new`` (see agent/store.py, RunStore).
        """
        stats = self.stats
        stats["log_requests"] += 1
        rejected, reasons, accepted = 0, [], 0
        groups: dict[tuple[str, str], list[wire.Batch]] = {}
        for batch, reason in wire.iter_batches(request):
            if batch is None:
                rejected += 1
                reasons.append(reason)
                continue
            try:
                table = _TABLE_OF_KIND.get(batch.kind)
                if table is None:
                    accepted += self._apply_control(batch)
                    continue
                if type(batch.items) is not wire.PackedBatch and SPECS[table].has_run_id:
                    run_id = batch.run_id
                    for r in batch.items:
                        if r.run_id != run_id:
                            raise ValueError(f"{batch.kind} record(s) of run {r.run_id!r} shipped as run {run_id!r}")
                groups.setdefault((batch.run_id, table), []).append(batch)
            except ValueError as e:  # e.g. a run id the store refuses, records of another run
                rejected += 1
                reasons.append(str(e))
        for (run_id, table), batches in groups.items():
            try:
                accepted += self._store_rows(run_id, table, batches)
            except ValueError as e:
                rejected += len(batches)
                reasons.append(str(e))
        if rejected:
            stats["rejected"] += rejected
            log.warning("head: rejected %d log record(s): %s", rejected, "; ".join(reasons[:3]))
        return accepted, rejected, "; ".join(reasons[:5])

    def _run_store(self, run_id: str):
        """The run's store, wired to its live window (queued rows reach it when the store processes them)."""
        rs = self._stores.get(run_id)
        if rs is None:
            live = self.run_live(run_id)
            rs = self.store.run(run_id)
            if rs.on_new is None:
                rs.on_new = self._on_new_fn(live)
            self._stores[run_id] = rs
        return rs

    def _on_new_fn(self, live: RunLive):
        stats = self.stats

        def on_new(table: str, new_table, new_rows, n_in: int, n_new: int) -> None:
            stats["records_in"] += n_in
            stats["records_new"] += n_new
            stats["duplicates"] += n_in - n_new
            live.add_new(table, new_table, new_rows)

        return on_new

    def _store_rows(self, run_id: str, table: str, batches: list[wire.Batch]) -> int:
        """Log and queue a request's batches of one (run, table); the store dedupes them at its next
        processing (every flush, or before a view reads the live window)."""
        rs = self._stores.get(run_id) or self._run_store(run_id)
        packed, decoded, n = [], [], 0
        for b in batches:
            it = b.items
            if type(it) is wire.PackedBatch:
                packed.append(it)
                n += it.count
            else:
                decoded.append((it, b.body))
                n += len(it)
        if packed:
            rs.enqueue_packed(table, packed)
        if decoded:
            rs.enqueue_rows(table, decoded)
        self.live[run_id].last_seen = time.time()
        return n

    def _apply_control(self, b: wire.Batch) -> int:
        """Manifest, heartbeat and control acks: small, rare, applied one by one."""
        run_id = b.run_id
        live = self.run_live(run_id)
        if b.kind == "heartbeat":
            live.heartbeat(b.items)
            return 0
        if b.kind == "manifest":
            if b.items.run_id != run_id:
                raise ValueError(f"manifest of {b.items.run_id!r} shipped as run {run_id!r}")
            live.manifest = b.items
            self.store.run(run_id).write_manifest(b.items, b.attrs.get(wire.A_MTIME))
            return 0
        if b.kind == "ack":
            self._apply_acks(run_id, b.items)
            return len(b.items)
        raise ValueError(f"unknown kind {b.kind!r}")

    def ingest_metrics(self, request) -> int:
        """Keep the latest value of each gauge/sum point (the live GPU/host view); history is in the logs path."""
        self.stats["metric_requests"] += 1
        n = 0
        for rm in request.resource_metrics:
            res = wire.attributes(rm.resource.attributes)
            node = res.get(wire.R_NODE)
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    kind = m.WhichOneof("data")
                    if kind not in ("gauge", "sum", "histogram"):
                        continue
                    for p in getattr(m, kind).data_points:
                        attrs = tuple(sorted((a.key, str(wire.any_value(a.value))) for a in p.attributes))
                        if kind == "histogram":
                            val = p.sum / p.count if p.count else 0.0
                        else:
                            val = p.as_double if p.WhichOneof("value") == "as_double" else float(p.as_int)
                        self.metrics_latest[(node, m.name, attrs)] = val
                        n += 1
        self.stats["metric_points"] += n
        return n

    # -- actions ------------------------------------------------------------------
    def _actions(self, run_id: str) -> dict[str, schema.Action]:
        acts = self.actions.get(run_id)
        if acts is None:
            acts = {}
            try:
                df = read_table(self.store.root, run_id, "actions")
                # The latest status of each action wins: a final one (applied/refused/failed) over
                # "requested" whatever the clocks say (an ack carries the trainer's time).
                rows = df.to_dict("records") if len(df) else []
                rows.sort(key=lambda r: (r["status"] != "requested", r["t"]))
                for row in rows:
                    ranks = row.get("ranks")
                    row["ranks"] = [int(r) for r in ranks] if ranks is not None else []
                    row = {k: (None if isinstance(v, float) and v != v else v) for k, v in row.items()}
                    acts[row["id"]] = msgspec.convert({**row, "run_id": run_id}, schema.Action, strict=False)
            except Exception as e:
                log.warning("head: could not load stored actions of %s: %s", run_id, e)
            self.actions[run_id] = acts
        return acts

    def _record_action(self, a: schema.Action) -> None:
        self._actions(a.run_id)[a.id] = a
        self.store.run(a.run_id).add("actions", [a])

    def _apply_acks(self, run_id: str, acks: list[schema.ControlAck]) -> None:
        acts = self._actions(run_id)
        for ack in acks:
            prev = acts.get(ack.id)
            if prev is None:
                prev = schema.Action(run_id=run_id, id=ack.id, t=ack.t, action=ack.action if ack.action in
                                     ("checkpoint", "profile", "evict") else "checkpoint", requested_by="unknown")
            if prev.status == ack.status and prev.applied_step == ack.applied_step:
                continue
            upd = msgspec.structs.replace(prev, status=ack.status, applied_step=ack.applied_step, t=ack.t)
            self._record_action(upd)
            log.info("head: action %s (%s) %s at step %s", ack.id, ack.action, ack.status, ack.applied_step)

    def request_action(self, run_id: str, req: dict[str, Any], requested_by: str = "api") -> schema.Action:
        """Create an action and forward it to the node agent that can carry it out."""
        action = req.get("action")
        if action not in ("checkpoint", "profile", "evict"):
            raise ValueError("action must be one of checkpoint, profile, evict")
        node = req.get("node")
        if node is not None and not isinstance(node, int):
            raise ValueError("node must be an integer")
        if action == "evict" and node is None:
            raise ValueError("evict needs a node")
        steps = int(req.get("steps") or (5 if action == "profile" else 0))
        a = schema.Action(run_id=run_id, id=req.get("id") or uuid.uuid4().hex[:12], t=time.time(), action=action,
                          node=node, ranks=[int(r) for r in req.get("ranks") or []], steps=steps,
                          reason=str(req.get("reason") or ""), finding_kind=str(req.get("finding_kind") or ""),
                          dry_run=bool(req.get("dry_run", False)), requested_by=requested_by)
        if a.dry_run:
            self._record_action(a)
            return a
        live = self.run_live(run_id)
        agent = self._agent_for(live, a)
        if agent is None:
            a = msgspec.structs.replace(a, status="failed", reason=(a.reason + " [no live agent for this run]").strip())
            self._record_action(a)
            return a
        creq = schema.ControlRequest(id=a.id, action=a.action, t=a.t, steps=a.steps, node=a.node, reason=a.reason)
        try:
            r = urllib.request.Request(agent.url.rstrip("/") + "/control", data=schema.encode(creq), method="POST",
                                       headers={"Authorization": f"Bearer {self.token}",
                                                "Content-Type": "application/json"})
            with urllib.request.urlopen(r, timeout=5) as resp:
                resp.read()
        except (urllib.error.URLError, OSError) as e:
            a = msgspec.structs.replace(a, status="failed",
                                        reason=(a.reason + f" [agent {agent.node} unreachable: {e}]").strip())
        self._record_action(a)
        return a

    def _agent_for(self, live: RunLive, a: schema.Action):
        with live.lock:
            agents = {n: ag for n, ag in live.agents.items() if ag.url}
            if not agents:
                return None
            if a.node is not None and a.action == "evict":
                # The eviction is carried out by rank 0's trainer, but the request names the node;
                # any agent of the run writes into the shared control directory. Prefer the named node's.
                return agents.get(a.node) or agents[min(agents)]
            rank0_node = None
            if live.manifest is not None:
                for p in live.manifest.ranks:
                    if p.rank == 0:
                        rank0_node = p.node
            if rank0_node is None:
                rank0_node = live.rank_node(0)
            return agents.get(rank0_node) or agents[min(agents)]

    # -- analyzers ------------------------------------------------------------------
    def analyze_once(self, run_id: str) -> list[schema.Finding]:
        if self.analyzer is None:
            return []
        live = self.run_live(run_id)
        frames = live.frames(self.analyze_window)
        try:
            found = list(self.analyzer(frames) or [])
        except Exception:
            self.stats["analyzer_errors"] += 1
            log.exception("head: analyzer failed on run %s", run_id)
            return []
        for hook in self.round_hooks:
            try:
                hook(run_id, found, live.manifest)
            except Exception:  # a failing policy must not stop analysis or ingestion
                log.exception("head: round hook %r failed", hook)
        book = self.findings.setdefault(run_id, FindingsBook(run_id))
        # the newest step in the data the analyzers just saw (not the live window now, which has moved on while they ran)
        st = frames.get("steps") if isinstance(frames, dict) else None
        last_step = int(st["step"].max()) if st is not None and len(st) else live.max_step()
        res = book.observe(found, last_step)
        for f in res.new:
            log.warning("finding [%s] %s/%s ranks=%s: %s", f.severity, f.analyzer, f.kind, f.ranks, f.summary)
        for f in res.escalated:
            log.warning("finding escalated to %s: %s/%s ranks=%s: %s", f.severity, f.analyzer, f.kind, f.ranks, f.summary)
        for f in res.changed:
            if f.status == "closed":
                log.info("finding closed: %s/%s ranks=%s, steps %s-%s", f.analyzer, f.kind, f.ranks, f.step_start, f.step_end)
        if res.new or res.changed:
            # append-only: the row with the latest ``updated`` per id is an episode's current state
            self.store.run(run_id).add("findings", res.new + res.changed)
        notify = res.new + res.escalated
        if notify:
            for listener in self.finding_listeners:
                try:
                    listener(notify)
                except Exception:  # an alert channel failing must not stop analysis or ingestion
                    log.exception("head: finding listener %r failed", listener)
        return res.new

    def analyze_if_due(self, run_id: str, now: float | None = None) -> bool:
        """One scheduled round for ``run_id``, unless nothing changed: skipped when no step, collective,
        event, XID or manifest reached the live window since the last round, except that a run not yet
        finished is looked at again every ``idle_recheck`` seconds (the hang check needs the clock).
        Returns whether the analyzers ran."""
        live = self.live.get(run_id)
        if live is None or self.analyzer is None:
            return False
        now = time.monotonic() if now is None else now
        mark = live.data_mark()
        if all(m is None for m in mark[:4]):
            return False  # nothing to analyze yet
        prev = self._analysis_marks.get(run_id)
        if prev is not None and all(a is b for a, b in zip(mark, prev[0])):
            finished = live.manifest is not None and live.manifest.finished is not None
            if finished or now - prev[1] < self.idle_recheck:
                self.stats["analysis_skipped"] += 1
                return False
        self._analysis_marks[run_id] = (mark, now)
        self.stats["analysis_rounds"] += 1
        self.analyze_once(run_id)
        return True

    def _analyzer_loop(self) -> None:
        while not self._stop.wait(self.analyzer_interval):
            for run_id in list(self.live):
                try:
                    self.analyze_if_due(run_id)
                except Exception:  # never let one run stop the loop
                    log.exception("head: analysis round failed on run %s", run_id)

    def _flush_loop(self) -> None:
        while not self._stop.wait(self.flush_interval):
            for run_id, rs in list(self.store.runs.items()):
                if rs.on_new is None and rs.pending_rows:
                    self._run_store(run_id)  # a run replayed at start: its rows feed the live window too
            try:
                self.store.flush_all()
            except Exception:
                log.exception("head: flush failed (rows stay in the WAL and are retried)")

    # -- views for the API ----------------------------------------------------------
    def findings_of(self, run_id: str) -> list[dict[str, Any]]:
        if run_id in self.findings:
            return [schema.to_dict(f) for f in self.findings[run_id].current()]
        df = read_table(self.store.root, run_id, "findings")
        return latest_per_id(json.loads(df.to_json(orient="records"))) if len(df) else []

    def actions_of(self, run_id: str) -> list[dict[str, Any]]:
        return [schema.to_dict(a) for a in sorted(self._actions(run_id).values(), key=lambda a: a.t)]

    def runs_summary(self) -> list[dict[str, Any]]:
        now = time.time()
        out = []
        for run_id in sorted(set(self.store.run_ids()) | set(self.live)):
            live = self.live.get(run_id)
            m = live.manifest if live else None
            if m is None:
                try:
                    m = msgspec.json.decode((self.store.root / run_id / "run.json").read_bytes(), type=schema.Manifest)
                except (OSError, msgspec.DecodeError, msgspec.ValidationError):
                    m = None
            last_step = live.max_step() if live else None
            if m is not None and m.finished:
                status = "finished"
            elif live is not None and now - live.last_seen < 30:
                status = "running"
            else:
                status = "stopped"
            rs = self.store.runs.get(run_id)
            out.append({"run_id": run_id, "status": status,
                        "start_time": m.start_time if m else None,
                        "world_size": (m.layout.get("world") or len(m.ranks)) if m else None,
                        "layout": m.layout if m else {}, "nodes": m.nodes if m else None,
                        "last_step": last_step, "last_seen": live.last_seen if live else None,
                        "ranks_live": live.n_ranks() if live else 0,
                        "steps_stored": rs.stored_and_buffered("steps") if rs else None,
                        # What MFU is measured against, and whether GPU data is simulated: surfaces must say so.
                        "peak_flops": m.peak_flops if m else None,
                        "peak_source": m.peak_source if m else "",
                        "peak_simulated": m.peak_simulated if m else None,
                        "device": m.device if m else "",
                        "gpu_simulated": _gpu_simulated(live)})
        return out

    # -- lifecycle --------------------------------------------------------------------
    def start_background(self) -> None:
        loops = [(self._flush_loop, "flush")]
        if self.analyzer_interval > 0:  # 0: no live analysis (diagnose still analyzes the stored run)
            loops.append((self._analyzer_loop, "analyze"))
        for fn, name in loops:
            t = threading.Thread(target=fn, name=f"head-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        self.store.close()
