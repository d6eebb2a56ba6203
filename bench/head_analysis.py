"""CPU of one live analysis round on the head: the whole live window vs the bounded analysis window.

    .venv/bin/python bench/head_analysis.py [--ranks 8,64] [--window 512] [--analyze-windows 0,256,128] [--rounds 5]

The head (``agent.head.Head``) analyzes each run every ``--analyze-interval`` seconds: it turns the
live window into DataFrames (``RunLive.frames``) and runs every analyzer (``analyzers.run_all``)
on them. Before ``--analyze-window`` a round read the whole live window (``--window``, 512 steps
per rank), so its cost grew with the run until the window was full; now it reads the last
``--analyze-window`` steps per rank (default 256).

For each rank count, one synthetic run fills a full live window (``--window`` steps per rank, 2
collectives per step, one GPU sample per GPU per second, host samples, a manifest), with a
straggler (rank 3 computes 1.3x from step 100, the others wait for it in the gradient sync).
The same data goes into one head per configuration: ``frames()`` as of ``--before-rev`` (the
code before), and the current code with each ``--analyze-windows`` value (0 = the whole live
window). The heads take their ``--rounds`` rounds in turn (``Head.analyze_once``, the real
analyzers; the analyzers' clock pinned to just after the last step, so no round sees a silent
job); reported: the median main-thread CPU ms per round (pyarrow on one thread), the
straggler episode each head holds (its onset must be the same), and the cost of a round the
head skips because nothing new arrived (``Head.analyze_if_due``).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402

pa.set_cpu_count(1)
pa.set_io_thread_count(1)

from agent.head import Head, tune_gc  # noqa: E402
from ranksight import schema  # noqa: E402

RUN = "bench-analysis"
STEP_S = 0.062
ONSET = 100


def build(ranks: int, steps: int, seed: int = 1, t_last: float | None = None) -> dict:
    rnd = random.Random(seed)
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
                                                 group_ranks=list(range(ranks)), nbytes=4 << 20,
                                                 t_arrive=base + c / 1000, t_done=base + (slowest + 3.0) / 1000,
                                                 duration_ms=wait + 3.0))
            crows.append(schema.CollectiveRecord(run_id=RUN, rank=r, step=s, seq=2 * s + 1, op="broadcast", group="world",
                                                 group_ranks=list(range(ranks)), nbytes=8, t_arrive=t_end - 0.001,
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


def old_frames(rev: str):
    """``RunLive.frames`` as it was at git revision ``rev`` (the code before the analysis window), or None."""
    import subprocess
    import types

    try:
        src = subprocess.run(["git", "show", f"{rev}:agent/live.py"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    mod = types.ModuleType("agent._live_before")
    mod.__file__ = f"{rev}:agent/live.py"
    sys.modules[mod.__name__] = mod  # its dataclasses look their module up
    exec(compile(src, mod.__file__, "exec"), mod.__dict__)
    return mod.RunLive.frames


def make_head(root: Path, data: dict, window: int, analyze_window: int | None, frames_fn=None) -> Head:
    h = Head(root, "bench-token", window=window, analyze_window=analyze_window)
    live = h.run_live(RUN)
    new_frames = live.frames

    def frames(window=None):
        # the old code took no window: it always read the whole live window
        fr = frames_fn(live) if frames_fn is not None else new_frames(window)
        fr["now"] = data["now"]  # the clock pinned to just after the last step: rounds later are no silent job
        return fr

    live.frames = frames
    live.manifest = data["manifest"]
    for srows, crows in data["batches"]:
        live.add("steps", srows)
        live.add("collectives", crows)
    live.add("gpu", data["gpu"])
    live.add("host", data["host"])
    return h


def cpu_ms(fn) -> float:
    t0 = time.thread_time()
    fn()
    return (time.thread_time() - t0) * 1000.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="8,64")
    ap.add_argument("--window", type=int, default=512, help="the live window (ranksight head --window)")
    ap.add_argument("--analyze-windows", default="0,256,128", help="0 = the whole live window (before)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--before-rev", default="99d07a2",
                    help="also run the live window's frames() as of this git revision (before the analysis window)")
    args = ap.parse_args(argv)
    wins = [int(w) for w in args.analyze_windows.split(",")]
    before = old_frames(args.before_rev) if args.before_rev else None
    configs = ([(f"{args.window} (frames() of {args.before_rev}: before)", None, before)] if before else []) + [
        (f"{w}" if w else f"{args.window} (whole live window)", w or None, None) for w in wins]
    tune_gc()  # as ranksight head does
    tmp = Path(tempfile.mkdtemp(prefix="rs-head-analysis-"))
    print(f"bench/head_analysis.py: live window {args.window} steps per rank; {args.rounds} rounds per head; "
          f"load average {' / '.join(f'{x:.2f}' for x in os.getloadavg())}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    header = "| ranks | analysis window (steps per rank) | CPU ms per round, median [min, max] | vs before | straggler episode of a fresh head (ranks, from step) | findings | a round skipped (nothing new), CPU ms |"
    print(header)
    print("|---|---|---|---|---|---|---|")
    try:
        for n in [int(x) for x in args.ranks.split(",")]:
            data = build(n, args.window)
            heads = [make_head(tmp / f"r{n}-{i}", data, args.window, w, fn) for i, (_, w, fn) in enumerate(configs)]
            del data
            gc.collect()
            gc.freeze()  # what exists now (the heads' windows) is never scanned, as in the head after tune_gc()
            try:
                times: list[list[float]] = [[] for _ in heads]
                for _ in range(args.rounds):  # interleaved: every head sees the same machine within seconds
                    for i, h in enumerate(heads):
                        times[i].append(cpu_ms(lambda: h.analyze_once(RUN)))
                base = statistics.median(times[0])
                for (label, _, _), h, ts in zip(configs, heads, times):
                    assert h.stats["analyzer_errors"] == 0
                    med = statistics.median(ts)
                    eps = h.findings[RUN].current()
                    ep = ", ".join(f"{e.ranks} from {e.step_start}" for e in eps if e.kind == "straggler") or "none"
                    h.analyze_if_due(RUN)  # sets the mark: nothing new after it
                    skip = statistics.median(cpu_ms(lambda: h.analyze_if_due(RUN)) for _ in range(20))
                    print(f"| {n} | {label} | {med:.1f} [{min(ts):.1f}, {max(ts):.1f}] | {med / base:.2f}x | {ep} | "
                          f"{', '.join(sorted(f'{e.analyzer}/{e.kind}' for e in eps))} | {skip:.3f} |", flush=True)
            finally:
                for h in heads:
                    h.close()
                gc.unfreeze()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
