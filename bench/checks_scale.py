"""The checks alone at scale: CPU time and peak RSS of each check on a run loaded once.

Loads a generated store (bench/scale_gen.py; read-only) with ``analyzers.loader.load_run``, builds the frame the
way ``run_all`` does, and runs every check in ``run_all``'s order, timing each (CPU time of the process, and wall)
and sampling the process's RSS every few milliseconds (its peak during the check, and the peak over the RSS the
loaded frames hold). ``--report`` also times the report ``diagnose --json`` prints, over the checks' findings. Each round builds a fresh frame, so the matrices the checks share are built inside the first
check that asks for them, as in a real round.

Before/after: ``--tree`` names code trees (a worktree of main at the baseline, this one); each round runs each tree
in its own process, interleaved (tree A, tree B, tree A, ...), so the load average hits both alike.

    bench/checks_scale.py --store /tmp/ranksight-scale/r1024-s1000-st1-f5-x5-1.3-parts \\
        --tree /work/wt/comm-base --tree . --rounds 3

Big stores (several GiB loaded): run it under ``flock /work/notes/bigmem.lock``; ``--max-rss-gib`` stops a worker
that passes the limit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

RUN = "scale"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The process's RSS sampled every ``every_s`` in a thread: the highest since the last ``reset``."""

    def __init__(self, every_s: float = 0.005, limit_bytes: int | None = None):
        self.peak = rss_bytes()
        self.limit = limit_bytes
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._t.start()

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            r = rss_bytes()
            if r > self.peak:
                self.peak = r
            if self.limit is not None and r > self.limit:
                print(json.dumps({"error": f"RSS {r / 2**30:.2f} GiB over the limit"}), flush=True)
                os._exit(3)

    def reset(self) -> int:
        self.peak = rss_bytes()
        return self.peak

    def stop(self) -> None:
        self._stop.set()


def worker(args) -> None:
    """Load once, then ``--rounds`` rounds of every check; one JSON line per round on stdout."""
    sys.path.insert(0, str(Path(args.tree).resolve()))
    import gc

    from analyzers.builder import build_frame
    from analyzers.checks import CHECKS
    from analyzers.loader import load_run

    mon = PeakRss(limit_bytes=int(args.max_rss_gib * 2**30) if args.max_rss_gib else None)
    t0 = time.perf_counter()
    data = load_run(args.store, RUN, since=args.since, until=args.until, progress=False)
    loaded = dict(load_s=time.perf_counter() - t0, load_peak_gib=mon.peak / 2**30,
                  rows={k: int(len(getattr(data, k))) for k in ("steps", "collectives", "gpu", "host")})
    gc.collect()
    base = rss_bytes()
    loaded["loaded_rss_gib"] = base / 2**30
    print(json.dumps({"loaded": loaded}), flush=True)
    names = args.checks.split(",") if args.checks else list(CHECKS)
    for rnd in range(args.rounds):
        gc.collect()
        base = mon.reset()
        out = {}
        c0, w0 = time.process_time(), time.perf_counter()
        frame = build_frame(data)
        out["(build_frame)"] = dict(cpu=time.process_time() - c0, wall=time.perf_counter() - w0,
                                    peak_over_gib=(mon.peak - base) / 2**30)
        findings = []
        found: list = []
        for name in names:
            start = mon.reset()
            c0, w0 = time.process_time(), time.perf_counter()
            try:
                got = CHECKS[name].analyze(frame, None)
                err = None
            except Exception as e:  # noqa: BLE001 - report it, time the others
                got, err = [], f"{type(e).__name__}: {e}"
            out[name] = dict(cpu=time.process_time() - c0, wall=time.perf_counter() - w0,
                             peak_over_gib=(max(mon.peak, rss_bytes()) - base) / 2**30,
                             peak_over_start_gib=(max(mon.peak, rss_bytes()) - start) / 2**30,
                             findings=len(got), error=err)
            findings += [(f.analyzer, f.kind, f.severity, list(f.ranks)[:8], f.step_start) for f in got]
            found += got
        del frame
        if args.report:
            # the report diagnose prints after the checks (--json): its model over the run and these findings
            from analyzers.report.model import build_report
            from analyzers.report.render_json import render_json

            start = mon.reset()
            c0, w0 = time.process_time(), time.perf_counter()
            render_json(build_report(data, found, [], [], with_plots=False))
            out["(report)"] = dict(cpu=time.process_time() - c0, wall=time.perf_counter() - w0,
                                   peak_over_gib=(max(mon.peak, rss_bytes()) - base) / 2**30,
                                   peak_over_start_gib=(max(mon.peak, rss_bytes()) - start) / 2**30,
                                   findings=0, error=None)
        print(json.dumps({"round": rnd, "checks": out, "findings": findings}), flush=True)
    mon.stop()


def run_worker(tree: str, args) -> list[dict]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--tree", tree, "--store", args.store,
           "--rounds", str(args.rounds_in_process)]
    for flag in ("since", "until", "max_rss_gib", "checks"):
        v = getattr(args, flag)
        if v is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(v)]
    if args.report:
        cmd.append("--report")
    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0:
        lines.append({"error": f"exit {p.returncode}: {p.stderr[-2000:]}"})
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", required=True, help="a generated store (bench/scale_gen.py): the directory holding scale/")
    ap.add_argument("--tree", action="append", help="code tree(s) to time (default: this one)")
    ap.add_argument("--rounds", type=int, default=3, help="processes per tree, interleaved")
    ap.add_argument("--rounds-in-process", type=int, default=1, help="rounds per process (one load)")
    ap.add_argument("--since", type=int)
    ap.add_argument("--until", type=int)
    ap.add_argument("--checks", help="comma-separated check names (default: all, in run_all's order)")
    ap.add_argument("--report", action="store_true",
                    help="also time the report after the checks (build_report + render_json, as diagnose --json)")
    ap.add_argument("--max-rss-gib", type=float)
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--json", help="write every round's numbers here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.tree = args.tree[0]
        args.rounds = args.rounds
        worker(args)
        return
    trees = args.tree or [str(Path(__file__).resolve().parent.parent)]
    print(f"load average at start: {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores; store {args.store}", flush=True)
    results: dict[str, list[dict]] = {t: [] for t in trees}
    for rnd in range(args.rounds):
        for t in trees:
            got = run_worker(t, args)
            results[t] += got
            for g in got:
                if "loaded" in g:
                    ld = g["loaded"]
                    print(f"[{rnd}] {t}: load {ld['load_s']:.1f} s, RSS loaded {ld['loaded_rss_gib']:.2f} GiB "
                          f"(peak {ld['load_peak_gib']:.2f}), rows {ld['rows']}", flush=True)
                elif "checks" in g:
                    tot = sum(c["cpu"] for c in g["checks"].values())
                    peak = max(c["peak_over_gib"] for c in g["checks"].values())
                    print(f"[{rnd}] {t}: checks {tot:.2f} s CPU, peak {peak:.2f} GiB over the loaded frames; "
                          f"findings {g['findings']}", flush=True)
                else:
                    print(f"[{rnd}] {t}: {g}", flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    names = []
    for t in trees:
        for g in results[t]:
            for n in g.get("checks", {}):
                if n not in names:
                    names.append(n)
    print(f"\n{'check':18s}" + "".join(f" | {Path(t).name[-14:]:>14s} cpu min/med s, peak GiB" for t in trees))
    for n in names + ["(all)"]:
        row = f"{n:18s}"
        for t in trees:
            rounds = [g["checks"] for g in results[t] if "checks" in g]
            if n == "(all)":
                cpu = [sum(c["cpu"] for c in r.values()) for r in rounds]
                pk = [max(c["peak_over_gib"] for c in r.values()) for r in rounds]
            else:
                cpu = [r[n]["cpu"] for r in rounds if n in r]
                pk = [r[n]["peak_over_gib"] for r in rounds if n in r]
            row += (f" | {min(cpu):7.2f} {statistics.median(cpu):7.2f}  {max(pk):6.2f}         " if cpu
                    else f" | {'-':>30s}")
        print(row)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
