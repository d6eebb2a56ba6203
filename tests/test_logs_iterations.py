"""logs.readers.iterations: each format's lines, rank copies grouped, and the conclusions with their numbers (steady,
warm-up not a slowdown, a 25 % slowdown from iteration 300, an MFU dip that recovers, NaN, fp16 skips and collapse);
fuzzing."""

from __future__ import annotations

import os

import pandas as pd
from hypothesis import given, strategies as st

from logs import analyze
from logs.inputs import InputFile
from logs.readers import iterations as I
from fuzz_settings import cut_and_mutate, fuzz_settings

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "logs", "iterations")


def _mine(name, kind=None):
    r = analyze([os.path.join(FIX, name)])
    assert not r.errors
    return [f for f in r.findings if f.analyzer == "logs.iterations" and (kind is None or f.kind == kind)], r


def _read(name):
    return I.read(InputFile(name, open(os.path.join(FIX, name), "rb").read()))


def test_megatron_fields():
    r = _read("megatron_steady.log")
    assert len(r.events) == 100 and len(r.claimed_lines) == 100
    e = r.events[5]
    assert (e["step"], e["total"], e["line"]) == (60, 1000, 7)
    assert e["tflops"] > 170 and 1480 < e["iter_ms"] < 1520 and e["loss_scale"] == 131072.0
    assert e["loss_key"] == "lm loss" and e["skipped"] == 0 and e["nan_iters"] == 0


def test_megatron_steady_with_warmup_and_loss_scale_calibration():
    fs, rep = _mine("megatron_steady.log")
    assert [f.severity for f in fs] == ["info", "info"]
    steady = next(f for f in fs if f.kind == "slowdown")
    assert steady.summary.startswith("steady: iterations 20-1000") and 1490 < steady.evidence["median_iter_ms"] < 1510
    assert steady.evidence["warmup"] == ["warm-up: iterations 10-40 slower, not judged"]
    cal = next(f for f in fs if f.kind == "fp16_overflow")
    assert cal.evidence["calibration_skipped"] == 5 and cal.evidence["calibration_until_iteration"] == 20
    assert cal.evidence["skipped_after"] == 0 and "benign" in cal.summary
    assert rep.inputs[0].unknown_lines == 1


def test_megatron_slowdown_25pct_from_300_not_recovered():
    (f,), _ = _mine("megatron_slowdown.log")
    assert f.kind == "slowdown" and f.severity == "warning" and f.step_start == 300 and f.step_end == 1000
    ev = f.evidence
    assert 24 <= ev["slower_pct"] <= 27 and ev["recovered"] is False and ev["onset_line"].endswith(":31")
    assert 178 < ev["tflops_before"] < 183 and 142 < ev["tflops_during"] < 146
    assert "25% slower from iteration 300" in f.summary


def test_torchtitan_mfu_dip_recovers_rank_copies_grouped():
    (f,), rep = _mine("torchtitan_dip.log")
    assert f.kind == "mfu_drop" and f.severity == "warning" and f.ranks == [0, 1, 2, 3]
    ev = f.evidence
    assert ev["metric"] == "mfu" and 28 <= ev["drop_pct"] <= 32 and ev["onset_iteration"] == 300
    assert ev["last_low_iteration"] == 390 and ev["recovered"] and ev["recovered_at_iteration"] == 400
    assert ev["rank_copies"] == 4
    assert rep.inputs[0].unknown_lines == 0 and rep.inputs[0].formats == {"iterations": 241}  # validate: claimed
    assert len(_read("torchtitan_dip.log").events) == 240  # ... but not an iteration


def test_torchtitan_colour_codes_parsed():
    e = _read("torchtitan_dip.log").events[0]
    assert (e["step"], e["rank"], e["tps"], e["mfu"], e["grad_norm"]) == (10, 0, 3600.0, 20.0, 1.1)


def test_torchtitan_old_format_nan():
    fs, _ = _mine("torchtitan_old_nocolor_nan.log", "nan")
    (f,) = fs
    assert f.severity == "critical" and (f.step_start, f.step_end) == (420, 600)
    assert f.evidence["last_finite_iteration"] == 410 and f.evidence["points"] == 19


def test_megatron_nan_iterations_counted():
    (f,), _ = _mine("megatron_nan.log", "nan")
    assert f.step_start == 700 and f.evidence["nan_iterations_counted"] == 1 and "1 NaN iteration" in f.summary


def test_megatron_loss_scale_collapse():
    (f,), _ = _mine("megatron_collapse.log", "fp16_overflow")
    assert f.severity == "critical" and f.evidence["loss_scale_min_after"] == 1.0
    assert f.evidence["halvings_from_peak"] == 16 and f.evidence["skipped_after"] == 40 and f.step_start == 600


def test_deepspeed_skips_after_warmup_warn():
    (f,), _ = _mine("deepspeed_skips.log", "fp16_overflow")
    assert f.severity == "warning" and f.evidence["calibration_skipped"] == 4
    assert f.evidence["skipped_after"] == 51 and f.evidence["iterations_after"] == 990 and f.step_start == 500


def test_fairseq_simple_two_ranks_steady():
    (f,), rep = _mine("fairseq_simple.log")
    assert f.severity == "info" and f.ranks == [0, 1] and f.evidence["rank_copies"] == 2
    assert abs(f.evidence["median_iter_ms"] - 312.5) < 3 and rep.inputs[0].formats == {"iterations": 60}


def test_fairseq_json_lines():
    line = ('2024-05-01 | INFO | train_inner | {"epoch": 1, "update": 0.01, "loss": "nan", "wps": "100", "ups": "2.00",'
            ' "num_updates": "7", "loss_scale": "16"}\n').encode()
    (e,) = I.read(InputFile("j", line)).events
    assert (e["step"], e["iter_ms"], e["loss_scale"], e["loss_nonfinite"]) == (7, 500.0, 16.0, True)


def test_hf_trainer_tqdm_on_the_same_line():
    r = _read("hf_trainer.log")
    assert len(r.events) == 20 and r.events[1]["step"] == 100 and r.events[1]["iter_ms"] == 250.0
    assert r.summary["hf_final"][0]["train_runtime"] == 250.1
    (f,), _ = _mine("hf_trainer.log")
    assert f.severity == "info" and f.evidence["median_iter_ms"] == 250.0


def test_dips_rule_numbers():
    y = pd.Series([100.0] * 20 + [70.0] * 6 + [100.0] * 10, index=range(0, 360, 10))
    (d,) = I.dips(y)
    assert (d["onset"], d["end"], d["recovered_at"]) == (200, 250, 260) and abs(d["drop"] - 0.3) < 1e-9


FIXTURE_BYTES = [open(os.path.join(FIX, n), "rb").read() for n in sorted(os.listdir(FIX)) if n.endswith(".log")]


@fuzz_settings(150)
@given(st.binary(max_size=2000))
def test_fuzz_random_bytes(data):
    if I.sniff(data):
        r = I.read(InputFile("f", data))
        I.conclude([r])
        I.summarize([r])


@fuzz_settings(60)
@given(st.integers(0, len(FIXTURE_BYTES) - 1), st.integers(0, 2**32), st.lists(st.tuples(st.integers(0, 10**6),
       st.binary(max_size=8)), max_size=6))
def test_fuzz_cut_and_mutated_fixtures(i, seed, muts):
    r = I.read(InputFile("f", cut_and_mutate(FIXTURE_BYTES[i], seed, muts)))
    for f in I.conclude([r]):
        assert f.severity in ("info", "warning", "critical")
    I.summarize([r])
