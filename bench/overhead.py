"""What ranksight costs a training job: the same config with and without instrumentation + agent.

    .venv/bin/python bench/overhead.py [--pairs 8] [--steps 150] [--warmup-steps 20] [--nproc 2]
                                       [--out bench/results/overhead.md] [-- extra trainer flags]

Each *pair* is two torchrun jobs of the bundled trainer with an identical config, run one
after the other (order alternates per pair, AB BA AB ..., so a slow drift of the machine
cancels out):

- **bare**: ``--no-instrument``: no spool records, no collective/p2p timing hooks, no
  simulated GPU state; no agent, no head. (The control channel's one small broadcast per
  step stays: it is part of the trainer, not of the observation.)
- **observed**: the default instrumentation, plus a real head and a real node agent
  (``agent.launcher.DataPath``) beside the job, tailing its spool and shipping OTLP to the head,
  exactly as ``ranksight launch`` runs them.

The figure of one job is the median step time of rank 0 (its progress line, the same code in
both arms) over the steps after ``--warmup-steps``. Reported: the ratio observed / bare of
each pair, their median, a 95 % confidence interval of the mean log-ratio (t distribution
over pairs), and the ratio of the pooled medians. Goal (issue 3): <= 1.005. Also the CPU
seconds of everything each job started (ranks, torchrun, head, agent), as a ratio per pair:
less sensitive to other work on a shared machine than wall time.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from agent.launcher import DataPath  # noqa: E402

STEP_RE = re.compile(r"^step\s+(\d+) \|.*\|\s+([0-9.]+) ms \|")
MODEL = ["--d-model", "128", "--n-layers", "4", "--n-heads", "4", "--seq-len", "64", "--batch-size", "8"]
# two-sided 97.5 % t quantiles by degrees of freedom
T975 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 18: 2.101, 20: 2.086, 25: 2.060, 30: 2.042}


def t975(df: int) -> float:
    return T975.get(df) or T975[max(k for k in T975 if k <= df)] if df >= 1 else float("nan")


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_job(store: Path, run_id: str, nproc: int, steps: int, extra: list[str], arm: str) -> tuple[list[float], float, float]:
    """(rank 0's step times in ms, CPU seconds of everything the job started: torchrun, its ranks,
    and in the observed arm the head and the agent, all reaped before this returns; CPU seconds
    of the head + agent alone)."""
    observed = arm == "observed"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--max-restarts=0", "-m", "trainer", *MODEL, *extra, "--steps", str(steps),
           "--store", str(store), "--run-id", run_id]
    if arm == "bare":
        cmd.append("--no-instrument")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "PYTHONPATH": str(ROOT), "RANKSIGHT_NODE": "0"}
    cpu0 = _children_cpu_s()
    dp = DataPath(store, run_id, nodes=1).start() if observed else None
    side_cpu = 0.0
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    finally:
        if dp is not None:
            for proc in [dp.head, *dp.agents]:
                try:
                    ct = psutil.Process(proc.pid).cpu_times()
                    side_cpu += ct.user + ct.system
                except psutil.NoSuchProcess:
                    pass
            dp.stop()
    if res.returncode != 0:
        raise SystemExit(f"{run_id}: torchrun failed rc={res.returncode}\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
    times = {}
    for line in res.stdout.splitlines():
        m = STEP_RE.match(line.strip())
        if m:
            times[int(m.group(1))] = float(m.group(2))
    if len(times) != steps:
        raise SystemExit(f"{run_id}: expected {steps} progress lines, got {len(times)}")
    return [times[k] for k in sorted(times)], _children_cpu_s() - cpu0, side_cpu


def max_mfu(store: Path, run_id: str) -> float | None:
    """flops / step time / the manifest's peak, the largest over every rank and step."""
    import json

    from ranksight.layout import RunDir
    from ranksight.schema import StepRecord, decode_spool_line

    rd = RunDir(store, run_id)
    peak = json.loads(rd.manifest.read_text())["peak_flops"]
    best = None
    for f in rd.spool_dir.glob("rank-*.jsonl"):
        for line in f.read_bytes().splitlines():
            r = decode_spool_line(line)
            if isinstance(r, StepRecord) and r.step_ms > 0:
                v = r.flops / (r.step_ms / 1000.0) / peak
                best = v if best is None else max(best, v)
    return best


def log_ci(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of the ratios and a 95 % t interval of the mean log-ratio."""
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    mean_log = statistics.fmean(logs)
    half = t975(n - 1) * statistics.stdev(logs) / math.sqrt(n) if n > 1 else float("nan")
    return math.exp(mean_log), math.exp(mean_log - half), math.exp(mean_log + half)


def main() -> None:
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=8, help="rounds (each runs bare, instr and observed once)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "overhead.md"))
    a = ap.parse_args(argv)
    if a.steps <= a.warmup_steps + 5:
        raise SystemExit("--steps must exceed --warmup-steps by more than 5")

    store = Path(tempfile.mkdtemp(prefix="ranksight-overhead-"))
    arms = ("bare", "instr", "observed")
    rows, ratios, instr_ratios, cpu_ratios, mfus, side = [], [], [], [], [], []
    pooled_all: dict[str, list[float]] = {a_: [] for a_ in arms}
    t0 = time.time()
    for p in range(a.pairs):
        # rotate the order every round and reverse it every other round, so drift cancels
        order = arms[p % 3:] + arms[:p % 3]
        order = order[::-1] if p % 2 else order
        med, cpu = {}, {}
        for arm in order:
            run_id = f"p{p}-{arm}"
            st, cpu[arm], side_cpu = run_job(store, run_id, a.nproc, a.steps, extra, arm)
            st = st[a.warmup_steps:]
            med[arm] = statistics.median(st)
            pooled_all[arm].extend(st)
            if arm == "observed":
                mfus.append(max_mfu(store, run_id))
                side.append(side_cpu)
        r, ri = med["observed"] / med["bare"], med["instr"] / med["bare"]
        cr = cpu["observed"] / cpu["bare"]
        ratios.append(r)
        instr_ratios.append(ri)
        cpu_ratios.append(cr)
        rows.append((p, "".join({"bare": "B", "instr": "I", "observed": "O"}[x] for x in order), med["bare"],
                     med["instr"], med["observed"], ri, r, cpu["bare"], cpu["observed"], side[-1], cr))
        print(f"round {p}: bare {med['bare']:.2f} ms  instr {med['instr']:.2f} ms  observed {med['observed']:.2f} ms"
              f"  observed/bare {r:.4f}  instr/bare {ri:.4f} | CPU s bare {cpu['bare']:.1f} observed "
              f"{cpu['observed']:.1f} (head+agent {side[-1]:.1f}) ratio {cr:.4f}", flush=True)

    n = len(ratios)
    gmean, lo, hi = log_ci(ratios)
    igmean, ilo, ihi = log_ci(instr_ratios)
    cpu_gmean, cpu_lo, cpu_hi = log_ci(cpu_ratios)
    pooled = statistics.median(pooled_all["observed"]) / statistics.median(pooled_all["bare"])
    med_ratio = statistics.median(ratios)
    verdict = "MET" if hi <= 1.005 else ("NOT shown (the interval reaches above 1.005)" if lo <= 1.005
                                          else "NOT met (the whole interval is above 1.005)")
    cmd = " ".join([".venv/bin/python bench/overhead.py", *map(shlex.quote, sys.argv[1:])])
    summary = (f"overhead (observed / bare, median step time): median of {n} ratios {med_ratio:.4f}; "
               f"geometric mean {gmean:.4f}, 95% CI [{lo:.4f}, {hi:.4f}]; pooled medians {pooled:.4f}. "
               f"Goal <= 1.005: {verdict}")
    instr_summary = (f"trainer instrumentation alone (instr / bare, no agent, no head): median "
                     f"{statistics.median(instr_ratios):.4f}; geometric mean {igmean:.4f}, 95% CI [{ilo:.4f}, {ihi:.4f}]")
    cpu_summary = (f"CPU cost (observed / bare, CPU seconds of the whole job incl. start-up, head and agent): "
                   f"median {statistics.median(cpu_ratios):.4f}; geometric mean {cpu_gmean:.4f}, "
                   f"95% CI [{cpu_lo:.4f}, {cpu_hi:.4f}]; head + agent alone: median {statistics.median(side):.1f} "
                   "CPU s per job")
    print(summary)
    print(instr_summary)
    print(cpu_summary)
    mfu_max = max((m for m in mfus if m is not None), default=None)
    if mfu_max is not None:
        print(f"largest MFU any rank reported in the observed runs: {100 * mfu_max:.2f} % (must be <= 100 %)")

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        "# bench/overhead.py: instrumentation + agent overhead on training",
        "",
        f"Command: `{cmd}`",
        "",
        f"Date (UTC): {time.strftime('%Y-%m-%d %H:%M', time.gmtime())}; {os.cpu_count()} CPU cores "
        f"(shared with other work: expect noise); wall {time.time() - t0:.0f} s.",
        "",
        f"Config: `torchrun --standalone --nproc-per-node {a.nproc} -m trainer {' '.join(MODEL + extra)} "
        f"--steps {a.steps}`; step time = rank 0's median over steps {a.warmup_steps + 1}..{a.steps}. "
        "bare = `--no-instrument`, no agent/head; instr = default instrumentation, no agent/head; observed = "
        "default instrumentation + a head and one node agent (`agent.launcher.DataPath`) on the same cores. "
        "Order rotates per round (B = bare, I = instr, O = observed).",
        "",
        "| round | order | bare ms | instr ms | observed ms | instr/bare | observed/bare | bare CPU s "
        "| observed CPU s | of which head+agent | CPU ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *[f"| {p} | {o} | {b:.2f} | {i:.2f} | {ob:.2f} | {ri:.4f} | {r:.4f} | {cb:.1f} | {co:.1f} | {sc:.1f} | {cr:.4f} |"
          for p, o, b, i, ob, ri, r, cb, co, sc, cr in rows],
        "",
        f"**{summary}**",
        "",
        f"{instr_summary}.",
        "",
        f"{cpu_summary}. Wall time per step is what the goal is about; CPU seconds are less sensitive "
        "to other load on a shared machine (time spent waiting for a core is not counted) and show "
        "what the observation itself burns, start-up included.",
        "",
    ]
    if mfu_max is not None:
        lines += [f"Largest MFU any rank reported in the observed runs: {100 * mfu_max:.2f} % "
                  "(flops / step time / the manifest's CPU peak).", ""]
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
