"""The host probe's error contract (issue 16: every probe's contract holds, a test per probe that nothing else
escapes): whatever /proc/meminfo and /proc/diskstats hold and whatever psutil answers or raises, ``sample()`` returns
a HostSample whose counters are non-negative, and a value it could not read is a named gap, never a made-up figure."""

from __future__ import annotations

import io

from hypothesis import given
from hypothesis import strategies as st

import probes.host as host_mod
from fuzz_settings import fuzz_settings

FUZZ = fuzz_settings(80)

proc_line = st.one_of(
    st.builds(lambda k, v, u: f"{k}: {v} {u}".encode(), st.sampled_from(["MemTotal", "MemAvailable", "MemFree"]),
              st.one_of(st.integers(-10**20, 10**20), st.text(max_size=5)), st.sampled_from(["kB", "", "x"])),
    st.builds(lambda f: " ".join(f).encode(), st.lists(st.one_of(st.sampled_from(["sda", "sda1", "nvme0n1", "loop0"]),
                                                                st.integers(-10**20, 10**20).map(str),
                                                                st.text(max_size=4)), max_size=20)),
    st.binary(max_size=40))
proc_file = st.one_of(st.none(), st.lists(proc_line, max_size=8).map(b"\n".join))
failures = st.sampled_from([None, OSError("gone"), ValueError("bad"), RuntimeError("psutil"), ZeroDivisionError()])


@FUZZ
@given(meminfo=proc_file, diskstats=proc_file, net=st.one_of(failures, st.integers(-10**6, 10**12)),
       vm=st.one_of(failures, st.integers(-10**6, 10**12)), disk_fallback=failures)
def test_fuzz_host_probe_never_raises_and_reports_no_negative_counter(monkeypatch, meminfo, diskstats, net, vm,
                                                                   disk_fallback):
    files = {"/proc/meminfo": meminfo, "/proc/diskstats": diskstats}
    real_open = open

    def fake_open(path, mode="r", *a, **kw):
        if path in files:
            if files[path] is None:
                raise FileNotFoundError(path)
            return io.BytesIO(files[path])
        return real_open(path, mode, *a, **kw)

    class Nic:
        def __init__(self, n):
            self.bytes_recv = self.bytes_sent = n

    class Vm:
        def __init__(self, n):
            self.total, self.available = n, n // 2

    class Disk:
        read_bytes = write_bytes = 7

    def answer(value, make):
        def f(*a, **kw):
            if isinstance(value, BaseException):
                raise value
            return make(value) if value is not None else None
        return f

    monkeypatch.setattr(host_mod, "open", fake_open, raising=False)
    monkeypatch.setattr(host_mod.psutil, "net_io_counters", answer(net, lambda n: {"eth0": Nic(n)}))
    monkeypatch.setattr(host_mod.psutil, "virtual_memory", answer(vm, Vm))
    monkeypatch.setattr(host_mod.psutil, "disk_io_counters",
                        answer(disk_fallback, lambda _: Disk()) if disk_fallback is not None else lambda **kw: Disk())
    probe = host_mod.HostProbe(0, "h")
    s = probe.sample()
    for f in ("mem_used_bytes", "mem_total_bytes", "net_rx_bytes", "net_tx_bytes", "disk_read_bytes",
              "disk_write_bytes"):
        assert getattr(s, f) >= 0, (f, s, probe.gaps)
    assert 0.0 <= s.cpu_pct <= 100.0
    if s.mem_total_bytes == 0:
        assert "memory" in probe.gaps  # not read: said, not a made-up 0 of 0
    assert s.mem_used_bytes <= s.mem_total_bytes
