"""The node agent: one process per node, between the trainer's files and the head.

Each cycle (``ship_interval``, 1 s; at once again while a spool has a backlog):

1. **collect**: walk the sources (node/sources) in order, each returning what is new since its last commit:
   the local ranks' spool records and gap events, the GPU/host samples the sampler thread took, this host's
   NCCL log lines, finished profiler traces, control acks, and the manifest when it changed;
2. **ship**: first the disk outbox (oldest first), then this cycle's batch plus a heartbeat, each as one OTLP/HTTP
   logs export (node/shipping.py), called synchronously so its result is known;
3. **commit**: on success, or once the batch is written to the bounded outbox (node/outbox.py) because the head
   was away, every source moves its saved position past what it collected, and the state file is saved
   (node/state.py). Snapshots (the manifest, the heartbeat) never go to the outbox: the manifest is committed
   only once the head acknowledged it.

So every record is shipped at least once, and the head's natural-key dedupe makes it exactly once in the store.
``kill -9`` at any point re-ships at most the last unacknowledged batch.

Alongside: the sampler thread (GPU every ``gpu_interval``, host stats), the OTel SDK's metric pipeline (periodic
OTLP metrics: best effort, the authoritative samples travel as logs), and one HTTP server (node/control.py) for
Prometheus ``/metrics`` (node/prom.py) and the token-protected ``POST /control`` the head uses to request actions.

``ranksight agent`` (node/cli.py) puts the whole process below training first (``ranksight.priority``: nice 19 on
every thread by default), so a rank that wants a core gets it; its lag metric shows when the agent falls behind.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
import uuid

import msgspec

from node.control import ControlServer
from node.outbox import Item, Outbox
from node.prom import AgentMetrics
from node.rejected import RejectedLog
from node.shipping import Exported, OtlpMetrics, Shipper
from node.sources import Snapshot, Source
from node.sources.control_acks import AckSource
from node.sources.manifest import ManifestSource
from node.sources.nccl import NcclLogSource
from node.sources.samples import SampleSource
from node.sources.spool import SpoolSource
from node.sources.traces import TraceSource
from node.state import StateFile
from ranksight import wire
from ranksight.http_server import serve_in_thread, shutdown_server
from ranksight.layout import RunDir, atomic_write
from ranksight.tls import ClientTls

log = logging.getLogger("ranksight.agent")


class ExitReport(msgspec.Struct, kw_only=True):
    """What an agent left undelivered when it stopped (``<run>/agent/node-<N>.exit.json``)."""

    node: int
    t: float
    undelivered_records: int  # in the outbox: not acknowledged by the head
    undelivered_bytes: int
    outbox: str
    dropped_records: int  # lost for good (outbox over its bound, sampler buffer overrun)
    drain_s: float  # how long the agent tried to deliver before giving up
    rejected_records: int = 0  # refused by the head (never sent again): kept aside in ``rejected_file``
    rejected_not_kept: int = 0  # of those, not written there (the file at its bound, or the head did not say which)
    rejected_file: str = ""

OUTBOX_SEGMENTS_PER_CYCLE = 64
FINAL_TRACE_WAIT_S = 30.0  # at stop: how long the last cycle waits for a trace summary in progress


class NodeAgent:
    """The agent of node ``node`` of one run: its sources (``sources``, walked in order; ``spool`` and ``samples``
    are also kept by name), the shipper, the outbox, the state file and the control endpoint. ``cycle()`` is one
    collect → ship → commit round; ``run()`` repeats it until stopped, ``close()`` ends with a last one."""

    def __init__(self, run_dir: RunDir, node: int, head_url: str, token: str, *, gpu_interval: float = 1.0,
                 ship_interval: float = 1.0, metrics_port: int | None = None, bind: str = "127.0.0.1",
                 sim_gpu: str = "auto", dcgm_url: str | None = None, host: str | None = None,
                 outbox_bytes: int = 256 * 1024 * 1024, ship_timeout: float = 3.0, otlp_metrics: bool = True,
                 drain_timeout_s: float = 0.0, rejected_bytes: int = 64 * 1024 * 1024,
                 tls_client: ClientTls | None = None, tls_server: ssl.SSLContext | None = None,
                 advertise_url: str | None = None, collectives: str = "auto"):
        self.rd = run_dir
        self.tls_server = tls_server  # the control endpoint's (HTTPS); tls_client: the shipper's, to an https head
        self.advertise_url = advertise_url  # the control URL the head is told (default: the bound one)
        self.drain_timeout_s = drain_timeout_s  # at stop: how long to keep trying to deliver the outbox
        self.node = node
        self.token = token
        self.ship_interval = ship_interval
        self.bind = bind
        self.metrics_port = metrics_port
        self.host = host or socket.gethostname()
        self.state_file = StateFile(run_dir.agent_state(node), node)
        self.outbox = Outbox(self.state_file.path.parent / f"node-{node}.outbox", outbox_bytes)
        self.metrics = AgentMetrics()
        self.rejected = RejectedLog(run_dir.agent_rejected(node), rejected_bytes)
        self.shipper = Shipper(head_url, token, run_id=run_dir.run_id, node=node, host=self.host,
                               agent_id=uuid.uuid4().hex[:8], timeout=ship_timeout, metrics=self.metrics,
                               tls=tls_client)
        self.otlp_metrics = OtlpMetrics(head_url, self.shipper.headers, ship_timeout, enabled=otlp_metrics,
                                        tls=tls_client)
        state = self.state_file.state  # each source owns one field of it
        self.spool = SpoolSource(run_dir, node, state, self.metrics, self.otlp_metrics, collectives)
        self.samples = SampleSource(run_dir, node, self.host, interval=gpu_interval, sim_gpu=sim_gpu,
                                    dcgm_url=dcgm_url, metrics=self.metrics, otlp_metrics=self.otlp_metrics)
        self.traces = TraceSource(run_dir, state, lambda: self.spool.local_ranks)  # summarizes on its own thread
        self.sources: list[Source] = [
            self.spool,
            self.samples,
            NcclLogSource(run_dir, node, self.host, state),
            self.traces,
            AckSource(run_dir, state),
            ManifestSource(run_dir, state),
        ]
        self.server: ControlServer | None = None
        self.url = ""  # the control endpoint's, once it listens
        self._stop = threading.Event()
        self._pending_since: float | None = None  # wall time of the oldest record not yet acknowledged
        self._last_ship_ok = True
        self._dropped_reported = 0
        self._rejected_reported = (0, 0)  # (kept, not kept) already counted in the metrics
        # Self-metrics exist (at 0) from the start: an absent series is not "no drops".
        n = str(node)
        for m in (self.metrics.shipped, self.metrics.dropped, self.metrics.ship_errors, self.metrics.lag,
                  self.metrics.spooled, self.metrics.spooled_bytes, self.metrics.ranks, self.metrics.rejected,
                  self.metrics.rejected_not_kept):
            m.labels(n)

    # -- one cycle -------------------------------------------------------------------------------
    def cycle(self, final: bool = False) -> bool:
        """One collect → ship → commit round. Returns True when a spool still has a backlog.

        ``final``: the agent is stopping; if the head was unreachable on the last try, do not wait
        for it again: the batch goes straight to the outbox."""
        # the final cycle waits (bounded) for trace summaries in progress; any other cycle takes what is ready
        collected = [x for source in self.sources
                     for x in (self.traces.collect(wait_s=FINAL_TRACE_WAIT_S) if final and source is self.traces
                               else source.collect())]
        items = [x for x in collected if isinstance(x, Item)]
        snapshots = [x for x in collected if isinstance(x, Snapshot)]
        n = sum(i.count for i in items)
        if items and self._pending_since is None:
            self._pending_since = min((i.t_first for i in items if i.t_first), default=time.time())
        shipped = False
        if not (final and not self._last_ship_ok):
            # The heartbeat is made after the outbox drained, so it reports what is still waiting.
            if self._drain_outbox():
                res = self.shipper.export(items, snapshots + [self.heartbeat()])
                shipped = res.ok
                if shipped:  # acknowledged; what the head refused in it is kept aside, never sent again
                    n -= self._keep_refused(items, snapshots, res)
            self._last_ship_ok = shipped
        if shipped:
            self.metrics.shipped.labels(str(self.node)).inc(n)
            self._pending_since = None
        elif items:
            # Head unreachable (or behind us in the outbox): keep this batch on disk, in order.
            self.outbox.append(items)
        # The batch is acknowledged or durable in the outbox: the positions may move on.
        moved = [source.commit(acknowledged=shipped) for source in self.sources]
        if any(moved):
            self.state_file.save()
        self._update_self_metrics(shipped)
        return self.spool.backlog and shipped

    def _drain_outbox(self) -> bool:
        """Ship outbox segments oldest first (a bounded number per cycle). True when the outbox is empty."""
        for _ in range(OUTBOX_SEGMENTS_PER_CYCLE):
            seg = self.outbox.oldest()
            if seg is None:
                return True
            items = self.outbox.read(seg)
            refused = 0
            if items:
                res = self.shipper.export(items)
                if not res.ok:
                    return False
                refused = self._keep_refused(items, [], res)
            self.outbox.remove(seg)
            self.metrics.shipped.labels(str(self.node)).inc(sum(i.count for i in items) - refused)
        return self.outbox.oldest() is None

    def _keep_refused(self, items: list[Item], snapshots: list[Snapshot], res: Exported) -> int:
        """Keep aside what the head refused in an acknowledged export (never sent again); returns how many of
        ``items``' records that was."""
        n = 0
        for r in res.refused:
            if r.i < len(items):
                n += self.rejected.keep(items[r.i], r)
            elif r.i - len(items) < len(snapshots):  # the manifest, a heartbeat
                s = snapshots[r.i - len(items)]
                self.rejected.keep(Item(kind=s.kind, body=s.body, count=1), r)
        if res.unlisted:
            self.rejected.not_itemized(res.unlisted)  # log records, each at least one record
        return min(n, sum(i.count for i in items))

    def dropped_records(self) -> int:
        """Records lost for good: outbox segments over its bound, and samples over the sampler's buffer."""
        return self.outbox.dropped_records + self.samples.dropped

    def lag(self) -> float:
        """Age of the oldest record not yet acknowledged by the head (0 when caught up)."""
        if self._pending_since is None:
            return 0.0
        return max(0.0, time.time() - self._pending_since)

    def heartbeat(self) -> Snapshot:
        """This agent's liveness and self-metrics as of now, sent with every direct export."""
        hb = wire.Heartbeat(node=self.node, host=self.host, url=self.url, t=time.time(), ranks=self.spool.local_ranks,
                            lag_s=self.lag(), spooled_records=self.outbox.records(),
                            dropped_records=self.dropped_records(), ship_errors=self.shipper.errors,
                            garbage_lines=self.spool.garbage_lines, rejected_records=self.rejected.total)
        return Snapshot(kind="heartbeat", body=msgspec.json.encode(hb))

    def _update_self_metrics(self, shipped: bool) -> None:
        node = str(self.node)
        dropped = self.dropped_records()
        if dropped > self._dropped_reported:
            self.metrics.dropped.labels(node).inc(dropped - self._dropped_reported)
            self._dropped_reported = dropped
        kept, not_kept = self.rejected.kept, self.rejected.not_kept
        if (kept, not_kept) != self._rejected_reported:
            self.metrics.rejected.labels(node).inc(kept + not_kept - sum(self._rejected_reported))
            self.metrics.rejected_not_kept.labels(node).inc(not_kept - self._rejected_reported[1])
            self._rejected_reported = (kept, not_kept)
        if len(self.outbox):
            oldest = self.outbox.oldest_t()
            self._pending_since = oldest if oldest is not None else self._pending_since
        elif shipped:
            self._pending_since = None
        self.metrics.spooled.labels(node).set(self.outbox.records())
        self.metrics.spooled_bytes.labels(node).set(self.outbox.bytes())
        self.metrics.lag.labels(node).set(self.lag())

    # -- lifecycle -------------------------------------------------------------------------------------
    def start_server(self) -> None:
        """The control endpoint on ``bind:metrics_port`` (none when ``metrics_port`` is None)."""
        if self.metrics_port is None:
            return
        self.server = ControlServer((self.bind, self.metrics_port), rd=self.rd, node=self.node, token=self.token,
                                    metrics=self.metrics, local_ranks=lambda: self.spool.local_ranks,
                                    tls=self.tls_server, advertise_url=self.advertise_url)
        self.url = self.shipper.agent_url = self.server.url
        serve_in_thread(self.server, "agent-http")

    def run(self, stop: threading.Event | None = None) -> None:
        stop = stop or self._stop
        self.start_server()
        self.otlp_metrics.start(self.shipper.resource())
        self.samples.start(self._stop)
        log.info("agent node %d for run %s: shipping to %s, metrics %s", self.node, self.rd.run_id,
                 self.shipper.head_url, self.url or "off")
        while not stop.is_set() and not self._stop.is_set():
            t0 = time.monotonic()
            try:
                backlog = self.cycle()
            except Exception:
                log.exception("agent: cycle failed; retrying next cycle (positions were not advanced)")
                backlog = False
            if not backlog:
                stop.wait(max(0.0, self.ship_interval - (time.monotonic() - t0)))
        self.close(self.drain_timeout_s)

    def stop(self) -> None:
        self._stop.set()

    def close(self, drain_timeout_s: float = 0.0) -> ExitReport:
        """Stop: a last cycle (what the sources still hold, shipped or into the outbox), then up to
        ``drain_timeout_s`` of retries to deliver the outbox, so a head that is briefly away at the end of a run
        does not strand its last records. What is still undelivered is written to the exit report (and logged);
        ``ranksight agent --drain`` ships it later."""
        self._stop.set()
        try:
            self.cycle(final=True)  # last records, or into the outbox
        except Exception:
            log.exception("agent: final cycle failed")
        report = self.drain(drain_timeout_s)
        if self.server is not None:
            shutdown_server(self.server)
            self.server.server_close()
        self.otlp_metrics.shutdown()
        self.samples.close()
        self.traces.close()
        self.shipper.close()
        return report

    def drain(self, timeout_s: float) -> ExitReport:
        """Deliver the outbox, retrying for up to ``timeout_s``; write and return the exit report."""
        t0 = time.monotonic()
        while len(self.outbox):
            try:
                if self._drain_outbox():
                    break
            except Exception:
                log.exception("agent: draining the outbox failed")
            if time.monotonic() - t0 >= timeout_s:
                break
            time.sleep(min(1.0, max(0.0, timeout_s - (time.monotonic() - t0))))
        report = ExitReport(node=self.node, t=time.time(), undelivered_records=self.outbox.records(),
                            undelivered_bytes=self.outbox.bytes(), outbox=str(self.outbox.dir),
                            dropped_records=self.dropped_records(), drain_s=round(time.monotonic() - t0, 2),
                            rejected_records=self.rejected.total, rejected_not_kept=self.rejected.not_kept,
                            rejected_file=str(self.rejected.path) if self.rejected.total else "")
        if report.undelivered_records:
            log.warning("agent: %d record(s) not delivered after %.0f s of retries; they stay in %s: ship them "
                        "later with `ranksight agent --drain --store ... --run-id %s --node %d --head URL`",
                        report.undelivered_records, report.drain_s, report.outbox, self.rd.run_id, self.node)
        try:
            atomic_write(self.rd.agent_exit_report(self.node), msgspec.json.encode(report), durable=False)
        except OSError as e:
            log.error("agent: cannot write the exit report: %s", e)
        return report
