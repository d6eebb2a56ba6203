"""What ranksight costs a training job: the same config with and without instrumentation + agent.

    .venv/bin/python bench/overhead.py [--steps 900] [--block 10] [--warmup-steps 100] [--nproc 2]
                                       [--jobs observed,instr] [--out bench/results/overhead.md]
                                       [-- extra trainer flags]

Separate torchrun jobs per arm differ on a shared machine by far more
than the overhead being measured, so the two arms alternate *inside one training job*: after
``--warmup-steps`` the trainer (``trainer.overhead_toggle.OverheadToggle``, switched on by the
``RANKSIGHT_OVERHEAD_*`` environment, see there) runs blocks of ``--block`` steps, ON and OFF in
ABBA order, switching at a step boundary:

- ON: everything on: the Recorder (spool records, collective/p2p timing hooks, simulated GPU
  state) and, in the ``observed`` job, a real head and node agent (``cli.datapath.DataPath``)
  tailing the spool and shipping OTLP, as ``ranksight launch`` runs them.
- OFF: ``Recorder.enabled = False`` (no spool writes; the hooks pass straight to the plain
  collective; no simulated GPU state) and the head and agent stopped (SIGSTOP by local rank 0
  when an OFF block starts, SIGCONT when an ON block starts).

Each rank times every loop iteration (top to top, so the step record, spool write and
simulated GPU state count) in wall time, main-thread CPU time and process CPU time, and writes
them at the end. Adjacent ON/OFF blocks form a pair; per pair the ratio of the mean ON step
to the mean OFF step. Reported: the median pair ratio with a bootstrap 95 % CI (pairs resampled),
and the ratio of the summed times (ON total / OFF total over all pairs, also bootstrapped),
for wall time (the goal: issue 3, <= 1.005) and for the ranks' CPU time (insensitive to other
work on the machine, it shows what the trainer-side instrumentation burns). Jobs:

- ``agent``: instrumentation + node agent toggled (the goal's figure: issue 3 bounds what instrumentation + agent
  cost); a real head stays awake throughout and receives and stores, with its live analysis off
  (``--analyze-interval 0``): that is head-node work, and on these two cores it would be billed to the agent;
- ``observed``: instrumentation + head (with live analysis) + agent toggled together: what a job costs when
  the head shares its cores, as on a one-machine setup;
- ``instr``: no head/agent at all, only the trainer's instrumentation toggled.

Priorities: the agent runs at ``--agent-priority`` (default low, its own default) and the head at
``--head-priority`` (default idle: the head stands in for a head node of its own, but here it has to share the
training cores); the report states both and the policy the kernel reported for their threads.

Bias to know about: the agent's and head's timers run on while they are stopped, so each ON
block starts with an overdue agent cycle: the agent works somewhat *more* per ON second than it
would running steadily (reported: their CPU seconds per ON second), so the observed ratio errs
on the high side. OFF keeps the registered DDP comm hook (it calls the stock ``allreduce_hook``
in Python), where ``--no-instrument`` uses DDP's built-in C++ all-reduce: a cost per bucket that
neither arm of the toggle sees.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from cli.datapath import DataPath  # noqa: E402

MODEL = ["--d-model", "128", "--n-layers", "4", "--n-heads", "4", "--seq-len", "64", "--batch-size", "8"]
# two-sided 97.5 % t quantiles by degrees of freedom
T975 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 18: 2.101, 20: 2.086, 25: 2.060, 30: 2.042}


def _tree_pids(procs) -> list[int]:
    pids = []
    for p in procs:
        try:
            pp = psutil.Process(p.pid)
            pids += [pp.pid] + [c.pid for c in pp.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return pids


def _cpu_of(pids: list[int]) -> float:
    tot = 0.0
    for pid in pids:
        try:
            ct = psutil.Process(pid).cpu_times()
            tot += ct.user + ct.system
        except psutil.NoSuchProcess:
            pass
    return tot


def _policy_of(pids: list[int]) -> str:
    """The scheduling of these processes' threads as the kernel reports it (idle / nice N / mixed)."""
    seen = set()
    for pid in pids:
        try:
            for t in os.listdir(f"/proc/{pid}/task"):
                tid = int(t)
                seen.add("idle" if os.sched_getscheduler(tid) == getattr(os, "SCHED_IDLE", -1)
                         else f"nice {os.getpriority(os.PRIO_PROCESS, tid)}")
        except (OSError, AttributeError):
            pass
    return "/".join(sorted(seen)) or "?"


def run_toggle_job(store: Path, run_id: str, nproc: int, steps: int, warmup: int, block: int, extra: list[str],
                   job: str, agent_priority: str = "low", head_priority: str = "idle") -> dict:
    """One torchrun job with the instrumentation toggled in blocks, and with it (job ``observed``) the head and
    the agent, or (job ``agent``) the agent alone, the head staying awake (receiving and storing, no live
    analysis); the per-rank rows."""
    with_agent = job in ("observed", "agent")
    out_dir = store / f"{run_id}-toggle"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--max-restarts=0", "-m", "trainer", *MODEL, *extra, "--steps", str(steps),
           "--store", str(store), "--run-id", run_id]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "PYTHONPATH": str(ROOT), "RANKSIGHT_NODE": "0", "RANKSIGHT_OVERHEAD_BLOCK": str(block),
           "RANKSIGHT_OVERHEAD_WARMUP": str(warmup), "RANKSIGHT_OVERHEAD_OUT": str(out_dir)}
    # The agent job measures what the goal covers, instrumentation + node agent: its head only receives and
    # stores. Live analysis is head-node work (a machine of its own in a deployment); here it would share the spare
    # core with the agent and, toggling with the data it analyzes, be billed to the agent. The observed job keeps it.
    head_args = ["--analyze-interval", "0"] if job == "agent" else []
    dp = (DataPath(store, run_id, nodes=1, agent_priority=agent_priority, head_priority=head_priority,
                   head_args=head_args).start()
          if with_agent else None)
    pids: list[int] = []
    side_cpu = None
    policies = None
    try:
        if dp is not None:
            time.sleep(1.0)  # let the agent finish importing before the pids are collected
            head_pids, agent_pids = _tree_pids([dp.head]), _tree_pids(dp.agents)
            pids = head_pids + agent_pids
            policies = {"head": _policy_of(head_pids), "agent": _policy_of(agent_pids)}
            paused = pids if job == "observed" else agent_pids
            env["RANKSIGHT_OVERHEAD_PAUSE_PIDS"] = ",".join(map(str, paused))
        side0 = _cpu_of(pids)
        # (unix time, head CPU s, agent CPU s): their CPU while toggling, and in the warm-up (steady, never stopped)
        samples: list[tuple[float, float, float]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                samples.append((time.time(), _cpu_of(head_pids), _cpu_of(agent_pids)))
                stop.wait(0.25)

        th = threading.Thread(target=sample, daemon=True)
        if pids:
            th.start()
        t0 = time.time()
        try:
            res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        finally:
            stop.set()
            if pids:
                th.join()
        wall = time.time() - t0
    finally:
        for pid in pids:  # whatever happened, nothing stays stopped
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if dp is not None:
            side_cpu = _cpu_of(pids) - side0
            dp.stop()
    if res.returncode != 0:
        raise SystemExit(f"{run_id}: torchrun failed rc={res.returncode}\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
    ranks = {}
    for f in sorted(out_dir.glob("toggle-rank-*.json")):
        d = json.loads(f.read_text())
        ranks[d["rank"]] = d["rows"]
    if len(ranks) != nproc:
        raise SystemExit(f"{run_id}: expected {nproc} toggle files in {out_dir}, got {len(ranks)}")
    return {"ranks": ranks, "side_cpu": side_cpu, "wall": wall, "side_samples": samples if pids else [],
            "policies": policies}


def _cpu_at(samples: list[tuple], t: float, i: int) -> float:
    """CPU seconds (column i of the sampler's readings: 1 head, 2 agent) at time t, interpolated."""
    prev = samples[0]
    for cur in samples:
        if cur[0] >= t:
            if cur[0] == prev[0]:
                return cur[i]
            return prev[i] + (cur[i] - prev[i]) * (t - prev[0]) / (cur[0] - prev[0])
        prev = cur
    return samples[-1][i]


def _side_between(samples: list[tuple], t_a: float, t_b: float) -> tuple[float, float]:
    """(head, agent) CPU seconds spent between t_a and t_b."""
    return tuple(_cpu_at(samples, t_b, i) - _cpu_at(samples, t_a, i) for i in (1, 2))


def pair_blocks(ranks: dict, warmup: int, block: int) -> list[dict]:
    """Per pair of adjacent blocks: ON and OFF means (wall ms: mean over ranks; CPU ms: summed over ranks)."""
    by_step: dict[int, list] = {}
    for rows in ranks.values():
        for step, on, wall, tcpu, pcpu, _t in rows:
            by_step.setdefault(step, []).append((on, wall, tcpu, pcpu))
    blocks: dict[int, dict] = {}
    for step, vals in by_step.items():
        if step <= warmup or len(vals) != len(ranks):
            continue
        b = (step - warmup - 1) // block
        on = vals[0][0]
        if any(v[0] != on for v in vals):
            raise SystemExit(f"ranks disagree on the arm of step {step}")
        acc = blocks.setdefault(b, {"on": on, "n": 0, "wall": 0.0, "tcpu": 0.0, "pcpu": 0.0, "max_wall": 0.0})
        acc["n"] += 1
        acc["wall"] += statistics.fmean(v[1] for v in vals)
        acc["max_wall"] += max(v[1] for v in vals)
        acc["tcpu"] += sum(v[2] for v in vals)
        acc["pcpu"] += sum(v[3] for v in vals)
    pairs = []
    for j in range(max(blocks, default=-1) // 2 + 1):
        a, b = blocks.get(2 * j), blocks.get(2 * j + 1)
        if a is None or b is None or a["n"] != block or b["n"] != block or a["on"] == b["on"]:
            continue
        on, off = (a, b) if a["on"] else (b, a)
        pairs.append({k: (on[k] / on["n"], off[k] / off["n"]) for k in ("wall", "tcpu", "pcpu")})
    return pairs


def _median_ci(ratios: list[float], reps: int, rng) -> tuple[float, float, float]:
    med = statistics.median(ratios)
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(reps))
    return med, boot[int(0.025 * reps)], boot[int(0.975 * reps) - 1]


def _total_ci(on: list[float], off: list[float], reps: int, rng) -> tuple[float, float, float]:
    n = len(on)
    r = sum(on) / sum(off)
    boot = []
    for _ in range(reps):
        idx = [rng.randrange(n) for _ in range(n)]
        boot.append(sum(on[i] for i in idx) / sum(off[i] for i in idx))
    boot.sort()
    return r, boot[int(0.025 * reps)], boot[int(0.975 * reps) - 1]


def summarize(pairs: list[dict], key: str, add_on: float = 0.0, reps: int = 4000, seed: int = 3) -> dict:
    """Median pair ratio and ratio of totals, each with a bootstrap 95 % CI. ``add_on``: a cost per ON step
    measured outside the ranks (the head's and agent's CPU ms), added to every ON step."""
    import random

    rng = random.Random(seed)
    on, off = [p[key][0] + add_on for p in pairs], [p[key][1] for p in pairs]
    ratios = [a / b for a, b in zip(on, off)]
    med, mlo, mhi = _median_ci(ratios, reps, rng)
    tot, tlo, thi = _total_ci(on, off, reps, rng)
    return {"n": len(pairs), "median": med, "median_ci": (mlo, mhi), "total": tot, "total_ci": (tlo, thi),
            "on_ms": statistics.median(on), "off_ms": statistics.median(off)}


def verdict(lo: float, hi: float, goal: float = 1.005) -> str:
    if hi <= goal:
        return "MET"
    if lo > goal:
        return "NOT met"
    return "not shown"


WHAT = {"agent": "instrumentation + node agent (head awake throughout, its live analysis off)",
        "observed": "instrumentation + node agent + head",
        "instr": "instrumentation only (no head, no agent)"}


def _fmt(x: dict, which: str = "median") -> str:
    lo, hi = x[f"{which}_ci"]
    return f"{x[which]:.4f} [{lo:.4f}, {hi:.4f}]"


def main_toggle(argv: list[str], extra: list[str]) -> None:
    ap = argparse.ArgumentParser(description="bench/overhead.py")
    ap.add_argument("--steps", type=int, default=900, help="steps per job, warm-up included")
    ap.add_argument("--warmup-steps", type=int, default=100,
                    help="steps with everything on before toggling (the second half also gives the head's and "
                         "agent's steady CPU rate)")
    ap.add_argument("--block", type=int, default=10, help="steps per ON or OFF block")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--jobs", default="agent,observed,instr",
                    help="comma list, run in this order: agent (instrumentation + agent toggled, the head always "
                         "awake, its live analysis off), observed (instrumentation + head + agent toggled), instr (instrumentation, no "
                         "head or agent)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "overhead.md"))
    ap.add_argument("--keep", action="store_true", help="keep the temporary store (run directories, toggle files)")
    ap.add_argument("--agent-priority", default="low", choices=("idle", "low", "normal"),
                    help="the node agent's --priority (its default: low)")
    ap.add_argument("--head-priority", default="idle", choices=("idle", "low", "normal"),
                    help="the head's --priority. Its default is normal (it has a node of its own); here it stands in "
                         "for that separate head node but must share the training cores, so idle")
    a = ap.parse_args(argv)
    jobs = [j.strip() for j in a.jobs.split(",") if j.strip()]
    if not jobs or any(j not in WHAT for j in jobs):
        raise SystemExit(f"--jobs takes some of {', '.join(WHAT)}")
    if a.steps < a.warmup_steps + 4 * a.block:
        raise SystemExit("--steps must leave at least two pairs of blocks after --warmup-steps")

    store = Path(tempfile.mkdtemp(prefix="ranksight-overhead-"))
    t0 = time.time()
    load0 = os.getloadavg()
    results = []
    for i, job in enumerate(jobs):
        run_id = f"t{i}-{job}"
        r = run_toggle_job(store, run_id, a.nproc, a.steps, a.warmup_steps, a.block, extra, job,
                           agent_priority=a.agent_priority, head_priority=a.head_priority)
        pairs = pair_blocks(r["ranks"], a.warmup_steps, a.block)
        rows0 = [row for row in r["ranks"][0] if row[0] > a.warmup_steps]
        on_rows = [row for row in rows0 if row[1]]
        side_ms_per_on_step, side_per_on_s, steady = 0.0, None, None
        if r["side_samples"] and rows0:
            # What is stopped in OFF blocks (observed: head + agent; agent: the agent) spends all its CPU while
            # toggling in the ON steps. In the agent job the head is awake throughout: its CPU is per second of
            # toggling, ON and OFF alike (a wall-time cost of both arms, not added to ON).
            t_a, t_b = rows0[0][5], rows0[-1][5] + rows0[-1][2] / 1000.0
            head_s, agent_s = _side_between(r["side_samples"], t_a, t_b)
            on_wall_s = sum(row[2] for row in on_rows) / 1000.0
            head_counted = job == "observed"
            paused_s = agent_s + (head_s if head_counted else 0.0)
            side_ms_per_on_step = 1000.0 * paused_s / len(on_rows)
            side_per_on_s = paused_s / on_wall_s
            # Steady state (never stopped): the second half of the warm-up steps.
            warm = [row for row in r["ranks"][0] if a.warmup_steps // 2 < row[0] <= a.warmup_steps]
            if len(warm) >= 2:
                w_a, w_b = warm[0][5], warm[-1][5] + warm[-1][2] / 1000.0
                wh, wa = _side_between(r["side_samples"], w_a, w_b)
                steady = {"head": wh / (w_b - w_a), "agent": wa / (w_b - w_a), "secs": w_b - w_a,
                          "on_head": head_s / (on_wall_s if head_counted else t_b - t_a),
                          "on_agent": agent_s / on_wall_s, "head_counted": head_counted}
        res = {"job": job, "pairs": len(pairs), "load": os.getloadavg(), "side_ms": side_ms_per_on_step,
               "policies": r["policies"],
               "side_per_on_s": side_per_on_s, "side_cpu": r["side_cpu"], "steady": steady,
               **{k: summarize(pairs, k) for k in ("wall", "tcpu", "pcpu")},
               "all_cpu": summarize(pairs, "pcpu", add_on=side_ms_per_on_step)}
        if steady is not None:
            # the same with the stopped processes' CPU at their steady (never stopped) rate per ON step
            rate = steady["agent"] + (steady["head"] if head_counted else 0.0)
            res["steady_cpu"] = summarize(pairs, "pcpu", add_on=1000.0 * rate * on_wall_s / len(on_rows))
        results.append(res)
        print(f"{job}: {len(pairs)} pairs; wall ON/OFF median {_fmt(res['wall'])}, totals "
              f"{_fmt(res['wall'], 'total')}; thread CPU median {_fmt(res['tcpu'])}; process CPU median "
              f"{_fmt(res['pcpu'])}" + (f"; stopped processes {side_ms_per_on_step:.2f} CPU ms per ON step "
                                         f"({side_per_on_s:.3f} CPU s per ON s); ranks + stopped CPU totals "
                                         f"{_fmt(res['all_cpu'], 'total')}" if side_per_on_s is not None else "")
              + (f"; head/agent CPU s per s: ON blocks {steady['on_head']:.3f}/{steady['on_agent']:.3f}, steady "
                 f"(warm-up) {steady['head']:.3f}/{steady['agent']:.3f}; ranks + head + agent CPU at the steady rate "
                 f"{_fmt(res['steady_cpu'], 'total')}" if steady is not None else "")
              + (f"; threads at: agent {r['policies']['agent']}, head {r['policies']['head']}" if r["policies"] else "")
              + f"; load {res['load'][0]:.2f}", flush=True)
    if not a.keep:
        shutil.rmtree(store, ignore_errors=True)

    cmd = " ".join([".venv/bin/python bench/overhead.py", *map(shlex.quote, sys.argv[1:])])
    what = WHAT
    lines = [
        "# bench/overhead.py: instrumentation + agent overhead on training",
        "",
        f"Command: `{cmd}`",
        "",
        f"Date (UTC): {time.strftime('%Y-%m-%d %H:%M', time.gmtime())}; {os.cpu_count()} CPU cores shared with other "
        f"work; load average at start {load0[0]:.2f} / {load0[1]:.2f} / {load0[2]:.2f} (1/5/15 min); "
        f"wall {time.time() - t0:.0f} s.",
        "",
        f"Priorities: node agent `--priority {a.agent_priority}`, head `--priority {a.head_priority}`"
        + (" (the head's own default is normal: it runs on a head node of its own; here it stands in for that node "
           "but has to share the two training cores, so it runs at idle priority too, in the agent and the observed "
           "job alike)" if a.head_priority == "idle" else "") + "; as the kernel reported their threads: "
        + "; ".join(f"{res['job']}: agent {res['policies']['agent']}, head {res['policies']['head']}"
                    for res in results if res.get("policies")) + ".",
        "",
        f"Config: `torchrun --standalone --nproc-per-node {a.nproc} -m trainer {' '.join(MODEL + extra)} "
        f"--steps {a.steps}`: steps 1..{a.warmup_steps} everything on, then blocks of {a.block} steps "
        "ON/OFF in ABBA order inside the same job; a pair = two adjacent blocks; ratio = mean ON step / mean OFF "
        "step of the pair. Wall = loop-top-to-loop-top time per step (mean over ranks); thread / process CPU = "
        "the ranks' main-thread / whole-process CPU time per step (summed over ranks); ranks + head + agent = "
        "process CPU plus the CPU of what is stopped in OFF blocks (observed: head + agent; agent: the agent) "
        "while toggling, spread over the ON steps, or at its steady rate (CPU s per s in the second half of the "
        "warm-up, never stopped) times the ON time. Head / agent CPU s per s in ON blocks: CPU while toggling "
        "over the ON seconds (the head in the agent job: over all toggling seconds, it never sleeps there). 95 % CIs: bootstrap over pairs (4000 resamples). Goal (issue 3): wall ON/OFF <= 1.005.",
        "",
        "| job | toggled | pairs | ON / OFF ms per step | **wall: median pair ratio [95 % CI]** | wall: ON total / OFF "
        "total [CI] | thread CPU: median [CI] | process CPU: median [CI] | head / agent CPU s per s: ON blocks; "
        "steady | ranks + head + agent CPU, ON total / OFF total: as measured; at the steady rate | load after |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        w, st = res["wall"], res["steady"]
        side = "-" if st is None else (f"{st['on_head']:.3f} / {st['on_agent']:.3f}; "
                                       f"{st['head']:.3f} / {st['agent']:.3f}")
        allc = "-" if st is None else f"{_fmt(res['all_cpu'], 'total')}; {_fmt(res['steady_cpu'], 'total')}"
        lines.append(
            f"| {res['job']} | {what[res['job']]} | {res['pairs']} | {w['on_ms']:.1f} / {w['off_ms']:.1f} "
            f"| **{_fmt(w)}** | {_fmt(w, 'total')} | {_fmt(res['tcpu'])} | {_fmt(res['pcpu'])} | {side} | {allc} "
            f"| {res['load'][0]:.2f} |")
    lines.append("")
    for res in results:
        w = res["wall"]
        line = (f"- **{res['job']}**: goal <= 1.005 on wall time, median pair ratio: **{verdict(*w['median_ci'])}** "
                f"(CI [{w['median_ci'][0]:.4f}, {w['median_ci'][1]:.4f}]); ratio of totals: "
                f"**{verdict(*w['total_ci'])}** ([{w['total_ci'][0]:.4f}, {w['total_ci'][1]:.4f}]); on the ranks' "
                f"main-thread CPU: **{verdict(*res['tcpu']['median_ci'])}**")
        if res["steady"] is not None:
            who = "head + agent" if res["steady"]["head_counted"] else "agent"
            line += (f"; on the CPU of ranks + {who}: **{verdict(*res['all_cpu']['total_ci'])}** "
                     f"(at their steady rate: **{verdict(*res['steady_cpu']['total_ci'])}**)")
        lines.append(line + ".")
    lines.append("")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    old = out.read_text() if out.exists() else ""
    if old.startswith("# "):
        old = old.split("\n", 1)[1] if "\n" in old else ""
    old = old.replace("\n## Earlier runs (newest first)\n", "\n").lstrip("\n")
    if old and not old.startswith("### "):  # the previous latest run gets a heading of its own
        date = re.search(r"Date \(UTC\): ([0-9-]+ [0-9:]+)", old)
        old = f"### {date.group(1) if date else 'previous run'} UTC\n\n" + old
    text = "\n".join(lines)
    if old.strip():
        text += "\n## Earlier runs (newest first)\n\n" + old
    out.write_text(text)
    print("\n".join(lines[-len(results) - 1:]))
    print(f"wrote {out}")


def main() -> None:
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    main_toggle(argv, extra)


if __name__ == "__main__":
    main()
