"""CPU of one live analysis round on the head, before and after a change to the analysis code, 8 to 16,384 ranks.

    .venv/bin/python bench/head_analysis.py [--ranks 8,64,256,1024] [--rounds 5] [--before-rev 7ccdc35]
        [--before-max-ranks 256] [--window 512] [--analyze-window 256] [--group-size 64] [--layout flat|3d]
    # a 3-D parallel job at scale (TP 8, PP 4, DP the rest: 512-rank DP groups at 16,384 ranks), every GPU's last
    # 60 s of samples in the window (--gpu-seconds)
    .venv/bin/python bench/head_analysis.py --layout 3d --ranks 1024,4096,16384 --before-max-ranks 1024

``--layout 3d`` (``build_3d``) builds the window column-wise, as the head's store processing hands it Arrow
batches, with the communicators of a 3-D parallel job named by ``comm_id`` (``CommunicatorRecord``), the form
``ranksight.instrument`` writes; ``--layout flat`` (the default, the H1-H4 rows) is the run described below.

The head (``head.service.Head``, its ``head.analysis.LiveAnalysis``) analyzes each run every
``--analyze-interval`` seconds (5 s): it turns the last ``--analyze-window`` steps per rank of its live window
(fewer above 4,096 ranks: ``head.analysis.round_window``, 64 at 16,384) into the analyzers' ``RunData``
(``RunLive.run_data``) and runs every analyzer on it (``analyzers.run_all``).

For each rank count, one synthetic run fills a full live window (``--window`` steps per rank, 2 collectives
per step on communicators of ``--group-size`` consecutive ranks, one GPU sample per GPU per second, host
samples, a manifest), with a straggler (rank 3 computes 1.3x from step 100, the others wait for it in the
gradient sync). It is analyzed by two heads in two processes, one after the other:

- *before*: the code as of ``--before-rev`` (from a temporary git worktree; a revision from before the ``head``
  package had the head in ``agent/head.py``, and its live window handed the analyzers a dict of DataFrames:
  ``make_head`` and ``worker`` take either), only up to ``--before-max-ranks`` ranks (at 1024 ranks it needs
  minutes a round);
- *now*: the working tree.

Each takes ``--rounds`` rounds (``LiveAnalysis.analyze_once``, the real analyzers; the analyzers' clock pinned
to just after the last step, so no round sees a silent job; fewer rounds at 256 ranks and up, see
``rounds_for``; the same number for both). Reported: the steps per rank a round looked at, the median main-thread CPU ms per round (pyarrow
on one thread), the ratio, the worker's peak RSS (the live window, the synthetic run it came from, a round), the
findings of the fresh head (they must be the same), and the cost of a round the head skips because nothing
new arrived (``LiveAnalysis.analyze_if_due``) and the live window's size (steps / collectives / GPU samples, MiB of
Arrow buffers). Ratios, not absolute times, are what carries over: the machine is
shared and noisy.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the code measured: the working tree, or (the "before" worker) a worktree of --before-rev
CODE = Path(os.environ.get("RS_BENCH_CODE", ROOT))
sys.path.insert(0, str(CODE))

import pyarrow as pa  # noqa: E402

pa.set_cpu_count(1)
pa.set_io_thread_count(1)

try:
    from head.service import Head, tune_gc  # noqa: E402
except ImportError:  # the "before" worker at a revision from before the head package
    from agent.head import Head, tune_gc  # noqa: E402
from ranksight import schema  # noqa: E402

RUN = "bench-analysis"
STEP_S = 0.062
ONSET = 100


def build(ranks: int, steps: int, seed: int = 1, t_last: float | None = None, group_size: int = 64) -> dict:
    """The synthetic run. Collectives run on communicators of ``group_size`` consecutive ranks (one communicator
    at 8 and 64 ranks; a 1024-rank job with world-sized member lists would hold 1024 x 1024 x 1024 ranks in
    its live window)."""
    rnd = random.Random(seed)
    gs = max(1, min(group_size, ranks))
    members = {r: list(range(r - r % gs, min(ranks, r - r % gs + gs))) for r in range(ranks)}
    per_node = 8
    t_last = time.time() - 0.5 if t_last is None else t_last
    t0 = t_last - steps * STEP_S
    manifest = schema.Manifest(
        run_id=RUN, created=t0 - 5, start_time=t0 - 1, layout={"dp": ranks, "tp": 1, "pp": 1, "world": ranks},
        nodes=max(1, ranks // per_node), device="cpu", flops_per_token=6 * 1.1e6, peak_flops=2.0e11,
        peak_source="bench", ranks=[schema.RankPlacement(rank=r, node=r // per_node, host=f"n{r // per_node}",
                                                         local_rank=r % per_node, pp_stage=0, dp_rank=r, tp_rank=0)
                                    for r in range(ranks)])
    batches = []  # about one second of steps (all ranks) per batch, as the head's flushes deliver them
    per_batch = max(1, round(1.0 / STEP_S))
    srows, crows = [], []
    for s in range(steps):
        base = t0 + s * STEP_S
        compute = {r: 52.0 * rnd.uniform(0.98, 1.02) * (1.3 if (r == 3 and s >= ONSET) else 1.0) for r in range(ranks)}
        slowest = max(compute.values())
        for r in range(ranks):
            c = compute[r]
            wait = slowest - c
            comm = 4.0 + wait
            t_end = base + STEP_S
            srows.append(schema.StepRecord(
                run_id=RUN, rank=r, step=s, node=r // per_node, host=f"n{r // per_node}", world_size=ranks, dp_rank=r,
                t_start=base, t_end=t_end, step_ms=STEP_S * 1000, data_ms=1.0, forward_ms=c / 3, backward_ms=2 * c / 3,
                optimizer_ms=2.0, comm_ms=comm, compute_ms=c, device_ms=c, sync_arrival=base + c / 1000,
                sync_wait_ms=wait, tokens=512, loss=3.0 - s * 1e-3, grad_norm=1.0, lr=3e-4, mem_bytes=2 << 30,
                flops=6 * 1.1e6 * 512))
            crows.append(schema.CollectiveRecord(run_id=RUN, rank=r, step=s, seq=2 * s, op="all_reduce", group="dp",
                                                 group_ranks=members[r], nbytes=4 << 20,
                                                 t_arrive=base + c / 1000, t_done=base + (slowest + 3.0) / 1000,
                                                 duration_ms=wait + 3.0))
            crows.append(schema.CollectiveRecord(run_id=RUN, rank=r, step=s, seq=2 * s + 1, op="broadcast", group="world",
                                                 group_ranks=members[r], nbytes=8, t_arrive=t_end - 0.001,
                                                 t_done=t_end, duration_ms=1.0))
        if (s + 1) % per_batch == 0 or s == steps - 1:
            batches.append((srows, crows))
            srows, crows = [], []
    gpu, host = [], []
    for sec in range(int(steps * STEP_S) + 1):
        t = t0 + sec
        for r in range(ranks):
            gpu.append(schema.GpuSample(node=r // per_node, host=f"n{r // per_node}", gpu=r % per_node, t=t, source="sim",
                                        simulated=True, name="Simulated GPU", uuid=f"GPU-{r}", util_pct=90.0,
                                        mem_used_bytes=2 << 30, mem_total_bytes=80 << 30, power_w=300.0,
                                        power_limit_w=700.0, temp_c=60.0, sm_clock_mhz=1980.0, max_sm_clock_mhz=1980.0,
                                        throttle_reasons=0, xid_total=0))
        for n in range(max(1, ranks // per_node)):
            host.append(schema.HostSample(node=n, host=f"n{n}", t=t, cpu_pct=50.0, load1=2.0, mem_used_bytes=1 << 33,
                                          mem_total_bytes=1 << 35, net_rx_bytes=0, net_tx_bytes=0, disk_read_bytes=0,
                                          disk_write_bytes=0))
    return {"manifest": manifest, "batches": batches, "gpu": gpu, "host": host, "now": t_last + 0.5}


def layout_3d(ranks: int, tp: int = 8, pp: int = 4) -> tuple[int, int, int]:
    """(tp, pp, dp) of a ``ranks``-rank job: TP ``tp`` within a node, PP ``pp``, DP the rest (smaller TP/PP where the
    job is too small for them)."""
    tp = max(1, min(tp, ranks))
    pp = max(1, min(pp, ranks // tp))
    return tp, pp, max(1, ranks // (tp * pp))


def build_3d(ranks: int, steps: int, seed: int = 1, t_last: float | None = None,
             gpu_seconds: int = 60) -> dict:
    """The synthetic run of a 3-D parallel job, built column-wise (Arrow tables, as the head's store processing hands
    them to the live window): TP 8 (one node's GPUs), PP 4, DP the rest (512 ranks per DP group at 16,384 ranks).
    Megatron's rank order: tp fastest, then dp, then pp. Each step, each rank records its gradient sync (an
    all_reduce on its DP communicator, where it waits for the slowest rank) and a tensor-parallel all_reduce on its TP
    communicator; both name their communicator by ``comm_id`` (``CommunicatorRecord``s, one per group), as
    ``ranksight.instrument`` writes them. Rank 3 computes 1.3x from step ``ONSET``. GPU samples: ``gpu_seconds`` of
    every GPU (``fleet_gpu_batches``); host samples: those the live window's bounded deque keeps."""
    import numpy as np
    import pyarrow as pa

    from ranksight.tables import SPECS

    tp, pp, dp = layout_3d(ranks)
    world = tp * pp * dp
    ranks = world
    rng = np.random.default_rng(seed)
    per_node = 8
    t_last = time.time() - 0.5 if t_last is None else t_last
    t0 = t_last - steps * STEP_S
    r_all = np.arange(ranks, dtype=np.int64)
    tp_rank, dp_rank, pp_stage = r_all % tp, (r_all // tp) % dp, r_all // (tp * dp)
    node = r_all // per_node
    hosts = pa.array([f"n{n}" for n in range(int(node.max()) + 1)])
    # communicators: tp groups (consecutive ranks), dp groups (stride tp), pp groups (stride tp*dp)
    comms, tp_cid, dp_cid = [], np.empty(ranks, object), np.empty(ranks, object)
    for p in range(pp):
        for d in range(dp):
            members = [p * tp * dp + d * tp + t for t in range(tp)]
            cid = schema.communicator_id("tp", members)
            comms.append(schema.CommunicatorRecord(run_id=RUN, comm_id=cid, group="tp", ranks=members, rank=members[0]))
            tp_cid[members] = cid
        for t in range(tp):
            members = [p * tp * dp + d * tp + t for d in range(dp)]
            cid = schema.communicator_id("dp", members)
            comms.append(schema.CommunicatorRecord(run_id=RUN, comm_id=cid, group="dp", ranks=members, rank=members[0]))
            dp_cid[members] = cid
    for i in range(tp * dp):
        members = [p * tp * dp + i for p in range(pp)]
        comms.append(schema.CommunicatorRecord(run_id=RUN, comm_id=schema.communicator_id("pp", members), group="pp",
                                               ranks=members, rank=members[0]))
    manifest = schema.Manifest(
        run_id=RUN, created=t0 - 5, start_time=t0 - 1, layout={"dp": dp, "tp": tp, "pp": pp, "world": world},
        nodes=int(node.max()) + 1, device="cpu", flops_per_token=6 * 1.1e6, peak_flops=2.0e11, peak_source="bench",
        ranks=[schema.RankPlacement(rank=r, node=r // per_node, host=f"n{r // per_node}", local_rank=r % per_node,
                                    pp_stage=int(pp_stage[r]), dp_rank=int(dp_rank[r]), tp_rank=int(tp_rank[r]))
               for r in range(ranks)])
    per_batch = max(1, round(1.0 / STEP_S))
    st_schema, co_schema = SPECS["steps"].schema, SPECS["collectives"].schema
    batches = []
    for b0 in range(0, steps, per_batch):
        s = np.arange(b0, min(steps, b0 + per_batch), dtype=np.int64)
        n = len(s) * ranks
        compute = 52.0 * rng.uniform(0.98, 1.02, size=(len(s), ranks))
        compute[s >= ONSET, 3] *= 1.3
        wait = compute.max(axis=1, keepdims=True) - compute
        base = np.repeat(t0 + s * STEP_S, ranks)
        rank = np.tile(r_all, len(s))
        step = np.repeat(s, ranks)
        c, w = compute.ravel(), wait.ravel()
        f = lambda v: pa.array(np.broadcast_to(np.asarray(v, np.float64), (n,)))  # noqa: E731
        i = lambda v: pa.array(np.broadcast_to(np.asarray(v, np.int64), (n,)))  # noqa: E731
        cols = dict(run_id=pa.array([RUN] * n), rank=pa.array(rank), step=pa.array(step), node=pa.array(node[rank]),
                    host=hosts.take(pa.array(node[rank])), attempt=i(0), world_size=i(world),
                    pp_stage=pa.array(pp_stage[rank]), dp_rank=pa.array(dp_rank[rank]), tp_rank=pa.array(tp_rank[rank]),
                    t_start=pa.array(base), t_end=pa.array(base + STEP_S), step_ms=f(STEP_S * 1000), data_ms=f(1.0),
                    forward_ms=pa.array(c / 3), backward_ms=pa.array(2 * c / 3), optimizer_ms=f(2.0),
                    comm_ms=pa.array(5.0 + w), pipeline_wait_ms=f(0.0), compute_ms=pa.array(c),
                    sync_arrival=pa.array(base + c / 1000), sync_wait_ms=pa.array(w), tokens=i(512),
                    loss=pa.array(3.0 - step * 1e-3), loss_nonfinite=pa.array(np.zeros(n, bool)), grad_norm=f(1.0),
                    loss_scale=pa.nulls(n, pa.float64()), overflow=pa.array(np.zeros(n, bool)),
                    skipped=pa.array(np.zeros(n, bool)), lr=f(3e-4), mem_bytes=i(2 << 30), flops=f(6 * 1.1e6 * 512),
                    profiling=pa.array(np.zeros(n, bool)), microbatches=i(1), device_ms=pa.array(c))
        srows = pa.Table.from_arrays([cols[k] for k in st_schema.names], schema=st_schema)
        # two collectives per rank and step, rank-major within a step as a rank's records arrive
        arrive = np.stack([base + c / 1000, base + c / 1000 - 0.003], axis=1).ravel()
        done = np.stack([base + (c + w + 3.0) / 1000, base + c / 1000 - 0.002], axis=1).ravel()
        m = 2 * n
        empty = pa.ListArray.from_arrays(pa.array(np.zeros(m + 1, np.int32)), pa.array([], pa.int64()))
        which = np.tile(np.array([0, 1]), n)
        ccols = dict(run_id=pa.array([RUN] * m), rank=pa.array(np.repeat(rank, 2)), step=pa.array(np.repeat(step, 2)),
                     seq=pa.array(np.repeat(step, 2) * 2 + which), op=pa.array(["all_reduce"] * m),
                     group=pa.array(np.where(which == 0, "dp", "tp")), group_ranks=empty,
                     nbytes=pa.array(np.where(which == 0, 4 << 20, 1 << 20).astype(np.int64)),
                     t_arrive=pa.array(arrive), t_done=pa.array(done),
                     duration_ms=pa.array(np.stack([w + 3.0, np.ones(n)], axis=1).ravel()),
                     attempt=pa.array(np.zeros(m, np.int64)), ops=pa.array(np.ones(m, np.int64)))
        # the comm_id: the DP group's for the gradient sync rows, the TP group's for the others
        rr = np.repeat(rank, 2)
        ccols["comm_id"] = pa.array(np.where(which == 0, dp_cid[rr], tp_cid[rr]).tolist(), pa.string())
        crows = pa.Table.from_arrays([ccols[k] for k in co_schema.names], schema=co_schema)
        batches.append((srows, crows))
    # GPU samples as a fleet sends them: every GPU once a second, one batch per second of the whole fleet (as the
    # head's store processing hands them to the live window), ``gpu_seconds`` of them (the live window keeps about
    # GPU_SAMPLES_PER_GPU per GPU); host samples: those the live window's bounded deque keeps
    gpu = fleet_gpu_batches(ranks, t_last, gpu_seconds, seed=seed)
    host = []
    secs = int(steps * STEP_S) + 1
    for sec in range(secs - 1, -1, -1):
        if len(host) >= 16 * 120:
            break
        t = t0 + sec
        host[:0] = [schema.HostSample(node=nd, host=f"n{nd}", t=t, cpu_pct=50.0, load1=2.0, mem_used_bytes=1 << 33,
                                      mem_total_bytes=1 << 35, net_rx_bytes=0, net_tx_bytes=0, disk_read_bytes=0,
                                      disk_write_bytes=0) for nd in range(int(node.max()) + 1)]
    return {"manifest": manifest, "batches": batches, "gpu": gpu, "host": host, "comms": comms, "now": t_last + 0.5}


THROTTLED_GPU = (-1, 5)  # (node, gpu) throttled in the 3-D run's GPU samples: the last node's GPU 5 (not rank 3's)


def fleet_gpu_batches(ranks: int, t_last: float, seconds: int, seed: int = 1, per_node: int = 8) -> list:
    """GPU samples of a ``ranks``-GPU fleet (one GPU per rank, ``per_node`` per node) as an NVML agent sends them:
    every GPU once a second for ``seconds`` seconds up to ``t_last``, one Arrow table (the store's schema) per second of
    the whole fleet. The readings vary a little from sample to sample; one GPU (``THROTTLED_GPU``) is held at a low
    clock by HW slowdown, which the gpu_health check must name. Simulated (the run's ranks are CPU processes), so the
    findings do not depend on a real device's peak."""
    import numpy as np
    import pyarrow as pa

    from ranksight.simgpu import THROTTLE_HW_SLOWDOWN
    from ranksight.tables import SPECS

    rng = np.random.default_rng(seed + 7)
    spec = SPECS["gpu"].schema
    g = np.arange(ranks, dtype=np.int64)
    node, local = g // per_node, g % per_node
    bad = (node == (int(node.max()) if THROTTLED_GPU[0] < 0 else THROTTLED_GPU[0])) & (local == THROTTLED_GPU[1])
    hosts = pa.array([f"n{n}" for n in node])
    uuids = pa.array([f"GPU-{i:08x}-5a1e-4c2b-9f3d-{i:012x}" for i in g])
    out = []
    for sec in range(seconds):
        t = t_last - (seconds - 1 - sec)
        n = ranks
        f = lambda v: pa.array(np.asarray(v, np.float64))  # noqa: E731
        cols = dict(
            run_id=pa.array([RUN] * n), node=pa.array(node), host=hosts, gpu=pa.array(local), t=f(np.full(n, t)),
            source=pa.array(["sim"] * n), simulated=pa.array(np.ones(n, bool)), name=pa.array(["Simulated GPU"] * n),
            uuid=uuids, util_pct=f(rng.uniform(88, 99, n).round(0)), mem_util_pct=f(rng.uniform(30, 60, n).round(0)),
            mem_used_bytes=pa.array(np.full(n, 62 << 30, np.int64)), mem_total_bytes=pa.array(np.full(n, 80 << 30, np.int64)),
            power_w=f(rng.uniform(280, 340, n).round(1)), power_limit_w=f(np.full(n, 700.0)),
            temp_c=f(rng.uniform(55, 68, n).round(0)), sm_clock_mhz=f(np.where(bad, 1100.0, 1980.0)),
            mem_clock_mhz=f(np.full(n, 2619.0)), max_sm_clock_mhz=f(np.full(n, 1980.0)),
            throttle_reasons=pa.array(np.where(bad, THROTTLE_HW_SLOWDOWN, 0).astype(np.int64)),
            throttle_names=pa.array([["hw_slowdown"] if b else [] for b in bad], pa.list_(pa.string())),
            ecc_sbe=pa.array(np.zeros(n, np.int64)), ecc_dbe=pa.array(np.zeros(n, np.int64)),
            retired_pages=pa.array(np.zeros(n, np.int64)), remapped_rows=pa.array(np.zeros(n, np.int64)),
            pcie_tx_bytes_s=f(rng.uniform(1e9, 2e9, n).round(0)), pcie_rx_bytes_s=f(rng.uniform(1e9, 2e9, n).round(0)),
            nvlink_tx_bytes_s=f(rng.uniform(5e10, 8e10, n).round(0)), nvlink_rx_bytes_s=f(rng.uniform(5e10, 8e10, n).round(0)),
            xid_total=pa.array(np.zeros(n, np.int64)))
        out.append(pa.Table.from_arrays([pa.array(cols[k], spec.field(k).type) if not isinstance(cols[k], pa.Array)
                                         else cols[k].cast(spec.field(k).type) for k in spec.names], schema=spec))
    return out


def make_head(root: Path, data: dict, window: int, analyze_window: int | None) -> Head:
    """A head whose live window holds the synthetic run, its analysis clock pinned to just after the last step
    (rounds run later see no silent job)."""
    h = Head(root, "bench-token", window=window, analyze_window=analyze_window)
    now = data["now"]
    if hasattr(h, "analysis"):
        h.analysis.clock = lambda: now
        live = h.live.run(RUN)
    else:  # a head from before head/analysis.py: the live window handed the analyzers a dict with "now"
        live = h.run_live(RUN)
        frames = live.frames
        live.frames = lambda window=None: {**frames(window), "now": now}
    live.manifest = data["manifest"]
    if data.get("comms"):
        live.add("communicators", data["comms"])
    for srows, crows in data["batches"]:
        if isinstance(srows, list):
            live.add("steps", srows)
            live.add("collectives", crows)
        else:  # Arrow tables (build_3d), as the head's store processing hands them over
            live.add_arrow("steps", srows)
            live.add_arrow("collectives", crows)
    if data["gpu"] and not isinstance(data["gpu"][0], schema.GpuSample):  # Arrow batches (build_3d)
        for t in data["gpu"]:
            live.add_arrow("gpu", t)
    else:
        live.add("gpu", data["gpu"])
    live.add("host", data["host"])
    return h


def cpu_ms(fn) -> float:
    """The CPU of ``fn`` in this thread plus that of the children it forked and reaped (a head forks a large live
    round's analyzers into a child: head/forked_round.py)."""
    def children() -> float:
        t = os.times()
        return t.children_user + t.children_system

    t0, c0 = time.thread_time(), children()
    fn()
    return (time.thread_time() - t0 + children() - c0) * 1000.0


def rounds_for(ranks: int, rounds: int) -> int:
    """Fewer rounds where one takes seconds: at most 3 from 256 ranks on."""
    return rounds if ranks < 256 else max(1, min(rounds, 3))


def worker(ranks: int, rounds: int, window: int, analyze_window: int, group_size: int, layout: str = "flat",
           gpu_seconds: int = 60) -> dict:
    """One head over one synthetic run: CPU ms of each round, its findings, a skipped round's cost."""
    tune_gc()  # as ranksight head does
    tmp = Path(tempfile.mkdtemp(prefix="rs-head-analysis-"))
    try:
        data = build_3d(ranks, window, gpu_seconds=gpu_seconds) if layout == "3d" else build(ranks, window, group_size=group_size)
        h = make_head(tmp / "head", data, window, analyze_window)
        analysis = getattr(h, "analysis", h)  # a head from before head/analysis.py analyzes itself
        del data
        gc.collect()
        gc.freeze()  # what exists now (the head's window) is never scanned, as in the head after tune_gc()
        try:
            times = [cpu_ms(lambda: analysis.analyze_once(RUN)) for _ in range(rounds)]
            assert h.stats["analyzer_errors"] == 0
            eps = analysis.findings[RUN].current()
            analysis.analyze_if_due(RUN)  # sets the mark: nothing new after it
            skip = statistics.median(cpu_ms(lambda: analysis.analyze_if_due(RUN)) for _ in range(20))
            try:  # the steps per rank a round looked at (a head from before head.analysis.round_window: its window)
                from head.analysis import round_window
                k = round_window(analysis.window, h.live.run(RUN).n_ranks(), analysis.round_rows)
            except (ImportError, AttributeError):
                k = analyze_window
            live = h.live.run(RUN) if hasattr(h, "live") else None
            return dict(times=times, skip=skip, analysed=k, window_mib=window_mib(live),
                        peak_rss_gib=round(max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,  # or a forked round's child's
                                               resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 2**20, 2),
                        straggler=", ".join(f"{e.ranks} from {e.step_start}" for e in eps if e.kind == "straggler") or "none",
                        findings=", ".join(sorted(f"{e.analyzer}/{e.kind}" for e in eps)))
        finally:
            h.close()
            gc.unfreeze()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def window_mib(live) -> str:
    """The live window's Arrow buffers in MiB: steps / collectives / GPU samples, each buffer counted once however
    many batches share it (a dictionary) ("-" where the window is not kept as Arrow batches)."""
    def walk(arr, seen):
        for b in arr.buffers():
            if b is not None:
                seen[b.address] = b.size
        if pa.types.is_dictionary(arr.type):
            walk(arr.dictionary, seen)

    def mib(name):
        chunks = getattr(live, name, None)
        if chunks is None:
            return "-"
        seen: dict[int, int] = {}
        for t in chunks:
            for col in t.columns:
                for chunk in col.chunks:
                    walk(chunk, seen)
        return f"{sum(seen.values()) / 2**20:,.0f}"
    return " / ".join(mib(n) for n in ("_steps", "_colls", "_gpu_arrow"))


def run_worker(code: Path, args, ranks: int, rounds: int) -> dict:
    env = dict(os.environ, RS_BENCH_CODE=str(code), PYTHONPATH=str(code))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--ranks", str(ranks), "--rounds", str(rounds),
           "--window", str(args.window), "--analyze-window", str(args.analyze_window), "--group-size", str(args.group_size),
           "--layout", args.layout, "--gpu-seconds", str(args.gpu_seconds)]
    out = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"worker for {ranks} ranks at {code} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="8,64,256,1024")
    ap.add_argument("--window", type=int, default=512, help="the live window (ranksight head --window)")
    ap.add_argument("--analyze-window", type=int, default=256, help="ranksight head --analyze-window")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--group-size", type=int, default=64, help="ranks per communicator (--layout flat)")
    ap.add_argument("--layout", choices=("flat", "3d"), default="flat",
                    help="flat: one kind of communicator, --group-size consecutive ranks, member lists in every record "
                         "(the H1-H4 rows); 3d: TP 8 x PP 4 x DP the rest, communicators named by comm_id (build_3d)")
    ap.add_argument("--gpu-seconds", type=int, default=60,
                    help="--layout 3d: seconds of GPU samples in the live window, every GPU once a second (the window "
                         "keeps head.live.GPU_SAMPLES_PER_GPU per GPU)")
    ap.add_argument("--before-rev", default="7ccdc35", help="the code before (a git revision; '' for none)")
    ap.add_argument("--before-max-ranks", type=int, default=256)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(int(args.ranks), args.rounds, args.window, args.analyze_window, args.group_size,
                                args.layout, args.gpu_seconds)))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="rs-head-analysis-rev-"))
    before = None
    if args.before_rev:
        subprocess.run(["git", "worktree", "add", "--detach", str(tmp / "before"), args.before_rev], cwd=ROOT,
                       check=True, capture_output=True)
        before = tmp / "before"
    print(f"bench/head_analysis.py: live window {args.window}, analysis window {args.analyze_window} steps per rank, "
          + (f"communicators of {args.group_size} ranks" if args.layout == "flat"
             else f"TP 8 x PP 4 x DP (build_3d), {args.gpu_seconds} s of every GPU's samples")
          + f"; before = {args.before_rev or '-'}; load average "
          f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| ranks | rounds | steps per rank a round looks at (before / now) | before: CPU ms per round, median "
          "[min, max] | now: CPU ms per round | before / now | peak RSS GiB (before / now) | findings of a fresh head "
          "(now) | same as before | a round skipped (nothing new), CPU ms | live window MiB: steps / collectives / GPU "
          "(before; now) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---|")
    try:
        for n in [int(x) for x in args.ranks.split(",")]:
            k = rounds_for(n, args.rounds)
            old = run_worker(before, args, n, k) if before and n <= args.before_max_ranks else None
            new = run_worker(ROOT, args, n, k)
            med = statistics.median(new["times"])
            fmt = lambda r: f"{statistics.median(r['times']):.0f} [{min(r['times']):.0f}, {max(r['times']):.0f}]"  # noqa: E731
            ratio = f"{statistics.median(old['times']) / med:.1f}x" if old else "-"
            same = "-" if old is None else ("yes" if (old["findings"], old["straggler"]) == (new["findings"], new["straggler"])
                                            else f"NO: before {old['findings']}; {old['straggler']}")
            print(f"| {n} | {len(old['times']) if old else '-'} / {k} | {old.get('analysed', '-') if old else '-'} / "
                  f"{new.get('analysed')} | {fmt(old) if old else '-'} | {fmt(new)} | {ratio} | "
                  f"{old.get('peak_rss_gib', '-') if old else '-'} / {new.get('peak_rss_gib')} | "
                  f"{new['findings']}; straggler {new['straggler']} | {same} | {new['skip']:.3f} | "
                  f"{old.get('window_mib', '-') if old else '-'}; {new.get('window_mib', '-')} |", flush=True)
    finally:
        if before is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
