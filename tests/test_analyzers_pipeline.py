"""Pipeline bubbles against the schedule's theory."""

import pytest
from analyzer_fixtures import build

from analyzers.builder import build_frame
from analyzers.checks import pipeline
from analyzers.checks.pipeline import microbatches_for, theory_bubble


def test_theory_numbers():
    assert theory_bubble(4, 8, "1f1b") == pytest.approx(3 / 11)
    assert theory_bubble(4, 8, "gpipe") == pytest.approx(3 / 11)
    assert theory_bubble(4, 8, "interleaved_1f1b", v=2) == pytest.approx(3 / 19)
    assert theory_bubble(4, 8, "1f1b", v=2) == pytest.approx(3 / 11)  # virtual stages only count when interleaved
    assert theory_bubble(2, 1) == pytest.approx(0.5)
    assert theory_bubble(1, 8) == 0.0
    # smallest M under 10 %: (P-1)(1-t)/(t V) -> P=4: 27; P=2: 9; interleaved V=2, P=4: 14
    assert microbatches_for(4, 0.10) == 27 and theory_bubble(4, 27) <= 0.10 < theory_bubble(4, 26)
    assert microbatches_for(2, 0.10) == 9
    assert microbatches_for(4, 0.10, "interleaved", v=2) == 14


def test_too_few_microbatches():
    data = build(world=4, pp=2, microbatches=1)
    (f,) = pipeline.analyze(build_frame(data))
    assert f.kind == "pipeline_bubble" and f.severity == "critical"
    ev = f.evidence
    assert ev["cause"] == "too_few_microbatches"
    assert ev["theory_bubble"] == 0.5 and abs(ev["measured_bubble"] - 0.5) < 0.02
    assert ev["microbatches_for_target"] == 9
    assert "M >= 9" in f.recommendation
    assert f.summary.endswith("too few micro-batches; M >= 9 would bring it under 10%")


def test_few_microbatches_m_equals_p_is_a_warning():
    # the benchmark's few_microbatches fault: M = P = 2, theory (P-1)/(M+P-1) = 1/3
    (f,) = pipeline.analyze(build_frame(build(world=4, pp=2, microbatches=2)))
    assert f.severity == "warning" and f.evidence["cause"] == "too_few_microbatches"
    assert abs(f.evidence["theory_bubble"] - 0.333) < 0.001 and f.evidence["microbatches_for_target"] == 9
    assert f.ranks == [0, 1, 2, 3] and "M >= 9" in f.summary


def test_enough_microbatches_is_info_only():
    fs = pipeline.analyze(build_frame(build(world=4, pp=2, microbatches=8)))
    assert [f.severity for f in fs] == ["info"]
    assert abs(fs[0].evidence["measured_bubble"] - 1 / 9) < 0.02


def test_imbalanced_stage_is_the_cause():
    # stage 1 computes 1.6x stage 0: stage 0 waits far beyond theory (M=8: 11 %)
    data = build(world=4, pp=2, microbatches=8, stage_compute_ms=[100.0, 160.0])
    (f,) = pipeline.analyze(build_frame(data))
    assert f.severity == "warning" and f.evidence["cause"] == "imbalanced_stage"
    assert f.evidence["slowest_stage"] == 1 and f.ranks == [2, 3]
    assert f.evidence["excess"] >= 0.10
    assert abs(f.evidence["imbalance_ratio"] - 1.6) < 0.05  # against the other stage


def test_no_pipeline_no_finding():
    assert pipeline.analyze(build_frame(build(world=4, pp=1))) == []
