"""The trainer under torchrun on CPU/gloo: every parallel layout trains, matches a 1-process
reference where the maths says it must, and every runtime fault leaves its raw signal.

Each run checks several things at once: the whole trainer suite must stay within a few
minutes on a shared 2-core machine. No timing assertions: only orderings that the
injected sleeps make large (factor 4 slowdowns, 150 ms delays) and lower bounds that
hold by construction (a sleep inside a timed region).
"""

from __future__ import annotations

import json

import msgspec
import pytest

from ranksight.layout import RunDir
from ranksight.schema import ControlAck, ControlRequest
from ranksight.simgpu import THROTTLE_HW_THERMAL, THROTTLE_SW_POWER_CAP, read_state
from trainer_helpers import (TINY, check_ok, collectives, events, manifest, mean, members, reference_losses, spool, steps,
                             torchrun)

pytestmark = pytest.mark.distributed


def _losses_decrease(st: dict) -> None:
    ks = sorted(st)
    first, last = st[ks[0]].loss, mean(st[k].loss for k in ks[-2:])
    assert last < first, f"loss did not decrease: {[st[k].loss for k in ks]}"


def test_ddp_reference_culprit_and_slow_link(tmp_path):
    """DDP on 2 ranks: = reference; slow_rank culprit vs victim; slow_link inside the comm timing."""
    n = 8
    res = torchrun(2, TINY + ["--steps", str(n), "--dp-mode", "ddp",
                              "--inject", "slow_rank:rank=1,factor=15,start=3,end=5",
                              "--inject", "slow_link:rank=1,delay_ms=150,start=7,end=8"], tmp_path, "ddp")
    check_ok(res)
    sp = spool(tmp_path, "ddp")
    s0, s1 = steps(sp[0]), steps(sp[1])
    assert sorted(s0) == list(range(1, n + 1)) == sorted(s1)
    ref, ref_norms = reference_losses(n, batch=8)
    for k in range(1, n + 1):  # the faults only sleep: the maths is untouched
        assert abs(mean([s0[k].loss, s1[k].loss]) - ref[k - 1]) < 2e-4, (k, s0[k].loss, s1[k].loss, ref[k - 1])
        assert abs(s0[k].grad_norm - ref_norms[k - 1]) < 2e-4
    _losses_decrease(s0)
    # culprit (rank 1) vs victim (rank 0) on the slow steps
    # (a x15 slowdown of the tiny model's compute: ~100 ms per step, far above scheduling noise)
    for k in (3, 4, 5):
        culprit, victim = s1[k], s0[k]
        assert culprit.compute_ms > victim.compute_ms, k
        assert culprit.sync_arrival > victim.sync_arrival, k
    # (the culprit's extra work is real CPU work that its node-mate shares the cores with: a margin, not 3x)
    assert mean(s0[k].sync_wait_ms for k in (3, 4, 5)) > 1.5 * mean(s1[k].sync_wait_ms for k in (3, 4, 5))
    assert mean(s0[k].comm_ms for k in (3, 4, 5)) > mean(s1[k].comm_ms for k in (3, 4, 5))
    # every field filled
    r = s1[4]
    assert r.t_end > r.t_start and r.step_ms > 0 and r.forward_ms > 0 and r.backward_ms > 0 and r.optimizer_ms > 0
    assert r.tokens == 4 * 16 and r.flops > 0 and r.mem_bytes > 0 and r.lr > 0 and r.world_size == 2
    assert abs(r.step_ms - (r.data_ms + r.comm_ms + r.pipeline_wait_ms + r.compute_ms)) < 1e-3
    # slow_link: rank 1's dp all-reduce includes its 150 ms delay (the sleep is inside the timing)
    for k in (7, 8):
        ar = [c for c in collectives(sp[1]) if c.step == k and c.group == "dp" and c.op == "all_reduce"]
        assert ar and max(c.duration_ms for c in ar) >= 150.0
        assert all(members(sp)[c.comm_id] == [0, 1] and c.group_ranks == [] for c in ar)
    # ground truth: fault events in the spool, onset in the manifest
    starts = events(sp[1], "fault_start")
    assert {(e.detail["fault"]["kind"], e.step) for e in starts} == {("slow_rank", 3), ("slow_link", 7)}
    assert [e.step for e in events(sp[1], "fault_end")] == [6]
    assert not events(sp[0], "fault_start")
    m = manifest(tmp_path, "ddp")
    assert [f["kind"] for f in m["faults"]] == ["slow_rank", "slow_link"]
    assert all(f["onset_t"] is not None for f in m["faults"])
    assert abs(m["faults"][0]["onset_t"] - s0[3].t_start) < 1.0
    assert m["layout"]["dp"] == 2 and m["flops_per_token"] > 0 and m["peak_simulated"] is True
    assert "not a GPU peak" in m["peak_source"] and m["finished"] is not None
    assert sorted(p["rank"] for p in m["ranks"]) == [0, 1] and m["attempts"][0]["world_size"] == 2


def test_fsdp_control_data_stall_throttle_xid(tmp_path):
    """FSDP2 on 2 ranks with grad accumulation and activation checkpointing: = reference; control requests (checkpoint, profile) acted on at the same
    step by all ranks; data_stall, throttle and xid leave their signals; scheduled profiling."""
    n = 7
    run = RunDir(tmp_path, "fsdp")
    run.control_requests.mkdir(parents=True)
    for i, (action, steps_) in enumerate([("checkpoint", 0), ("profile", 2)]):
        req = ControlRequest(id=f"req{i}", action=action, t=1000.0 + i, steps=steps_)
        (run.control_requests / f"req{i}.json").write_bytes(msgspec.json.encode(req))
    (run.control_requests / "bad.json").write_text("{not json")
    args = TINY + ["--steps", str(n), "--dp-mode", "fsdp", "--grad-accum", "2", "--activation-checkpointing"]
    args[args.index("--batch-size") + 1] = "2"  # 2 micro-steps of 2 = the reference's 4 per rank
    res = torchrun(2, args + ["--inject", "data_stall:rank=0,delay_ms=150,start=2,end=3",
                              "--inject", "throttle:rank=1,factor=4,start=5",
                              "--inject", "xid:node=0,code=79,start=4"], tmp_path, "fsdp")
    check_ok(res)
    sp = spool(tmp_path, "fsdp")
    s0, s1 = steps(sp[0]), steps(sp[1])
    ref, _ = reference_losses(n, batch=8)
    for k in range(1, n + 1):
        assert abs(mean([s0[k].loss, s1[k].loss]) - ref[k - 1]) < 2e-4, (k, ref[k - 1])
    # FSDP2 collectives are recorded with arrival/done; reduce-scatters are gradient sync
    rs = [c for c in collectives(sp[0]) if c.op == "reduce_scatter"]
    assert rs and all(c.t_done >= c.t_arrive for c in rs)
    assert all(s0[k].sync_arrival is not None and s0[k].sync_wait_ms is not None for k in s0)
    # data_stall: the stalled rank's data wait contains the 150 ms sleep
    for k in (2, 3):
        assert s0[k].data_ms >= 2 * 150.0 and s1[k].data_ms < 150.0  # once per micro-step
    assert s0[1].microbatches == 2 and s0[1].tokens == 2 * 2 * 16
    # control: both requests acked, applied at the same step on every rank, oldest first
    acks = {p.stem: msgspec.json.decode(p.read_bytes(), type=ControlAck) for p in run.control_acks.glob("*.json")}
    assert acks["req0"].status == "applied" and acks["req1"].status == "applied"
    assert acks["bad"].status == "refused"
    assert acks["req0"].applied_step < acks["req1"].applied_step
    for rank in (0, 1):
        ctl = {e.detail["action"]: e.step for e in events(sp[rank], "control")}
        assert ctl == {"checkpoint": acks["req0"].applied_step, "profile": acks["req1"].applied_step}
    ck = acks["req0"].applied_step
    assert (run.checkpoints_dir / f"step-{ck}" / ".metadata").exists()
    assert events(sp[0], "checkpoint")[0].step == ck == events(sp[1], "checkpoint")[0].step
    # on-demand profile: the 2 following steps traced on both ranks, one trace per rank
    p = acks["req1"].applied_step
    for rank, st in ((0, s0), (1, s1)):
        assert [k for k in sorted(st) if st[k].profiling] == [p + 1, p + 2]
        trace = run.traces_dir / f"rank-{rank}.ondemand-step{p + 1}-{p + 2}.json"
        assert trace.exists() and "traceEvents" in json.loads(trace.read_text())
    # simulated GPU: throttle on rank 1 (node 0, gpu 1), xid on node 0's GPUs
    g0, g1 = read_state(run.simgpu_node_dir(0), 0), read_state(run.simgpu_node_dir(0), 1)
    assert g1.sm_clock_mhz == g1.max_sm_clock_mhz // 4
    assert g1.throttle_reasons & THROTTLE_HW_THERMAL and g1.throttle_reasons & THROTTLE_SW_POWER_CAP
    assert g1.temp_c > g0.temp_c
    assert g0.throttle_reasons == 0 and g0.sm_clock_mhz == g0.max_sm_clock_mhz
    assert [c for c, _ in g0.xids] == [79] and [c for c, _ in g1.xids] == [79]
    assert "simulated" in g0.name.lower()
    # throttle is also a compute slowdown on rank 1 (extra compute inside its forward)
    assert mean(s1[k].forward_ms for k in (5, 6, 7)) > mean(s0[k].forward_ms for k in (5, 6, 7))


def test_tp_reference(tmp_path):
    """TP=2 (FSDP2 on a size-1 dp mesh): loss and grad norm = 1-process reference; TP all-reduces
    timed (slow_rank culprit vs victim); scheduled profiling."""
    n = 5
    res = torchrun(2, TINY + ["--steps", str(n), "--tp", "2", "--profile-every", "3", "--profile-steps", "1",
                              "--profile-warmup", "1", "--inject", "slow_rank:rank=1,factor=15,start=2,end=3"],
                   tmp_path, "tp")
    check_ok(res)
    sp = spool(tmp_path, "tp")
    s0, s1 = steps(sp[0]), steps(sp[1])
    ref, ref_norms = reference_losses(n, batch=4)
    for k in range(1, n + 1):
        assert abs(s0[k].loss - ref[k - 1]) < 2e-4 and abs(s1[k].loss - ref[k - 1]) < 2e-4
        assert abs(s0[k].grad_norm - ref_norms[k - 1]) < 2e-4
    assert {s0[1].tp_rank, s1[1].tp_rank} == {0, 1}
    # TP all-reduces are timed (DTensor's functional collectives, forward and backward); with
    # dp = 1 the backward ones stand in for the gradient sync: culprit vs victim is visible
    tp_ops = [c for c in collectives(sp[0]) if c.group == "tp" and c.step == 1]
    assert tp_ops and all(c.t_done is not None and members(sp)[c.comm_id] == [0, 1] for c in tp_ops)
    for k in (2, 3):
        assert s1[k].compute_ms > s0[k].compute_ms and s1[k].sync_arrival > s0[k].sync_arrival, k
    assert mean(s0[k].sync_wait_ms for k in (2, 3)) > 3 * mean(s1[k].sync_wait_ms for k in (2, 3))
    assert mean(s0[k].comm_ms for k in (2, 3)) > mean(s1[k].comm_ms for k in (2, 3))
    _losses_decrease(s0)
    assert manifest(tmp_path, "tp")["layout"]["dp_mode"] == "fsdp"
    # scheduled profiler: window at step 3 = 1 warm-up step, then step 4 traced, one trace per rank
    for rank, st in ((0, s0), (1, s1)):
        assert [k for k in sorted(st) if st[k].profiling] == [4]
        trace = RunDir(tmp_path, "tp").traces_dir / f"rank-{rank}.step4-4.json"
        assert "traceEvents" in json.loads(trace.read_text())


def test_pp_interleaved_nan_loss(tmp_path):
    """PP=2 interleaved 1F1B (2 stages per rank, 4 layers): = reference; a slow stage shows as its
    own compute and as the other stage's pipeline wait; nan_loss on stage 0 -> non-finite loss
    on the last stage, step skipped on every stage."""
    n = 6
    res = torchrun(2, TINY + ["--steps", str(n), "--pp", "2", "--pp-schedule", "interleaved", "--n-layers", "4",
                              "--microbatches", "4", "--inject", "nan_loss:rank=0,start=5,end=5",
                              "--inject", "slow_rank:rank=1,factor=15,start=2,end=3"], tmp_path, "pp")
    check_ok(res)
    sp = spool(tmp_path, "pp")
    s0, s1 = steps(sp[0]), steps(sp[1])
    ref, ref_norms = reference_losses(4, batch=4, n_layers=4)
    for k in range(1, 5):
        assert abs(s1[k].loss - ref[k - 1]) < 2e-4, (k, s1[k].loss, ref[k - 1])
        assert s0[k].loss == s1[k].loss  # every stage reports the pipeline's loss
        assert abs(s0[k].grad_norm - ref_norms[k - 1]) < 2e-4
    assert s0[2].pp_stage == 0 and s1[2].pp_stage == 1 and s1[2].microbatches == 4
    assert all(s.pipeline_wait_ms > 0 for s in list(s0.values()) + list(s1.values()))
    for k in (2, 3):  # rank 1 slow: its compute grows, rank 0 waits for it in the pipeline
        assert s1[k].compute_ms > s0[k].compute_ms and s0[k].pipeline_wait_ms > s1[k].pipeline_wait_ms, k
    assert s1[5].loss_nonfinite and s1[5].loss is None and s1[5].skipped and s0[5].skipped
    assert not s1[6].loss_nonfinite and not s1[6].skipped
    assert s1[4].loss < s1[1].loss
    assert any(c.group == "pp" for c in collectives(sp[0]))
    assert manifest(tmp_path, "pp")["layout"]["virtual_stages"] == 2
    # every pipeline send is recorded on its directed link and pairs with the peer's recv of the same seq (the
    # interleaved schedule posts its recvs ahead and waits for them later: a recv arrives when it is waited for)
    p2p = {(c.group, c.seq, c.op): c for r in (0, 1) for c in collectives(sp[r]) if c.op in ("send", "recv")}
    sends = {(g, q) for g, q, op in p2p if op == "send"}
    assert sends and sends == {(g, q) for g, q, op in p2p if op == "recv"}
    assert {g for g, _ in sends} == {"pp:0>1", "pp:1>0"}
    assert all(c.t_done is not None and c.t_done >= c.t_arrive for c in p2p.values())
    assert all(members(sp)[c.comm_id] == sorted([int(c.group[3]), int(c.group[5])]) for c in p2p.values())


def test_dp2_tp2(tmp_path):
    """2 x 2 (dp=2 FSDP2 x tp=2) on 4 ranks: = reference on the global batch."""
    n = 4
    res = torchrun(4, TINY + ["--steps", str(n), "--dp", "2", "--tp", "2"], tmp_path, "dp2tp2")
    check_ok(res)
    sp = spool(tmp_path, "dp2tp2")
    assert sorted(sp) == [0, 1, 2, 3]
    ref, ref_norms = reference_losses(n, batch=8)
    by = {r: steps(sp[r]) for r in sp}
    for k in range(1, n + 1):
        dp_losses = {by[r][k].dp_rank: by[r][k].loss for r in by}
        assert abs(mean(dp_losses.values()) - ref[k - 1]) < 2e-4, (k, dp_losses, ref[k - 1])
        assert abs(by[0][k].grad_norm - ref_norms[k - 1]) < 2e-4
    assert by[0][n].loss < by[0][1].loss


def test_pp2_dp2_tp2(tmp_path):
    """2 x 2 x 2 (pp=2, dp=2, tp=2) on 8 ranks: = reference, every rank reports; the
    few_microbatches config fault runs the pipeline with M = pp = 2 and is ground truth."""
    n = 4
    res = torchrun(8, TINY + ["--steps", str(n), "--pp", "2", "--dp", "2", "--tp", "2", "--microbatches", "4",
                              "--inject", "few_microbatches"], tmp_path, "3d", timeout=400)
    check_ok(res)
    sp = spool(tmp_path, "3d")
    assert sorted(sp) == list(range(8))
    layout = {(s.pp_stage, s.dp_rank, s.tp_rank) for r in sp for s in steps(sp[r]).values()}
    assert len(layout) == 8
    last = [r for r in sp if steps(sp[r])[1].pp_stage == 1]
    ref, _ = reference_losses(n, batch=8)
    for k in range(1, n + 1):
        dp_losses = {steps(sp[r])[k].dp_rank: steps(sp[r])[k].loss for r in last}
        assert abs(mean(dp_losses.values()) - ref[k - 1]) < 5e-4, (k, dp_losses, ref[k - 1])
    assert steps(sp[0])[n].loss < steps(sp[0])[1].loss
    assert all(s.microbatches == 2 for r in sp for s in steps(sp[r]).values())
    m = manifest(tmp_path, "3d")
    assert m["layout"]["microbatches"] == 2 and m["faults"][0]["kind"] == "few_microbatches"
    assert m["faults"][0]["onset_t"] is not None and len(events(sp[5], "fault_start")) == 1


def test_pp_fp16_overflow_then_hang(tmp_path):
    """fp16 with PP=2 (FSDP2, ShardedGradScaler): an overflow injected on stage 0 (which has no loss
    and never calls scaler.scale itself) skips the step and halves the scale on both stages,
    because found_inf is agreed over the pp group. Then a hang on rank 1: it never reaches its
    next collective/p2p; rank 0 times out waiting for it and records the wait that never completed."""
    res = torchrun(2, TINY + ["--steps", "8", "--pp", "2", "--dp-mode", "fsdp", "--precision", "fp16",
                              "--pg-timeout", "10", "--inject", "fp16_overflow:rank=0,start=3,end=3",
                              "--inject", "hang:rank=1,start=5"], tmp_path, "fp16", timeout=240)
    assert res.returncode != 0  # the job dies of the hang
    sp = spool(tmp_path, "fp16")
    s0, s1 = steps(sp[0]), steps(sp[1])
    for st in (s0, s1):
        assert [st[k].skipped for k in (1, 2, 3, 4)] == [False, False, True, False]
        assert st[3].overflow and st[3].loss_scale == st[2].loss_scale / 2 == st[4].loss_scale
        assert sorted(st) == [1, 2, 3, 4]  # step 5 never completed
    assert events(sp[0], "overflow")[0].step == 3
    # hang: rank 1 announced it and never arrived; rank 0 entered a wait that never completed
    assert events(sp[1], "hang_entered")[0].step == 5
    assert not [c for c in collectives(sp[1]) if c.step == 5 and c.t_done is None]
    stuck = [c for c in collectives(sp[0]) if c.step == 5 and c.t_done is None]
    assert stuck and set(members(sp)[stuck[0].comm_id]) == {0, 1} and stuck[0].op in ("send", "recv")
    assert "finished" not in [e.detail["reason"] for e in events(sp[0], "exit")]


def test_pp2_dp2_ddp_few_microbatches_mfu(tmp_path):
    """pp=2 x dp=2 with DDP and the few_microbatches fault (M = pp = 2): trains to the reference
    (DDP's bucket rebuild used to crash step 2 of a pipeline with so few micro-batches); no
    stage reports a non-finite loss on step 1; the fault is ground truth in the manifest. And
    the MFU any rank achieves (flops / step time / the manifest's peak) stays <= 100 %."""
    n = 4
    res = torchrun(4, TINY + ["--steps", str(n), "--pp", "2", "--dp", "2", "--dp-mode", "ddp",
                              "--inject", "few_microbatches"], tmp_path, "ppddp")
    check_ok(res)
    sp = spool(tmp_path, "ppddp")
    by = {r: steps(sp[r]) for r in sp}
    assert sorted(by) == [0, 1, 2, 3] and all(sorted(st) == list(range(1, n + 1)) for st in by.values())
    ref, _ = reference_losses(n, batch=8)
    for k in range(1, n + 1):
        dp_losses = {by[r][k].dp_rank: by[r][k].loss for r in by if by[r][k].pp_stage == 1}
        assert abs(mean(dp_losses.values()) - ref[k - 1]) < 5e-4, (k, dp_losses, ref[k - 1])
    for st in by.values():
        assert all(not s.loss_nonfinite and s.loss is not None and not s.skipped for s in st.values())
        assert all(s.microbatches == 2 for s in st.values())
    m = manifest(tmp_path, "ppddp")
    assert m["layout"]["dp_mode"] == "ddp" and m["layout"]["microbatches"] == 2
    assert [f["kind"] for f in m["faults"]] == ["few_microbatches"] and m["faults"][0]["onset_t"] is not None
    assert all(len(events(sp[r], "fault_start")) == 1 for r in sp)
    # the CPU peak is an upper bound for what one rank does (measured alone, larger matmuls)
    assert "barrier" in m["peak_source"] and "1024x1024" in m["peak_source"] and m["peak_simulated"]
    mfu = [s.flops / (s.step_ms / 1000.0) / m["peak_flops"] for st in by.values() for s in st.values()]
    assert 0 < max(mfu) <= 1.0, max(mfu)


def test_no_instrument_baseline(tmp_path):
    """--no-instrument (the overhead baseline) trains and writes no spool and no simulated GPU state."""
    res = torchrun(2, TINY + ["--steps", "3", "--no-instrument"], tmp_path, "bare", timeout=120)
    check_ok(res)
    run = RunDir(tmp_path, "bare")
    assert not run.spool(0).exists() and not run.spool(1).exists()
    assert not run.simgpu_dir.exists()
    m = manifest(tmp_path, "bare")
    assert m["config"]["instrument"] is False and m["finished"] is not None
