"""The NVML probe: samples every GPU through nvidia-ml-py (``pynvml``).

Modes (``probe.mode``), chosen by :func:`build_gpu_probe`, best first:

``nvml``            a real GPU: pynvml loads the system ``libnvidia-ml.so.1``.
``simulated-nvml``  no GPU, but the simulated NVML library (``probes/simnvml``, C, built by
                    ``make simnvml``) exists: the **same pynvml code** runs against it; device
                    state follows ``<run>/simgpu/node-<N>/gpu-<I>.state``.
``python-sim``      no library (no gcc): :mod:`probes.simgpu_python` reads the same files.
``none``            nothing to read: ``sample()`` returns ``[]`` and ``probe.status`` says why.

How the simulated library gets into pynvml, and why one process serves one state directory:
:mod:`probes.simnvml_loader`.

The probe never raises from ``sample()``/``poll_xids()``: a query the device does not support
gives ``None`` for that field (recorded in ``probe.gaps``), a failed init gives ``[]`` and a
``probe.status`` starting with ``"no GPU data:"``; init is retried lazily (every ``retry_s``).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from probes.simgpu_python import PythonSimGpuProbe
from probes.simnvml_loader import (
    SimNvmlError,
    attach_simulated,
    detach_simulated,
    is_simulated_library,
    pynvml_module,
    simnvml_library_path,
)
from ranksight.schema import GpuSample, XidEvent
from ranksight.simgpu import throttle_names

MODES = ("nvml", "simulated-nvml", "python-sim", "none")

_XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError
_NVLINK_TX, _NVLINK_RX = 138, 139  # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX / _RX (cumulative KiB)
_ALL_LINKS = 0xFFFFFFFF  # scopeId UINT_MAX: aggregate over all links
_MAX_EVENTS_PER_DRAIN = 10_000


# --------------------------------------------------------------------------------------------
# The probe
# --------------------------------------------------------------------------------------------


class NvmlProbe:
    """Samples GPUs through pynvml; real NVML when ``sim_dir`` is None, the simulated library otherwise.

    ``sample() -> list[GpuSample]``, ``poll_xids() -> list[XidEvent]``, ``close()``; ``mode``,
    ``source``, ``simulated``, ``status``, ``gaps`` (field -> last reason it was None).

    Its 16 methods are that surface, the context-manager pair, and one small reader per NVML query group
    (each records its own gaps); kept together because they share the NVML handles and the gap bookkeeping.
    """

    def __init__(self, node: int, host: str, sim_dir: str | os.PathLike | None = None, *,
                 lib_path: str | os.PathLike | None = None, retry_s: float = 10.0):
        self.node = int(node)
        self.host = str(host)
        self.sim_dir = Path(sim_dir) if sim_dir is not None else None
        self.lib_path = Path(lib_path) if lib_path is not None else simnvml_library_path()
        self.retry_s = retry_s
        self.mode = "simulated-nvml" if self.sim_dir is not None else "nvml"
        self.simulated = self.sim_dir is not None
        self.source = self.mode
        self.status = "starting"
        self.driver_version = ""
        self.gaps: dict[str, str] = {}
        self._ok = False
        self._attached = False
        self._last_try = -1e18
        self._lock = threading.RLock()
        self._handles: dict[int, Any] = {}
        self._ident: dict[int, tuple[str, str]] = {}  # gpu index -> (name, uuid), cleared with the handles
        self._addr_to_gpu: dict[int, int] = {}
        self._event_set = None
        self._xid_total: dict[int, int] = {}
        self._pending: list[XidEvent] = []
        self._throttle_fn: str | None = None
        self._nvlink_prev: dict[tuple[int, int], tuple[int, int]] = {}
        self._missing_fns: set[str] = set()
        self._try_init()

    # -- lifecycle ------------------------------------------------------------------------
    @property
    def ok(self) -> bool:
        return self._ok

    def _try_init(self) -> bool:
        with self._lock:
            if self._ok:
                return True
            now = time.monotonic()
            if now - self._last_try < self.retry_s:
                return False
            self._last_try = now
            try:
                pynvml = pynvml_module()
            except ImportError as e:
                self.status = f"no GPU data: pynvml not importable ({e})"
                return False
            if self.sim_dir is not None and not self._attached:
                if not self.lib_path.exists():
                    self.status = f"no GPU data: simulated NVML library not built ({self.lib_path} missing)"
                    return False
                try:
                    attach_simulated(self.lib_path, self.sim_dir)
                    self._attached = True
                except SimNvmlError as e:
                    self.status = f"no GPU data: {e}"
                    return False
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as e:
                where = f" (simulated NVML: state directory {self.sim_dir} missing?)" if self.sim_dir else ""
                self.status = f"no GPU data: {e}{where}"
                return False
            except Exception as e:  # pragma: no cover - defensive: a broken library must not crash the agent
                self.status = f"no GPU data: NVML init failed: {e!r}"
                return False
            self._ok = True
            self.simulated = is_simulated_library(pynvml.nvmlLib)
            self.mode = self.source = "simulated-nvml" if self.simulated else "nvml"
            self.status = ("ok: simulated NVML initialised" + (f" ({self.sim_dir})" if self.sim_dir else "")
                           if self.simulated else "ok: NVML initialised")
            self.driver_version = str(self._call("driver_version", pynvml.nvmlSystemGetDriverVersion) or "")
            ev = self._call("xid_events", pynvml.nvmlEventSetCreate)
            self._event_set = ev
            self._refresh_devices()
            return True

    def close(self) -> None:
        with self._lock:
            if self._ok:
                pynvml = pynvml_module()
                if self._event_set is not None:
                    self._call("xid_events", pynvml.nvmlEventSetFree, self._event_set)
                    self._event_set = None
                self._call("shutdown", pynvml.nvmlShutdown)
                self._ok = False
            if self._attached:
                detach_simulated()
                self._attached = False
            self._handles.clear()
            self._ident.clear()
            self._addr_to_gpu.clear()
            self.status = "closed"
            self._last_try = float("inf")  # a closed probe stays closed

    def __enter__(self) -> "NvmlProbe":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> dict:
        return {"mode": self.mode, "status": self.status, "simulated": self.simulated, "driver": self.driver_version,
                "sim_dir": str(self.sim_dir) if self.sim_dir else None,
                "library": str(self.lib_path) if self.simulated else "libnvidia-ml.so.1", "gaps": dict(self.gaps)}

    # -- helpers --------------------------------------------------------------------------
    def _call(self, field: str, fn: Callable, *args):
        """Call one pynvml function; any failure -> None, with the reason kept in ``gaps[field]``.

        A function the library lacks (FunctionNotFound) is not called again.
        """
        pynvml = pynvml_module()
        name = getattr(fn, "__name__", str(fn))
        if name in self._missing_fns:
            self.gaps[field] = "Function Not Found"
            return None
        try:
            value = fn(*args)
            self.gaps.pop(field, None)
            return value
        except pynvml.NVMLError as e:
            if isinstance(e, pynvml.NVMLError_FunctionNotFound):
                self._missing_fns.add(name)
            self.gaps[field] = str(e)
        except Exception as e:  # ctypes argument errors, a library that misbehaves: a gap, not a crash
            self.gaps[field] = f"{type(e).__name__}: {e}"
        return None

    def _refresh_devices(self) -> int | None:
        """Fetch handles for devices not seen yet (the simulated count can grow) and register XID events."""
        pynvml = pynvml_module()
        n = self._call("device_count", pynvml.nvmlDeviceGetCount)
        if n is None:
            return None
        for i in range(n):
            if i in self._handles:
                continue
            h = self._call("handle", pynvml.nvmlDeviceGetHandleByIndex, i)
            if h is None:
                continue
            self._handles[i] = h
            self._addr_to_gpu[ctypes.cast(h, ctypes.c_void_p).value or 0] = i
            if self._event_set is not None:
                supported = self._call("xid_events", pynvml.nvmlDeviceGetSupportedEventTypes, h) or 0
                if supported & _XID_EVENT:
                    self._call("xid_events", pynvml.nvmlDeviceRegisterEvents, h, _XID_EVENT, self._event_set)
                else:
                    self.gaps["xid_events"] = f"gpu {i}: XID events not supported"
        return n

    # -- sampling -------------------------------------------------------------------------
    def sample(self) -> list[GpuSample]:
        with self._lock:
            if not self._ok and not self._try_init():
                return []
            n = self._refresh_devices()
            if n is None:
                self.status = f"no GPU data: nvmlDeviceGetCount failed: {self.gaps.get('device_count')}"
                return []
            t = time.time()
            out = []
            for i in range(n):
                h = self._handles.get(i)
                if h is not None:
                    out.append(self._sample_one(i, h, t))
            self._drain_events()
            # xid_total must include the events just drained
            for s in out:
                s.xid_total = self._xid_total.get(s.gpu, 0)
            kind = "simulated GPU(s) via simulated NVML" if self.simulated else "GPU(s) via NVML"
            self.status = f"ok: {len(out)} {kind}" + (f" ({self.sim_dir})" if self.simulated else "")
            return out

    def _sample_one(self, gpu: int, h, t: float) -> GpuSample:
        pynvml = pynvml_module()

        def c(field: str, fn: Callable, *args):
            return self._call(f"gpu{gpu}.{field}", fn, *args)

        util = c("util_pct", pynvml.nvmlDeviceGetUtilizationRates, h)
        mem = c("mem_used_bytes", pynvml.nvmlDeviceGetMemoryInfo, h)
        power = c("power_w", pynvml.nvmlDeviceGetPowerUsage, h)
        limit = c("power_limit_w", pynvml.nvmlDeviceGetEnforcedPowerLimit, h)
        temp = c("temp_c", pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU)
        sm = c("sm_clock_mhz", pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM)
        memclk = c("mem_clock_mhz", pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_MEM)
        max_sm = c("max_sm_clock_mhz", pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_SM)
        reasons = self._throttle(gpu, h)
        sbe = c("ecc_sbe", pynvml.nvmlDeviceGetTotalEccErrors, h, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                pynvml.NVML_VOLATILE_ECC)
        dbe = c("ecc_dbe", pynvml.nvmlDeviceGetTotalEccErrors, h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                pynvml.NVML_VOLATILE_ECC)
        retired = self._retired_pages(gpu, h)
        remap = c("remapped_rows", pynvml.nvmlDeviceGetRemappedRows, h)
        pcie_tx = c("pcie_tx_bytes_s", pynvml.nvmlDeviceGetPcieThroughput, h, pynvml.NVML_PCIE_UTIL_TX_BYTES)
        pcie_rx = c("pcie_rx_bytes_s", pynvml.nvmlDeviceGetPcieThroughput, h, pynvml.NVML_PCIE_UTIL_RX_BYTES)
        nv_tx, nv_rx = self._nvlink(gpu, h)
        ident = self._ident.get(gpu)
        if ident is None:  # a device's name and UUID do not change: asked once per handle
            ident = (str(c("name", pynvml.nvmlDeviceGetName, h) or ""), str(c("uuid", pynvml.nvmlDeviceGetUUID, h) or ""))
            if ident[0] and ident[1]:
                self._ident[gpu] = ident
        return GpuSample(
            node=self.node, host=self.host, gpu=gpu, t=t, source=self.source, simulated=self.simulated,
            name=ident[0], uuid=ident[1],
            util_pct=float(util.gpu) if util is not None else None,
            mem_util_pct=float(util.memory) if util is not None else None,
            mem_used_bytes=int(mem.used) if mem is not None else None,
            mem_total_bytes=int(mem.total) if mem is not None else None,
            power_w=power / 1000.0 if power is not None else None,
            power_limit_w=limit / 1000.0 if limit is not None else None,
            temp_c=float(temp) if temp is not None else None,
            sm_clock_mhz=float(sm) if sm is not None else None,
            mem_clock_mhz=float(memclk) if memclk is not None else None,
            max_sm_clock_mhz=float(max_sm) if max_sm is not None else None,
            throttle_reasons=int(reasons or 0),
            throttle_names=throttle_names(int(reasons or 0)),
            ecc_sbe=int(sbe) if sbe is not None else None,
            ecc_dbe=int(dbe) if dbe is not None else None,
            retired_pages=retired,
            remapped_rows=int(remap[0]) + int(remap[1]) if remap is not None else None,
            pcie_tx_bytes_s=pcie_tx * 1024.0 if pcie_tx is not None else None,  # NVML reports KB/s
            pcie_rx_bytes_s=pcie_rx * 1024.0 if pcie_rx is not None else None,
            nvlink_tx_bytes_s=nv_tx,
            nvlink_rx_bytes_s=nv_rx,
            xid_total=self._xid_total.get(gpu, 0),
        )

    def _throttle(self, gpu: int, h) -> int | None:
        """Clock event reasons (NVML >= 12.2 name), falling back to the older throttle-reasons call."""
        pynvml = pynvml_module()
        names = [self._throttle_fn] if self._throttle_fn else [
            "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"]
        for name in names:
            fn = getattr(pynvml, name, None)
            if fn is None:
                continue
            try:
                value = fn(h)
            except pynvml.NVMLError_FunctionNotFound:
                continue
            except pynvml.NVMLError as e:
                self.gaps[f"gpu{gpu}.throttle_reasons"] = str(e)
                return None
            except Exception as e:
                self.gaps[f"gpu{gpu}.throttle_reasons"] = f"{type(e).__name__}: {e}"
                return None
            self._throttle_fn = name
            self.gaps.pop(f"gpu{gpu}.throttle_reasons", None)
            return int(value)
        self.gaps[f"gpu{gpu}.throttle_reasons"] = "Function Not Found"
        return None

    def _retired_pages(self, gpu: int, h) -> int | None:
        pynvml = pynvml_module()
        total = 0
        for cause in (pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                      pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR):
            pages = self._call(f"gpu{gpu}.retired_pages", pynvml.nvmlDeviceGetRetiredPages, h, cause)
            if pages is None:
                return None
            total += len(pages)
        return total

    def _nvlink(self, gpu: int, h) -> tuple[float | None, float | None]:
        """NVLink data throughput in bytes/s from the cumulative KiB counters (None until two samples)."""
        pynvml = pynvml_module()
        values = self._call(f"gpu{gpu}.nvlink", pynvml.nvmlDeviceGetFieldValues, h,
                            [(_NVLINK_TX, _ALL_LINKS), (_NVLINK_RX, _ALL_LINKS)])
        if values is None:
            return None, None
        rates: list[float | None] = []
        for v, fid, field in zip(values, (_NVLINK_TX, _NVLINK_RX), ("nvlink_tx_bytes_s", "nvlink_rx_bytes_s")):
            if v.nvmlReturn != pynvml.NVML_SUCCESS:
                self.gaps[f"gpu{gpu}.{field}"] = str(pynvml.NVMLError(v.nvmlReturn))
                rates.append(None)
                continue
            self.gaps.pop(f"gpu{gpu}.{field}", None)
            kib, ts = int(v.value.ullVal), int(v.timestamp)
            prev = self._nvlink_prev.get((gpu, fid))
            self._nvlink_prev[(gpu, fid)] = (kib, ts)
            if prev is None or ts <= prev[1] or kib < prev[0]:
                rates.append(None)
            else:
                rates.append((kib - prev[0]) * 1024.0 / ((ts - prev[1]) / 1e6))
        return rates[0], rates[1]

    # -- XID events -------------------------------------------------------------------------
    def _drain_events(self) -> None:
        if self._event_set is None:
            return
        pynvml = pynvml_module()
        for _ in range(_MAX_EVENTS_PER_DRAIN):
            try:
                data = pynvml.nvmlEventSetWait_v2(self._event_set, 0)
            except pynvml.NVMLError_Timeout:
                return
            except pynvml.NVMLError as e:
                self.gaps["xid_events"] = str(e)
                return
            except Exception as e:
                self.gaps["xid_events"] = f"{type(e).__name__}: {e}"
                return
            if not (int(data.eventType) & _XID_EVENT):
                continue
            addr = ctypes.cast(data.device, ctypes.c_void_p).value or 0
            gpu = self._addr_to_gpu.get(addr)
            if gpu is None:
                idx = self._call("xid_events", pynvml.nvmlDeviceGetIndex, data.device)
                gpu = int(idx) if idx is not None else -1
            t = time.time()
            if self.simulated:
                ms = ctypes.c_ulonglong(0)
                try:
                    if pynvml.nvmlLib.simnvmlEventSetLastTimeMs(self._event_set, ctypes.byref(ms)) == 0 and ms.value:
                        t = ms.value / 1000.0  # the injection time written in the state file
                except Exception:
                    pass
            self._xid_total[gpu] = self._xid_total.get(gpu, 0) + 1
            self._pending.append(XidEvent(node=self.node, host=self.host, gpu=gpu, t=t, code=int(data.eventData),
                                          source=self.source, simulated=self.simulated))

    def poll_xids(self) -> list[XidEvent]:
        """XID events since the last call (non-blocking: the event set is waited on with timeout 0)."""
        with self._lock:
            if not self._ok and not self._try_init():
                return []
            self._refresh_devices()
            self._drain_events()
            events, self._pending = self._pending, []
            return events


# --------------------------------------------------------------------------------------------
# "none": nothing to read
# --------------------------------------------------------------------------------------------


class NullGpuProbe:
    """No GPU data at all: ``sample()`` is ``[]``; ``status`` says why."""

    mode = "none"
    source = "none"
    simulated = False

    def __init__(self, node: int, host: str, reason: str):
        self.node = int(node)
        self.host = str(host)
        self.status = reason if reason.startswith("no GPU data") else f"no GPU data: {reason}"
        self.gaps: dict[str, str] = {}

    def sample(self) -> list[GpuSample]:
        return []

    def poll_xids(self) -> list[XidEvent]:
        return []

    def close(self) -> None:
        pass

    def describe(self) -> dict:
        return {"mode": self.mode, "status": self.status, "simulated": False}


GpuProbe = NvmlProbe | PythonSimGpuProbe | NullGpuProbe


def build_gpu_probe(node: int, host: str, sim_dir: str | os.PathLike | None = None, *,
                    lib_path: str | os.PathLike | None = None, mode: str = "auto") -> GpuProbe:
    """Pick the best GPU probe this machine allows; never raises for a missing GPU or library.

    ``mode="auto"``: real NVML if it initialises with at least one device; else the simulated
    NVML library over ``sim_dir`` if the library exists (the directory may appear later: the probe
    retries); else the pure-Python simulator over ``sim_dir``; else :class:`NullGpuProbe`.
    Other modes force one choice (``"nvml"``, ``"simulated-nvml"``, ``"python-sim"``, ``"none"``).

    The result has ``.mode`` (one of :data:`MODES`), ``.status``, and ``.selection``: the reasons the
    better modes were skipped.
    """
    if mode not in ("auto",) + MODES:
        raise ValueError(f"unknown GPU probe mode {mode!r}: use auto, {', '.join(MODES)}")
    lib = Path(lib_path) if lib_path is not None else simnvml_library_path()
    skipped: list[str] = []

    def done(p):
        p.selection = skipped
        return p

    if mode == "none":
        return done(NullGpuProbe(node, host, "GPU sampling disabled"))
    if mode == "nvml":
        return done(NvmlProbe(node, host, None))
    if mode == "simulated-nvml":
        if sim_dir is None:
            raise ValueError("mode 'simulated-nvml' needs sim_dir")
        return done(NvmlProbe(node, host, sim_dir, lib_path=lib))
    if mode == "python-sim":
        if sim_dir is None:
            raise ValueError("mode 'python-sim' needs sim_dir")
        return done(PythonSimGpuProbe(node, host, sim_dir))

    # auto
    real = NvmlProbe(node, host, None)
    if real.ok:
        n = real._call("device_count", pynvml_module().nvmlDeviceGetCount) or 0
        if n > 0 and (not real.simulated or sim_dir is None):
            return done(real)
        skipped.append(f"nvml: {'simulated library on the library path' if real.simulated else f'{n} devices'}")
    else:
        skipped.append(f"nvml: {real.status.removeprefix('no GPU data: ')}")
    real.close()
    if sim_dir is None:
        return done(NullGpuProbe(node, host, "; ".join(skipped) + "; simulated: no state directory given"))
    if lib.exists():
        sim = NvmlProbe(node, host, sim_dir, lib_path=lib)
        if sim.ok or sim._attached:
            return done(sim)
        skipped.append(f"simulated-nvml: {sim.status.removeprefix('no GPU data: ')}")
        sim.close()
    else:
        skipped.append(f"simulated-nvml: library {lib} not built (make simnvml; needs gcc)")
    return done(PythonSimGpuProbe(node, host, sim_dir))
