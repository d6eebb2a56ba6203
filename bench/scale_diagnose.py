"""``diagnose`` on generated run stores of R ranks x S steps: wall time, peak RSS, and where the time goes.

    .venv/bin/python bench/scale_diagnose.py [--sizes 1024x10000,16384x1000] [--rounds 3]
                                             [--baseline 7ccdc35] [--baseline-max 256x2000] [--profile]

Each store is generated once by ``bench/scale_gen.py`` (the job: TP 8 x PP 4 x DP rest, two collectives per rank
and step on communicators stored once, a GPU sample per GPU per second, a host sample per node per second, a
manifest, rank 5 a 1.3x straggler from a third of the run on; written through the head's ``RunStore``, flushed
every 5 simulated seconds) and cached under ``--cache`` (``/tmp/ranksight-scale``; ``df -h`` it).

Per size, in ``--rounds`` interleaved rounds:

- the real CLI, ``python -m cli.diagnose scale --store STORE --json > /dev/null``, in a subprocess: wall time and
  peak RSS (``os.wait4``'s ``ru_maxrss`` of that process); a watchdog kills it above ``--max-rss-gb``;
- the same for the baseline: a ``git worktree`` of ``--baseline`` (main as of this session's start), run the same
  way, only at sizes up to ``--baseline-max`` ranks x steps (at the big sizes it takes minutes and tens of GB).

Then once per tree, the time split in a subprocess that does what ``diagnose`` does, timed: load (store ->
RunData), the builder's eager part (``build_frame``) and each check (the frame's matrices are built on first use,
inside the first check that asks), the logs stored with the run, and the report (model + JSON). ``--profile`` runs
the checks under cProfile and prints the top functions.

``--shuffled``: stores generated with each flush's rows in a random order (ranks ship independently, as on a real
job), so compaction has to sort them for the loader's marked path.

``--load-only``: instead of the CLI, a subprocess per tree and round that only loads the run (store -> ``RunData``,
as ``diagnose`` does): wall and CPU time of the load, the process's peak RSS, and each frame's rows and size
(``--profile`` then profiles the load). The baseline runs at every size in this mode.

``--baseline-cache DIR``: the baseline reads the store of the same name in DIR (as the baseline's head wrote it),
this tree the one in ``--cache`` (as this tree's head writes it, e.g. another compaction encoding).
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.scale_gen import RUN, Job, cached  # noqa: E402

PHASES = r"""
import cProfile, io, json, pstats, resource, sys, time
from pathlib import Path
t0 = time.perf_counter()
import analyzers
from analyzers.loader import load_run
from analyzers.checks import CHECKS
from analyzers.report.model import build_report
from analyzers.report.render_json import render_json
from cli.diagnose import stored_findings
store, run, profile = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
out = {"import_s": time.perf_counter() - t0}
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
t = time.perf_counter(); data = load_run(store, run, progress=False); out["load_s"] = time.perf_counter() - t
out["rss_after_load_gib"] = rss()
out["rows"] = {n: len(getattr(data, n)) for n in ("steps", "collectives", "gpu", "host")}
out["frames_gib"] = {n: getattr(data, n).memory_usage(deep=False).sum() / 2**30 for n in ("steps", "collectives", "gpu", "host")}
print(f"   ... load: {out['load_s']:.1f} s, peak RSS {out['rss_after_load_gib']:.2f} GiB, rows {out['rows']}, frames "
      + ", ".join(f"{n} {v:.2f}" for n, v in out["frames_gib"].items()) + " GiB", file=sys.stderr, flush=True)
checks, checks_rss = {}, {}
import psutil
me = psutil.Process()
def timed(name, fn):
    def run_timed(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            checks[name] = checks.get(name, 0.0) + time.perf_counter() - t
            checks_rss[name] = me.memory_info().rss / 2**30
            print(f"   ... {name}: {checks[name]:.1f} s, RSS {checks_rss[name]:.2f} GiB", file=sys.stderr, flush=True)
    return run_timed
for name, mod in CHECKS.items():
    mod.analyze = timed(name, mod.analyze)
analyzers.build_frame = timed("(build_frame)", analyzers.build_frame)
errors, coverage = [], []
prof = cProfile.Profile() if profile else None
t = time.perf_counter()
if prof: prof.enable()
findings = analyzers.run_all(data, errors=errors, coverage=coverage)
if prof: prof.disable()
out["analysis_s"] = time.perf_counter() - t
out["checks_s"] = checks
out["checks_rss_gib"] = checks_rss
out["rss_after_analysis_gib"] = rss()
t = time.perf_counter()
more, notes = stored_findings(Path(store) / run)
findings = findings + more
out["logs_s"] = time.perf_counter() - t
t = time.perf_counter()
try:  # as diagnose --json does: without the HTML page's plot series
    report = build_report(data, findings, errors + notes, coverage, with_plots=False)
except TypeError:  # a tree before with_plots
    report = build_report(data, findings, errors + notes, coverage)
text = render_json(report)
out["report_s"] = time.perf_counter() - t
out["maxrss_gib"] = rss()
out["findings"] = [[f.kind, f.severity, list(f.ranks)[:8], f.step_start] for f in findings if f.severity != "info"]
out["errors"] = [e.splitlines()[0] for e in errors]
if prof:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
    out["profile"] = s.getvalue()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(20)
    out["profile_tottime"] = s.getvalue()
print("PHASES " + json.dumps(out))
"""


LOAD_ONLY = r"""
import cProfile, io, json, pstats, resource, sys, time
store, run, profile = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
from analyzers.loader import load_run
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
out = {"rss_before_gib": rss()}
prof = cProfile.Profile() if profile else None
if prof: prof.enable()
t, c = time.perf_counter(), time.process_time()
data = load_run(store, run, progress=False)
out["load_s"], out["load_cpu_s"] = time.perf_counter() - t, time.process_time() - c
if prof: prof.disable()
out["maxrss_gib"] = rss()
# resident now, the frames held: below their nominal size where a column is zeroed memory never written
out["rss_now_gib"] = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**30
names = ("steps", "collectives", "gpu", "host")
out["rows"] = {n: len(getattr(data, n)) for n in names}
out["frames_gib"] = {n: float(getattr(data, n).memory_usage(deep=False).sum()) / 2**30 for n in names}
if prof:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(40)
    out["profile"] = s.getvalue()
print("LOAD " + json.dumps(out))
"""


def load_only(store: Path, trees: dict[str, Path], rounds: int, a: argparse.Namespace,
              stores: dict[str, Path] | None = None) -> list[tuple]:
    """``--load-only`` at one store (``stores``: another store for some trees): per round and tree a fresh process
    that loads the run; returns report rows."""
    got: dict[str, list[dict]] = {t: [] for t in trees}
    for i in range(rounds):
        for t, tree in trees.items():
            r = run_measured([sys.executable, "-c", LOAD_ONLY, str((stores or {}).get(t, store)), RUN, "1" if a.profile else "0"], tree,
                             a.max_rss_gb, a.timeout, keep_stdout=True)
            line = next((x for x in r["stdout"].splitlines() if x.startswith("LOAD ")), None)
            if line is None:
                print(f"   round {i + 1} {t:8s} failed ({r['killed'] or r['rc']}):\n{r['stderr'][-1500:]}", flush=True)
                continue
            o = json.loads(line[5:])
            o["proc_maxrss_gib"] = r["maxrss_gib"]
            got[t].append(o)
            print(f"   round {i + 1} {t:8s} load {o['load_s']:6.1f} s (CPU {o['load_cpu_s']:6.1f} s), peak RSS "
                  f"{r['maxrss_gib']:5.2f} GiB, RSS after it {o['rss_now_gib']:5.2f} GiB; frames "
                  + ", ".join(f"{n} {v:.2f}" for n, v in o["frames_gib"].items())
                  + f" GiB; load average {os.getloadavg()[0]:.1f}", flush=True)
            if o.get("profile"):
                print(o["profile"])
    rows = []
    for t, rs in got.items():
        if rs:
            rows.append((t, [r["load_s"] for r in rs], [r["load_cpu_s"] for r in rs],
                         max(r["proc_maxrss_gib"] for r in rs), rs[-1]["frames_gib"], rs[-1]["rows"],
                         max(r["rss_now_gib"] for r in rs)))
    return rows


def parse_size(s: str) -> tuple[int, int]:
    r, _, st = s.lower().partition("x")
    return int(r), int(st)


def baseline_tree(rev: str) -> Path:
    """A worktree of ``rev`` under /tmp (made once)."""
    path = Path(f"/tmp/ranksight-base-{rev}")
    if not (path / "analyzers" / "loader.py").exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True,
                       capture_output=True)
    return path


def run_measured(cmd: list[str], cwd: Path, max_rss_gib: float, timeout_s: float, keep_stdout: bool = False) -> dict:
    """Run ``cmd`` (stdout to /dev/null unless ``keep_stdout``): wall time, its own peak RSS, whether the watchdog
    or the timeout killed it."""
    import psutil

    env = dict(os.environ, PYTHONPATH=str(cwd))
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE if keep_stdout else subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    killed: list[str] = []

    tree_peak = {"rss": 0, "pss": 0}
    reaped = threading.Event()  # set once os.wait4 has the child: the watchdog never reaps it (p.poll() would, and
    # os.wait4 then fails with ECHILD on a quick child)

    def watch() -> None:
        try:
            proc = psutil.Process(p.pid)
            n = 0
            while not reaped.is_set():
                rss = proc.memory_info().rss
                if n % 3 == 0:  # the process and its forked checks: the sum of their RSS and of their PSS
                    tree_rss, tree_pss = _tree_memory(proc)
                    tree_peak["rss"] = max(tree_peak["rss"], tree_rss)
                    tree_peak["pss"] = max(tree_peak["pss"], tree_pss)
                n += 1
                if rss > max_rss_gib * 2**30 or tree_peak["pss"] > max_rss_gib * 2**30:
                    killed.append(f"over {max_rss_gib:g} GiB")
                    p.kill()
                    return
                if time.perf_counter() - t0 > timeout_s:
                    killed.append(f"over {timeout_s:g} s")
                    p.kill()
                    return
                time.sleep(0.1)
        except psutil.Error:
            return

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    out_chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: out_chunks.append(p.stdout.read() if p.stdout else b""), daemon=True)
    reader.start()
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    reaped.set()
    wall = time.perf_counter() - t0
    reader.join()
    p.returncode = os.waitstatus_to_exitcode(status)
    return dict(wall_s=wall, maxrss_gib=ru.ru_maxrss / 2**20, rc=p.returncode, killed=killed[0] if killed else "",
                cpu_s=ru.ru_utime + ru.ru_stime, tree_rss_gib=tree_peak["rss"] / 2**30,
                tree_pss_gib=tree_peak["pss"] / 2**30,
                stdout=b"".join(out_chunks).decode(errors="replace"), stderr=err.decode(errors="replace")[-2000:])


def _tree_memory(proc) -> tuple[int, int]:
    """(sum of RSS, sum of PSS) of ``proc`` and its children (``diagnose --jobs``' forked checks share the loaded
    frames: the RSS sum counts them once per process, the PSS sum once in all), sampled every third tick (reading
    a big process's smaps_rollup is not free)."""
    import psutil

    rss = pss = 0
    for q in [proc] + proc.children(recursive=True):
        try:
            m = q.memory_full_info()
        except psutil.Error:
            continue
        rss += m.rss
        pss += getattr(m, "pss", m.rss)
    return rss, pss


def cli_cmd(store: Path, jobs: int | None = None) -> list[str]:
    return [sys.executable, "-m", "cli.diagnose", RUN, "--store", str(store), "--json"] + (
        ["--jobs", str(jobs)] if jobs else [])


def fmt_s(xs: list[float]) -> str:
    return f"{min(xs):7.1f} {statistics.median(xs):7.1f}" if xs else f"{'-':>7s} {'-':>7s}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1024x10000,16384x1000", help="RANKSxSTEPS, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", default="7ccdc35", help="git revision of the baseline ('' for none)")
    ap.add_argument("--baseline-max", default="256x2000",
                    help="run the baseline only where ranks x steps is at most this (it needs minutes and GBs above)")
    ap.add_argument("--cache", default="/tmp/ranksight-scale")
    ap.add_argument("--max-rss-gb", type=float, default=14.0, help="kill a diagnose process above this RSS")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--profile", action="store_true", help="cProfile the checks (the analysis time then includes "
                                                           "the profiler's overhead)")
    ap.add_argument("--jobs", default="", help="comma-separated --jobs values to run this tree's CLI with (each a "
                                               "variant now-jN, interleaved); '' for the CLI's default")
    ap.add_argument("--no-split", action="store_true", help="skip the time split")
    ap.add_argument("--load-only", action="store_true", help="time only the load (store -> RunData): wall, CPU, peak "
                                                             "RSS and frame sizes, baseline at every size")
    ap.add_argument("--baseline-cache", default="", help="the baseline reads the store of the same name from this "
                                                         "cache (e.g. as the baseline's head compacted it), this tree "
                                                         "the one in --cache")
    ap.add_argument("--shuffled", action="store_true", help="stores whose parts hold each flush's rows in a random "
                                                            "order, as a real head's do (scale_gen Job.shuffled)")
    a = ap.parse_args()
    jobs_of: dict[str, int | None] = {}
    trees = {}
    for j in [int(x) for x in a.jobs.split(",") if x] or [None]:
        label = f"now-j{j}" if j else "now"
        trees[label] = ROOT
        jobs_of[label] = j
    if a.baseline:
        trees["baseline"] = baseline_tree(a.baseline)
    br, bs = parse_size(a.baseline_max)
    print(f"load average at start: {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores", flush=True)
    rows = []
    for size in a.sizes.split(","):
        ranks, steps = parse_size(size)
        job = Job(ranks=ranks, steps=steps, shuffled=a.shuffled)
        store = cached(job, Path(a.cache))
        if a.load_only:
            other = {"baseline": Path(a.baseline_cache) / store.name} if a.baseline_cache else None
            print(f"\n== load only: {ranks} ranks x {steps} steps; store {store}"
                  + (f" (baseline: {other['baseline']})" if other else ""), flush=True)
            for t, walls, cpus, rss, frames, nrows, rss_now in load_only(store, trees, a.rounds, a, other):
                print(f"   {t:8s} load wall min {min(walls):.1f} median {statistics.median(walls):.1f} s, CPU min "
                      f"{min(cpus):.1f} median {statistics.median(cpus):.1f} s, peak RSS {rss:.2f} GiB, RSS after "
                      f"the load {rss_now:.2f} GiB; frames "
                      + ", ".join(f"{n} {v:.2f}" for n, v in frames.items()) + f" GiB (total "
                      f"{sum(frames.values()):.2f}, nominal: zeroed columns never written are not resident); rows "
                      f"{nrows}", flush=True)
            continue
        use = [t for t in trees if t.startswith("now") or ranks * steps <= br * bs]
        print(f"\n== {ranks} ranks x {steps} steps (TP {job.tp} x PP {job.pp} x DP {job.dp}; straggler rank "
              f"{job.straggler} x{job.factor} from step {job.start}); store {store} "
              f"({sum(f.stat().st_size for f in store.rglob('*') if f.is_file()) / 2**30:.2f} GiB)", flush=True)
        if len(use) < len(trees):
            print(f"   baseline not run at this size (above --baseline-max {a.baseline_max})")
        runs: dict[str, list[dict]] = {t: [] for t in use}
        for i in range(a.rounds):
            for t in use:
                where = Path(a.baseline_cache) / store.name if a.baseline_cache and t == "baseline" else store
                r = run_measured(cli_cmd(where, jobs_of.get(t)), trees[t], a.max_rss_gb, a.timeout)
                runs[t].append(r)
                state = f"killed ({r['killed']})" if r["killed"] else f"exit {r['rc']}"
                print(f"   round {i + 1} {t:8s} {r['wall_s']:7.1f} s (CPU {r['cpu_s']:6.1f} s)  {r['maxrss_gib']:5.2f} GiB "
                      f"(processes' sum: RSS {r['tree_rss_gib']:5.2f}, PSS {r['tree_pss_gib']:5.2f} GiB)  {state}; "
                      f"load average {os.getloadavg()[0]:.1f}", flush=True)
                if r["rc"] not in (0, 10, 20, 30):
                    print("   " + r["stderr"].replace("\n", "\n   "))
        split = {}
        if not a.no_split:
            for t in dict.fromkeys(x for x in use if jobs_of.get(x, 1) in (None, 1)):
                where = Path(a.baseline_cache) / store.name if a.baseline_cache and t == "baseline" else store
                r = run_measured([sys.executable, "-c", PHASES, str(where), RUN, "1" if a.profile else "0"],
                                 trees[t], a.max_rss_gb, a.timeout, keep_stdout=True)
                line = next((x for x in r["stdout"].splitlines() if x.startswith("PHASES ")), None)
                if line is None:
                    print(f"   split {t}: failed ({r['killed'] or r['rc']}) after {r['wall_s']:.0f} s, peak "
                          f"{r['maxrss_gib']:.2f} GiB:\n{r['stderr'][-1500:]}")
                    continue
                split[t] = json.loads(line[7:])
        for t in use:
            ok = [r for r in runs[t] if not r["killed"] and r["rc"] in (0, 10, 20, 30)]
            walls = [r["wall_s"] for r in ok]
            rss = max((max(r["maxrss_gib"], r["tree_pss_gib"]) for r in ok), default=float("nan"))
            if ok:
                cpus = [r["cpu_s"] for r in ok]
                print(f"   {t:8s} CPU min {min(cpus):.1f} median {statistics.median(cpus):.1f} s; peak: one process's "
                      f"RSS {max(r['maxrss_gib'] for r in ok):.2f} GiB, processes' sum RSS "
                      f"{max(r['tree_rss_gib'] for r in ok):.2f} PSS {max(r['tree_pss_gib'] for r in ok):.2f} GiB")
            rows.append((f"{ranks}x{steps}", t, walls, rss, split.get(t)))
        for t, sp in split.items():
            chk = sorted(sp["checks_s"].items(), key=lambda kv: -kv[1])
            print(f"   split {t}: load {sp['load_s']:.1f} s (RSS {sp['rss_after_load_gib']:.2f} GiB; frames "
                  + ", ".join(f"{n} {v:.2f}" for n, v in sp["frames_gib"].items()) + " GiB)"
                  f", analysis {sp['analysis_s']:.1f} s (RSS {sp['rss_after_analysis_gib']:.2f} GiB), logs "
                  f"{sp['logs_s']:.1f} s, report {sp['report_s']:.1f} s, imports {sp['import_s']:.1f} s; peak "
                  f"{sp['maxrss_gib']:.2f} GiB")
            print("     analysis by check (s, RSS after it GiB): " + ", ".join(
                f"{n} {v:.1f} ({sp['checks_rss_gib'].get(n, 0):.1f})" for n, v in chk if v >= 0.05))
            print(f"     rows: {sp['rows']}")
            found = [f for f in sp["findings"] if f[0] == "straggler"]
            print(f"     warnings+: {sp['findings']}" + ("" if found else "  (the injected straggler NOT found)"))
            if sp["errors"]:
                print(f"     check errors: {sp['errors']}")
            if sp.get("profile"):
                print(sp["profile"])
                print(sp["profile_tottime"])
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")
    if a.load_only:
        return
    print(f"\n{'size':>11s} {'tree':>8s} {'wall min':>8s} {'median':>7s} {'peak RSS':>9s} {'load':>6s} "
          f"{'analysis':>8s} {'report':>6s}")
    base = {size: r for size, t, *r in rows if t == "baseline"}
    for size, t, walls, rss, sp in rows:
        extra = ""
        if t.startswith("now") and size in base and walls and base[size][0]:
            extra = (f"   baseline/now: {min(base[size][0]) / min(walls):.1f}x time, "
                     f"{base[size][1] / rss:.1f}x RSS")
        ph = (f"{sp['load_s']:6.1f} {sp['analysis_s']:8.1f} {sp['report_s'] + sp['logs_s']:6.1f}" if sp
              else f"{'-':>6s} {'-':>8s} {'-':>6s}")
        print(f"{size:>11s} {t:>8s} {fmt_s(walls)} {rss:8.2f}G {ph}{extra}")


if __name__ == "__main__":
    main()
