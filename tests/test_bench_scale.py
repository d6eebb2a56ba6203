"""bench/scale.py end to end at a small size: the real head fed over HTTP in real time reports its CPU by part,
runs live analysis rounds, and names the straggler the generated telemetry carries."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_scale_bench_small_fleet(tmp_path):
    out = tmp_path / "scale.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"), "--ranks", "64", "--pp", "2", "--seconds", "18",
                        "--warmup", "4", "--slow-from", "2", "--connections", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    got = json.loads(out.read_text())
    assert {"http", "flush", "analyze"} <= set(got["share_pct"]), got["share_pct"]
    assert got["share_pct"]["http"] > 0
    assert got["rounds"] >= 1
    assert got["findings"] and all(3 in f["ranks"] for f in got["findings"]), got["findings"]
    assert "share of one core by part" in p.stdout
    assert got["stored"] == got["sent"] and got["sent"]["collectives"] > 0, (got["stored"], got["sent"])  # none lost
    assert "every record sent is stored once" in p.stdout


def test_scale_bench_one_connection_per_agent(tmp_path):
    """--per-agent-connections: each agent's requests over its own keep-alive connection from forked sender
    processes, as real agents connect; the senders' lag, the head's CPU per request and each round's time come back."""
    out = tmp_path / "scale.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"), "--ranks", "64", "--pp", "2", "--seconds", "14",
                        "--warmup", "4", "--slow-from", "2", "--per-agent-connections", "--sender-processes", "2",
                        "--analyze-interval", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    got = json.loads(out.read_text())
    assert got["connections"].startswith("8 keep-alive connections"), got["connections"]  # 64 ranks: 8 agents
    assert len(got["behind_s"]) == 14 and got["requests"] >= 8 * 5
    assert got["round_s"] and all(r > 0 for r in got["round_s"])
    assert got["findings"] and all(3 in f["ranks"] for f in got["findings"]), got["findings"]


def test_scale_bench_in_process(tmp_path):
    """--in-process: the same bodies through the head's ingest and flush in one process, no HTTP: every record taken,
    the CPU per second of the fleet reported by stage."""
    out = tmp_path / "scale.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"), "--ranks", "64", "--pp", "2", "--seconds", "5",
                        "--warmup", "2", "--agents-per-request", "4", "--in-process", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    got = json.loads(out.read_text())["in_process"]
    assert got["seconds"] == 3 and got["rejected"] == 0 and got["accepted"] > 64 * 5
    assert got["ingest_ms"] > 0 and got["flush_ms"] > 0
    assert abs(got["total_ms"] - got["ingest_ms"] - got["flush_ms"]) < 1e-6
    assert "head in-process" in p.stdout


def test_scale_bench_in_process_parts_every(tmp_path):
    """--parts-every 2: the queue processed every second, parts every 2 s: the same records taken as with a part a
    second, and the seconds that wrote parts are a share of the flush's CPU."""
    got = {}
    for every in (1, 2):
        out = tmp_path / f"scale-{every}.json"
        p = subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"), "--ranks", "64", "--pp", "2", "--seconds",
                            "6", "--warmup", "2", "--agents-per-request", "4", "--in-process", "--parts-every",
                            str(every), "--json", str(out)], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        got[every] = json.loads(out.read_text())["in_process"]
        assert f"part files every {every} s" in p.stdout
    assert got[1]["accepted"] == got[2]["accepted"] > 64 * 6 and got[2]["rejected"] == 0
    assert got[2]["parts_every"] == 2 and 0 < got[2]["parts_ms"] < got[2]["flush_ms"]
    assert got[1]["parts_ms"] == got[1]["flush_ms"]
