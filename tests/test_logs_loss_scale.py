"""logs.readers.loss_scale: each format's messages and the conclusions (warm-up calibration, late overflow run,
collapse to the minimum scale, Megatron NaN checks grouped with rank/node/device/iteration); fuzzing."""

from __future__ import annotations

import os

from hypothesis import given, strategies as st

from logs import analyze
from logs.inputs import InputFile
from logs.readers import loss_scale as L
from fuzz_settings import cut_and_mutate, fuzz_settings

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "logs", "loss_scale")


def _fx(name: str) -> str:
    return os.path.join(FIX, name)


def _mine(paths, kind=None):
    r = analyze([_fx(p) for p in paths])
    assert not r.errors
    return [f for f in r.findings if f.analyzer == "logs.loss_scale" and (kind is None or f.kind == kind)]


def test_deepspeed_warmup_with_hysteresis_is_benign_info():
    (f,) = _mine(["deepspeed_warmup.log"])
    assert f.kind == "fp16_overflow" and f.severity == "info" and "benign" in f.summary
    ev = f.evidence
    assert ev["cause"] == "calibration" and ev["calibration_overflows"] == 5 and ev["hysteresis_absorbed"] == 1
    assert ev["scale_start"] == "65536" and ev["scale_settled"] == "4096" and ev["late_overflows"] == 1
    assert ev["last_iteration"] == 1000  # the late overflow placed after DeepSpeed's step=1000 line
    assert f.ranks == [0]


def test_deepspeed_message_fields():
    data = open(_fx("deepspeed_warmup.log"), "rb").read()
    r = L.read(InputFile("x", data))
    ovf = [e for e in r.events if e["kind"] == "overflow"]
    assert len(ovf) == 6 and ovf[0]["hysteresis"] == 2 and ovf[0]["scale"] == 65536
    assert (ovf[1]["attempted"], ovf[1]["scale"], ovf[1]["line"]) == (65536, 32768, 3)
    assert len(r.claimed_lines) == 6


def test_fairseq_collapse_to_min_scale_is_critical():
    (f,) = _mine(["fairseq_collapse.log"])
    assert f.kind == "fp16_overflow" and f.severity == "critical"
    ev = f.evidence
    assert ev["cause"] == "loss_scale_collapse" and ev["overflows"] == 22 and ev["calibration_overflows"] == 2
    assert ev["scale_min"] == "0.0001" and ev["min_scale_message"].endswith("fairseq_collapse.log:75")
    assert ev["halvings_from_peak_after_calibration"] == 19 and f.step_start == 5000
    assert ev["trajectory"][0] == [None, 64.0] and len(ev["trajectory"]) == 23  # 22 overflows and the min-scale message


def test_apex_copies_on_every_rank_grouped_and_late_run_warns():
    (f,) = _mine(["apex_ranks.log"])
    assert f.severity == "warning" and f.ranks == [0, 1, 2, 3] and f.evidence["rank_copies"] == 4
    ev = f.evidence
    assert ev["calibration_overflows"] == 3 and ev["late_overflows"] == 5
    assert ev["longest_halving_run_after_calibration"] == 4 and ev["scale_final"] == "1024"


def test_megatron_nan_rank_node_device_iteration():
    (f,) = _mine(["megatron_nan.log"], "nan")
    assert f.severity == "critical" and f.ranks == [5] and f.hosts == ["host-b"] and f.gpus == ["host-b:1"]
    assert f.step_start == f.step_end == 1201
    assert "found NaN in local grad norm for bucket #N" in f.evidence["message"]
    assert f.evidence["reports"][0]["value"] == "nan" and f.evidence["first_line"].endswith("megatron_nan.log:14")
    assert "rank 5 (node host-b, device 1)" in f.summary


def test_megatron_nan_across_files_old_and_new_formats():
    fs = _mine(["megatron_nan.log", "megatron_nan_old.log"], "nan")
    assert sorted(r for f in fs for r in f.ranks) == [5, 13]
    old = next(f for f in fs if f.ranks == [13])
    assert old.hosts == ["host-c"] and old.gpus == ["host-c:5"] and old.step_start is None


def test_nan_on_many_ranks_is_one_finding_with_the_rerun_verdict():
    lines = [f"[rank{r}]: Rank {r}, node host-{r // 8}, device {r % 8}, iteration #{300 + r % 2}: Unexpected result nan "
             f"(message='found NaN in local forward loss calculation')" for r in (3, 11, 12)]
    lines.append("[rank3]: Rank 3, node host-0, device 3, iteration #300: Possible transient error!")
    p = os.path.join(os.environ.get("TMPDIR", "/tmp"), "ls_many_ranks.log")
    with open(p, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    r = analyze([p])
    (f,) = [f for f in r.findings if f.kind == "nan"]
    assert f.ranks == [3, 11, 12] and f.hosts == ["host-0", "host-1"] and f.evidence["count"] == 3
    assert (f.step_start, f.step_end) == (300, 301) and f.evidence["rerun_verdicts"][0]["rank"] == 3


def test_isolated_overflows_after_growth_are_benign():
    msgs = ["Increasing dynamic loss scale from 1024 to 2048", "Grad overflow on iteration 2500",
            "Reducing dynamic loss scale from 2048 to 1024"] * 3
    r = L.read(InputFile("y", ("\n".join(msgs) + "\n").encode()))
    (f,) = L.conclude([r])
    assert f.severity == "info" and f.evidence["overflows"] == 3 and f.evidence["first_iteration"] == 2500


def test_static_junk_and_binary_are_nothing():
    assert L.read(InputFile("z", b"\x00\xff loss scale \x1b[31m OVERFLOW\n")).events == []
    assert L.conclude([L.read(InputFile("z", b""))]) == []


FIXTURE_BYTES = [open(_fx(n), "rb").read() for n in sorted(os.listdir(FIX)) if n.endswith(".log")]


@fuzz_settings(150)
@given(st.binary(max_size=2000))
def test_fuzz_random_bytes(data):
    if L.sniff(data):
        r = L.read(InputFile("f", data))
        L.conclude([r])
        L.summarize([r])


@fuzz_settings(120)
@given(st.integers(0, len(FIXTURE_BYTES) - 1), st.integers(0, 2**32), st.lists(st.tuples(st.integers(0, 10**6),
       st.binary(max_size=8)), max_size=6))
def test_fuzz_cut_and_mutated_fixtures(i, seed, muts):
    r = L.read(InputFile("f", cut_and_mutate(FIXTURE_BYTES[i], seed, muts)))
    for f in L.conclude([r]):
        assert f.severity in ("info", "warning", "critical")
