"""Read a dcgm-exporter ``/metrics`` endpoint into GpuSample / XidEvent records.

Optional: on clusters that already run NVIDIA's dcgm-exporter, the agent can read it
instead of (or beside) NVML. The exposition is Prometheus text; it is parsed with
``prometheus_client.parser.text_string_to_metric_families`` and mapped per GPU (labels
``gpu``, ``UUID``, ``Hostname``, ``modelName``) into the same :class:`GpuSample` the NVML
probe writes (``source="dcgm"``, ``simulated=False``).

Units: FB_* are MiB (-> bytes); POWER_USAGE W; clocks MHz; DCGM_FI_PROF_PCIE_*_BYTES and
DCGM_FI_PROF_NVLINK_*_BYTES are bytes/s; the older DCGM_FI_DEV_PCIE_*_THROUGHPUT are KB/s.
DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL is a counter of unspecified unit summed over links and
directions, so it does not fill the tx/rx fields: its raw value and per-second rate are in
:attr:`DcgmResult.extra`.

**XID counting.** ``DCGM_FI_DEV_XID_ERRORS`` is a gauge holding only the *last* XID a GPU
reported, and it never resets. Counting its values would re-report an old XID on every
scrape; so the probe counts *transitions*: a new XID is reported when a GPU's value changes
to a non-zero code, or when its ``err_code``/``err_msg`` labels (dcgm-exporter >= 3.3.6)
change. Two identical XIDs in a row are invisible to the gauge; when the exporter also
serves ``DCGM_EXP_XID_ERRORS_COUNT{xid="N"}`` (a count per XID over a sliding window), the
probe uses increases of that count instead, which do see repeats (an XID arriving while
another of the same code leaves the window in the same scrape interval is still missed).
The first scrape of a GPU is a baseline: an XID already there is not reported as new,
unless ``report_existing_xids=True``.

Failures never raise out of :meth:`DcgmProbe.sample`: an unreachable endpoint, an HTTP
error or unparsable text is a recorded gap (``errors`` count, ``last_error``,
``gaps["scrape"]``) and the scrape yields nothing; XID state is left untouched.
"""

from __future__ import annotations

import math
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable

from ranksight.schema import GpuSample, XidEvent
from ranksight.simgpu import throttle_names

_MIB = 1024 * 1024

# metric -> (GpuSample field, scale)
_DIRECT = {
    "DCGM_FI_DEV_GPU_UTIL": ("util_pct", 1.0),
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("mem_util_pct", 1.0),
    "DCGM_FI_DEV_POWER_USAGE": ("power_w", 1.0),
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": ("power_limit_w", 1.0),
    "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": ("power_limit_w", 1.0),
    "DCGM_FI_DEV_GPU_TEMP": ("temp_c", 1.0),
    "DCGM_FI_DEV_SM_CLOCK": ("sm_clock_mhz", 1.0),
    "DCGM_FI_DEV_MEM_CLOCK": ("mem_clock_mhz", 1.0),
    "DCGM_FI_DEV_MAX_SM_CLOCK": ("max_sm_clock_mhz", 1.0),
    "DCGM_FI_PROF_PCIE_TX_BYTES": ("pcie_tx_bytes_s", 1.0),
    "DCGM_FI_PROF_PCIE_RX_BYTES": ("pcie_rx_bytes_s", 1.0),
    "DCGM_FI_PROF_NVLINK_TX_BYTES": ("nvlink_tx_bytes_s", 1.0),
    "DCGM_FI_PROF_NVLINK_RX_BYTES": ("nvlink_rx_bytes_s", 1.0),
}
_INT_FIELDS = {
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": "ecc_sbe",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "ecc_dbe",
}
_THROTTLE = ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS")
_XID = "DCGM_FI_DEV_XID_ERRORS"
_XID_COUNT = "DCGM_EXP_XID_ERRORS_COUNT"


@dataclass
class DcgmResult:
    """One scrape: samples per GPU, new XIDs, and the gap if the scrape failed."""

    t: float
    samples: list[GpuSample] = field(default_factory=list)
    xids: list[XidEvent] = field(default_factory=list)
    error: str | None = None
    extra: dict[int, dict[str, Any]] = field(default_factory=dict)  # gpu -> unmapped values


def fetch(url: str, timeout_s: float) -> str:
    """GET the exposition text. Raises OSError/urllib errors; the probe turns them into gaps."""
    req = urllib.request.Request(url, headers={"Accept": "text/plain"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - URL is configuration
        return resp.read().decode("utf-8", "replace")


def parse_exposition(text: str) -> dict[str, dict[str, Any]]:
    """Group the samples per GPU: ``{gpu_key: {"labels": {...}, "values": {metric: v},
    "xid": (value, err_code, err_msg) | None, "xid_counts": {code: count}}}``.

    Raises ValueError when the text is not Prometheus exposition format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    gpus: dict[str, dict[str, Any]] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as e:  # the parser raises ValueError, IndexError, ... on garbage
        raise ValueError(f"not Prometheus text: {type(e).__name__}: {e}") from e
    for fam in families:
        for s in fam.samples:
            name = s.name
            # prometheus_client names counter samples "<family>_total" even when the exposition
            # line has no such suffix (DCGM_FI_DEV_ECC_SBE_VOL_TOTAL is a counter): undo that.
            if fam.type == "counter":
                if name == fam.name + "_total":
                    name = fam.name
                elif name.endswith("_created"):
                    continue
            if not name.startswith("DCGM_"):
                continue
            labels = s.labels
            if "gpu" not in labels:
                continue
            # MIG instances repeat the GPU's series with GPU_I_ID: keep the whole-GPU ones.
            if labels.get("GPU_I_ID") not in (None, ""):
                continue
            key = labels.get("UUID") or f"gpu{labels['gpu']}"
            g = gpus.get(key)
            if g is None:
                g = gpus[key] = {"labels": dict(labels), "values": {}, "xid": None, "xid_counts": {}}
            if name == _XID:
                g["xid"] = (s.value, labels.get("err_code", ""), labels.get("err_msg", ""))
            elif name == _XID_COUNT:
                code = labels.get("xid") or labels.get("err_code") or ""
                g["xid_counts"][code] = g["xid_counts"].get(code, 0.0) + s.value
            else:
                g["values"][name] = s.value
    return gpus


def _int(v: float | None) -> int | None:
    if v is None or not math.isfinite(v):  # NaN, +-Inf: no reading
        return None
    return int(v)


def _gpu_order(label: Any) -> tuple[int, str]:
    """Sort key of a ``gpu`` label: numeric ones by number, anything else after them (it becomes a gap)."""
    try:
        return (int(label), "")
    except (TypeError, ValueError):
        return (1 << 62, str(label))


# New XIDs of one code in one scrape beyond this are not listed one by one (a counter that jumped by 1e9 would
# otherwise build a list of 1e9 events): the rest is noted as a gap of the GPU
MAX_NEW_XIDS_PER_CODE = 100


class DcgmProbe:
    """Scrapes one dcgm-exporter endpoint.

    ``sample() -> list[GpuSample]`` and ``poll_xids() -> list[XidEvent]`` (the XIDs found by
    the scrapes since the last call) mirror :class:`probes.nvml.NvmlProbe`; ``scrape()``
    returns everything of one scrape as a :class:`DcgmResult`. ``errors``, ``last_error``
    and ``gaps`` record failed scrapes.
    """

    source = "dcgm"
    simulated = False

    def __init__(
        self,
        url: str = "http://127.0.0.1:9400/metrics",
        *,
        node: int = 0,
        host: str = "",
        timeout_s: float = 2.0,
        report_existing_xids: bool = False,
        clock: Callable[[], float] = time.time,
        fetcher: Callable[[str, float], str] | None = None,
    ) -> None:
        self.url = url
        self.node = int(node)
        self.host = host
        self.timeout_s = timeout_s
        self.report_existing_xids = report_existing_xids
        self.clock = clock
        self._fetch = fetcher or fetch
        self.scrapes = 0
        self.errors = 0
        self.last_error: str | None = None
        self.gaps: dict[str, str] = {}
        self._xid_last: dict[str, tuple[float, str, str]] = {}  # gpu key -> last gauge reading
        self._xid_counts: dict[str, dict[str, float]] = {}  # gpu key -> {code: last count}
        self._xid_total: dict[str, int] = {}
        self._nvlink_prev: dict[str, tuple[float, float]] = {}  # gpu key -> (t, counter)
        self._pending: list[XidEvent] = []

    @property
    def status(self) -> str:
        return f"dcgm {self.url}: " + (f"error: {self.last_error}" if self.last_error else "ok")

    def sample(self) -> list[GpuSample]:
        """Scrape once; GPU samples (empty on a failed scrape). New XIDs wait in :meth:`poll_xids`."""
        r = self.scrape()
        self._pending.extend(r.xids)
        return r.samples

    def poll_xids(self) -> list[XidEvent]:
        out, self._pending = self._pending, []
        return out

    def scrape(self) -> DcgmResult:
        t = self.clock()
        res = DcgmResult(t=t)
        try:
            text = self._fetch(self.url, self.timeout_s)
            gpus = parse_exposition(text)
        except urllib.error.HTTPError as e:
            return self._gap(res, f"HTTP {e.code} from {self.url}")
        except (OSError, ValueError, UnicodeError) as e:  # refused, timeout, DNS, garbage text
            reason = getattr(e, "reason", None)
            return self._gap(res, f"{type(e).__name__}: {reason if reason is not None else e}")
        except Exception as e:  # noqa: BLE001 - a probe must never take the agent down
            return self._gap(res, f"{type(e).__name__}: {e}")
        if not gpus:
            return self._gap(res, "no DCGM_* GPU series in the exposition")
        self.scrapes += 1
        self.last_error = None
        self.gaps.pop("scrape", None)
        for key, g in sorted(gpus.items(), key=lambda kv: _gpu_order(kv[1]["labels"].get("gpu"))):
            try:
                sample, xids, extra = self._one(key, g, t)
            except (TypeError, ValueError, OverflowError) as e:  # a label or value no GPU has (gpu="x", +Inf)
                self.gaps[key] = f"{type(e).__name__}: {e}"
                continue
            res.samples.append(sample)
            res.xids.extend(xids)
            if extra:
                res.extra[sample.gpu] = extra
        return res

    def _gap(self, res: DcgmResult, msg: str) -> DcgmResult:
        self.errors += 1
        self.last_error = msg
        self.gaps["scrape"] = msg
        res.error = msg
        return res

    def _one(self, key: str, g: dict[str, Any], t: float) -> tuple[GpuSample, list[XidEvent], dict[str, Any]]:
        labels, vals = g["labels"], g["values"]
        gpu = int(labels.get("gpu", 0))
        host = labels.get("Hostname") or self.host
        kw: dict[str, Any] = {}
        for metric, (fname, scale) in _DIRECT.items():
            if metric in vals and fname not in kw:
                kw[fname] = vals[metric] * scale
        for metric, fname in _INT_FIELDS.items():
            if metric in vals:
                kw[fname] = _int(vals[metric])
        if "DCGM_FI_DEV_FB_USED" in vals:
            used = vals["DCGM_FI_DEV_FB_USED"]
            kw["mem_used_bytes"] = int(used * _MIB)
            if "DCGM_FI_DEV_FB_FREE" in vals:
                total = used + vals["DCGM_FI_DEV_FB_FREE"] + vals.get("DCGM_FI_DEV_FB_RESERVED", 0.0)
                kw["mem_total_bytes"] = int(total * _MIB)
        if "DCGM_FI_DEV_FB_TOTAL" in vals:
            kw["mem_total_bytes"] = int(vals["DCGM_FI_DEV_FB_TOTAL"] * _MIB)
        if "pcie_tx_bytes_s" not in kw and "DCGM_FI_DEV_PCIE_TX_THROUGHPUT" in vals:
            kw["pcie_tx_bytes_s"] = vals["DCGM_FI_DEV_PCIE_TX_THROUGHPUT"] * 1024.0
        if "pcie_rx_bytes_s" not in kw and "DCGM_FI_DEV_PCIE_RX_THROUGHPUT" in vals:
            kw["pcie_rx_bytes_s"] = vals["DCGM_FI_DEV_PCIE_RX_THROUGHPUT"] * 1024.0
        retired = [vals[m] for m in ("DCGM_FI_DEV_RETIRED_SBE", "DCGM_FI_DEV_RETIRED_DBE") if m in vals]
        if retired:
            kw["retired_pages"] = int(sum(retired))
        remapped = [vals[m] for m in ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS")
                    if m in vals]
        if remapped:
            kw["remapped_rows"] = int(sum(remapped))
        for m in _THROTTLE:
            if m in vals:
                mask = int(vals[m])
                kw["throttle_reasons"] = mask
                kw["throttle_names"] = throttle_names(mask)
                break

        extra: dict[str, Any] = {}
        if "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL" in vals:
            v = vals["DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"]
            extra["nvlink_bandwidth_total"] = v
            prev = self._nvlink_prev.get(key)
            if prev is not None and t > prev[0] and v >= prev[1]:
                extra["nvlink_bandwidth_total_per_s"] = (v - prev[1]) / (t - prev[0])
            self._nvlink_prev[key] = (t, v)
        if labels.get("DCGM_FI_DRIVER_VERSION"):
            extra["driver_version"] = labels["DCGM_FI_DRIVER_VERSION"]

        xids = self._xids(key, g, gpu, host, t)
        total = self._xid_total.get(key, 0) + len(xids)
        self._xid_total[key] = total
        sample = GpuSample(node=self.node, host=host, gpu=gpu, t=t, source="dcgm", simulated=False,
                           name=labels.get("modelName", ""), uuid=labels.get("UUID", ""), xid_total=total, **kw)
        return sample, xids, extra

    def _xids(self, key: str, g: dict[str, Any], gpu: int, host: str, t: float) -> list[XidEvent]:
        """New XIDs since the previous scrape of this GPU (see the module docstring)."""
        codes: list[int] = []
        counts = g["xid_counts"]
        if counts or key in self._xid_counts:
            # The windowed count sees repeats of the same code; it is authoritative when served.
            prev = self._xid_counts.get(key)
            for code, n in counts.items():
                before = prev.get(code, 0.0) if prev is not None else (0.0 if self.report_existing_xids else n)
                if n > before:
                    try:
                        new = n - before
                        c = int(float(code))
                        if not math.isfinite(new):
                            raise ValueError(f"xid {code} count {n}")
                    except (ValueError, OverflowError):
                        continue
                    if new > MAX_NEW_XIDS_PER_CODE:
                        self.gaps[key] = f"xid {c} count rose by {new:.0f} in one scrape: {MAX_NEW_XIDS_PER_CODE} listed"
                    codes.extend([c] * int(min(new, MAX_NEW_XIDS_PER_CODE)))
            self._xid_counts[key] = dict(counts)
        elif g["xid"] is not None:
            cur = g["xid"]
            last = self._xid_last.get(key)
            if last is None:
                if self.report_existing_xids and cur[0]:
                    codes.append(int(cur[0]))
            elif cur != last and cur[0]:
                codes.append(int(cur[0]))
        if g["xid"] is not None:
            self._xid_last[key] = g["xid"]
        return [XidEvent(node=self.node, host=host, gpu=gpu, t=t, code=c, source="dcgm", simulated=False)
                for c in codes]


__all__ = ["DcgmProbe", "DcgmResult", "fetch", "parse_exposition"]
