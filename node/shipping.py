"""OTLP from the node agent to the head: the log exporter every cycle's batch goes through (``Shipper``), and the
SDK's periodic metrics pipeline (``OtlpMetrics``).

Logs are the authoritative path: each export is called synchronously so its result is known (the SDK's batch
processor would drop failures silently), and the agent moves its positions only after a success or after the
batch is durable in the outbox. Metrics are a best-effort live view (step histogram, GPU/host gauges) sent every
5 s; the stored history travels as logs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse
from opentelemetry.sdk._logs.export import LogRecordExportResult
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from node.otlp_session import CompressingSession, exporter_session
from node.outbox import Item
from node.prom import STEP_BUCKETS, AgentMetrics
from ranksight import __version__, wire, wire_rejections
from ranksight.tls import ClientTls

log = logging.getLogger("ranksight.agent")

OTLP_METRICS_INTERVAL_MS = 5000


@dataclass
class Exported:
    """What became of one export: ``ok`` when the head acknowledged it; ``refused``: the log records it refused
    (which record of the export, which rows, why; ``ranksight.wire_rejections.rejections_message``), each never to be sent
    again; ``unlisted``: refused log records the head did not name (an older head, a long list cut short)."""

    ok: bool
    refused: list[wire_rejections.Rejection] = field(default_factory=list)
    unlisted: int = 0


class _KeepsResponse:
    """The exporter's HTTP session, keeping the body of the last response: the SDK exporter reports only success or
    failure, and the head's partial success (which records it refused) is in the body."""

    def __init__(self, session):
        object.__setattr__(self, "inner", session)  # the session itself
        object.__setattr__(self, "last_body", None)

    def request(self, *args, **kwargs):
        r = self.inner.request(*args, **kwargs)
        object.__setattr__(self, "last_body", r.content)
        return r

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):  # ``verify``, ``cert``: set by the SDK's transport on the session
        setattr(self.inner, name, value)


def exporter_tls_kwargs(tls: ClientTls) -> dict[str, str]:
    """The OTLP exporters' TLS arguments (they apply to https endpoints): only those given, so that an absent one
    still falls back to the SDK's ``OTEL_EXPORTER_OTLP_*_CERTIFICATE`` / ``_CLIENT_*`` variables, then the system's
    CAs."""
    kw = {"certificate_file": tls.ca, "client_certificate_file": tls.cert, "client_key_file": tls.key}
    return {k: v for k, v in kw.items() if v}


class Shipper:
    """One agent's OTLP log exporter, its resource and scope; ``errors`` counts failed exports.

    ``agent_url``: where the agent's control endpoint listens ("" until it does); part of the resource, so the
    head knows where to send control requests. ``tls``: for an https head, the CA to verify it against (None: the
    system's) and the agent's client certificate under mutual TLS."""

    def __init__(self, head_url: str, token: str, *, run_id: str, node: int, host: str, agent_id: str,
                 timeout: float, metrics: AgentMetrics, tls: ClientTls | None = None):
        self.head_url = head_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"}
        self.timeout = timeout
        self.run_id = run_id
        self.node = node
        self.host = host
        self.agent_id = agent_id
        self.agent_url = ""
        self.metrics = metrics
        self.errors = 0
        self.tls = tls or ClientTls()
        # zstd, or deflate (zlib level 6) for a head that refuses zstd (node.otlp_session.CompressingSession), not
        # the SDK's gzip at level 9; the head and the OpenTelemetry Collector accept both. The session compresses,
        # so the exporter sends the body as it is.
        self.compressing = CompressingSession(exporter_session(self.head_url + "/v1/logs"))
        self.session = _KeepsResponse(self.compressing)
        self.exporter = OTLPLogExporter(endpoint=self.head_url + "/v1/logs", headers=self.headers, timeout=timeout,
                                        compression=Compression.NoCompression, session=self.session,
                                        **exporter_tls_kwargs(self.tls))
        self.scope = InstrumentationScope("ranksight.agent", __version__)
        self._resource: tuple[tuple, Resource] | None = None
        # One bundle-v1 log record per export for the packed batches and the heartbeat (the head reads one record's
        # attributes per agent and cycle, not one per kind); off for good once a head refuses bundles (an older one).
        self.bundle = True

    def resource_attributes(self) -> dict[str, Any]:
        return {"service.name": "ranksight-agent", wire.R_NODE: self.node, wire.R_HOST: self.host,
                wire.R_AGENT_URL: self.agent_url, wire.R_AGENT_ID: self.agent_id, wire.R_RUN: self.run_id}

    def resource(self) -> Resource:
        """The OTel resource of this agent, built once per set of attributes (they change only when the control
        endpoint's URL becomes known): ``Resource.create`` runs the SDK's resource detectors in a thread pool,
        too costly to repeat for every export."""
        attrs = self.resource_attributes()
        key = tuple(sorted(attrs.items()))
        if self._resource is None or self._resource[0] != key:
            self._resource = (key, Resource.create(attrs))
        return self._resource[1]

    def log_records(self, items: list[Item], snapshots: list | None = None) -> list:
        """The OTLP log records of ``items`` then ``snapshots`` (``node.sources.Snapshot``), in that order."""
        res = self.resource()
        recs = [wire.make_log_record(self.run_id, it.kind, it.body, rank=it.rank, node=self.node, count=it.count,
                                     step_min=it.step_min, step_max=it.step_max, resource=res, scope=self.scope,
                                     layout=it.layout)
                for it in items]
        recs += [wire.make_log_record(self.run_id, s.kind, s.body, node=self.node, extra=s.attributes,
                                      resource=res, scope=self.scope)
                 for s in snapshots or []]
        return recs

    def bundled_records(self, items: list[Item], snapshots: list | None = None) -> tuple[list, list[list[int]]]:
        """The export's log records with the packed items and the heartbeat in one ``bundle-v1`` record (first),
        and for each log record the positions (in ``items`` then ``snapshots``) of what it holds. Without two such
        parts, or with bundles off, the same as ``log_records``."""
        snapshots = snapshots or []
        inside = [j for j, it in enumerate(items) if it.layout is not None]
        inside += [len(items) + j for j, s in enumerate(snapshots) if s.kind == "heartbeat" and not s.attributes]
        if not self.bundle or len(inside) < 2:
            return self.log_records(items, snapshots), [[j] for j in range(len(items) + len(snapshots))]
        sections = []
        for j in inside:
            if j < len(items):
                it = items[j]
                sections.append((it.kind, it.layout, it.body, it.count))
            else:
                s = snapshots[j - len(items)]
                sections.append((s.kind, None, s.body, 1))
        res = self.resource()
        taken = set(inside)
        rest_items = [it for j, it in enumerate(items) if j not in taken]
        rest_snaps = [s for j, s in enumerate(snapshots) if len(items) + j not in taken]
        bundle = wire.make_log_record(self.run_id, wire.KIND_BUNDLE, wire.pack_bundle(sections), node=self.node,
                                      count=sum(c for *_, c in sections), resource=res, scope=self.scope,
                                      bundle=True)
        parts = [inside] + [[j] for j in range(len(items)) if j not in taken] + \
            [[len(items) + j] for j in range(len(snapshots)) if len(items) + j not in taken]
        return [bundle] + self.log_records(rest_items, rest_snaps), parts

    def export(self, items: list[Item], snapshots: list | None = None) -> Exported:
        """One synchronous OTLP logs export. ``ok`` when the head acknowledged it (or there was nothing to send);
        the log records it refused in ``refused``, by index into ``items`` then ``snapshots`` (one resource and one
        scope per export, so the request holds them in that order: a refused bundle names each of its parts)."""
        snapshots = snapshots or []
        recs, parts = self.bundled_records(items, snapshots)
        if not recs:
            return Exported(ok=True)
        res = self._export(recs)
        if not res.ok or len(parts) == len(items) + len(snapshots):  # nothing bundled
            return res
        bundle_refused = [r for r in res.refused if r.i == 0]
        if bundle_refused and _older_head(bundle_refused[0].why) or (res.unlisted and not res.refused):
            # a head that does not know bundles: its parts again, one log record each, and no more bundles
            log.warning("agent: the head refused a bundle (%s): sending one log record per batch from now on",
                        bundle_refused[0].why if bundle_refused else "no reason given")
            self.bundle = False
            inner = [items[j] for j in parts[0] if j < len(items)]
            inner_snaps = [snapshots[j - len(items)] for j in parts[0] if j >= len(items)]
            again = self._export(self.log_records(inner, inner_snaps))
            if not again.ok:  # the rest was acknowledged; the bundle's parts are not: the caller keeps all of them
                return Exported(ok=False)
            refused = [wire_rejections.Rejection(i=parts[0][r.i], why=r.why, rows=r.rows, rows_more=r.rows_more)
                       for r in again.refused if 0 <= r.i < len(parts[0])]
            refused += [wire_rejections.Rejection(i=parts[r.i][0], why=r.why, rows=r.rows, rows_more=r.rows_more)
                        for r in res.refused if 0 < r.i < len(parts)]
            return Exported(ok=True, refused=refused, unlisted=again.unlisted + max(0, res.unlisted - 1))
        refused = []
        for r in res.refused:
            if not 0 <= r.i < len(parts):
                continue
            if r.i == 0:  # a bundle is taken or refused whole: each of its parts refused, for the same reason
                refused += [wire_rejections.Rejection(i=j, why=r.why) for j in parts[0]]
            else:
                refused.append(wire_rejections.Rejection(i=parts[r.i][0], why=r.why, rows=r.rows, rows_more=r.rows_more))
        return Exported(ok=True, refused=refused, unlisted=res.unlisted)

    def _export(self, recs: list) -> Exported:
        object.__setattr__(self.session, "last_body", None)
        try:
            ok = self.exporter.export(recs) == LogRecordExportResult.SUCCESS
        except Exception as e:  # the exporter should not raise; if it does, it is a failed export
            log.error("agent: OTLP export raised %s", e)
            ok = False
        if not ok:
            self.errors += 1
            self.metrics.ship_errors.labels(str(self.node)).inc()
            return Exported(ok=False)
        return self._refusals(self.session.last_body, len(recs))

    @staticmethod
    def _refusals(body: bytes | None, n_sent: int) -> Exported:
        """The head's partial success in a 200's ``body``: which of the ``n_sent`` log records it refused."""
        if not body:
            return Exported(ok=True)
        resp = ExportLogsServiceResponse()
        try:
            resp.ParseFromString(body)
        except Exception:  # noqa: BLE001 - a 200 whose body is not a response: nothing known to be refused
            log.warning("agent: the head's response to an export does not parse; taken as a full success")
            return Exported(ok=True)
        n = resp.partial_success.rejected_log_records
        if not n:
            return Exported(ok=True)
        msg = resp.partial_success.error_message
        listed = wire_rejections.parse_rejections(msg)
        refused = [r for r in (listed.rejected if listed else []) if 0 <= r.i < n_sent]
        log.warning("agent: the head refused %d log record(s): %s", n,
                    "; ".join(r.why for r in refused[:3]) if refused else msg[:300])
        return Exported(ok=True, refused=refused, unlisted=max(0, n - len(refused)))

    def close(self) -> None:
        self.exporter.shutdown()


def _older_head(why: str) -> bool:
    """Whether a bundle's rejection comes from a head that does not know the bundle encoding (it names the packed
    encoding it expected, or the kind it does not know)."""
    return "expected packed-v1" in why or "unknown ranksight.kind" in why


class OtlpMetrics:
    """The SDK metric pipeline: periodic OTLP metrics to the head's ``/v1/metrics`` (lossy by design: live view
    only). Off until ``start()``, and for good when ``enabled`` is False: the ``record_*`` / ``set_*`` calls then
    do nothing."""

    def __init__(self, head_url: str, headers: dict[str, str], timeout: float, enabled: bool = True,
                 tls: ClientTls | None = None):
        self.head_url = head_url.rstrip("/")
        self.headers = headers
        self.tls = tls or ClientTls()
        self.timeout = timeout
        self.enabled = enabled
        self.provider = None
        self._step = None
        self._gpu: dict[str, Any] = {}
        self._host_cpu = None

    def start(self, resource: Resource) -> None:
        if not self.enabled:
            return
        # Imported here: an agent with the pipeline off never loads the metrics SDK.
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

        url = self.head_url + "/v1/metrics"
        exp = OTLPMetricExporter(endpoint=url, headers=self.headers, timeout=self.timeout,
                                 session=exporter_session(url), **exporter_tls_kwargs(self.tls))
        reader = PeriodicExportingMetricReader(exp, export_interval_millis=OTLP_METRICS_INTERVAL_MS)
        view = View(instrument_name="ranksight.step.duration",
                    aggregation=ExplicitBucketHistogramAggregation([b for b in STEP_BUCKETS if b != float("inf")]))
        self.provider = MeterProvider(resource=resource, metric_readers=[reader], views=[view])
        m = self.provider.get_meter("ranksight.agent")
        self._step = m.create_histogram("ranksight.step.duration", unit="s", description="Training step wall time")
        # OpenTelemetry semantic conventions (hardware metrics, opentelemetry-semantic-conventions 0.66b2): ratios in
        # unit "1", hw.type="gpu" and hw.id (the GPU's UUID) on the generic hw.* names; no convention exists for
        # the SM clock or throttle reasons, which keep a ranksight.* name (docs/otlp-mapping.md: the table old -> new)
        self._gpu = {
            "util_pct": (m.create_gauge("hw.gpu.utilization", unit="1", description="GPU busy ratio"), 0.01),
            "temp_c": (m.create_gauge("hw.temperature", unit="Cel", description="GPU temperature"), 1.0),
            "power_w": (m.create_gauge("hw.power", unit="W", description="GPU power draw"), 1.0),
            "sm_clock_mhz": (m.create_gauge("ranksight.gpu.clock.sm", unit="Hz", description="GPU SM clock"), 1e6),
            "throttle_reasons": (m.create_gauge("ranksight.gpu.throttle_reasons", unit="1",
                                                description="NVML clocks-throttle-reasons bitmask"), 1),
        }
        # hw.gpu.memory.usage / .limit are UpDownCounters in the conventions: the agent adds the change since its
        # last sample of that GPU
        self._gpu_mem = {"mem_used_bytes": m.create_up_down_counter("hw.gpu.memory.usage", unit="By"),
                         "mem_total_bytes": m.create_up_down_counter("hw.gpu.memory.limit", unit="By")}
        self._gpu_mem_last: dict[tuple, int] = {}
        self._host_cpu = m.create_gauge("system.cpu.utilization", unit="1", description="Host CPU busy ratio")

    def record_steps(self, steps) -> None:
        if self.provider is None:
            return
        for rec in steps:
            self._step.record(rec.step_ms / 1000.0, {"rank": rec.rank, "run_id": rec.run_id})

    def set_gpu(self, s, node: int) -> None:
        if self.provider is None:
            return
        attrs = {"hw.type": "gpu", "hw.id": s.uuid or f"{s.host}/gpu{s.gpu}", "gpu": s.gpu, "simulated": s.simulated,
                 "node": node}
        for field, (gauge, scale) in self._gpu.items():
            v = getattr(s, field)
            if v is not None:
                gauge.set(v * scale, attrs)
        for field, counter in self._gpu_mem.items():
            v = getattr(s, field)
            if v is not None:
                key = (field, attrs["hw.id"])
                counter.add(int(v) - self._gpu_mem_last.get(key, 0), attrs)
                self._gpu_mem_last[key] = int(v)

    def set_host(self, h, node: int) -> None:
        if self.provider is not None:
            self._host_cpu.set(h.cpu_pct / 100.0, {"node": node})

    def shutdown(self) -> None:
        if self.provider is not None:
            try:
                self.provider.shutdown(timeout_millis=2000)
            except Exception:
                pass
