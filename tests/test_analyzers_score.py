"""Scoring findings against injected ground truth."""

from analyzer_fixtures import build

from analyzers import run_all
from analyzers.score import score
from ranksight.schema import FaultSpec, Finding

RN = {0: 0, 1: 0, 2: 1, 3: 1}


def f(kind, ranks, start, severity="warning", detected=None, nodes=None):
    ev = {"detected_at_step": detected} if detected is not None else {}
    return Finding(analyzer="x", kind=kind, severity=severity, ranks=ranks, nodes=nodes or sorted({RN[r] for r in ranks}),
                   step_start=start, step_end=start + 10, evidence=ev, summary=f"{kind} {ranks}")


def test_precision_recall_latency():
    faults = [FaultSpec(kind="slow_rank", rank=1, factor=1.5, start=5), FaultSpec(kind="data_stall", rank=3, delay_ms=100, start=10)]
    found = [f("straggler", [1], 5, detected=7), f("mfu_drop", [1], 5), f("straggler", [2], 6)]
    s = score(found, faults, RN)
    assert s.recall == 0.5  # the data stall was missed
    assert s.true_positives == 2 and s.false_positives == 1  # rank 2 is a wrong accusation; the MFU drop is a consequence
    assert abs(s.precision - 2 / 3) < 1e-9
    assert s.latencies == [2] and s.median_latency == 2
    assert s.faults[0].detected and s.faults[0].onset_error_steps == 0
    assert not s.faults[1].detected


def test_naming_a_victim_too_is_not_a_match():
    faults = [FaultSpec(kind="slow_rank", rank=1, start=0)]
    s = score([f("straggler", [0, 1], 0)], faults, RN)
    assert s.recall == 0.0 and s.precision == 0.0


def test_node_fault_and_time_overlap():
    faults = [FaultSpec(kind="xid", node=1, code=79, start=20, end=25)]
    assert score([f("gpu_health", [2], 21, severity="critical")], faults, RN).recall == 1.0
    assert score([f("gpu_health", [2], 2, severity="critical")], faults, RN).recall == 0.0  # steps 2-12: before the fault
    assert score([f("gpu_health", [0], 21, severity="critical")], faults, RN).recall == 0.0  # wrong node


def test_info_findings_ignored_and_clean_run_precision():
    assert score([f("comm_bottleneck", [0, 1, 2, 3], 0, severity="info")], [], RN).precision == 1.0
    s = score([f("straggler", [1], 3)], [], RN)
    assert s.precision == 0.0 and s.recall is None and s.false_positives == 1


def test_end_to_end_on_a_synthetic_run():
    data = build(world=4, nodes=2, compute_factor=lambda r, s: 1.3 if (r == 2 and s >= 8) else 1.0,
                 faults=[FaultSpec(kind="slow_rank", rank=2, factor=1.3, start=8)])
    s = score(run_all(data), data.manifest.faults, manifest=data.manifest)
    assert s.recall == 1.0 and s.precision == 1.0 and s.median_latency == 2
