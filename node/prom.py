"""The node agent's Prometheus metrics, served on ``GET /metrics`` by node/control.py. (Some of them also go to the
head as OTLP metrics: node/shipping.py ``OtlpMetrics``.)

Names follow Prometheus conventions (base units, ``_total`` counters); GPU
gauges use dcgm-exporter's names and labels (``gpu``, ``UUID``, ``device``,
``modelName``, ``Hostname``) so existing DCGM dashboards work unchanged, plus a
``simulated`` label so simulated telemetry can never pass for real.

**Bounded cardinality.** A job of 16,384 ranks must not cost Prometheus a histogram per rank (77 buckets each:
over a million series). Per rank the agent exports only the few gauges the straggler and stall rules compare
across ranks (compute and blocked-comm time of the last step, the last step and when it ended). Everything else is
per node (``run_id``, ``node``): the step-time histogram, the counters (steps, tokens, FLOPs, overflows) and the
node's loss, gradient norm, loss scale, data and pipeline wait and peak memory. The histogram's buckets carry
OpenMetrics exemplars (``rank``, ``step``: the last step that fell in the bucket), so a slow bucket still names
its rank; Prometheus keeps them with ``--enable-feature=exemplar-storage`` (the agent serves OpenMetrics to a
scraper that asks for it). ``bench/prom_series.py`` counts the series of a 16,384-rank job.

**No duplicate GPU series.** When the GPU samples come from a dcgm-exporter (``--dcgm-url``, samples with
``source == "dcgm"``), the agent does not re-export its gauges: Prometheus already scrapes them from
dcgm-exporter, and two copies would double every sum. It exports the join instead,
``ranksight_rank_gpu_info{run_id, rank, node, gpu, UUID, Hostname} 1`` for each rank of the run's manifest placed
on one of this node's GPUs (in every mode), so PromQL puts ranks on DCGM's series:
``DCGM_FI_DEV_GPU_UTIL * on (UUID) group_right ranksight_rank_gpu_info``.

Step-time buckets: a geometric ladder with 6 buckets per doubling (ratio
2^(1/6) ≈ 1.12) from 10 ms to 60 s. ``histogram_quantile`` interpolates linearly
inside a bucket, so its error is at most half a bucket: ≤ 6 %, inside the 10 %
the median check needs.
"""

from __future__ import annotations

import math
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

STEP_BUCKETS = tuple(round(0.01 * 2 ** (i / 6), 6) for i in range(0, 6 * 13)) # 0.01 .. ~81 s
STEP_BUCKETS = tuple(b for b in STEP_BUCKETS if b <= 64.0) + (float("inf"),)

DCGM_LABELS = ("gpu", "UUID", "device", "modelName", "Hostname", "simulated")
RANK_LABELS = ("run_id", "rank", "node")
NODE_LABELS = ("run_id", "node")
GPU_INFO_LABELS = ("run_id", "rank", "node", "gpu", "UUID", "Hostname")


class RankGpuInfo:
    """The collector of ``ranksight_rank_gpu_info``: built at each scrape from the manifest's placements and the GPUs
    last sampled, so a rank that moved (an elastic restart) or a GPU gone leaves no stale series."""

    def __init__(self):
        self._lock = threading.Lock()
        self._placements: dict[str, list] = {}  # run_id -> the manifest's RankPlacement list
        self._gpus: dict[int, tuple[str, str]] = {}  # GPU index on this node -> (UUID, Hostname)
        self.node: int | None = None

    def set_placements(self, run_id: str, placements) -> None:
        with self._lock:
            self._placements[run_id] = list(placements or [])

    def set_gpu(self, node: int, gpu: int, uuid: str, host: str) -> None:
        with self._lock:
            self.node = node
            self._gpus[gpu] = (uuid, host)

    def collect(self):
        fam = GaugeMetricFamily("ranksight_rank_gpu_info",
                                "1 for each rank and the GPU it runs on (join key UUID: "
                                "DCGM_FI_DEV_GPU_UTIL * on (UUID) group_right ranksight_rank_gpu_info)",
                                labels=GPU_INFO_LABELS)
        with self._lock:
            node, gpus = self.node, dict(self._gpus)
            runs = {k: list(v) for k, v in self._placements.items()}
        if node is not None:
            for run_id, placements in runs.items():
                for p in placements:
                    gpu = p.gpu if p.gpu is not None else p.local_rank
                    if p.node == node and gpu in gpus and gpus[gpu][0]:
                        uuid, host = gpus[gpu]
                        fam.add_metric([run_id, str(p.rank), str(node), str(gpu), uuid, host], 1.0)
        yield fam


class AgentMetrics:
    """Every metric of one agent, in its own registry (``registry``): the ranks' training series, the run, the
    GPUs and the host as the sampler sees them, and the agent's own shipping counters."""

    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self._series: dict[tuple, tuple] = {}
        # per node, each rank's last value of a per-node gauge: (run_id, node) -> {metric key: {rank: value}}
        self._node_last: dict[tuple, dict[str, dict[int, float]]] = {}
        # -- training, per rank: only what the rules compare across ranks ----------------------
        self.step_compute = Gauge("ranksight_step_compute_seconds",
                                  "Last step's own work: step time minus data wait, blocked comm and pipeline wait",
                                  RANK_LABELS, registry=r)
        self.step_comm = Gauge("ranksight_step_comm_seconds", "Last step's time blocked in collectives",
                               RANK_LABELS, registry=r)
        self.last_step = Gauge("ranksight_last_step", "Last step number recorded", RANK_LABELS, registry=r)
        self.last_step_time = Gauge("ranksight_last_step_timestamp_seconds", "Wall time the last step ended",
                                    RANK_LABELS, registry=r)
        # -- training, per node ----------------------------------------------------------------
        self.step_duration = Histogram("ranksight_step_duration_seconds",
                                       "Wall time of one training step, every rank of the node (exemplar: rank, step)",
                                       NODE_LABELS, buckets=STEP_BUCKETS, registry=r)
        self.step_data = Gauge("ranksight_step_data_wait_seconds",
                               "The longest wait for the next batch among the node's ranks' last steps",
                               NODE_LABELS, registry=r)
        self.step_pipe = Gauge("ranksight_step_pipeline_wait_seconds",
                               "The longest pipeline (bubble) wait among the node's ranks' last steps",
                               NODE_LABELS, registry=r)
        self.steps = Counter("ranksight_steps", "Training steps recorded, summed over the node's ranks",
                             NODE_LABELS, registry=r)
        self.tokens = Counter("ranksight_tokens", "Tokens processed by the node's ranks", NODE_LABELS, registry=r)
        self.flops = Counter("ranksight_model_flops", "Model FLOPs done by the node's ranks (PaLM convention)",
                             NODE_LABELS, registry=r)
        self.overflow = Counter("ranksight_overflow_steps",
                                "Rank steps whose gradients overflowed (GradScaler found inf)", NODE_LABELS, registry=r)
        self.loss = Gauge("ranksight_loss", "The last loss a rank of the node recorded (NaN when non-finite)",
                          NODE_LABELS, registry=r)
        self.grad_norm = Gauge("ranksight_grad_norm", "The last gradient norm a rank of the node recorded",
                               NODE_LABELS, registry=r)
        self.loss_scale = Gauge("ranksight_loss_scale", "The last GradScaler scale a rank of the node recorded",
                                NODE_LABELS, registry=r)
        self.mem = Gauge("ranksight_memory_peak_bytes", "The largest peak memory among the node's ranks' last steps",
                         NODE_LABELS, registry=r)
        # -- the run ------------------------------------------------------------------------
        # 1 once the run's manifest (run.json) says the run finished, 0 before: alert rules
        # about training progress drop finished runs with ``unless on (run_id) ranksight_run_finished == 1``
        # (an agent left running after its job ends must not page anyone).
        self.run_finished = Gauge("ranksight_run_finished",
                                  "1 once the run's manifest says the run finished, else 0", ("run_id",), registry=r)
        self.rank_gpu_info = RankGpuInfo()
        r.register(self.rank_gpu_info)
        # -- GPU, dcgm-exporter names (only when no dcgm-exporter serves them) ------------------
        g = lambda name, doc: Gauge(name, doc, DCGM_LABELS, registry=r)  # noqa: E731
        self.dcgm = {
            "DCGM_FI_DEV_GPU_UTIL": g("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %)."),
            "DCGM_FI_DEV_MEM_COPY_UTIL": g("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %)."),
            "DCGM_FI_DEV_SM_CLOCK": g("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz)."),
            "DCGM_FI_DEV_MEM_CLOCK": g("DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz)."),
            "DCGM_FI_DEV_GPU_TEMP": g("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C)."),
            "DCGM_FI_DEV_POWER_USAGE": g("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W)."),
            "DCGM_FI_DEV_FB_USED": g("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB)."),
            "DCGM_FI_DEV_FB_FREE": g("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB)."),
            "DCGM_FI_DEV_XID_ERRORS": g("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered."),
            "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": g("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
                                                     "Current clock throttle reasons (bitmask)."),
            "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": g("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Volatile single-bit ECC errors."),
            "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": g("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Volatile double-bit ECC errors."),
        }
        self.xid_total = Counter("ranksight_gpu_xid_events", "XID events seen (every event, unlike DCGM_FI_DEV_XID_ERRORS)",
                                 DCGM_LABELS + ("code",), registry=r)
        # -- host ---------------------------------------------------------------------------
        hl = ("node", "Hostname")
        self.host_cpu = Gauge("ranksight_host_cpu_percent", "Host CPU utilization (in %)", hl, registry=r)
        self.host_load1 = Gauge("ranksight_host_load1", "1-minute load average", hl, registry=r)
        self.host_mem_used = Gauge("ranksight_host_memory_used_bytes", "Host memory in use", hl, registry=r)
        self.host_mem_total = Gauge("ranksight_host_memory_total_bytes", "Host memory total", hl, registry=r)
        self.host_net_rx = Gauge("ranksight_host_network_receive_bytes", "Network bytes received (counter value)", hl, registry=r)
        self.host_net_tx = Gauge("ranksight_host_network_transmit_bytes", "Network bytes sent (counter value)", hl, registry=r)
        # -- the agent itself -----------------------------------------------------------------
        al = ("node",)
        self.shipped = Counter("ranksight_agent_records_shipped", "Records the head acknowledged", al, registry=r)
        self.lag = Gauge("ranksight_agent_lag_seconds",
                         "Age of the oldest record not yet acknowledged by the head (0 when caught up)", al, registry=r)
        self.spooled = Gauge("ranksight_agent_spooled_records", "Records waiting in the agent's disk outbox", al, registry=r)
        self.spooled_bytes = Gauge("ranksight_agent_spooled_bytes", "Bytes in the agent's disk outbox", al, registry=r)
        self.dropped = Counter("ranksight_agent_dropped_records", "Records dropped because the outbox was full", al, registry=r)
        self.ship_errors = Counter("ranksight_agent_ship_errors", "Failed OTLP exports to the head", al, registry=r)
        self.rejected = Counter("ranksight_agent_rejected_records",
                                "Records the head refused (kept aside in node-<N>.rejected.jsonl, never sent again)",
                                al, registry=r)
        self.rejected_not_kept = Counter("ranksight_agent_rejected_not_kept_records",
                                         "Records the head refused that were not kept aside (the file at its bound, "
                                         "or the head did not say which)", al, registry=r)
        self.garbage = Counter("ranksight_agent_spool_garbage_lines", "Spool lines that did not decode (kept as gaps)",
                               al + ("rank",), registry=r)
        self.resets = Counter("ranksight_agent_spool_resets", "Spool files found truncated or replaced", al + ("rank",), registry=r)
        self.ranks = Gauge("ranksight_agent_local_ranks", "Ranks this agent tails", al, registry=r)
        self.control = Counter("ranksight_agent_control_requests", "Control requests written for the trainer",
                               al + ("action",), registry=r)
        self.ops_queries = Counter("ranksight_agent_ops_queries", "Drill-down queries (GET /ops) answered, by HTTP "
                                   "status", al + ("status",), registry=r)
        self.ops_seconds = Counter("ranksight_agent_ops_seconds", "Wall time spent answering drill-down queries "
                                   "(a spool's first query indexes it)", al, registry=r)

    # -- updates -------------------------------------------------------------------------------
    def observe_steps(self, recs) -> None:
        """A batch of step records in spool order (the agent passes one rank's records of a cycle). The same
        series values as observing them one by one: every step time goes into the node's histogram (its bucket's
        exemplar names the rank and step), the node's counters grow by the batch's sums, and each gauge takes the
        value of the last record that sets it; but each series is touched once per batch instead of once per
        record."""
        if len(recs) > 1 and len({(r.run_id, r.rank, r.node) for r in recs}) > 1:
            by: dict[tuple, list] = {}
            for r in recs:
                by.setdefault((r.run_id, r.rank, r.node), []).append(r)
            for group in by.values():
                self.observe_steps(group)
            return
        if not recs:
            return
        last = recs[-1]
        rank = str(last.rank)
        lab = (last.run_id, rank, str(last.node))
        node_lab = (last.run_id, str(last.node))

        def c(metric):
            return self._labelled(metric, lab)

        def n(metric):
            return self._labelled(metric, node_lab)

        h = n(self.step_duration)
        for r in recs:
            h.observe(r.step_ms / 1000.0, {"rank": rank, "step": str(r.step)})
        c(self.step_compute).set(last.compute_ms / 1000.0)
        c(self.step_comm).set(last.comm_ms / 1000.0)
        c(self.last_step).set(last.step)
        c(self.last_step_time).set(last.t_end)
        self._node_max(self.step_data, node_lab, last.rank, last.data_ms / 1000.0)
        self._node_max(self.step_pipe, node_lab, last.rank, last.pipeline_wait_ms / 1000.0)
        mem = next((r.mem_bytes for r in reversed(recs) if r.mem_bytes), None)
        if mem:
            self._node_max(self.mem, node_lab, last.rank, float(mem))
        n(self.steps).inc(len(recs))
        # a counter only goes up (prometheus_client raises on a negative increment): a negative or non-finite
        # count in a record is bad data, left out here rather than stopping the agent's cycle
        tokens = [r.tokens for r in recs if r.tokens and math.isfinite(r.tokens) and r.tokens > 0]
        if tokens:
            n(self.tokens).inc(sum(tokens))
        flops = [r.flops for r in recs if r.flops and math.isfinite(r.flops) and r.flops > 0]
        if flops:
            n(self.flops).inc(sum(flops))
        overflows = sum(1 for r in recs if r.overflow)
        if overflows:
            n(self.overflow).inc(overflows)
        # a pipeline's first stages record no loss: the node's loss is the last one a rank recorded; a rank that
        # recorded losses and now has none (a non-finite loss is written as null) sets NaN
        loss = next((r.loss for r in reversed(recs) if r.loss is not None), None)
        loss_ranks = self._node_last.setdefault(node_lab, {}).setdefault("loss_ranks", {})
        if loss is not None:
            loss_ranks[last.rank] = 1.0
        if last.loss is not None:
            n(self.loss).set(last.loss)
        elif last.rank in loss_ranks:
            n(self.loss).set(float("nan"))
        for metric, field in ((self.grad_norm, "grad_norm"), (self.loss_scale, "loss_scale")):
            v = next((getattr(r, field) for r in reversed(recs) if getattr(r, field) is not None), None)
            if v is not None:
                n(metric).set(v)

    def _node_max(self, metric, node_lab: tuple, rank: int, value: float) -> None:
        """Sets the node gauge ``metric`` to the largest of its ranks' last values (the worst rank of the node)."""
        per_rank = self._node_last.setdefault(node_lab, {}).setdefault(str(id(metric)), {})
        per_rank[rank] = value
        self._labelled(metric, node_lab).set(max(per_rank.values()))

    def observe_manifest(self, run_id: str, manifest) -> None:
        """The run's manifest as read by the agent (None while it is missing or unreadable)."""
        self.run_finished.labels(run_id).set(1 if manifest is not None and manifest.finished else 0)
        if manifest is not None and manifest.ranks:
            self.rank_gpu_info.set_placements(run_id, manifest.ranks)

    @staticmethod
    def gpu_labels(s) -> tuple[str, ...]:
        return (str(s.gpu), s.uuid, f"nvidia{s.gpu}", s.name, s.host, "true" if s.simulated else "false")

    def observe_gpu(self, s, last_xid: int | None = None) -> None:
        """One GPU sample: its identity for ``ranksight_rank_gpu_info``, and the dcgm-exporter gauges unless the
        sample came from a dcgm-exporter (Prometheus scrapes those from it; a second copy would double sums)."""
        self.rank_gpu_info.set_gpu(s.node, s.gpu, s.uuid, s.host)
        if s.source == "dcgm":
            return
        lab = self.gpu_labels(s)
        MiB = 1024 * 1024
        vals = {
            "DCGM_FI_DEV_GPU_UTIL": s.util_pct,
            "DCGM_FI_DEV_MEM_COPY_UTIL": s.mem_util_pct,
            "DCGM_FI_DEV_SM_CLOCK": s.sm_clock_mhz,
            "DCGM_FI_DEV_MEM_CLOCK": s.mem_clock_mhz,
            "DCGM_FI_DEV_GPU_TEMP": s.temp_c,
            "DCGM_FI_DEV_POWER_USAGE": s.power_w,
            "DCGM_FI_DEV_FB_USED": None if s.mem_used_bytes is None else s.mem_used_bytes / MiB,
            "DCGM_FI_DEV_FB_FREE": None if s.mem_used_bytes is None or s.mem_total_bytes is None
            else (s.mem_total_bytes - s.mem_used_bytes) / MiB,
            "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": s.throttle_reasons,
            "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": s.ecc_sbe,
            "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": s.ecc_dbe,
        }
        for name, v in vals.items():
            if v is not None:
                self._labelled(self.dcgm[name], lab).set(v)
        # dcgm-exporter semantics: the last XID code, 0 until one happens.
        self._labelled(self.dcgm["DCGM_FI_DEV_XID_ERRORS"], lab).set(last_xid or 0)

    def observe_xid(self, x, sample_labels: tuple[str, ...]) -> None:
        self.xid_total.labels(*sample_labels, str(x.code)).inc()

    def observe_host(self, h) -> None:
        lab = (str(h.node), h.host)
        c = self._labelled
        c(self.host_cpu, lab).set(h.cpu_pct)
        c(self.host_load1, lab).set(h.load1)
        c(self.host_mem_used, lab).set(h.mem_used_bytes)
        c(self.host_mem_total, lab).set(h.mem_total_bytes)
        c(self.host_net_rx, lab).set(h.net_rx_bytes)
        c(self.host_net_tx, lab).set(h.net_tx_bytes)

    def _labelled(self, metric, lab: tuple):
        """``metric.labels(*lab)``, looked up once per series: ``labels()`` takes a lock and validates the labels on
        every call, and the agent updates a dozen series per rank and cycle and every GPU gauge per sample. A
        series is still created only when first used (an overflow counter appears with the first overflow)."""
        key = (id(metric), lab)
        ch = self._series.get(key)
        if ch is None:
            ch = self._series[key] = metric.labels(*lab)
        return ch
