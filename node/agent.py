"""The node agent: one process per node, between the trainer's files and the head.

Each cycle (``ship_interval``, 1 s):

1. find the local ranks (manifest placement says node == N; before the manifest
   exists, the node named in each spool's first record),
2. tail their spools from the saved positions (ranksight.spool), turn spool gaps
   into ``spool_gap``/``spool_reset`` events, read new control acks and a changed
   manifest, and take the GPU/host samples gathered by the sampler thread,
3. ship: first the disk outbox (oldest first), then this cycle's batch, each as
   one OTLP/HTTP logs export through the OpenTelemetry SDK's exporter, called
   synchronously so its result is known,
4. on success save the new positions (atomic state file); on failure write the
   batch to the bounded outbox, then save the positions (the data is durable
   either way).

So every record is shipped at least once, and the head's natural-key dedupe
makes it exactly once in the store. ``kill -9`` at any point re-ships at most
the last unacknowledged batch.

Alongside: a sampler thread (GPU every ``gpu_interval``, host stats), the OTel
SDK's metric pipeline (periodic OTLP metrics: best effort, the authoritative
samples travel as logs), and one HTTP server for Prometheus ``/metrics`` and
the token-protected ``POST /control`` the head uses to request actions.

``ranksight agent`` puts the whole process below training first (``ranksight.priority``:
nice 19 on every thread by default), so a rank that wants a core gets it; its lag
metric shows when the agent falls behind.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgspec

from ranksight import wire
from ranksight.http_server import NoDelayHandler, serve_in_thread, shutdown_server
from node.otlp_session import _exporter_session
from node.outbox import Item, Outbox
from node.prom import AgentMetrics
from ranksight.spool import SpoolGap, TailPosition, first_node, spool_ranks, tail
from ranksight import schema
from ranksight.layout import RunDir, atomic_write

log = logging.getLogger("ranksight.agent")

READ_BYTES_PER_RANK = 1024 * 1024  # per cycle: keeps one OTLP request well under the head's limit
MAX_ITEMS_RECORDS = 20_000
_SAFE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class AgentState(msgspec.Struct, kw_only=True):
    """What the agent must remember across restarts (RunDir.agent_state(node))."""

    node: int
    positions: dict[int, TailPosition] = {}
    acks_shipped: list[str] = []
    manifest_mtime: float = 0.0
    nccl: dict[str, list[int]] = {}  # NCCL log file name -> [offset, line_no, inode]
    traces_done: list[str] = []  # profiler trace files already summarized and shipped


def load_state(path: Path, node: int) -> AgentState:
    try:
        st = msgspec.json.decode(path.read_bytes(), type=AgentState)
        if st.node != node:
            log.error("agent state %s belongs to node %d, not %d: starting from scratch", path, st.node, node)
            return AgentState(node=node)
        return st
    except FileNotFoundError:
        return AgentState(node=node)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
        # Re-reading from 0 re-ships records the head already has; it drops them. Nothing is lost.
        log.error("agent state %s unreadable (%s): re-reading spools from the start", path, e)
        return AgentState(node=node)


class NodeAgent:
    def __init__(self, run_dir: RunDir, node: int, head_url: str, token: str, *, gpu_interval: float = 1.0,
                 ship_interval: float = 1.0, metrics_port: int | None = None, bind: str = "127.0.0.1",
                 sim_gpu: str = "auto", dcgm_url: str | None = None, host: str | None = None,
                 outbox_bytes: int = 256 * 1024 * 1024, ship_timeout: float = 3.0, otlp_metrics: bool = True):
        self.rd = run_dir
        self.run_id = run_dir.run_id
        self.node = node
        self.head_url = head_url.rstrip("/")
        self.token = token
        self.gpu_interval = gpu_interval
        self.ship_interval = ship_interval
        self.bind = bind
        self.metrics_port = metrics_port
        self.sim_gpu = sim_gpu
        self.dcgm_url = dcgm_url
        self.host = host or socket.gethostname()
        self.ship_timeout = ship_timeout
        self.state_path = run_dir.agent_state(node)
        self.state = load_state(self.state_path, node)
        self.outbox = Outbox(self.state_path.parent / f"node-{node}.outbox", outbox_bytes)
        self.metrics = AgentMetrics()
        self._dropped_reported = 0
        self.local_ranks: list[int] = []
        self._rank_nodes: dict[int, int] = {}
        self._last_discovery = 0.0
        self._samples: list[Any] = []
        self._samples_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.server: ThreadingHTTPServer | None = None
        self.url = ""
        self.garbage_lines = 0
        self.ship_errors = 0
        self.shipped = 0
        self.agent_id = uuid.uuid4().hex[:8]
        self._otlp_metrics_enabled = otlp_metrics
        self._meter_provider = None
        self._gpu_probe = None
        self._host_probe = None
        self._last_xid: dict[int, int] = {}
        self._pending_since: float | None = None
        self._last_ship_ok = True
        self._nccl_parsers: dict[str, Any] = {}
        self._pending_nccl: dict[str, list[int]] = {}
        self._pending_traces: list[str] = []
        self._resource_cache: tuple | None = None
        self._saved_state: bytes | None = None  # the state file's content as last written by this process
        self._init_exporter()
        # Self-metrics exist (at 0) from the start: an absent series is not "no drops".
        n = str(node)
        for m in (self.metrics.shipped, self.metrics.dropped, self.metrics.ship_errors, self.metrics.lag,
                  self.metrics.spooled, self.metrics.spooled_bytes, self.metrics.ranks):
            m.labels(n)

    # -- OTLP -----------------------------------------------------------------------------
    def _resource_attrs(self) -> dict[str, Any]:
        return {"service.name": "ranksight-agent", wire.R_NODE: self.node, wire.R_HOST: self.host,
                wire.R_AGENT_URL: self.url, wire.R_AGENT_ID: self.agent_id, wire.R_RUN: self.run_id}

    def _init_exporter(self) -> None:
        from opentelemetry.exporter.otlp.proto.http import Compression
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self._headers = {"Authorization": f"Bearer {self.token}"}
        self.exporter = OTLPLogExporter(endpoint=self.head_url + "/v1/logs", headers=self._headers,
                                        timeout=self.ship_timeout, compression=Compression.Deflate,
                                        session=_exporter_session(self.head_url + "/v1/logs"))
        # Deflate (zlib level 6), not the SDK's gzip at level 9: a third less CPU per export for a body
        # ~2 % larger; the head and the OpenTelemetry Collector both accept Content-Encoding: deflate.
        from ranksight import __version__

        self._scope = InstrumentationScope("ranksight.agent", __version__)

    def _resource(self):
        """The OTel resource of this agent, built once per set of attributes (they change only when the
        metrics URL becomes known): ``Resource.create`` runs the SDK's resource detectors in a thread
        pool, which was a fifth of the agent's CPU when called for every export."""
        from opentelemetry.sdk.resources import Resource

        attrs = self._resource_attrs()
        key = tuple(sorted(attrs.items()))
        if self._resource_cache is None or self._resource_cache[0] != key:
            self._resource_cache = (key, Resource.create(attrs))
        return self._resource_cache[1]

    def _init_otlp_metrics(self) -> None:
        """The SDK metric pipeline: periodic OTLP metrics to the head (lossy by design: live view only)."""
        if not self._otlp_metrics_enabled:
            return
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

        from node.prom import STEP_BUCKETS

        exp = OTLPMetricExporter(endpoint=self.head_url + "/v1/metrics", headers=self._headers, timeout=self.ship_timeout,
                                 session=_exporter_session(self.head_url + "/v1/metrics"))
        reader = PeriodicExportingMetricReader(exp, export_interval_millis=5000)
        view = View(instrument_name="ranksight.step.duration",
                    aggregation=ExplicitBucketHistogramAggregation([b for b in STEP_BUCKETS if b != float("inf")]))
        self._meter_provider = MeterProvider(resource=self._resource(), metric_readers=[reader], views=[view])
        m = self._meter_provider.get_meter("ranksight.agent")
        self._om_step = m.create_histogram("ranksight.step.duration", unit="s", description="Training step wall time")
        self._om_gpu = {
            "util_pct": m.create_gauge("gpu.utilization", unit="%"),
            "temp_c": m.create_gauge("gpu.temperature", unit="Cel"),
            "power_w": m.create_gauge("gpu.power", unit="W"),
            "sm_clock_mhz": m.create_gauge("gpu.clock.sm", unit="MHz"),
            "throttle_reasons": m.create_gauge("gpu.throttle_reasons", unit="1"),
        }
        self._om_host_cpu = m.create_gauge("host.cpu.utilization", unit="%")

    # -- discovery --------------------------------------------------------------------------
    def _manifest(self) -> schema.Manifest | None:
        try:
            return msgspec.json.decode(self.rd.manifest.read_bytes(), type=schema.Manifest)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return None

    def discover(self, force: bool = False) -> list[int]:
        now = time.time()
        if not force and now - self._last_discovery < 2.0:
            return self.local_ranks
        self._last_discovery = now
        m = self._manifest()
        self.metrics.observe_manifest(self.run_id, m)  # ranksight_run_finished: silences stall alerts after the end
        if m is not None and m.ranks:
            self._rank_nodes = {p.rank: p.node for p in m.ranks}
        for r in spool_ranks(self.rd.spool_dir):
            if r not in self._rank_nodes:
                pos = self.state.positions.get(r)
                n = pos.node if pos is not None and pos.node is not None else first_node(self.rd.spool(r))
                if n is not None:
                    self._rank_nodes[r] = n
        ranks = sorted(r for r, n in self._rank_nodes.items() if n == self.node)
        if ranks != self.local_ranks:
            log.info("agent node %d: tailing ranks %s", self.node, ranks)
        self.local_ranks = ranks
        self.metrics.ranks.labels(str(self.node)).set(len(ranks))
        return ranks

    # -- collection -----------------------------------------------------------------------------
    def collect(self) -> tuple[list[Item], dict[int, TailPosition], list[str], float | None, bool]:
        """This cycle's items, plus what to save once they are safe. ``more`` = a spool has a backlog."""
        items: list[Item] = []
        positions: dict[int, TailPosition] = {}
        more = False
        now = time.time()
        # One log record per kind for all local ranks: per-record overhead (protobuf, attributes)
        # is paid once per cycle, not once per rank (see bench/ingest.py).
        acc: dict[str, tuple[list[bytes], list[int], set[int], list[float], list]] = {}

        def put(kind: str, raw: bytes, step: int, rank: int, t: float | None, rec=None) -> None:
            a = acc.get(kind)
            if a is None:
                a = acc[kind] = ([], [], set(), [], [])
            a[0].append(raw)
            a[1].append(step)
            a[2].add(rank)
            if t:
                a[3].append(t)
            a[4].append(rec)

        for rank in self.discover():
            res = tail(self.rd.spool(rank), self.state.positions.get(rank), max_bytes=READ_BYTES_PER_RANK)
            positions[rank] = res.position
            if not res.eof:
                more = True
            steps = []
            for rec, raw in zip(res.records, res.raw):
                put(type(rec).__struct_config__.tag, raw, rec.step, rank, _rec_time(rec), rec)
                if isinstance(rec, schema.StepRecord):
                    steps.append(rec)
            if steps:
                self.metrics.observe_steps(steps)  # each Prometheus series once per rank and cycle
                if self._meter_provider is not None:
                    for rec in steps:
                        self._om_step.record(rec.step_ms / 1000.0, {"rank": rec.rank, "run_id": rec.run_id})
            for g in res.gaps:
                ev = self._gap_event(rank, g)
                put("event", schema.encode(ev), ev.step, rank, now, ev)
                if g.reason == "reset":
                    self.metrics.resets.labels(str(self.node), str(rank)).inc()
                else:
                    self.metrics.garbage.labels(str(self.node), str(rank)).inc(g.lines)
                    self.garbage_lines += g.lines
                log.warning("agent node %d: rank %d spool %s at offset %d (%d lines, %d bytes) after step %d",
                            self.node, rank, g.reason, g.offset, g.lines, g.nbytes, g.after_step)
        for kind, (raws, steps, ranks, ts, recs) in acc.items():
            # Step records travel packed (the head stores them without a Python object per record);
            # anything that cannot be packed exactly, and every other kind, as the JSON spool lines.
            packed = wire.pack_records(kind, self.run_id, recs) if kind in wire.PACKED_LAYOUTS else None
            layout, body = packed if packed is not None else (None, wire.join_array(raws))
            items.append(Item(kind=kind, body=body, rank=next(iter(ranks)) if len(ranks) == 1 else None,
                              count=len(raws), step_min=min(steps), step_max=max(steps),
                              t_first=min(ts) if ts else now, layout=layout))
        with self._samples_lock:
            samples, self._samples = self._samples, []
        for kind in ("gpu", "host", "xid"):
            group = [s for k, s in samples if k == kind]
            if group:
                items.append(Item(kind=kind, body=msgspec.json.encode(group), count=len(group),
                                  t_first=min(getattr(s, "t", now) for s in group)))
        nccl_events, nccl_pos = self._read_nccl_logs()
        if nccl_events:
            items.append(Item(kind="nccl", body=msgspec.json.encode(nccl_events), count=len(nccl_events), t_first=now))
        self._pending_nccl = nccl_pos
        summaries, trace_names = self._summarize_traces()
        if summaries:
            items.append(Item(kind="trace_summary", body=msgspec.json.encode(summaries), count=len(summaries),
                              step_min=min(s.step_start for s in summaries), step_max=max(s.step_end for s in summaries),
                              t_first=now))
        self._pending_traces = trace_names
        # control acks written by the trainer
        acks, ack_names = self._new_acks()
        if acks:
            items.append(Item(kind="ack", body=msgspec.json.encode(acks), count=len(acks), t_first=now))
        manifest_mtime = None
        try:
            mt = self.rd.manifest.stat().st_mtime
            if mt != self.state.manifest_mtime:
                manifest_mtime = mt
        except FileNotFoundError:
            pass
        return items, positions, ack_names, manifest_mtime, more

    def _gap_event(self, rank: int, g: SpoolGap) -> schema.EventRecord:
        # Deterministic fields only (no "now"): a re-read after a crash yields the same key.
        return schema.EventRecord(run_id=self.run_id, rank=rank, step=g.after_step, t=g.after_t,
                                  event="spool_reset" if g.reason == "reset" else "spool_gap",
                                  detail={"reason": g.reason, "offset": g.offset, "bytes": g.nbytes, "lines": g.lines,
                                          "inode": g.inode, "sample": g.sample, "node": self.node})

    # -- NCCL logs and profiler traces (probes.nccl_log, probes.profiler) -------------------------
    def _local_hosts(self) -> set[str]:
        hosts = {self.host, socket.gethostname()}
        m = self._manifest()
        if m is not None:
            hosts |= {p.host for p in m.ranks if p.node == self.node}
        return hosts

    def _read_nccl_logs(self) -> tuple[list, dict[str, list[int]]]:
        """New complete lines of this node's NCCL_DEBUG_FILEs, parsed; positions to save after shipping."""
        d = self.rd.nccl_dir
        if not d.is_dir():
            return [], {}
        try:
            from probes.nccl_log import NcclLogParser, host_pid_from_filename
        except ImportError:
            return [], {}
        hosts = self._local_hosts()
        events, pos = [], {}
        for p in sorted(d.iterdir()):
            if p.name.startswith(".") or not p.is_file():
                continue
            fhost, _ = host_pid_from_filename(p.name)
            if fhost and fhost not in hosts:
                continue  # another node's log (a shared file system)
            off, line_no, ino = (list(self.state.nccl.get(p.name) or []) + [0, 0, 0])[:3]
            try:
                st = p.stat()
                if ino and (st.st_ino != ino or st.st_size < off):
                    off, line_no = 0, 0  # rotated or truncated: read it again (the head dedupes)
                if st.st_size <= off:
                    continue
                with open(p, "rb") as f:
                    f.seek(off)
                    data = f.read(READ_BYTES_PER_RANK)
            except OSError as e:
                log.warning("agent: cannot read NCCL log %s: %s", p, e)
                continue
            end = data.rfind(b"\n")
            if end < 0:
                continue
            parser = self._nccl_parsers.get(p.name)
            if parser is None or parser.line_no != line_no:
                parser = self._nccl_parsers[p.name] = NcclLogParser(source_file=p.name)
                parser.line_no = line_no  # line numbers are part of the dedupe key: keep them stable
            try:
                evs = parser.feed(data[: end + 1])
            except Exception as e:  # the parser promises not to raise; never let it stop shipping
                log.error("agent: NCCL parser failed on %s: %s", p, e)
                evs = []
            events.extend(evs)
            pos[p.name] = [off + end + 1, parser.line_no, st.st_ino]
        return events, pos

    def _summarize_traces(self) -> tuple[list, list[str]]:
        """Summaries of finished profiler traces of local ranks (at most 2 per cycle: they can be large)."""
        d = self.rd.traces_dir
        if not d.is_dir():
            return [], []
        try:
            from probes.profiler import TraceError, summarize_trace
        except ImportError:
            return [], []
        done = set(self.state.traces_done)
        local = set(self.local_ranks)
        out, names = [], []
        now = time.time()
        for p in sorted(d.iterdir()):
            if len(names) >= 2:
                break
            n = p.name
            if n in done or not n.startswith("rank-") or not (n.endswith(".json") or n.endswith(".json.gz")):
                continue
            try:
                rank = int(n[5:].split(".", 1)[0])
                if rank not in local or now - p.stat().st_mtime < 2.0:
                    continue  # not ours, or still being written
            except (ValueError, OSError):
                continue
            try:
                s = summarize_trace(str(p), run_id=self.run_id, rank=rank)
            except (TraceError, OSError) as e:
                log.warning("agent: trace %s not summarized: %s", p, e)
                names.append(n)  # do not retry a broken file every cycle
                continue
            out.append(s)
            names.append(n)
        return out, names

    def _new_acks(self) -> tuple[list[schema.ControlAck], list[str]]:
        d = self.rd.control_acks
        try:
            names = sorted(n for n in os.listdir(d) if n.endswith(".json") and not n.startswith("."))
        except FileNotFoundError:
            return [], []
        done = set(self.state.acks_shipped)
        acks, new_names = [], []
        for n in names:
            if n in done:
                continue
            try:
                acks.append(msgspec.json.decode((d / n).read_bytes(), type=schema.ControlAck))
                new_names.append(n)
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
                log.warning("agent: unreadable control ack %s: %s", n, e)
        return acks, new_names

    # -- shipping ---------------------------------------------------------------------------------
    def _export(self, items: list[Item], extra_records: list | None = None) -> bool:
        from opentelemetry.sdk._logs.export import LogRecordExportResult

        res = self._resource()
        recs = [wire.make_log_record(self.run_id, it.kind, it.body, rank=it.rank, node=self.node, count=it.count,
                                     step_min=it.step_min, step_max=it.step_max, resource=res, scope=self._scope,
                                     layout=it.layout)
                for it in items]
        recs += extra_records or []
        if not recs:
            return True
        try:
            ok = self.exporter.export(recs) == LogRecordExportResult.SUCCESS
        except Exception as e:  # the exporter should not raise; if it does, it is a failed export
            log.error("agent: OTLP export raised %s", e)
            ok = False
        if not ok:
            self.ship_errors += 1
            self.metrics.ship_errors.labels(str(self.node)).inc()
        return ok

    def _manifest_record(self, mtime: float):
        try:
            body = self.rd.manifest.read_bytes()
            msgspec.json.decode(body, type=schema.Manifest)  # never ship a half-written or foreign file
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("agent: manifest not shippable yet: %s", e)
            return None
        return wire.make_log_record(self.run_id, "manifest", body, node=self.node, extra={wire.A_MTIME: mtime},
                                    resource=self._resource(), scope=self._scope)

    def _heartbeat_record(self):
        hb = wire.Heartbeat(node=self.node, host=self.host, url=self.url, t=time.time(), ranks=self.local_ranks,
                            lag_s=self._lag(), spooled_records=self.outbox.records(),
                            dropped_records=self.outbox.dropped_records, ship_errors=self.ship_errors,
                            garbage_lines=self.garbage_lines)
        return wire.make_log_record(self.run_id, "heartbeat", msgspec.json.encode(hb), node=self.node,
                                    resource=self._resource(), scope=self._scope)

    def _lag(self) -> float:
        if self._pending_since is None:
            return 0.0
        return max(0.0, time.time() - self._pending_since)

    def _drain_outbox(self) -> bool:
        """Ship outbox segments oldest first (at most 64 per cycle). True when the outbox is empty."""
        for _ in range(64):
            seg = self.outbox.oldest()
            if seg is None:
                return True
            items = self.outbox.read(seg)
            if items and not self._export(items):
                return False
            self.outbox.remove(seg)
            n = sum(i.count for i in items)
            self.shipped += n
            self.metrics.shipped.labels(str(self.node)).inc(n)
        return self.outbox.oldest() is None

    def save_state(self) -> None:
        """Atomic, not fsynced, and skipped when nothing changed. The positions only ever move past records
        that are acknowledged by the head or durable (fsynced) in the outbox, so a state file that a power
        loss leaves stale or empty only makes the agent re-read records the head already has; it drops them
        by natural key (the same as a ``kill -9`` between shipping and saving)."""
        data = msgspec.json.encode(self.state)
        if data == self._saved_state:
            return
        atomic_write(self.state_path, data, durable=False)
        self._saved_state = data

    def cycle(self, final: bool = False) -> bool:
        """One collect+ship round. Returns True when a spool still has a backlog.

        ``final``: the agent is stopping; if the head was unreachable on the last try, do not wait
        for it again: the batch goes straight to the outbox."""
        items, positions, ack_names, manifest_mtime, more = self.collect()
        extra = []
        mrec = self._manifest_record(manifest_mtime) if manifest_mtime is not None else None
        if mrec is not None:
            extra.append(mrec)
        n = sum(i.count for i in items)
        if items and self._pending_since is None:
            self._pending_since = min((i.t_first for i in items if i.t_first), default=time.time())
        if final and not self._last_ship_ok:
            drained, shipped = False, False
        else:
            drained = self._drain_outbox()
            shipped = drained and self._export(items, extra + [self._heartbeat_record()])
            self._last_ship_ok = shipped
        if shipped:
            self.shipped += n
            self.metrics.shipped.labels(str(self.node)).inc(n)
            if mrec is not None:
                self.state.manifest_mtime = manifest_mtime
            self._pending_since = None
        elif items:
            # Head unreachable (or behind us in the outbox): keep this batch on disk, in order.
            self.outbox.append(items)
        # The batch is acknowledged or durable in the outbox: the positions may move on.
        self.state.positions.update(positions)
        if ack_names:
            self.state.acks_shipped = sorted(set(self.state.acks_shipped) | set(ack_names))[-10_000:]
        if self._pending_nccl:
            self.state.nccl.update(self._pending_nccl)
        if self._pending_traces:
            self.state.traces_done = (self.state.traces_done + self._pending_traces)[-10_000:]
        if positions or ack_names or mrec is not None or self._pending_nccl or self._pending_traces:
            self.save_state()
        if self.outbox.dropped_records > self._dropped_reported:
            self.metrics.dropped.labels(str(self.node)).inc(self.outbox.dropped_records - self._dropped_reported)
            self._dropped_reported = self.outbox.dropped_records
        if len(self.outbox):
            oldest = self.outbox.oldest_t()
            self._pending_since = oldest if oldest is not None else self._pending_since
        elif shipped:
            self._pending_since = None
        self.metrics.spooled.labels(str(self.node)).set(self.outbox.records())
        self.metrics.spooled_bytes.labels(str(self.node)).set(self.outbox.bytes())
        self.metrics.lag.labels(str(self.node)).set(self._lag())
        return more and shipped

    # -- sampling --------------------------------------------------------------------------------
    def _build_probes(self) -> None:
        sim_dir = self.rd.simgpu_node_dir(self.node)
        try:
            if self.dcgm_url:
                self._gpu_probe = _dcgm_probe(self.dcgm_url, self.node, self.host)
            if self._gpu_probe is None:
                from probes.nvml import build_gpu_probe

                # auto: real NVML if there is a GPU, else the simulated device of this node.
                # off: real NVML or nothing. on: simulated even on a GPU machine.
                self._gpu_probe = build_gpu_probe(self.node, self.host, None if self.sim_gpu == "off" else sim_dir,
                                                  mode="auto")
                if self.sim_gpu == "on" and not getattr(self._gpu_probe, "simulated", True):
                    self._gpu_probe.close()
                    self._gpu_probe = build_gpu_probe(self.node, self.host, sim_dir, mode="python-sim")
                log.info("agent node %d: GPU probe %s (%s)", self.node, getattr(self._gpu_probe, "mode", "?"),
                         getattr(self._gpu_probe, "status", ""))
        except ImportError as e:
            log.warning("agent node %d: no GPU probe available (%s): no GPU data", self.node, e)
            self._gpu_probe = None
        try:
            from probes.host import HostProbe

            self._host_probe = HostProbe(self.node, self.host)
        except ImportError as e:
            log.warning("agent node %d: no host probe available (%s)", self.node, e)

    def sample_once(self) -> None:
        out: list[tuple[str, Any]] = []
        p = self._gpu_probe
        if p is not None:
            try:
                xids = p.poll_xids() if hasattr(p, "poll_xids") else []
                samples = p.sample()
            except Exception as e:  # a probe bug must not stop the agent
                log.error("agent: GPU probe failed: %s", e)
                xids, samples = [], []
            by_gpu = {s.gpu: s for s in samples}
            for x in xids:
                self._last_xid[x.gpu] = x.code
                s = by_gpu.get(x.gpu)
                if s is not None:
                    self.metrics.observe_xid(x, AgentMetrics.gpu_labels(s))
                out.append(("xid", x))
            for s in samples:
                self.metrics.observe_gpu(s, self._last_xid.get(s.gpu))
                if self._meter_provider is not None:
                    attrs = {"gpu": s.gpu, "simulated": s.simulated, "node": self.node}
                    for f, inst in self._om_gpu.items():
                        v = getattr(s, f)
                        if v is not None:
                            inst.set(v, attrs)
                out.append(("gpu", s))
        if self._host_probe is not None:
            try:
                h = self._host_probe.sample()
            except Exception as e:
                log.error("agent: host probe failed: %s", e)
                h = None
            if h is not None:
                self.metrics.observe_host(h)
                if self._meter_provider is not None:
                    self._om_host_cpu.set(h.cpu_pct, {"node": self.node})
                out.append(("host", h))
        if out:
            with self._samples_lock:
                self._samples.extend(out)
                if len(self._samples) > 100_000:  # the ship loop is stuck: keep memory bounded, count it
                    drop = len(self._samples) - 100_000
                    del self._samples[:drop]
                    self.outbox.dropped_records += drop

    def _sampler_loop(self) -> None:
        self._build_probes()
        while not self._stop.is_set():
            t0 = time.monotonic()
            self.sample_once()
            self._stop.wait(max(0.05, self.gpu_interval - (time.monotonic() - t0)))

    # -- control endpoint + /metrics ---------------------------------------------------------------
    def write_control_request(self, req: schema.ControlRequest) -> Path:
        if not _SAFE_ID.match(req.id):
            raise ValueError("control request id must be 1-64 of [A-Za-z0-9_.-]")
        path = self.rd.control_requests / f"{req.id}.json"
        atomic_write(path, schema.encode(req))
        self.metrics.control.labels(str(self.node), req.action).inc()
        log.info("agent node %d: control request %s (%s) written for the trainer", self.node, req.id, req.action)
        return path

    def start_server(self) -> None:
        if self.metrics_port is None:
            return
        agent = self

        class Handler(NoDelayHandler):

            def log_message(self, fmt, *args):
                log.debug("agent http: " + fmt, *args)

            def _send(self, status, body: bytes, ctype="application/json"):
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

                path = self.path.split("?")[0]
                if path == "/metrics":
                    self._send(200, generate_latest(agent.metrics.registry), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    self._send(200, json.dumps({"ok": True, "node": agent.node, "ranks": agent.local_ranks}).encode())
                else:
                    self._send(404, b'{"error":"not found"}')

            def do_POST(self):
                self.close_connection = True
                if self.path.split("?")[0] != "/control":
                    self._send(404, b'{"error":"not found"}')
                    return
                auth = self.headers.get("Authorization") or ""
                if not auth.startswith("Bearer ") or not hmac.compare_digest(auth[7:].strip().encode(),
                                                                             agent.token.encode()):
                    log.warning("agent: control request without a valid token from %s", self.client_address[0])
                    self._send(401 if not auth else 403, b'{"error":"bearer token required"}')
                    return
                try:
                    n = int(self.headers.get("Content-Length") or -1)
                    if not 0 <= n <= 65536:
                        raise ValueError("bad Content-Length")
                    req = msgspec.json.decode(self.rfile.read(n), type=schema.ControlRequest)
                    path = agent.write_control_request(req)
                except (ValueError, msgspec.DecodeError, msgspec.ValidationError) as e:
                    log.warning("agent: bad control request: %s", e)
                    self._send(400, json.dumps({"error": str(e)}).encode())
                    return
                self._send(202, json.dumps({"written": str(path)}).encode())

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server((self.bind, self.metrics_port), Handler)
        host, port = self.server.server_address[:2]
        self.url = f"http://{host}:{port}"
        self._threads.append(serve_in_thread(self.server, "agent-http"))

    # -- lifecycle -------------------------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None) -> None:
        stop = stop or self._stop
        self.start_server()
        self._init_otlp_metrics()
        t = threading.Thread(target=self._sampler_loop, daemon=True, name="agent-sampler")
        t.start()
        self._threads.append(t)
        log.info("agent node %d for run %s: shipping to %s, metrics %s", self.node, self.run_id, self.head_url,
                 self.url or "off")
        while not stop.is_set() and not self._stop.is_set():
            t0 = time.monotonic()
            try:
                backlog = self.cycle()
            except Exception:
                log.exception("agent: cycle failed; retrying next cycle (positions were not advanced)")
                backlog = False
            if not backlog:
                stop.wait(max(0.0, self.ship_interval - (time.monotonic() - t0)))
        self.close()

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self._stop.set()
        try:
            self.cycle(final=True)  # last records, or into the outbox
        except Exception:
            log.exception("agent: final cycle failed")
        if self.server is not None:
            shutdown_server(self.server)
            self.server.server_close()
        if self._meter_provider is not None:
            try:
                self._meter_provider.shutdown(timeout_millis=2000)
            except Exception:
                pass
        p = self._gpu_probe
        if p is not None and hasattr(p, "close"):
            try:
                p.close()
            except Exception:
                pass
        self.exporter.shutdown()


def _rec_time(rec) -> float | None:
    return getattr(rec, "t_end", None) or getattr(rec, "t", None) or getattr(rec, "t_arrive", None)


def _dcgm_probe(url: str, node: int, host: str):
    """A dcgm-exporter reader as the GPU probe, if probes.dcgm provides one."""
    try:
        from probes import dcgm
    except ImportError as e:
        log.warning("agent: --dcgm-url given but probes.dcgm is not available (%s); using NVML", e)
        return None
    for name in ("DcgmProbe", "DcgmExporterProbe"):
        cls = getattr(dcgm, name, None)
        if cls is not None:
            return cls(url, node=node, host=host)
    log.warning("agent: probes.dcgm has no DcgmProbe; using NVML")
    return None
