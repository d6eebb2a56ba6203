"""The cheaper per-step instrumentation (bench/recorder_cost.py) writes exactly what it wrote before:
the same spool bytes, the same step summary, the same StepRecord fields, the same simulated GPU state."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from ranksight.layout import RunDir
from ranksight.schema import CollectiveRecord, EventRecord, StepRecord, decode_spool_line, encode
from ranksight.simgpu import read_state
from trainer.faults import FaultState, parse_fault
from ranksight.spool import SpoolWriter
from ranksight.instrument.memory import MemoryProbe
from ranksight.instrument.recorder import OpenCollective, Recorder, comm_summary
from ranksight.instrument.session import Session
from trainer.simdevice import SimulatedGpu

ROOT = Path(__file__).resolve().parent.parent


def _records():
    return [
        CollectiveRecord(run_id="r", rank=1, step=3, seq=7, op="all_reduce", group="dp", group_ranks=[0, 1],
                         nbytes=4096, t_arrive=1700000000.123456, t_done=1700000000.2, duration_ms=76.544),
        CollectiveRecord(run_id="r", rank=1, step=3, seq=8, op="recv", group="pp:0>1", group_ranks=[0, 1],
                         nbytes=16, t_arrive=1700000000.3, t_done=None, duration_ms=None, attempt=2),
        StepRecord(run_id="r", rank=1, step=3, node=0, host="h\u00e9", world_size=2, t_start=1.5, t_end=2.25,
                   step_ms=750.0, loss=None, loss_nonfinite=True, grad_norm=float("1e-300"), sync_wait_ms=None,
                   device_ms=0.1 + 0.2, mem_bytes=2**40, flops=1.2345678901234567e15),
        EventRecord(run_id="r", rank=1, step=3, t=3.0, event="overflow", detail={"a": [1, 2.5, None], "b": "x\n"}),
    ]


def test_spool_flush_writes_the_bytes_of_one_encode_per_record(tmp_path):
    """One encode_lines call per flush: byte for byte the lines of schema.encode, in order."""
    path = RunDir(tmp_path, "r").spool(1)
    w = SpoolWriter(path)
    recs = _records()
    for r in recs[:3]:
        w.add(r)
    w.flush()
    w.write_now(recs[3])
    w.flush()  # nothing pending: nothing written
    assert path.read_bytes() == b"".join(encode(r) + b"\n" for r in recs)
    assert [type(decode_spool_line(line)).__name__ for line in path.read_bytes().splitlines()] == [
        "CollectiveRecord", "CollectiveRecord", "StepRecord", "EventRecord"]


def _comm_summary_before(collectives, blocked_comm):
    """Recorder.comm_summary as it was before it became one pass (the reference)."""
    sync = [c for c in collectives if c.sync]
    exposed = blocked_comm
    sync_arrival = min(c.t_arrive for c in sync) if sync else None
    sync_wait = None
    if sync:
        async_sync = [c for c in sync if c.async_bucket]
        blocking_sync = [c for c in sync if not c.async_bucket]
        wait = sum(max(0.0, (c.t_done or c.t_arrive) - c.t_arrive) for c in blocking_sync)
        if async_sync:
            last = max(async_sync, key=lambda c: c.t_arrive)
            last_arrive = last.t_arrive
            last_done = max((c.t_done or last_arrive) for c in async_sync)
            peers_wait = max(0.0, last_done - last_arrive)
            wait += peers_wait
            exposed += peers_wait
        sync_wait = wait
    return exposed, sync_arrival, sync_wait


def test_comm_summary_is_bit_for_bit_the_two_pass_one(tmp_path):
    rng = random.Random(3)
    rec = Recorder("r", RunDir(tmp_path, "r").spool(0), 0, {"dp": [0, 1]})
    for trial in range(3000):
        rec.begin_step(trial)
        rec.t.blocked_comm = rng.choice([0.0, rng.random() * 0.01])
        for i in range(rng.randint(0, 6)):
            t_arrive = 1700000000.0 + rng.choice([0.0, 0.001, rng.random()])  # ties on purpose
            t_done = rng.choice([None, t_arrive + rng.random() * 0.02, t_arrive - 0.001])
            c = OpenCollective("all_reduce", rng.choice(["dp", "pp", "world"]), [0, 1], 4, t_arrive,
                                rng.random() < 0.7, i, t_done=t_done,
                                async_bucket=rng.random() < 0.5)
            rec.t.collectives.append(c)
        got = comm_summary(rec.t.collectives, rec.t.blocked_comm)
        want = _comm_summary_before(rec.t.collectives, rec.t.blocked_comm)
        assert got == want and [type(v) for v in got] == [type(v) for v in want], (trial, got, want)


def _step_record_before(run_id, rank, attempt, node, host, world, lay, rec, mem_bytes, step, t_start, t_end,
                        step_ms, device_ms, step_loss, grad_norm, loss_scale, overflow, skipped, lr, profiling,
                        tokens, flops, microbatches):
    """The StepRecord as trainer/train.py built it inline before the API (the reference)."""
    import math

    comm_s, sync_arrival, sync_wait = comm_summary(rec.t.collectives, rec.t.blocked_comm)
    data_ms, comm_ms, pw_ms = rec.t.data * 1000, comm_s * 1000, rec.t.pipeline_wait * 1000
    compute_ms = max(0.0, step_ms - data_ms - comm_ms - pw_ms)
    loss_ok = math.isfinite(step_loss)
    return StepRecord(
        run_id=run_id, rank=rank, step=step, node=node, host=host, attempt=attempt, world_size=world,
        pp_stage=lay[0], dp_rank=lay[1], tp_rank=lay[2], t_start=t_start, t_end=t_end,
        step_ms=step_ms, data_ms=data_ms, forward_ms=rec.t.forward * 1000, backward_ms=rec.t.backward * 1000,
        optimizer_ms=rec.t.optimizer * 1000, comm_ms=comm_ms, pipeline_wait_ms=pw_ms, compute_ms=compute_ms,
        sync_arrival=sync_arrival, sync_wait_ms=None if sync_wait is None else sync_wait * 1000,
        tokens=tokens, loss=step_loss if loss_ok else None, loss_nonfinite=not loss_ok,
        grad_norm=grad_norm if math.isfinite(grad_norm) else None, loss_scale=loss_scale,
        overflow=overflow, skipped=skipped, lr=lr, mem_bytes=mem_bytes, flops=flops, profiling=profiling,
        microbatches=microbatches, device_ms=device_ms)


class _FixedMemory(MemoryProbe):
    def __init__(self, value):
        self.value = value

    def sample(self):
        return self.value


@pytest.mark.parametrize("loss,grad_norm,scale", [(2.5, 1.25, None), (float("nan"), float("inf"), 1024.0)])
def test_session_writes_the_record_train_py_wrote(tmp_path, loss, grad_norm, scale):
    """Session.end_step builds the StepRecord the trainer built inline before the API, from the same accumulators:
    every field but the host clock's (t_start, t_end, step_ms, device_ms), which it measures itself."""
    from ranksight.schema import RankPlacement

    run = RunDir(tmp_path, "run-x")
    me = RankPlacement(rank=3, node=1, host="node-b", local_rank=1, pp_stage=1, dp_rank=1, tp_rank=0)
    rs = Session(run, me, 4, 2, {"dp": [2, 3], "world": [0, 1, 2, 3]}, device="cpu", tokens_per_step=512,
                 flops_per_step=3.0e9 * 512 / 2, microbatches=4)
    rs.mem = _FixedMemory(123456789)
    rec = rs.recorder
    rs.begin_step(9)
    rec.t.data, rec.t.forward, rec.t.backward, rec.t.optimizer = 0.001, 0.010, 0.020, 0.005
    rec.t.pipeline_wait = 0.003
    bucket = rec.enter("all_reduce", "dp", 4096, sync=True, async_bucket=True)
    bucket.t_done = bucket.t_arrive + 0.002
    rec.timed("broadcast", "world", lambda: None, nbytes=24)
    want = _step_record_before("run-x", 3, 2, 1, "node-b", 4, (1, 1, 0), rec, 123456789, 9, 0.0, 0.0, 50.0, None,
                               loss, grad_norm, scale, True, False, 0.003, True, 512, 3.0e9 * 512 / 2, 4)
    h = rs.end_step(loss=loss, grad_norm=grad_norm, loss_scale=scale, overflow=True, skipped=False, lr=0.003,
                    profiling=True)
    lines = RunDir(tmp_path, "run-x").spool(3).read_bytes().splitlines()
    assert [decode_spool_line(line).op for line in lines[:2]] == ["all_reduce", "broadcast"]
    got = decode_spool_line(lines[2])
    assert h.mem_bytes == 123456789 and got.step_ms == h.step_ms and got.t_end >= got.t_start
    assert got.device_ms is not None and 0 <= got.device_ms <= got.step_ms + 1.0  # thread CPU time, nothing added
    assert got.compute_ms == pytest.approx(max(0.0, got.step_ms - got.data_ms - got.comm_ms - got.pipeline_wait_ms))
    same = ("run_id", "rank", "node", "host", "attempt", "world_size", "pp_stage", "dp_rank", "tp_rank", "step",
            "data_ms", "forward_ms", "backward_ms", "optimizer_ms", "comm_ms", "pipeline_wait_ms", "sync_arrival",
            "sync_wait_ms", "tokens", "loss", "loss_nonfinite", "grad_norm", "loss_scale", "overflow", "skipped",
            "lr", "mem_bytes", "flops", "profiling", "microbatches")
    assert {k: getattr(got, k) for k in same} == {k: getattr(want, k) for k in same}


def test_simulated_gpu_state_is_written_by_a_thread_and_flush_waits_for_it(tmp_path):
    run = RunDir(tmp_path, "r")
    g = SimulatedGpu(run, 2, 1, 5, min_interval_s=3600.0)
    g.update(100.0, 50.0, 7000, FaultState([], 5, 2))  # no --inject: no fault work, the first state is written
    assert g.file.wait()
    st = read_state(run.simgpu_node_dir(2), 1)
    assert st.util_gpu == 50 and st.mem_used == 7000 and st.sm_clock_mhz == st.max_sm_clock_mhz
    for _ in range(50):
        g.update(100.0, 90.0, 8000, None)
    assert g.writes == 1
    g.flush()  # returns once the file has it
    st = read_state(run.simgpu_node_dir(2), 1)
    assert g.writes == 2 and st.util_gpu == 90 and st.mem_used == 8000 and "simulated" in st.name
    assert sorted(p.name for p in run.simgpu_node_dir(2).iterdir()) == ["gpu-1.state"]  # no temporary left
    # an XID: written at once, with the node's faults
    faults = FaultState([parse_fault("xid:node=2,code=48,start=3")], rank=5, node=2)
    faults.set_step(3)
    g.update(100.0, 90.0, 8000, faults)
    assert g.writes == 3 and g.file.wait()
    assert [code for code, _ in read_state(run.simgpu_node_dir(2), 1).xids] == [48]


def test_writer_thread_keeps_only_the_newest_state(tmp_path):
    from trainer.simdevice import StateFileWriter

    w = StateFileWriter(tmp_path / "d" / "gpu-0.state")
    for i in range(200):
        w.submit(f"util_gpu={i}\n".encode())
    assert w.wait()
    assert (tmp_path / "d" / "gpu-0.state").read_text() == "util_gpu=199\n"


DDP_BUCKETS_CHECK = r"""
import os, sys
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from ranksight.instrument.ddp import make_ddp_comm_hook
from ranksight.instrument.recorder import Recorder
from ranksight.layout import RunDir

tmp = sys.argv[1]
dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "pg"), rank=0, world_size=1)
grads = []
for hook in ("ranksight", "plain"):
    rec = Recorder("r", RunDir(tmp, hook).spool(0), 0, {"dp": [0]})
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Linear(300, 300), torch.nn.Linear(300, 2))
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.2)
    model.register_comm_hook(None, make_ddp_comm_hook(rec) if hook == "ranksight" else allreduce_hook)
    for step in (1, 2):  # step 2: after DDP rebuilt its buckets
        rec.begin_step(step)
        model.zero_grad()
        model(torch.ones(3, 300)).sum().backward()
    grads.append([p.grad.clone() for p in model.parameters()])
    if hook == "ranksight":
        cs = rec.t.collectives
        print("buckets", len(cs), flush=True)
        print("completed", all(c.t_done is not None and c.t_done >= c.t_arrive for c in cs), flush=True)
        print("flags", all(c.async_bucket and c.sync and c.group == "dp" for c in cs), flush=True)
        print("bytes", sum(c.nbytes for c in cs) == sum(p.numel() * 4 for p in net.parameters()), flush=True)
        # per-group sequence numbers go on from step 1's buckets (DDP may rebuild them after step 1)
        print("seq", cs[0].seq >= 1 and [c.seq for c in cs] == list(range(cs[0].seq, cs[0].seq + len(cs))), flush=True)
print("same_grads", all(torch.equal(a, b) for a, b in zip(*grads)), flush=True)
# no teardown: freeing a DDP reducer while gloo's worker thread still releases the hook's Python callback can
# deadlock (~ProcessGroupGloo joins that thread; seen under make test): the check is done
os._exit(0)
"""


def test_ddp_hook_records_every_bucket_with_one_callback(tmp_path):
    """A 1-rank gloo DDP model with several buckets (in its own process): one CollectiveRecord per bucket, each
    completed, the bytes of every gradient, and the gradients of the plain allreduce_hook."""
    res = subprocess.run([sys.executable, "-c", DDP_BUCKETS_CHECK, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    got = dict(line.split(" ", 1) for line in res.stdout.strip().split("\n") if " " in line)
    assert int(got["buckets"]) >= 2, res.stdout
    for what in ("completed", "flags", "bytes", "seq", "same_grads"):
        assert got[what] == "True", (what, res.stdout)


def test_recorder_cost_bench_runs(tmp_path):
    """The benchmark itself (a few steps; its numbers are not checked here)."""
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "recorder_cost.py"), "--steps", "40", "--warmup", "4",
                          "--block", "5", "--d-model", "32", "--n-layers", "2"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    for part in ("totals", "wall", "main-thread CPU", "Session.end_step", "write_record", "simgpu.update",
                 "control.poll", "loop: backward"):
        assert part in out, out
