"""Checkpoint -> crash -> resume reproduces the uninterrupted loss curve (FSDP2, DCP), and a
resume at a smaller dp degree (the shape an eviction leaves) continues the same trajectory."""

from __future__ import annotations

import shutil

import pytest

from ranksight.layout import RunDir
from trainer_helpers import TINY, check_ok, events, manifest, mean, spool, steps, torchrun

pytestmark = pytest.mark.distributed

N = 7
ARGS = TINY + ["--steps", str(N), "--dp-mode", "fsdp", "--checkpoint-every", "3"]


def test_checkpoint_crash_resume_and_smaller_dp(tmp_path):
    # 1) the uninterrupted run
    check_ok(torchrun(2, ARGS, tmp_path, "full"))
    full = {r: steps(v) for r, v in spool(tmp_path, "full").items()}
    assert sorted(full[0]) == list(range(1, N + 1))

    # 2) the same run, crashing after step 4: checkpoints/latest names step-3
    res = torchrun(2, ARGS + ["--crash-after-step", "4"], tmp_path, "crash")
    assert res.returncode != 0
    run = RunDir(tmp_path, "crash")
    assert (run.checkpoints_dir / "latest").read_text().strip() == "step-3"
    # an incomplete later checkpoint directory (a crash mid-save) must not be used
    (run.checkpoints_dir / "step-4").mkdir()
    shutil.copytree(run.root, tmp_path / "crash-dp1")

    # 3) resume at the same world size: bit-identical to the uninterrupted run
    check_ok(torchrun(2, ARGS, tmp_path, "crash"))
    sp = spool(tmp_path, "crash")
    for r in (0, 1):
        st = steps(sp[r])  # steps 4 appear twice in the spool (before and after the crash); keep the last
        resumed = events(sp[r], "resume")
        assert len(resumed) == 1 and resumed[0].detail["step"] == 3 and resumed[0].detail["rng_restored"] is True
        for k in range(4, N + 1):
            assert st[k].loss == full[r][k].loss, (r, k, st[k].loss, full[r][k].loss)
            assert st[k].attempt == 0
    m = manifest(tmp_path, "crash")
    assert [a["resumed_step"] for a in m["attempts"]] == [None, 3]

    # 4) resume the copy with dp=1 and the same global batch: DCP reshards the FSDP2 state,
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
        global_loss = mean([full[0][k].loss, full[1][k].loss])
        assert abs(st1[k].loss - global_loss) < 1e-4, (k, st1[k].loss, global_loss)
        assert st1[k].world_size == 1
