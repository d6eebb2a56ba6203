"""traces.checks, diff and the command on generated trace sets with known ground truth."""

from __future__ import annotations

import json
import os
import sys

import pytest
from typer.testing import CliRunner

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import kineto_synth  # noqa: E402

from traces.breakdown import analyse_rank  # noqa: E402
from traces.checks import run_checks  # noqa: E402
from traces.diff import diff  # noqa: E402
from traces.load import load_traces  # noqa: E402


def _run(d, window="steps"):
    ts, err = load_traces([str(d)])
    assert not err
    rs = [analyse_rank(t, window=window) for t in ts]
    return ts, rs, run_checks(rs, ts)


@pytest.mark.parametrize("slow", [0, 2, 3])
def test_injected_straggler_is_named_not_its_victims(tmp_path, slow):
    kineto_synth.generate(str(tmp_path), ranks=4, steps=4, kernels=60, slow_rank=slow, slow_factor=1.3, seed=slow)
    ts, rs, (findings, _) = _run(tmp_path)
    st = [f for f in findings if f.kind == "straggler"]
    assert len(st) == 1
    f = st[0]
    assert f.ranks == [slow]
    assert f.evidence["culprit_waits_least_in_nccl"] is True
    assert f.evidence["excess_pct"] == pytest.approx(30, abs=6)
    victims = f.evidence["victims_nccl_kernel_ms"]
    assert slow not in victims and len(victims) == 3
    assert all(v > f.evidence["nccl_kernel_ms_median"][slow] for v in victims.values())
    assert max(f.evidence["arrived_last"], key=f.evidence["arrived_last"].get) == slow


def test_no_straggler_when_balanced(tmp_path):
    kineto_synth.generate(str(tmp_path), ranks=4, steps=4, kernels=60, seed=5)
    _, _, (findings, _) = _run(tmp_path)
    assert not [f for f in findings if f.kind == "straggler"]


def test_slow_collective_group(tmp_path):
    kineto_synth.generate(str(tmp_path), ranks=4, steps=3, kernels=40, subgroup_size=2, slow_comm_group=1,
                          slow_comm_factor=3.0, seed=2)
    _, _, (findings, extra) = _run(tmp_path)
    cb = [f for f in findings if f.kind == "comm_bottleneck" and "process group" in f.summary]
    assert len(cb) == 1 and cb[0].ranks == [2, 3]
    assert extra["slowest_collective"]["transfer_ms"] > 0


def test_pipeline_bubbles(tmp_path):
    kineto_synth.generate(str(tmp_path), ranks=4, steps=2, pipeline=True, microbatches=4, seed=3)
    _, rs, (findings, _) = _run(tmp_path)
    pb = [f for f in findings if f.kind == "pipeline_bubble"]
    assert len(pb) == 1
    # GPipe, 4 stages, 4 microbatches: (S-1)/(M+S-1) = 3/7 of the stage time idle, plus the p2p time
    assert pb[0].evidence["mean_bubble_pct"] == pytest.approx(100 * 3 / 7, abs=12)


def test_exposed_comm_per_step_matches_breakdown(tmp_path):
    kineto_synth.generate(str(tmp_path), ranks=2, steps=3, kernels=40, buckets=2, seed=4)
    _, rs, _ = _run(tmp_path)
    for r in rs:
        for s in r["steps"]:
            assert s["exposed_comm_ms"] <= s["comm_ms"] + 1e-9
            assert s["compute_ms"] + s["exposed_comm_ms"] + s["memcpy_ms"] + s["memset_ms"] + s["idle_ms"] == \
                pytest.approx(s["window_ms"], abs=1e-5)


def test_diff_finds_the_slower_phase_and_kernel(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    kineto_synth.generate(str(a), ranks=2, steps=3, kernels=40, seed=6)
    kineto_synth.generate(str(b), ranks=2, steps=3, kernels=40, seed=6, slow_rank=1, slow_factor=1.5)
    base = [analyse_rank(t, window="steps", top=None) for t in load_traces([str(a)])[0]]
    new = [analyse_rank(t, window="steps", top=None) for t in load_traces([str(b)])[0]]
    d = diff(base, new)
    comp = next(r for r in d["phases"] if r["name"] == "compute")
    assert comp["delta_ms"] > 0 and comp["delta_pct"] == pytest.approx(25, abs=8)  # one rank of two 1.5x
    assert d["kernels"][0]["delta_ms"] > 0


def test_cli_json_and_html(tmp_path):
    from traces.cli import trace_command

    kineto_synth.generate(str(tmp_path / "t"), ranks=3, steps=3, kernels=40, slow_rank=1, slow_factor=1.4, seed=7)
    html = tmp_path / "r.html"
    res = CliRunner().invoke(trace_command, [str(tmp_path / "t"), "--json", "--window", "steps", "--html", str(html)])
    assert res.exit_code == 1, res.output
    rep = json.loads(res.output)
    assert set(rep) >= {"verdict", "ranks", "findings", "notes"}
    assert "rank 1 is the straggler" in rep["verdict"]
    assert html.read_text().startswith("<!doctype html>")
    res = CliRunner().invoke(trace_command, [str(tmp_path / "t")])
    assert max(len(line) for line in res.output.splitlines()) <= 80
    res = CliRunner().invoke(trace_command, [str(tmp_path / "nothing")])
    assert res.exit_code == 10
