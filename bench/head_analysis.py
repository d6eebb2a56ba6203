"""CPU of one live analysis round on the head, before and after a change to the analysis code, 8 to 1024 ranks.

    .venv/bin/python bench/head_analysis.py [--ranks 8,64,256,1024] [--rounds 5] [--before-rev 64d38ef]
        [--before-max-ranks 256] [--window 512] [--analyze-window 256] [--group-size 64]

The head (``head.service.Head``, its ``head.analysis.LiveAnalysis``) analyzes each run every
``--analyze-interval`` seconds (5 s): it turns the last ``--analyze-window`` steps per rank of its live window
into the analyzers' ``RunData`` (``RunLive.run_data``) and runs every analyzer on it (``analyzers.run_all``).

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
``rounds_for``). Reported: the median main-thread CPU ms per round (pyarrow on one thread), the ratio, the
findings of the fresh head (they must be the same), and the cost of a round the head skips because nothing
new arrived (``LiveAnalysis.analyze_if_due``). Ratios, not absolute times, are what carries over: the machine is
shared and noisy.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
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


def rounds_for(ranks: int, rounds: int) -> int:
    """Fewer rounds where one takes seconds: 3 at 256 ranks, 2 at 1024 and up."""
    return rounds if ranks < 256 else max(1, min(rounds, 3 if ranks < 1024 else 2))


def worker(ranks: int, rounds: int, window: int, analyze_window: int, group_size: int) -> dict:
    """One head over one synthetic run: CPU ms of each round, its findings, a skipped round's cost."""
    tune_gc()  # as ranksight head does
    tmp = Path(tempfile.mkdtemp(prefix="rs-head-analysis-"))
    try:
        data = build(ranks, window, group_size=group_size)
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
            return dict(times=times, skip=skip,
                        straggler=", ".join(f"{e.ranks} from {e.step_start}" for e in eps if e.kind == "straggler") or "none",
                        findings=", ".join(sorted(f"{e.analyzer}/{e.kind}" for e in eps)))
        finally:
            h.close()
            gc.unfreeze()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_worker(code: Path, args, ranks: int, rounds: int) -> dict:
    env = dict(os.environ, RS_BENCH_CODE=str(code), PYTHONPATH=str(code))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--ranks", str(ranks), "--rounds", str(rounds),
           "--window", str(args.window), "--analyze-window", str(args.analyze_window), "--group-size", str(args.group_size)]
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
    ap.add_argument("--group-size", type=int, default=64, help="ranks per communicator")
    ap.add_argument("--before-rev", default="64d38ef", help="the code before (a git revision; '' for none)")
    ap.add_argument("--before-max-ranks", type=int, default=256)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(int(args.ranks), args.rounds, args.window, args.analyze_window, args.group_size)))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="rs-head-analysis-rev-"))
    before = None
    if args.before_rev:
        subprocess.run(["git", "worktree", "add", "--detach", str(tmp / "before"), args.before_rev], cwd=ROOT,
                       check=True, capture_output=True)
        before = tmp / "before"
    print(f"bench/head_analysis.py: live window {args.window}, analysis window {args.analyze_window} steps per rank, "
          f"communicators of {args.group_size} ranks; before = {args.before_rev or '-'}; load average "
          f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| ranks | rounds | before: CPU ms per round, median [min, max] | now: CPU ms per round | before / now | "
          "findings of a fresh head (now) | same as before | a round skipped (nothing new), CPU ms |")
    print("|---:|---:|---:|---:|---:|---|---|---:|")
    try:
        for n in [int(x) for x in args.ranks.split(",")]:
            k = rounds_for(n, args.rounds)
            old = run_worker(before, args, n, 1 if n >= 256 else k) if before and n <= args.before_max_ranks else None
            new = run_worker(ROOT, args, n, k)
            med = statistics.median(new["times"])
            fmt = lambda r: f"{statistics.median(r['times']):.0f} [{min(r['times']):.0f}, {max(r['times']):.0f}]"  # noqa: E731
            ratio = f"{statistics.median(old['times']) / med:.1f}x" if old else "-"
            same = "-" if old is None else ("yes" if (old["findings"], old["straggler"]) == (new["findings"], new["straggler"])
                                            else f"NO: before {old['findings']}; {old['straggler']}")
            print(f"| {n} | {len(old['times']) if old else '-'} / {k} | {fmt(old) if old else '-'} | {fmt(new)} | {ratio} | "
                  f"{new['findings']}; straggler {new['straggler']} | {same} | {new['skip']:.3f} |", flush=True)
    finally:
        if before is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
