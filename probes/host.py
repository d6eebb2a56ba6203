"""The host probe: CPU, load, memory, network bytes and disk I/O of this machine (psutil over /proc).

``HostProbe(node, host).sample() -> HostSample``. Network and disk figures are cumulative byte
counters since boot (rates are a downstream subtraction, like Prometheus counters).
``cpu_pct`` is busy CPU over all cores since this probe's previous sample (or since it was
created, for the first one), computed from the probe's own ``cpu_times`` snapshots so several
probes in one process do not disturb each other (``psutil.cpu_percent(None)`` shares one global
baseline).

Counters the machine does not expose (a container without /proc/diskstats, say) read as 0 and
are named in ``probe.gaps``; ``sample()`` never raises.
"""

from __future__ import annotations

import os
import time

import psutil

from ranksight.schema import HostSample


class _Mem:
    __slots__ = ("total", "available")

    def __init__(self, total: int, available: int):
        self.total, self.available = total, available


def _meminfo() -> _Mem | None:
    """MemTotal and MemAvailable from /proc/meminfo (what psutil.virtual_memory() reports as total and
    available, without parsing and computing the rest of it every second); None when not there."""
    total = avail = None
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemTotal:"):
                    total = int(line.split()[1]) * 1024
                elif line.startswith(b"MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        return None
    return _Mem(total, avail) if total is not None and avail is not None else None


def _diskstats(whole: dict[str, bool]) -> tuple[int, int] | None:
    """Bytes read and written by all whole disks, from /proc/diskstats, as
    ``psutil.disk_io_counters(perdisk=False)`` counts them (partitions skipped: a name is a whole disk
    when /sys/block/<name> exists, looked up once per name and kept in ``whole``; 512-byte sectors).
    None when the file is missing or a line is not understood (the caller falls back to psutil)."""
    try:
        with open("/proc/diskstats", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    rd = wr = 0
    for line in lines:
        fields = line.split()
        n = len(fields)
        if n == 14 or n >= 18:
            name, r, w = fields[2], fields[5], fields[9]
        elif n == 7:
            name, r, w = fields[2], fields[4], fields[6]
        elif n == 15:
            name, r, w = fields[3], fields[5], fields[9]
        else:
            return None
        key = name.decode("utf-8", "replace")
        ok = whole.get(key)
        if ok is None:
            ok = whole[key] = os.access("/sys/block/" + key.replace("/", "!"), os.F_OK)
        if ok:
            try:
                rd += int(r)
                wr += int(w)
            except ValueError:
                return None
    return rd * 512, wr * 512


def _implausible(value) -> str:
    """Why a read value cannot be true ("" when it can): byte counters and memory sizes are never negative, a
    machine has some memory, and never more memory available than it has."""
    if isinstance(value, tuple):
        return "negative counter read" if any(isinstance(v, (int, float)) and v < 0 for v in value) else ""
    total, avail = getattr(value, "total", None), getattr(value, "available", None)
    if isinstance(total, (int, float)) and isinstance(avail, (int, float)):
        if total <= 0 or avail < 0:
            return f"no or negative memory size read (total {total}, available {avail})"
        if avail > total:
            return f"more memory available ({avail}) than there is ({total})"
    return ""


def _busy_idle(ct) -> tuple[float, float]:
    idle = ct.idle + getattr(ct, "iowait", 0.0)
    total = sum(ct)  # psutil's fields partition the CPU time (guest is already inside user on Linux)
    total -= getattr(ct, "guest", 0.0) + getattr(ct, "guest_nice", 0.0)
    return total - idle, idle


class HostProbe:
    """Samples this machine: ``sample() -> HostSample``; ``gaps`` names the counters it could not read."""

    def __init__(self, node: int, host: str, *, net_exclude_loopback: bool = False):
        self.node = int(node)
        self.host = str(host)
        self.net_exclude_loopback = net_exclude_loopback
        self.gaps: dict[str, str] = {}
        self.status = "ok"
        self._last_cpu = self._cpu_times()
        self._last_pct = 0.0
        self._whole_disk: dict[str, bool] = {}  # /proc/diskstats name -> counted in the total (a whole disk)

    def _cpu_times(self):
        try:
            return _busy_idle(psutil.cpu_times())
        except Exception as e:  # pragma: no cover - /proc/stat unreadable
            self.gaps["cpu_pct"] = f"{type(e).__name__}: {e}"
            return None

    def _cpu_pct(self) -> float:
        now = self._cpu_times()
        prev, self._last_cpu = self._last_cpu, now
        if now is None or prev is None:
            return self._last_pct
        d_busy, d_idle = now[0] - prev[0], now[1] - prev[1]
        if d_busy + d_idle <= 0:  # two samples within one clock tick: nothing new to say
            return self._last_pct
        self._last_pct = max(0.0, min(100.0, 100.0 * d_busy / (d_busy + d_idle)))
        return self._last_pct

    def _guard(self, field: str, fn, default):
        try:
            value = fn()
        except Exception as e:
            self.gaps[field] = f"{type(e).__name__}: {e}"
            return default
        if value is None:
            self.gaps[field] = "not available on this machine"
            return default
        bad = _implausible(value)
        if bad:  # a garbled /proc or a library bug: a named gap, never a negative counter downstream
            self.gaps[field] = bad
            return default
        self.gaps.pop(field, None)
        return value

    def _net(self) -> tuple[int, int] | None:
        counters = psutil.net_io_counters(pernic=True)
        if not counters:
            return None
        rx = tx = 0
        for nic, c in counters.items():
            if self.net_exclude_loopback and nic == "lo":
                continue
            rx += c.bytes_recv
            tx += c.bytes_sent
        return rx, tx

    def _disk(self) -> tuple[int, int] | None:
        fast = _diskstats(self._whole_disk)
        if fast is not None:
            return fast
        c = psutil.disk_io_counters(perdisk=False)
        if c is None:
            return None
        return c.read_bytes, c.write_bytes

    def _memory(self):
        fast = _meminfo()
        return fast if fast is not None else psutil.virtual_memory()

    def sample(self) -> HostSample:
        t = time.time()
        cpu = self._guard("cpu_pct", self._cpu_pct, 0.0)
        load1 = self._guard("load1", lambda: os.getloadavg()[0], 0.0)
        mem = self._guard("memory", self._memory, None)
        rx, tx = self._guard("net", self._net, (0, 0))
        rd, wr = self._guard("disk", self._disk, (0, 0))
        self.status = "ok" if not self.gaps else "partial: " + ", ".join(f"{k}: {v}" for k, v in self.gaps.items())
        return HostSample(
            node=self.node, host=self.host, t=t, cpu_pct=float(cpu), load1=float(load1),
            mem_used_bytes=int(mem.total - mem.available) if mem is not None else 0,
            mem_total_bytes=int(mem.total) if mem is not None else 0,
            net_rx_bytes=int(rx), net_tx_bytes=int(tx),
            disk_read_bytes=int(rd), disk_write_bytes=int(wr),
        )
