"""Smoke test of bench/agent_cycle.py: it runs against a real head with tiny counts and prints its tables.
No timing assertions (figures live in bench/RESULTS.md)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_agent_cycle_bench_prints_its_tables():
    r = subprocess.run([sys.executable, str(REPO / "bench" / "agent_cycle.py"), "--exports", "3", "--prom-calls", "5",
                        "--cycles", "3", "--records", "4"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    for row in ("| OTLP export | lean |", "| OTLP export | requests |", "| Prometheus step series, per cycle | batched |",
                "| Prometheus step series, per cycle | per_record |", "| NodeAgent.cycle() | per step record |",
                "| OTLP export: requests / lean |", "| Prometheus: per_record / batched |"):
        assert row in r.stdout, r.stdout
