"""fp16: loss-scale collapse, calibration at the start, NaN losses."""

from analyzer_fixtures import build

from analyzers.builder import build_frame
from analyzers.checks import fp16


def test_loss_scale_collapse_is_critical():
    data = build(fp16=True, overflow=lambda r, s: s >= 15)
    (f,) = fp16.analyze(build_frame(data))
    assert f.kind == "fp16_overflow" and f.severity == "critical"
    assert f.step_start == 15 and f.step_end == 29
    ev = f.evidence
    assert ev["cause"] == "loss_scale_collapse"
    assert ev["scale_peak"] == 65536.0 and ev["scale_min"] == 2.0 and ev["halvings_from_peak"] == 15
    assert ev["detected_at_step"] == 17
    assert "bf16" in f.recommendation


def test_short_overflow_run_is_a_warning():
    data = build(fp16=True, overflow=lambda r, s: 10 <= s <= 13)
    (f,) = fp16.analyze(build_frame(data))
    assert f.severity == "warning" and f.evidence["overflow_steps"] == 4 and f.step_start == 10


def test_calibration_at_start_is_ignored():
    # GradScaler starts at 65536 and halves a few times before the first clean step: normal
    data = build(fp16=True, overflow=lambda r, s: s < 4)
    assert fp16.analyze(build_frame(data)) == []


def test_isolated_overflows_are_not_a_finding():
    data = build(fp16=True, steps=60, overflow=lambda r, s: s in (20, 50))
    assert fp16.analyze(build_frame(data)) == []


def test_frequent_isolated_overflows_raise_the_skip_rate():
    data = build(fp16=True, steps=64, overflow=lambda r, s: s % 8 == 7)
    (f,) = fp16.analyze(build_frame(data))
    assert f.severity == "warning" and f.evidence["cause"] == "skip_rate"
    assert f.evidence["skipped_steps"] == 8 and abs(f.evidence["skipped_rate"] - 0.125) < 0.001


def test_nonfinite_loss_on_one_rank():
    data = build(nonfinite=lambda r, s: r == 2 and s >= 20)
    (f,) = fp16.analyze(build_frame(data))
    assert f.severity == "critical" and f.ranks == [2] and f.step_start == 20
    assert f.evidence["cause"] == "nonfinite_loss" and f.evidence["nonfinite_steps"] == 10


def test_bf16_run_without_scale_is_clean():
    assert fp16.analyze(build_frame(build())) == []


def test_steps_skipped_for_a_nan_loss_are_not_also_overflow():
    # fp32 run: the trainer skips the optimizer step when the loss is NaN; one finding, the non-finite one
    data = build(nonfinite=lambda r, s: r == 2 and s >= 10)
    data.steps.loc[data.steps["step"] >= 10, "skipped"] = True
    (f,) = fp16.analyze(build_frame(data))
    assert f.evidence["cause"] == "nonfinite_loss" and f.ranks == [2]


def test_a_run_without_overflow_records_skips_the_per_step_pass_with_the_same_findings():
    # no overflow or skipped record at all: analyze returns before the per-step pass; the same run with one skipped
    # record on a step whose loss is non-finite (not an overflow: the pass finds nothing more) goes through it
    for nonfinite in (lambda r, s: False, lambda r, s: r == 1 and s >= 12):
        data = build(fp16=True, nonfinite=nonfinite)
        short = fp16.analyze(build_frame(data))
        forced = build(fp16=True, nonfinite=lambda r, s: nonfinite(r, s) or (r == 3 and s == 25))
        forced.steps.loc[(forced.steps["rank"] == 3) & (forced.steps["step"] == 25), "skipped"] = True
        through = [f for f in fp16.analyze(build_frame(forced))]
        assert not data.steps["overflow"].any() and not data.steps["skipped"].any()
        assert [(f.kind, f.ranks, f.step_start) for f in short] == [
            (f.kind, [r for r in f.ranks if r != 3], f.step_start) for f in through if f.ranks != [3]]
