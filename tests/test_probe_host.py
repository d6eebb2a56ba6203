"""The host probe: real numbers from this machine, and gaps instead of crashes."""

from __future__ import annotations

import os
import socket
import threading
from collections import namedtuple

import psutil
import pytest

import probes.host as host_mod
from probes.host import HostProbe
from ranksight.schema import HostSample, encode


def test_sample_reports_this_machine():
    probe = HostProbe(3, "node-a")
    s = probe.sample()
    assert isinstance(s, HostSample)
    assert (s.node, s.host) == (3, "node-a")
    vm = psutil.virtual_memory()
    assert s.mem_total_bytes == vm.total
    assert 0 < s.mem_used_bytes < s.mem_total_bytes
    assert 0.0 <= s.cpu_pct <= 100.0
    assert s.load1 >= 0.0
    assert s.net_rx_bytes > 0 or s.net_tx_bytes > 0
    assert s.disk_read_bytes >= 0 and s.disk_write_bytes >= 0
    assert probe.status == "ok" and probe.gaps == {}
    assert b'"kind":"host"' in encode(s)


def test_network_bytes_follow_real_traffic(port):
    """Push 4 MiB through loopback between two samples: both counters grow by at least that."""
    probe = HostProbe(0, "h")
    before = probe.sample()
    payload = b"x" * (4 * 1024 * 1024)
    srv = socket.socket()
    srv.bind(("127.0.0.1", port))
    srv.listen(1)
    got = bytearray()

    def serve():
        conn, _ = srv.accept()
        with conn:
            while len(got) < len(payload):
                chunk = conn.recv(1 << 16)
                if not chunk:
                    break
                got.extend(chunk)

    t = threading.Thread(target=serve)
    t.start()
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(payload)
    t.join(timeout=30)
    srv.close()
    assert len(got) == len(payload)
    after = probe.sample()
    assert after.net_tx_bytes - before.net_tx_bytes >= len(payload)
    assert after.net_rx_bytes - before.net_rx_bytes >= len(payload)
    assert after.t >= before.t


CT = namedtuple("scputimes", "user nice system idle iowait irq softirq steal guest guest_nice")


def test_cpu_percent_from_own_deltas(monkeypatch):
    times = [CT(100, 0, 50, 800, 50, 0, 0, 0, 0, 0)]
    monkeypatch.setattr(psutil, "cpu_times", lambda: times[-1])
    probe = HostProbe(0, "h")
    # +30 user, +10 system, +50 idle, +10 iowait: 40 busy of 100
    times.append(CT(130, 0, 60, 850, 60, 0, 0, 0, 0, 0))
    assert probe.sample().cpu_pct == pytest.approx(40.0)
    # no time passed: keep the last value instead of dividing by zero
    assert probe.sample().cpu_pct == pytest.approx(40.0)
    # guest time is already inside user; it must not count twice
    times.append(CT(230, 0, 60, 850, 60, 0, 0, 0, 100, 0))
    assert probe.sample().cpu_pct == pytest.approx(100.0)
    # a second probe has its own baseline
    other = HostProbe(0, "h")
    times.append(CT(230, 0, 60, 950, 60, 0, 0, 0, 100, 0))
    assert other.sample().cpu_pct == pytest.approx(0.0)


def test_missing_counters_become_gaps_not_crashes(monkeypatch):
    probe = HostProbe(0, "h")
    monkeypatch.setattr(host_mod, "_diskstats", lambda whole: None)  # no /proc/diskstats: psutil is asked ...
    monkeypatch.setattr(psutil, "disk_io_counters", lambda perdisk=False: None)  # ... and has nothing either

    def broken(pernic=True):
        raise PermissionError("/proc/net/dev: denied")

    monkeypatch.setattr(psutil, "net_io_counters", broken)
    s = probe.sample()
    assert (s.disk_read_bytes, s.disk_write_bytes, s.net_rx_bytes, s.net_tx_bytes) == (0, 0, 0, 0)
    assert s.mem_total_bytes == psutil.virtual_memory().total
    assert probe.gaps["disk"] == "not available on this machine"
    assert "denied" in probe.gaps["net"]
    assert probe.status.startswith("partial:")
    monkeypatch.undo()
    s = probe.sample()
    assert probe.status == "ok" and s.net_rx_bytes > 0


def test_loopback_can_be_excluded(monkeypatch):
    nic = namedtuple("snetio", "bytes_sent bytes_recv")
    monkeypatch.setattr(psutil, "net_io_counters", lambda pernic=True: {"lo": nic(1000, 1000), "eth0": nic(7, 9)})
    assert (HostProbe(0, "h").sample().net_tx_bytes, HostProbe(0, "h").sample().net_rx_bytes) == (1007, 1009)
    s = HostProbe(0, "h", net_exclude_loopback=True).sample()
    assert (s.net_tx_bytes, s.net_rx_bytes) == (7, 9)


def test_proc_fast_paths_read_what_psutil_reads():
    # the probe reads /proc/meminfo and /proc/diskstats itself (psutil parses far more every second)
    mem, fast_mem = psutil.virtual_memory(), host_mod._meminfo()
    assert fast_mem.total == mem.total and abs(fast_mem.available - mem.available) < 64 * 2**20
    c, whole = psutil.disk_io_counters(perdisk=False), {}
    rd, wr = host_mod._diskstats(whole)
    c2 = psutil.disk_io_counters(perdisk=False)
    assert c.read_bytes <= rd <= c2.read_bytes and c.write_bytes <= wr <= c2.write_bytes
    assert whole and all(ok == os.path.exists(f"/sys/block/{n.replace('/', '!')}") for n, ok in whole.items())
