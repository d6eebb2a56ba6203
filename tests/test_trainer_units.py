"""Trainer pieces that need no process group: fault specs, config checks, control-request
handling (including evict refusal), data determinism, FLOPs, stage splitting, spool writing."""

from __future__ import annotations

import os

import msgspec
import pytest
import torch

from ranksight.layout import RunDir
from ranksight.schema import ControlAck, ControlRequest, StepRecord, decode_spool_line
from trainer import control
from trainer.config import ModelConfig, ParallelConfig, TrainConfig
from trainer.data import DataLoader, SyntheticTokens, TextFileTokens, make_dataset
from trainer.faults import FaultSpecError, FaultState, parse_fault
from ranksight.spool import SpoolWriter
from trainer.model import GPT, count_params, flops_per_token, init_weights
from trainer.parallelize import stage_layers


def test_parse_fault_specs():
    f = parse_fault("slow_rank:rank=3,factor=1.3,start=15")
    assert (f.kind, f.rank, f.factor, f.start, f.end) == ("slow_rank", 3, 1.3, 15, None)
    x = parse_fault("xid:node=1,code=79,start=30")
    assert (x.kind, x.node, x.code, x.start) == ("xid", 1, 79, 30)
    assert parse_fault("data_stall:rank=0").delay_ms == 200.0  # documented default
    assert parse_fault("hang:node=2,start=4,end=9").end == 9
    for bad, msg in [
        ("slow_rnk:rank=1", "unknown fault kind"),
        ("slow_rank:factor=2", "needs rank"),
        ("xid:rank=1", "needs node"),
        ("slow_rank:rank=x", "not a valid int"),
        ("slow_rank:rank=1,colour=red", "bad item"),
        ("slow_rank:rank=1,factor=0.5", "factor must be >= 1"),
        ("slow_link:rank=1,start=5,end=2", "start <= end"),
        ("few_microbatches:rank=1", "takes no keys"),
    ]:
        with pytest.raises(FaultSpecError, match=msg):
            parse_fault(bad)


def test_few_microbatches_is_a_config_fault():
    from trainer.faults import apply_config_faults

    spec = parse_fault("few_microbatches")
    cfg = TrainConfig(parallel=ParallelConfig(pp=2, microbatches=8))
    apply_config_faults(cfg, [spec])
    assert cfg.parallel.microbatches == 2 and spec.start == 1
    fs = FaultState([spec], rank=3, node=1)
    fs.set_step(1)
    assert not fs.has("few_microbatches") and fs.compute_factor() == 1.0  # nothing at run time
    with pytest.raises(FaultSpecError, match="needs --pp > 1"):
        apply_config_faults(TrainConfig(), [spec])


def test_fault_state_targets_and_windows():
    specs = [parse_fault("slow_rank:rank=1,factor=2,start=3,end=4"), parse_fault("throttle:node=0,factor=1.5"),
             parse_fault("data_stall:rank=1,delay_ms=100,start=2")]
    fs = FaultState(specs, rank=1, node=1)
    fs.set_step(2)
    assert fs.compute_factor() == 1.0 and fs.data_delay_s() == pytest.approx(0.1)
    fs.set_step(3)
    assert fs.compute_factor() == 2.0
    fs.set_step(5)
    assert fs.compute_factor() == 1.0
    on_node0 = FaultState(specs, rank=0, node=0)
    on_node0.set_step(1)
    assert on_node0.compute_factor() == 1.5 and on_node0.has("throttle") and not on_node0.has("slow_rank")


def test_config_validation_errors():
    ok = TrainConfig()
    ok.validate()
    bad = [
        (TrainConfig(model=ModelConfig(d_model=30, n_heads=4)), "divisible by --n-heads"),
        (TrainConfig(parallel=ParallelConfig(dp_mode="zero")), "--dp-mode"),
        (TrainConfig(parallel=ParallelConfig(pp=2, pp_schedule="zb")), "--pp-schedule"),
        (TrainConfig(precision="fp8"), "--precision"),
        (TrainConfig(parallel=ParallelConfig(pp=4), model=ModelConfig(n_layers=2)), "pipeline stages"),
        (TrainConfig(parallel=ParallelConfig(pp=2, microbatches=3), batch_size=8), "divisible by --microbatches"),
        (TrainConfig(parallel=ParallelConfig(pp=2), grad_accum=2), "--grad-accum"),
        (TrainConfig(dataset="parquet:x"), "--dataset"),
    ]
    for cfg, msg in bad:
        with pytest.raises(ValueError, match=msg):
            cfg.validate()


def test_synthetic_data_is_a_function_of_global_index():
    ds = SyntheticTokens(256, 16, seed=7)
    assert torch.equal(ds.sample(5), SyntheticTokens(256, 16, seed=7).sample(5))
    assert not torch.equal(ds.sample(5), ds.sample(6))
    # dp=2 ranks of batch 4 together see exactly the rows of dp=1 with batch 8, at every position
    one = DataLoader(ds, 8, 1, 0, position=24)
    r0, r1 = DataLoader(ds, 4, 2, 0, position=24), DataLoader(ds, 4, 2, 1, position=24)
    x, y = one.micro_batch(0)
    assert torch.equal(torch.cat([r0.micro_batch(0)[0], r1.micro_batch(0)[0]]), x)
    assert torch.equal(x[:, 1:], y[:, :-1])
    r0.advance(1)
    assert r0.position == 32


def test_textfile_dataset(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("hello ranksight " * 20)
    ds = make_dataset(f"textfile:{p}", 256, 16, 1)
    s = ds.sample(3)
    assert s.shape == (17,) and int(s.max()) < 256
    assert bytes(s.tolist()).decode() in ("hello ranksight " * 21)
    with pytest.raises(FileNotFoundError):
        TextFileTokens(str(tmp_path / "missing"), 256, 16, 1)
    with pytest.raises(ValueError, match="byte-level"):
        TextFileTokens(str(p), 128, 16, 1)


def test_flops_per_token_palm_convention():
    cfg = ModelConfig(vocab=256, d_model=64, n_layers=2, n_heads=4, seq_len=32)
    model = GPT(cfg)
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
    n_no_emb = count_params(cfg) - model.tok.weight.numel() - model.pos.weight.numel()
    assert flops_per_token(cfg) == 6 * n_no_emb + 12 * 2 * 4 * 16 * 32


def test_stage_split_and_stage_agnostic_forward():
    assert stage_layers(5, 2, 0) == ["0", "1", "2"] and stage_layers(5, 2, 1) == ["3", "4"]
    cfg = ModelConfig(d_model=32, n_layers=4, n_heads=4, seq_len=8)
    full = GPT(cfg)
    init_weights(full, 1)
    x = torch.randint(0, 256, (2, 8))
    import copy

    a, b = copy.deepcopy(full), copy.deepcopy(full)
    for name in ["2", "3"]:
        del a.layers[name]
    a.norm = a.head = None
    for name in ["0", "1"]:
        del b.layers[name]
    b.tok = b.pos = None
    assert torch.allclose(b(a(x)), full(x), atol=1e-6)
    assert "layers.3.attn.wq.weight" in dict(b.named_parameters())


def _req(run: RunDir, rid: str, action: str, t: float, **kw) -> None:
    run.control_requests.mkdir(parents=True, exist_ok=True)
    (run.control_requests / f"{rid}.json").write_bytes(
        msgspec.json.encode(ControlRequest(id=rid, action=action, t=t, **kw)))


def test_control_requests_order_validation_and_acks(tmp_path):
    run = RunDir(tmp_path, "ctl")
    _req(run, "b", "profile", 2.0, steps=3)
    _req(run, "a", "checkpoint", 1.0)
    _req(run, "c", "evict", 3.0, node=1)
    pend = control.pending_requests(run)
    assert [r.id for r, _, _ in pend] == ["a", "b", "c"]  # oldest first
    control.write_ack(run, "a", "checkpoint", 7)
    assert [r.id for r, _, _ in control.pending_requests(run)] == ["b", "c"]
    ack = msgspec.json.decode((run.control_acks / "a.json").read_bytes(), type=ControlAck)
    assert (ack.applied_step, ack.status) == (7, "applied")


def test_evict_refusals():
    ev = lambda node: ControlRequest(id="e", action="evict", t=0.0, node=node)  # noqa: E731
    assert control.validate(ev(1), {0, 1}, min_nodes=1) == ""
    assert "below --min-nodes 2" in control.validate(ev(1), {0, 1}, min_nodes=2)
    assert "unknown node 5" in control.validate(ev(5), {0, 1}, min_nodes=1)
    assert "would leave 0 node" in control.validate(ev(0), {0}, min_nodes=1)
    assert "needs a node" in control.validate(ev(None), {0, 1}, min_nodes=1)
    assert "1 <= steps" in control.validate(ControlRequest(id="p", action="profile", t=0.0), {0}, 1)
    # would overflow the int64 broadcast on every rank, at every restart while pending
    huge = ControlRequest(id="p", action="profile", t=0.0, steps=2**63)
    assert "got 9223372036854775808" in control.validate(huge, {0}, 1)


def test_refused_evict_is_acked_and_not_broadcast(tmp_path, monkeypatch):
    """Rank 0's poll: a refused evict gets a 'refused' ack and the broadcast carries nothing."""
    run = RunDir(tmp_path, "ctl2")
    _req(run, "e1", "evict", 1.0, node=3)
    _req(run, "bad", "checkpoint", 2.0)
    (run.control_requests / "bad.json").write_text('{"id": "bad", "action": "explode", "t": 2}')
    sent = []
    monkeypatch.setattr(control.dist, "broadcast", lambda t, src, group=None: sent.append(t.clone()))
    ch = control.ControlChannel(run, 0, nodes={0, 1}, min_nodes=1, device=torch.device("cpu"))
    assert ch.poll(4) == (None, 0, None)
    assert sent[0].tolist() == [0, 0, 0]
    e1 = msgspec.json.decode((run.control_acks / "e1.json").read_bytes(), type=ControlAck)
    bad = msgspec.json.decode((run.control_acks / "bad.json").read_bytes(), type=ControlAck)
    assert (e1.status, e1.applied_step) == ("refused", 4) and "unknown node 3" in e1.detail
    assert bad.status == "refused"
    _req(run, "e2", "evict", 5.0, node=1)
    assert ch.poll(5) == ("evict", 0, 1)
    assert sent[-1].tolist() == [3, 0, 1]
    ch.ack(5, "done")
    assert msgspec.json.decode((run.control_acks / "e2.json").read_bytes(), type=ControlAck).status == "applied"
    assert control.evicted_marker(run, 1) == run.root / "control" / "evicted" / "node-1"


def test_control_poll_reads_the_requests_folder_only_when_it_changed(tmp_path, monkeypatch):
    """Rank 0 lists and decodes the requests only when the folder's time stamp moved (or moved recently)."""
    run = RunDir(tmp_path, "ctl3")
    _req(run, "old", "checkpoint", 1.0)
    control.write_ack(run, "old", "checkpoint", 1)
    monkeypatch.setattr(control.dist, "broadcast", lambda t, src, group=None: None)
    monkeypatch.setattr(control, "RESCAN_RECENT_S", 0.0)  # no recent-change window: only the time stamp counts
    reads = []
    real = control.pending_requests
    monkeypatch.setattr(control, "pending_requests", lambda r: reads.append(1) or real(r))
    ch = control.ControlChannel(run, 0, nodes={0}, min_nodes=1, device=torch.device("cpu"))
    assert ch.poll(2) == (None, 0, None) and len(reads) == 1
    assert ch.poll(3) == (None, 0, None) and len(reads) == 1  # unchanged: not read again
    _req(run, "new", "profile", 2.0, steps=2)
    st = run.control_requests.stat()
    os.utime(run.control_requests, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a later clock tick
    assert ch.poll(4) == ("profile", 2, None) and len(reads) == 2
    assert ch.poll(5) == ("profile", 2, None) and len(reads) == 3  # still pending (no ack yet): read again
    ch.ack(5)
    assert ch.poll(6) == (None, 0, None) and len(reads) == 4
    assert ch.poll(7) == (None, 0, None) and len(reads) == 4


def test_spool_writer_appends_whole_lines(tmp_path):
    path = tmp_path / "spool" / "rank-0.jsonl"
    w = SpoolWriter(path)
    rec = StepRecord(run_id="r", rank=0, step=1, node=0, host="h", world_size=1, t_start=1.0, t_end=2.0, step_ms=1000)
    w.add(rec)
    assert path.read_bytes() == b""  # nothing until flush
    w.flush()
    w2 = SpoolWriter(path)  # a restarted rank appends
    w2.write_now(rec)
    lines = path.read_bytes().splitlines()
    assert len(lines) == 2 and decode_spool_line(lines[1]).step == 1


def test_cli_rejects_bad_input_before_starting(tmp_path):
    """Bad flags exit 2 with one clear line, without creating a process group or a run directory."""
    import subprocess
    import sys

    for args, msg in [(["--inject", "slow_rank:factor=2"], "needs rank"),
                      (["--d-model", "30"], "divisible by --n-heads"),
                      (["--pp-schedule", "zigzag"], "--pp-schedule"),
                      (["--no-instrument", "--inject", "slow_rank:rank=0"], "needs the instrumentation")]:
        res = subprocess.run([sys.executable, "-m", "trainer", "--store", str(tmp_path), *args],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and msg in res.stderr, (args, res.stderr)
    assert not any(tmp_path.iterdir())


SLOW_LINK_CHECK = r"""
import os, sys, time
import torch
import torch.distributed as dist
from ranksight.instrument.ddp import make_ddp_comm_hook
from ranksight.instrument.recorder import Recorder, comm_summary
from ranksight.layout import RunDir
from trainer.faults import FaultState, parse_fault

tmp = sys.argv[1]
faults = FaultState([parse_fault("slow_link:rank=0,delay_ms=40,start=2")], rank=0, node=0)
saved = dist.all_reduce
dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "pg"), rank=0, world_size=1)
print("installed", faults.install_transport_delay(), flush=True)
rec = Recorder("r", RunDir(tmp, "r").spool(0), 0, {"dp": [0]})
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
model.register_comm_hook(None, make_ddp_comm_hook(rec))
for step in (1, 2):  # the fault starts at step 2
    faults.set_step(step)
    rec.begin_step(step)
    t0 = time.time()
    model(torch.ones(2, 8)).sum().backward()
    cs = rec.t.collectives
    print(f"completed{step}", bool(cs) and all(c.t_done is not None for c in cs), flush=True)
    print(f"arrive_after{step}", cs[0].t_arrive - t0, flush=True)
    exposed, arrival, wait = comm_summary(cs, 0.0)
    print(f"span{step}", max(c.t_done for c in cs) - arrival, flush=True)
    print(f"wait{step}", wait, flush=True)
faults.remove_transport_delay()
print("restored", dist.all_reduce is saved, flush=True)
# no teardown: freeing a DDP reducer while gloo's worker thread still releases the hook's Python callback can
# deadlock (see tests/test_recorder_cost.py's DDP check): the check is done
os._exit(0)
"""


def test_slow_link_delays_the_transport_and_nothing_is_subtracted(tmp_path):
    """slow_link without a network namespace (a 1-rank gloo DDP model, in its own process): the rank's data leaves
    late inside the collective calls the hooks make (installed before them), so the rank is seen arriving on time
    and its collective taking the delay longer. No signal knows of the fault: the delay is in the collective's
    duration and in the wait, as a slow link's."""
    import subprocess
    import sys
    from pathlib import Path

    res = subprocess.run([sys.executable, "-c", SLOW_LINK_CHECK, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr[-2000:]
    got = dict(line.split(" ", 1) for line in res.stdout.strip().split("\n") if " " in line)
    for what in ("installed", "completed1", "completed2", "restored"):
        assert got[what] == "True", (what, res.stdout)
    # arrival is taken before the transport's delay (compared with step 1's: a busy machine slows both alike)
    assert float(got["arrive_after2"]) - float(got["arrive_after1"]) < 0.035
    span1, span2 = float(got["span1"]), float(got["span2"])
    assert span2 >= 0.04 and span2 - span1 >= 0.03  # the collective took the delay longer ...
    assert float(got["wait2"]) >= 0.04  # ... and so did the wait: nothing is subtracted


def test_disabled_session_writes_nothing_and_still_runs_collectives(tmp_path):
    """--no-instrument: nothing is written (no spool file), and timed() only runs the collective."""
    from ranksight.instrument.recorder import Recorder
    from ranksight.instrument.session import Session
    from ranksight.schema import RankPlacement

    run = RunDir(tmp_path, "r")
    me = RankPlacement(rank=0, node=0, host="h", local_rank=0, pp_stage=0, dp_rank=0, tp_rank=0)
    rs = Session(run, me, 1, 0, {"pp": [0]}, device="cpu", enabled=False)
    rs.begin_step(1)
    assert rs.timed("all_reduce", "pp", lambda x: x + 1, 41) == 42
    h = rs.end_step(loss=1.0)
    assert h.step_ms >= 0 and not rs.recorder.t.collectives and not run.spool(0).exists()
    path = run.spool(0)
    assert Recorder("r", path, 0, {}).spool is not None and path.exists()  # default: on


def test_cpu_peak_keeps_the_best_measurement_on_this_host(tmp_path):
    """A CPU peak measured while the machine is busy is too low (MFU > 100 %). The manifest's peak
    is the max of this measurement and the best earlier one on this host (cached), and says so."""
    import json

    from ranksight.instrument.manifest import cpu_key, measure_cpu_peak

    cache = tmp_path / "cpu-peak.json"
    shapes = ((64, 64, 64),)
    now, src, simulated = measure_cpu_peak(shapes, reps=1, min_rep_s=0.005, cache=cache)
    assert simulated and now > 0 and "barrier" in src and "64x64@64x64" in src
    key = cpu_key(torch.get_num_threads())
    assert json.loads(cache.read_text())[key]["peak_flops"] == now  # recorded for later runs
    cache.write_text(json.dumps({key: {"peak_flops": 1e18}}))  # an earlier, higher measurement
    peak, src, _ = measure_cpu_peak(shapes, reps=1, min_rep_s=0.005, cache=cache)
    assert peak == 1e18 and "earlier measurement" in src
    cache.write_text(json.dumps({key: {"peak_flops": 1.0}}))  # a lower one is replaced
    peak, _, _ = measure_cpu_peak(shapes, reps=1, min_rep_s=0.005, cache=cache)
    assert peak > 1.0 and json.loads(cache.read_text())[key]["peak_flops"] == peak


def test_an_unwaited_tp_all_reduce_whose_id_is_reused_is_dropped(tmp_path):
    """A TP all-reduce output that dies unwaited can have its id reused by the next one: the first is dropped (as
    finish_step drops unwaited ones), never written without a completion."""
    from ranksight.instrument.recorder import Recorder

    rec = Recorder("r", RunDir(tmp_path, "r").spool(0), 0, {"tp": [0, 1]})
    rec.begin_step(1)
    first = rec.enter("all_reduce", "tp", 4)
    rec.tp_issued(1234, first)
    second = rec.enter("all_reduce", "tp", 4)
    rec.tp_issued(1234, second)  # same id: the first tensor is gone
    assert [c.seq for c in rec.t.collectives] == [second.seq]
    c = rec.tp_pending.pop(1234)
    c.t_done = c.t_arrive + 0.001
    assert c is second
