"""diagnose on real trainer runs: two recorded 4-rank CPU runs (replayed, fast) and one live run (torchrun).

The recorded runs (tests/fixtures/runs/) are the trainer's own output on this 2-core machine:
d_model 96, 3 layers, seq 48, 20 steps, 4 ranks (gloo, DDP); one with
``--inject slow_rank:rank=1,factor=2.0,start=6``, one clean.
"""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.diagnose import diagnose_command
from analyzers.report.model import EXIT_CRITICAL, EXIT_HEALTHY, EXIT_INCOMPLETE, EXIT_WARNING

FIXTURES = Path(__file__).parent / "fixtures" / "runs"


def diagnose_json(store, run_id, *extra):
    r = CliRunner().invoke(diagnose_command, [run_id, "--store", str(store), "--json", *extra])
    return r.exit_code, json.loads(r.output)


def check_slow_rank(code, obj, rank, start):
    assert code in (EXIT_WARNING, EXIT_CRITICAL), obj["verdict"]  # warning, or critical for a slow-down of 2x or more
    stragglers = [f for f in obj["findings"] if f["kind"] == "straggler" and f["severity"] != "info"]
    assert len(stragglers) == 1, obj["findings"]
    f = stragglers[0]
    # Under a busy suite (another test's processes on the same 2 cores) a second rank is sometimes measurably slower
    # for a few steps. diagnose may say so, but only as info, unconfirmed: its wall-clock arrival order does not
    # confirm it, so it accuses no one.
    for g in obj["findings"]:
        if g["kind"] == "straggler" and g is not f:
            assert g["severity"] == "info" and not g["evidence"]["arrival_corroborated"], g
    assert f["ranks"] == [rank]  # that rank and no other
    assert abs(f["step_start"] - start) <= 3
    assert f["evidence"]["ratio"] > 1.2
    # no other finding of warning or worse accuses another rank. A job-wide one (scope "world": every rank) accuses
    # none: under a busy suite the last arriver's all-reduce on this shared 2-core box really slows mid-run, and a
    # world comm_growth warning may stand beside the straggler
    for g in obj["findings"]:
        if g["severity"] != "info" and g["kind"] in ("straggler", "comm_bottleneck", "data_stall", "hang", "gpu_health") \
                and g["evidence"].get("scope") != "world":
            assert g["ranks"] == [rank], g
    assert obj["faults"][0]["found"]


def test_recorded_slow_rank_run():
    code, obj = diagnose_json(FIXTURES, "real-4rank-slow")
    check_slow_rank(code, obj, rank=1, start=6)


def test_recorded_clean_run():
    code, obj = diagnose_json(FIXTURES, "real-4rank-clean")
    assert code == 0, obj["findings"]
    assert all(f["severity"] == "info" for f in obj["findings"])


@pytest.mark.distributed
def test_live_4rank_slow_rank(tmp_path):
    from trainer_helpers import torchrun

    args = ["--d-model", "96", "--n-layers", "3", "--n-heads", "4", "--seq-len", "48", "--batch-size", "8", "--steps", "18",
            "--quiet", "--pg-timeout", "90", "--inject", "slow_rank:rank=2,factor=3.0,start=6"]
    res = torchrun(4, args, tmp_path, "live-slow", timeout=240)
    assert res.returncode == 0, res.stdout[-3000:]
    code, obj = diagnose_json(tmp_path, "live-slow")
    check_slow_rank(code, obj, rank=2, start=6)
    # the steps before the fault are a clean run: nothing worse than info, where they are clean in the data. On the
    # shared 2-core box a rank sometimes really is slower for the first steps (device time 1.4x its peers' for steps
    # 2-5 in one suite run, when other tests' processes were still exiting): naming it then is right, not a false
    # finding, so the assertion is about prefixes where no rank's device time stands out.
    from analyzers.loader import load_run

    st = load_run(tmp_path, "live-slow").steps
    dev = st[(st["step"] >= 2) & (st["step"] <= 5)].pivot_table(index="rank", columns="step", values="device_ms")
    worst = float((dev / dev.median()).median(axis=1).max())
    code, obj = diagnose_json(tmp_path, "live-slow", "--until", "5")
    if worst < 1.15:
        # (too few steps for some checks to judge: incomplete, not healthy)
        assert code in (EXIT_HEALTHY, EXIT_INCOMPLETE) and all(f["severity"] == "info" for f in obj["findings"]), (
            worst, obj["findings"])
    else:
        assert [f["ranks"] for f in obj["findings"] if f["severity"] != "info"] in ([], [[int((dev / dev.median()).median(axis=1).idxmax())]])


def test_run_without_manifest_still_diagnosed(tmp_path):
    # agents never ran and run.json is missing: the spool alone names the culprit
    import shutil

    shutil.copytree(FIXTURES / "real-4rank-slow", tmp_path / "nomanifest")
    (tmp_path / "nomanifest" / "run.json").unlink()
    code, obj = diagnose_json(tmp_path, "nomanifest")
    assert code == EXIT_WARNING and obj["faults"] == [] and obj["peak"].startswith("no peak FLOPs")
    assert [f["ranks"] for f in obj["findings"] if f["kind"] == "straggler"] == [[1]]
