"""Checkpoint -> crash -> resume reproduces the loss curve exactly (FSDP2, DCP), and a resume at
a smaller dp degree (the shape an eviction leaves) continues the same trajectory."""

from __future__ import annotations

import shutil

import pytest

from ranksight.layout import RunDir
from trainer_helpers import TINY, check_ok, events, manifest, mean, reference_losses, spool, steps, torchrun

pytestmark = pytest.mark.distributed

N = 7
ARGS = TINY + ["--steps", str(N), "--dp-mode", "fsdp", "--checkpoint-every", "3"]


def test_checkpoint_crash_resume_and_smaller_dp(tmp_path):
    # 1) the run crashes (every rank exits abruptly) after step 5; checkpoints/latest names step-3
    res = torchrun(2, ARGS + ["--crash-after-step", "5"], tmp_path, "crash")
    assert res.returncode != 0
    run = RunDir(tmp_path, "crash")
    assert (run.checkpoints_dir / "latest").read_text().strip() == "step-3"
    before = {r: steps(v) for r, v in spool(tmp_path, "crash").items()}
    assert sorted(before[0]) == [1, 2, 3, 4, 5]
    # an incomplete later checkpoint directory (a crash mid-save) must not be used
    (run.checkpoints_dir / "step-4").mkdir()
    shutil.copytree(run.root, tmp_path / "crash-dp1")

    # 2) resume at the same world size: steps 4 and 5 are recomputed bit-identically
    #    (weights, AdamW moments, scaler, data position and RNG all restored), then it finishes
    check_ok(torchrun(2, ARGS, tmp_path, "crash"))
    sp = spool(tmp_path, "crash")
    ref, _ = reference_losses(N, batch=8)
    for r in (0, 1):
        st = steps(sp[r])  # steps 4-5 appear twice in the spool; the dict keeps the resumed ones
        resumed = events(sp[r], "resume")
        assert len(resumed) == 1 and resumed[0].detail["step"] == 3 and resumed[0].detail["rng_restored"] is True
        for k in (4, 5):
            assert st[k].loss == before[r][k].loss and st[k].grad_norm == before[r][k].grad_norm, (r, k)
        assert sorted(st) == list(range(1, N + 1))
    for k in range(1, N + 1):  # and the whole curve is the uninterrupted one
        assert abs(mean(steps(sp[r])[k].loss for r in (0, 1)) - ref[k - 1]) < 2e-4, k
    m = manifest(tmp_path, "crash")
    assert [a["resumed_step"] for a in m["attempts"]] == [None, 3]

    # 3) resume the copy with dp=1 and the same global batch: DCP reshards the FSDP2 state,
    #    the data position continues, and the loss follows the dp=2 run's global loss
    small = ARGS[:]
    small[small.index("--batch-size") + 1] = "8"
    check_ok(torchrun(1, small, tmp_path, "crash-dp1"))
    sp1 = spool(tmp_path, "crash-dp1")
    st1 = steps(sp1[0])
    ev = events(sp1[0], "resume")[-1]
    assert ev.detail["saved_world_size"] == 2 and ev.detail["world_size"] == 1
    assert ev.detail["rng_restored"] is False and ev.detail["data_position"] == 3 * 8
    for k in range(4, N + 1):
        global_loss = mean(steps(sp[r])[k].loss for r in (0, 1))
        assert abs(st1[k].loss - global_loss) < 1e-4, (k, st1[k].loss, global_loss)
        assert st1[k].world_size == 1
