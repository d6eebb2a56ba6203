"""The overhead benchmark's run-time switch (trainer.overhead_toggle.OverheadToggle, bench/overhead.py) and the
cheaper per-step instrumentation: simulated GPU state written at most once a second, RSS from /proc."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil
import torch

from ranksight.layout import RunDir
from ranksight.simgpu import THROTTLE_HW_THERMAL, read_state
from trainer.faults import FaultState, parse_fault
from ranksight.instrument.memory import MemoryProbe
from trainer.overhead_toggle import OverheadToggle
from ranksight.instrument.recorder import Recorder
from trainer.simdevice import SimulatedGpu

from trainer_helpers import TINY, check_ok, collectives, spool, steps, torchrun


def test_toggle_is_off_unless_the_environment_asks(monkeypatch):
    monkeypatch.delenv("RANKSIGHT_OVERHEAD_BLOCK", raising=False)
    assert OverheadToggle.from_env(0, 0) is None
    monkeypatch.setenv("RANKSIGHT_OVERHEAD_BLOCK", "3")
    monkeypatch.setenv("RANKSIGHT_OVERHEAD_WARMUP", "2")
    monkeypatch.setenv("RANKSIGHT_OVERHEAD_PAUSE_PIDS", "11,12")
    t = OverheadToggle.from_env(1, 0)
    assert t.block == 3 and t.warmup == 2 and t.pause_pids == [11, 12]
    assert OverheadToggle.from_env(1, 1).pause_pids == []  # only local rank 0 signals


def test_toggle_schedule_is_abba_after_warmup():
    t = OverheadToggle(2, 3, None, [], 0, 0)
    on = "".join("1" if t.is_on(s) else "0" for s in range(1, 3 + 16 + 1))
    # warm-up 111; then pairs of 2-step blocks: ON OFF | OFF ON | ON OFF | OFF ON
    assert on == "111" + "1100" + "0011" + "1100" + "0011"


def test_toggle_switches_the_recorder_pauses_pids_and_writes_rows(tmp_path):
    rec = Recorder("r", RunDir(tmp_path, "r").spool(0), 0, {"dp": [0, 1]})
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        t = OverheadToggle(1, 1, str(tmp_path / "out"), [child.pid], 0, 0)
        seen = []
        for step in range(1, 6):
            t.begin_step(step, rec)
            seen.append(rec.enabled)
            if not rec.enabled:
                deadline = time.monotonic() + 5
                while psutil.Process(child.pid).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert psutil.Process(child.pid).status() == psutil.STATUS_STOPPED
            # disabled: timed() only runs the collective, nothing is recorded
            assert rec.timed("all_reduce", "dp", lambda x: x + 1, 1) == 2
            assert len(rec.t.collectives) == (1 if rec.enabled else 0)
            rec.t.collectives.clear()
        t.finish(rec)
        assert seen == [True, True, False, False, True]  # warm-up, then ON OFF | OFF ON
        assert rec.enabled
        assert psutil.Process(child.pid).status() != psutil.STATUS_STOPPED  # resumed at the end
        d = json.loads((tmp_path / "out" / "toggle-rank-0.json").read_text())
        assert [r[0] for r in d["rows"]] == [1, 2, 3, 4, 5] and [r[1] for r in d["rows"]] == [1, 1, 0, 0, 1]
        assert all(r[2] >= 0 and r[3] >= 0 for r in d["rows"])
    finally:
        child.send_signal(signal.SIGCONT)
        child.kill()
        child.wait()


DDP_HOOK_CHECK = r"""
import os, sys, torch, torch.distributed as dist
from ranksight.instrument.ddp import make_ddp_comm_hook
from ranksight.instrument.recorder import Recorder
from ranksight.layout import RunDir
tmp = sys.argv[1]
dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "pg"), rank=0, world_size=1)
rec = Recorder("r", RunDir(tmp, "r").spool(0), 0, {"dp": [0]})
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
model.register_comm_hook(None, make_ddp_comm_hook(rec))
x = torch.ones(3, 4)
grads = []
for enabled in (True, False):
    rec.enabled = enabled
    rec.begin_step(1)
    model.zero_grad()
    model(x).sum().backward()
    grads.append(model.module.weight.grad.clone())
    n = len(rec.t.collectives)
    ok = (n >= 1 and all(c.t_done is not None for c in rec.t.collectives)) if enabled else n == 0
    print("recorded", enabled, n, ok, flush=True)
print("same_grads", torch.equal(grads[0], grads[1]), flush=True)
# no teardown: freeing the DDP reducer while gloo's worker thread still releases the hook's Python callback can
# deadlock on the GIL (a torch issue of any Python comm hook, allreduce_hook included); the check is done
os._exit(0)
"""


def test_ddp_comm_hook_is_the_plain_allreduce_when_disabled(tmp_path):
    """A 1-rank gloo group (in its own process): the DDP hook records a bucket when enabled, nothing when
    disabled, and the gradients are the same either way."""
    res = subprocess.run([sys.executable, "-c", DDP_HOOK_CHECK, str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.split("\n")
    assert "recorded True" in res.stdout and all(ln.endswith("True") for ln in lines if ln.startswith("recorded")), res.stdout
    assert "same_grads True" in res.stdout


def test_simulated_gpu_writes_at_most_once_a_second_but_faults_at_once(tmp_path):
    run = RunDir(tmp_path, "r")
    g = SimulatedGpu(run, 0, 0, 0, min_interval_s=3600.0)
    g.update(100.0, 80.0, 1000, None)  # the first update is written (by the writer thread: wait for it)
    assert g.file.wait()
    assert g.writes == 1 and read_state(run.simgpu_node_dir(0), 0).util_gpu == 80
    g.update(100.0, 20.0, 2000, None)
    g.update(100.0, 20.0, 3000, None)
    assert g.writes == 1  # rate-limited
    faults = FaultState([parse_fault("throttle:rank=0,factor=2,start=5")], rank=0, node=0)
    faults.set_step(5)
    g.update(100.0, 20.0, 4000, faults)  # the throttle starts: written at once
    assert g.file.wait()
    st = read_state(run.simgpu_node_dir(0), 0)
    assert g.writes == 2 and st.throttle_reasons & THROTTLE_HW_THERMAL and st.sm_clock_mhz == st.max_sm_clock_mhz // 2
    assert st.util_gpu == 20 and st.mem_used == 4000  # utilization over every step since the last write
    g.update(100.0, 60.0, 5000, faults)
    assert g.writes == 2
    g.flush()
    st = read_state(run.simgpu_node_dir(0), 0)
    assert g.writes == 3 and st.util_gpu == 60 and st.mem_used == 5000 and st.temp_c == 91
    g.flush()
    assert g.writes == 3  # nothing pending


def test_memory_probe_reads_the_rss():
    m = MemoryProbe(torch.device("cpu"))
    rss = psutil.Process().memory_info().rss
    assert abs(m.sample() - rss) < 64 * 1024 * 1024


def test_toggled_run_writes_step_records_only_for_on_steps(tmp_path):
    """Two ranks under torchrun with the switch on: every rank agrees on the blocks, OFF steps leave no
    step record, the per-step timings are written; with --no-instrument the switch is refused."""
    out = tmp_path / "toggle"
    env = {"RANKSIGHT_OVERHEAD_BLOCK": "2", "RANKSIGHT_OVERHEAD_WARMUP": "1", "RANKSIGHT_OVERHEAD_OUT": str(out)}
    res = torchrun(2, TINY + ["--steps", "9"], tmp_path, "tog", timeout=180, env=env)
    check_ok(res)
    sp = spool(tmp_path, "tog")
    for rank in (0, 1):
        assert sorted(steps(sp[rank])) == [1, 2, 3, 8, 9]  # warm-up 1; ON 2-3, OFF 4-5, OFF 6-7, ON 8-9
        assert {c.step for c in collectives(sp[rank])} == {1, 2, 3, 8, 9}  # no collective timing in OFF steps
        d = json.loads((out / f"toggle-rank-{rank}.json").read_text())
        assert [(r[0], r[1]) for r in d["rows"]] == [(s, int(s in (1, 2, 3, 8, 9))) for s in range(1, 10)]
    assert read_state(RunDir(tmp_path, "tog").simgpu_node_dir(0), 0) is not None
    res = torchrun(2, TINY + ["--steps", "2", "--no-instrument"], tmp_path, "tog2", timeout=120, env=env)
    assert res.returncode != 0 and "RANKSIGHT_OVERHEAD_BLOCK needs the instrumentation" in res.stdout
