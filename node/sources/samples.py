"""GPU, host and XID samples: a sampler thread reads the probes every ``interval``; ``collect()`` takes what it has.

The GPU probe: a dcgm-exporter endpoint (``probes.dcgm.DcgmProbe``) when ``dcgm_url`` is given, else
``probes.nvml.build_gpu_probe`` (``sim_gpu`` auto: real NVML if there is a GPU, else this node's simulated devices;
off: real NVML or nothing; on: simulated even on a GPU machine). The host probe: ``probes.host.HostProbe``. Each
sample also updates the Prometheus gauges (dcgm-exporter names) and the OTLP gauges at once, not at ship time.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import msgspec

from node.outbox import Item
from node.prom import AgentMetrics
from node.shipping import OtlpMetrics
from probes.dcgm import DcgmProbe
from probes.host import HostProbe
from probes.nvml import build_gpu_probe
from ranksight import wire
from ranksight.layout import RunDir

log = logging.getLogger("ranksight.agent")

MAX_BUFFERED = 100_000  # samples held between two collects; beyond, the oldest are dropped and counted


class SampleSource:
    """The sampler thread (``start``) and the samples it buffered: ``collect()`` returns one item per kind
    (``gpu``, ``host``, ``xid``). The samples leave memory at collect, so ``commit`` has nothing to move: from
    then on they are in the export or the outbox like everything else. ``dropped``: samples dropped because the
    buffer was full (the ship loop was stuck)."""

    def __init__(self, rd: RunDir, node: int, host: str, *, interval: float, sim_gpu: str, dcgm_url: str | None,
                 metrics: AgentMetrics, otlp_metrics: OtlpMetrics):
        self.rd = rd
        self.node = node
        self.host = host
        self.interval = interval
        self.sim_gpu = sim_gpu
        self.dcgm_url = dcgm_url
        self.metrics = metrics
        self.otlp_metrics = otlp_metrics
        self.gpu_probe: Any = None
        self.host_probe: HostProbe | None = None
        self.dropped = 0
        self._last_xid: dict[int, int] = {}  # gpu -> last XID code (the DCGM_FI_DEV_XID_ERRORS gauge)
        self._buffer: list[tuple[str, Any]] = []
        self._lock = threading.Lock()

    def build_probes(self) -> None:
        if self.dcgm_url:
            self.gpu_probe = DcgmProbe(self.dcgm_url, node=self.node, host=self.host)
        else:
            sim_dir = self.rd.simgpu_node_dir(self.node)
            self.gpu_probe = build_gpu_probe(self.node, self.host, None if self.sim_gpu == "off" else sim_dir,
                                             mode="auto")
            if self.sim_gpu == "on" and not getattr(self.gpu_probe, "simulated", True):
                self.gpu_probe.close()
                self.gpu_probe = build_gpu_probe(self.node, self.host, sim_dir, mode="python-sim")
            log.info("agent node %d: GPU probe %s (%s)", self.node, getattr(self.gpu_probe, "mode", "?"),
                     getattr(self.gpu_probe, "status", ""))
        self.host_probe = HostProbe(self.node, self.host)

    def sample_once(self) -> None:
        out: list[tuple[str, Any]] = []
        p = self.gpu_probe
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
                self.otlp_metrics.set_gpu(s, self.node)
                out.append(("gpu", s))
        if self.host_probe is not None:
            try:
                h = self.host_probe.sample()
            except Exception as e:
                log.error("agent: host probe failed: %s", e)
                h = None
            if h is not None:
                self.metrics.observe_host(h)
                self.otlp_metrics.set_host(h, self.node)
                out.append(("host", h))
        if out:
            with self._lock:
                self._buffer.extend(out)
                if len(self._buffer) > MAX_BUFFERED:  # the ship loop is stuck: keep memory bounded, count it
                    drop = len(self._buffer) - MAX_BUFFERED
                    del self._buffer[:drop]
                    self.dropped += drop

    def start(self, stop: threading.Event) -> None:
        """The sampler thread: builds the probes, then samples every ``interval`` until ``stop`` is set."""
        threading.Thread(target=self._loop, args=(stop,), daemon=True, name="agent-sampler").start()

    def _loop(self, stop: threading.Event) -> None:
        self.build_probes()
        while not stop.is_set():
            t0 = time.monotonic()
            self.sample_once()
            stop.wait(max(0.05, self.interval - (time.monotonic() - t0)))

    def collect(self) -> list[Item]:
        now = time.time()
        with self._lock:
            samples, self._buffer = self._buffer, []
        items = []
        for kind in ("gpu", "host", "xid"):
            group = [s for k, s in samples if k == kind]
            if group:
                # GPU samples travel packed (the head stores them without a Python object per sample); a batch that
                # cannot be packed exactly, and the other kinds, as JSON
                packed = wire.pack_records(kind, "", group) if kind in wire.PACKED_LAYOUTS else None
                layout, body = packed if packed is not None else (None, msgspec.json.encode(group))
                items.append(Item(kind=kind, body=body, count=len(group),
                                  t_first=min(getattr(s, "t", now) for s in group), layout=layout))
        return items

    def commit(self, acknowledged: bool) -> bool:
        return False

    def close(self) -> None:
        p = self.gpu_probe
        if p is not None and hasattr(p, "close"):
            try:
                p.close()
            except Exception:
                pass
