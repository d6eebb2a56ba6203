"""The same traces through ``ranksight trace`` and Holistic Trace Analysis (HTA), side by side (issue 14).

    python bench/trace_vs_hta.py [--traces DIR] [--ranks 4] [--mb-per-rank 20] [--rounds 3] [--json OUT]

- **HTA** (PyPI ``HolisticTraceAnalysis``, ``--hta-version``, default 0.5.0, the newest on PyPI when this was
  written, with pandas < 3: HTA 0.5.0's parser fails under pandas 3) is installed by this script into its own
  virtualenv, ``bench/.venv-hta`` (created on first use, reused after), so its pandas/plotly never meet
  ranksight's environment.
- **Traces**: ``--traces DIR`` (plain or ``.gz`` per-rank Kineto traces), else ``bench/kineto_synth.py`` writes
  ``--ranks`` traces of about ``--mb-per-rank`` MB each into a temporary directory (the issue's goal is measured
  at >= 300 MB per rank; the default is small so that the script runs in minutes on a small machine).
- **Rounds** (``--rounds``, >= 3): ranksight and HTA alternate, the order flipped every round, each run in a fresh
  process: (a) ``python -m cli.main trace DIR --json`` with this checkout's code (or ``--ranksight CMD``), (b) HTA's
  ``TraceAnalysis(trace_dir=DIR)`` then get_temporal_breakdown, get_idle_time_breakdown, get_comm_comp_overlap,
  get_gpu_kernel_breakdown, get_cuda_kernel_launch_stats and get_queue_length_summary over every rank, nothing
  drawn. Measured per run: wall time, CPU time of the whole process tree (user + system, from ``wait4``: the
  process and every child it reaped, e.g. HTA's multiprocessing pool) and peak memory of the whole tree (the
  largest sum of RSS over the process and its live descendants, polled every 20 ms; at least ``wait4``'s
  ``ru_maxrss``). The files are read once before the rounds so every run finds them in the page cache.
- **Figures**: a per-rank table of every figure both tools compute, from the last round's outputs, with the
  difference and a flag where it exceeds 1 % (relative, or 1 percentage point for percentages), and an
  explanation column filled from the known differences of definition (``EXPLAIN``).

Prints the rounds, medians, ratios (ranksight / HTA: wall, CPU, peak memory) and the figures; ``--json OUT``
writes all of it. Internal: ``--hta-worker DIR OUT`` is what runs inside HTA's virtualenv.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
VENV = os.path.join(HERE, ".venv-hta")
DEFAULT_HTA = "0.5.0"


# ----------------------------------------------------------------------------------------------------------------
# The HTA side: runs inside bench/.venv-hta (no ranksight import here)
# ----------------------------------------------------------------------------------------------------------------


def hta_worker(trace_dir: str, out: str, include_last: bool) -> None:
    import logging

    logging.disable(logging.WARNING)
    t0 = time.perf_counter()
    from hta.trace_analysis import TraceAnalysis

    t_import = time.perf_counter()
    ta = TraceAnalysis(trace_dir=trace_dir, include_last_profiler_step=include_last)
    t_load = time.perf_counter()
    ranks = sorted(ta.t.traces.keys())
    res: dict[str, Any] = {"ranks": ranks, "include_last_profiler_step": include_last,
                           "gpu_events_kept": {str(r): int((ta.t.get_trace(r)["stream"] >= 0).sum()) for r in ranks}}
    tb = ta.get_temporal_breakdown(visualize=False)
    res["temporal"] = tb.to_dict(orient="records")
    idle, _ = ta.get_idle_time_breakdown(ranks=ranks, visualize=False)
    res["idle"] = idle.to_dict(orient="records")
    ov = ta.get_comm_comp_overlap(visualize=False)
    res["overlap"] = ov.to_dict(orient="records")
    ktype, kmetrics = ta.get_gpu_kernel_breakdown(visualize=False)
    res["kernel_types"] = ktype.to_dict(orient="records")
    res["kernels"] = kmetrics.to_dict(orient="records")
    launch = ta.get_cuda_kernel_launch_stats(ranks=ranks, visualize=False)
    res["launch"] = {}
    for r, df in launch.items():
        cpu, gpu, delay = df["cpu_duration"], df["gpu_duration"], df["launch_delay"]
        res["launch"][str(r)] = {
            "with_launch": int(len(df)),
            "short_kernels": int(((cpu <= 50) & (gpu < cpu)).sum()),
            "runtime_outliers": int((cpu > 50).sum()),
            "launch_delay_outliers": int((delay > 100).sum()),
            "launch_delay_mean_us": float(delay.mean()) if len(df) else 0.0,
            "launch_delay_p50_us": float(delay.median()) if len(df) else 0.0,
        }
    ql = ta.get_queue_length_summary(ranks=ranks)
    res["queue"] = []
    if ql is not None:
        ql.columns = ["_".join(str(c) for c in col) for col in ql.columns]
        for (r, s), row in ql.iterrows():
            res["queue"].append({"rank": int(r), "stream": int(s), **{k: float(v) for k, v in row.items()}})
    t_end = time.perf_counter()
    res["phases_s"] = {"import": t_import - t0, "load": t_load - t_import, "analyses": t_end - t_load}
    with open(out, "w") as f:
        json.dump(res, f, default=str)


# ----------------------------------------------------------------------------------------------------------------
# Setting up HTA
# ----------------------------------------------------------------------------------------------------------------


# HTA 0.5.0 predates pandas 3, which raises where pandas 2 only warned (HTA's parser assigns int64 row indices
# into an int16 column): its parse fails on every trace with more than 32767 events.
PANDAS_PIN = "pandas>=2.2,<3"


def ensure_hta(version: str) -> str:
    """The virtualenv's python with HolisticTraceAnalysis==version (and pandas < 3) installed, created when missing."""
    py = os.path.join(VENV, "bin", "python")
    probe = ("import importlib.metadata as m; print(m.version('HolisticTraceAnalysis'), "
             "m.version('pandas').split('.')[0])")
    if os.path.exists(py):
        r = subprocess.run([py, "-c", probe], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.split() == [version, "2"]:
            return py
    if not os.path.exists(py):
        print(f"creating {VENV} ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
    print(f"installing HolisticTraceAnalysis=={version} {PANDAS_PIN} into {VENV} (with plotly, jupyterlab, ...)",
          file=sys.stderr)
    subprocess.run([py, "-m", "pip", "install", "-q", f"HolisticTraceAnalysis=={version}", PANDAS_PIN, "psutil"],
                   check=True)
    return py


# ----------------------------------------------------------------------------------------------------------------
# Measuring one run: wall, CPU and peak RSS of the process tree
# ----------------------------------------------------------------------------------------------------------------


def measure(cmd: list[str], stdout_path: str, env: dict[str, str] | None = None, cwd: str | None = None,
            poll_s: float = 0.02) -> dict[str, Any]:
    import psutil

    with open(stdout_path, "wb") as out, open(stdout_path + ".err", "wb") as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=cwd)
        root = psutil.Process(p.pid)
        peak = 0
        while True:
            total = 0
            try:
                procs = [root] + root.children(recursive=True)
            except psutil.Error:
                procs = []
            for q in procs:
                try:
                    total += q.memory_info().rss
                except psutil.Error:
                    pass
            peak = max(peak, total)
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            time.sleep(poll_s)
        wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    rc = p.returncode
    maxrss = ru.ru_maxrss * 1024
    res = {"wall_s": round(wall, 3), "cpu_s": round(ru.ru_utime + ru.ru_stime, 3),
           "peak_rss_mb": round(max(peak, maxrss) / 2**20, 1), "rc": rc}
    if rc != 0:
        with open(stdout_path + ".err", "rb") as f:
            res["stderr_tail"] = f.read()[-2000:].decode("utf-8", "replace")
    return res


# ----------------------------------------------------------------------------------------------------------------
# Figures both compute
# ----------------------------------------------------------------------------------------------------------------

# Known differences of definition, by figure family: what a > 1 % difference is expected to come from.
EXPLAIN = {
    "window": "HTA's window: first to last kernel it keeps; by default it drops the last ProfilerStep's kernels "
              "(include_last_profiler_step=False) and every kernel without a launch event (it keeps only GPU "
              "events whose correlation matches a CPU op before the last step's start)",
    "temporal": "HTA counts only the GPU events it keeps (a launch event before its last step's start: none "
                "without a launch), so their time is idle or exposed communication in HTA; it also rounds to whole "
                "microseconds",
    "idle": "HTA classifies per stream the gap before each kernel: host wait when its launch came after the "
            "previous kernel ended; kernel wait when shorter than 30 us; other. The GPU events HTA drops (no launch "
            "event) merge their neighbouring gaps into one in HTA; ranksight keeps them, and a gap that ends at an "
            "event without a launch cannot be host wait there (no launch time): it is kernel wait or other",
    "overlap": "HTA: |compute within comm| / |comm| over its kept kernels; kernels without launch are dropped",
    "launch": "HTA joins launches (cudaLaunchKernel[ExC], cudaMemcpyAsync, cudaMemsetAsync) to GPU events by "
              "correlation over its kept events, and rounds durations to whole microseconds, which moves GPU events "
              "of about the launch's duration across 'short' (GPU time < launch CPU time)",
    "queue": "HTA's queue mean is over samples (each change), ranksight's is time-weighted; max is comparable",
    "kernels": "HTA's totals count only the kernels it keeps (none without a launch event); its table lists "
               "kernels up to 80 % of each type's time, at most 10",
}


def _ranksight_ranks(doc: Any) -> list[dict[str, Any]]:
    """The per-rank analysis dicts of ``ranksight trace --json`` (traces/report.py's layout)."""
    if isinstance(doc, dict):
        for key in ("ranks", "per_rank", "rank_analyses"):
            v = doc.get(key)
            if isinstance(v, list) and v and isinstance(v[0], dict) and "rank" in v[0]:
                return v
        for v in doc.values():
            if isinstance(v, dict):
                got = _ranksight_ranks(v)
                if got:
                    return got
    return []


def _row(rows: list, rank: int, figure: str, ours: float | None, hta: float | None, family: str,
         pct: bool = False, why: str = "") -> None:
    if ours is None or hta is None:
        return
    diff = ours - hta
    if pct:
        flag = abs(diff) > 1.0
    else:
        flag = abs(diff) > 0.01 * max(abs(hta), abs(ours)) and abs(diff) > 1e-9
    rows.append({"rank": rank, "figure": figure, "ranksight": round(ours, 4), "hta": round(hta, 4),
                 "diff": round(diff, 4), "flag": flag, "explanation": EXPLAIN.get(family, "") if flag else "",
                 "rank_context": why if flag else ""})


def compare(ours_doc: Any, hta: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows (rank, figure, ranksight, hta, diff, flag, explanation); times in ms, percentages in %."""
    rows: list[dict[str, Any]] = []
    ours = {int(r["rank"]): r for r in _ranksight_ranks(ours_doc)}
    h_temp = {int(r["rank"]): r for r in hta.get("temporal", [])}
    h_ov = {int(r["rank"]): r for r in hta.get("overlap", [])}
    for rank in sorted(set(ours) & set(h_temp)):
        o = ours[rank]
        t = o.get("temporal", {})
        h = h_temp[rank]
        ol = o.get("launch") or {}
        kept = hta.get("gpu_events_kept", {}).get(str(rank))
        why = ("ranksight's window holds %s GPU events, %s of them without a launch event (%s ms of compute "
               "kernels), which HTA drops; HTA kept %s GPU events" % (ol.get("events"), ol.get("without_launch"),
                                                                      ol.get("without_launch_compute_ms"), kept))
        _row(rows, rank, "window_ms", t.get("window_ms"), h["kernel_time(us)"] / 1000.0, "window", why=why)
        _row(rows, rank, "compute_ms", t.get("compute_ms"), h["compute_time(us)"] / 1000.0, "temporal", why=why)
        _row(rows, rank, "non_compute_ms", t.get("non_compute_ms"), h["non_compute_time(us)"] / 1000.0, "temporal", why=why)
        _row(rows, rank, "idle_ms", t.get("idle_ms"), h["idle_time(us)"] / 1000.0, "temporal", why=why)
        _row(rows, rank, "compute_pct", t.get("compute_pct"), h["compute_time_pctg"], "temporal", pct=True, why=why)
        nc = None
        if t.get("window_ms"):
            nc = 100.0 * t.get("non_compute_ms", 0.0) / t["window_ms"]
        _row(rows, rank, "non_compute_pct", nc, h["non_compute_time_pctg"], "temporal", pct=True, why=why)
        _row(rows, rank, "idle_pct", t.get("idle_pct"), h["idle_time_pctg"], "temporal", pct=True, why=why)
        if rank in h_ov and "overlap" in o:
            _row(rows, rank, "comm_comp_overlap_pct", 100.0 * o["overlap"].get("overlap_ratio", 0.0),
                 h_ov[rank]["comp_comm_overlap_pctg"], "overlap", pct=True, why=why)
        # Idle breakdown per stream and category.
        streams = {int(s["stream"]): s for s in (o.get("idle") or {}).get("streams", [])}
        for hrow in hta.get("idle", []):
            if int(hrow["rank"]) != rank or int(hrow["stream"]) not in streams:
                continue
            cat = hrow["idle_category"]
            mine = streams[int(hrow["stream"])].get(f"{cat}_ms")
            _row(rows, rank, f"idle[{hrow['stream']}].{cat}_ms", mine, hrow["idle_time"] / 1000.0, "idle", why=why)
        # Launch statistics.
        hl = hta.get("launch", {}).get(str(rank))
        if hl:
            for k in ("with_launch", "short_kernels", "runtime_outliers", "launch_delay_outliers"):
                _row(rows, rank, f"launch.{k}", ol.get(k), hl[k], "launch")
            if ol.get("launch_delay_mean_ms") is not None:
                _row(rows, rank, "launch.delay_mean_us", ol["launch_delay_mean_ms"] * 1000.0,
                     hl["launch_delay_mean_us"], "launch")
        # Queue length: max per stream (and the mean, explained).
        oq = {int(q["stream"]): q for q in o.get("queue") or []}
        for hq in hta.get("queue", []):
            if hq["rank"] != rank or hq["stream"] not in oq:
                continue
            _row(rows, rank, f"queue[{hq['stream']}].max", oq[hq["stream"]].get("max"),
                 hq.get("queue_length_max"), "queue")
            _row(rows, rank, f"queue[{hq['stream']}].mean", oq[hq["stream"]].get("mean"),
                 hq.get("queue_length_mean"), "queue")
        # Kernel totals, for names in both tables.
        ok = {k["name"]: k for k in o.get("kernels") or []}
        for hk in hta.get("kernels", []):
            if int(hk.get("rank", -1)) != rank or hk.get("name") not in ok:
                continue
            _row(rows, rank, "kernel[%s].total_ms" % hk["name"][:40], ok[hk["name"]].get("total_ms"),
                 float(hk["sum (us)"]) / 1000.0 if "sum (us)" in hk else None, "kernels", why=why)
    return rows


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 3) if xs else float("nan")


def _print_table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) if rows else len(c) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", help="a directory of per-rank traces (default: generate with kineto_synth)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mb-per-rank", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--hta-version", default=DEFAULT_HTA)
    ap.add_argument("--hta-include-last-step", action="store_true",
                    help="HTA with include_last_profiler_step=True (its default drops the last step)")
    ap.add_argument("--window", help="ranksight's --window (default: the one HTA's setting matches: steps-hta, or "
                                     "steps with --hta-include-last-step)")
    ap.add_argument("--ranksight", help="command for the ranksight side, DIR appended "
                                        "(default: this python -m cli.main trace DIR --json)")
    ap.add_argument("--keep", action="store_true", help="keep the generated traces and the outputs")
    ap.add_argument("--hta-worker", nargs=2, metavar=("DIR", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.hta_worker:
        hta_worker(a.hta_worker[0], a.hta_worker[1], a.hta_include_last_step)
        return 0
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    hta_py = ensure_hta(a.hta_version)
    work = tempfile.mkdtemp(prefix="trace_vs_hta.")
    trace_dir = a.traces
    gen_info: dict[str, Any] = {}
    if not trace_dir:
        sys.path.insert(0, HERE)
        from kineto_synth import generate

        trace_dir = os.path.join(work, "traces")
        t0 = time.perf_counter()
        res = generate(trace_dir, ranks=a.ranks, target_mb=a.mb_per_rank, steps=3, seed=1)
        gen_info = {"generated_s": round(time.perf_counter() - t0, 1), "mb_per_rank": [
            round(b / 1e6, 1) for b in res.bytes_written]}
        print(f"generated {a.ranks} ranks, MB per rank {gen_info['mb_per_rank']} in {gen_info['generated_s']} s",
              file=sys.stderr)
    files = sorted(os.path.join(trace_dir, f) for f in os.listdir(trace_dir) if ".json" in f)
    sizes = {os.path.basename(f): round(os.path.getsize(f) / 1e6, 1) for f in files}
    for f in files:  # into the page cache, for every run alike
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ours_cmd = (a.ranksight.split() if a.ranksight else [sys.executable, "-m", "cli.main", "trace"]) + [trace_dir]
    window = a.window or ("steps" if a.hta_include_last_step else "steps-hta")
    if not a.ranksight:
        ours_cmd += ["--json", "--window", window]
    hta_cmd = [hta_py, os.path.abspath(__file__), "--hta-worker", trace_dir, os.path.join(work, "hta.json")]
    if a.hta_include_last_step:
        hta_cmd.append("--hta-include-last-step")
    hta_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    rounds = []
    for i in range(a.rounds):
        order = ["ranksight", "hta"] if i % 2 == 0 else ["hta", "ranksight"]
        for tool in order:
            if tool == "ranksight":
                m = measure(ours_cmd, os.path.join(work, "ranksight.json"), env=env, cwd=REPO)
            else:
                m = measure(hta_cmd, os.path.join(work, "hta.stdout"), env=hta_env)
            # ranksight trace exits 1 when it has warning/critical findings: a verdict, not a failure
            m["ok"] = m["rc"] == 0 or (tool == "ranksight" and m["rc"] == 1)
            rounds.append({"round": i + 1, "tool": tool, **m})
            print(f"round {i + 1} {tool:9s} wall {m['wall_s']:8.2f} s  cpu {m['cpu_s']:8.2f} s  "
                  f"peak {m['peak_rss_mb']:8.1f} MB  rc {m['rc']}", file=sys.stderr)
            if not m["ok"]:
                print(m.get("stderr_tail", ""), file=sys.stderr)
    med = {}
    for tool in ("ranksight", "hta"):
        rs = [r for r in rounds if r["tool"] == tool and r["ok"]]
        med[tool] = {k: _median([r[k] for r in rs]) for k in ("wall_s", "cpu_s", "peak_rss_mb")}
    ratios = {k: round(med["ranksight"][k] / med["hta"][k], 4) if med["hta"][k] else None
              for k in ("wall_s", "cpu_s", "peak_rss_mb")}
    figures: list[dict[str, Any]] = []
    hta_out: dict[str, Any] = {}
    try:
        with open(os.path.join(work, "hta.json")) as f:
            hta_out = json.load(f)
        with open(os.path.join(work, "ranksight.json")) as f:
            ours_doc = json.load(f)
        figures = compare(ours_doc, hta_out)
    except (OSError, ValueError) as e:
        print(f"figures not compared: {e}", file=sys.stderr)
    print(f"\ntraces: {trace_dir} ({len(files)} files, MB: {sizes})")
    print(f"ranksight: {' '.join(ours_cmd)}")
    print(f"HTA {a.hta_version}, include_last_profiler_step={a.hta_include_last_step}; "
          f"HTA phases (last run, s): {hta_out.get('phases_s')}")
    print("\nrounds")
    _print_table(rounds, ["round", "tool", "wall_s", "cpu_s", "peak_rss_mb", "rc"])
    print("\nmedians")
    _print_table([{"tool": t, **v} for t, v in med.items()], ["tool", "wall_s", "cpu_s", "peak_rss_mb"])
    print(f"\nratios ranksight / HTA: wall {ratios['wall_s']}, CPU {ratios['cpu_s']}, peak memory "
          f"{ratios['peak_rss_mb']}")
    if figures:
        print("\nfigures both compute (times ms, percentages %; flag: > 1 % apart, or > 1 point for percentages)")
        notes: dict[str, int] = {}
        for r in figures:
            if r["explanation"] and r["explanation"] not in notes:
                notes[r["explanation"]] = len(notes) + 1
        _print_table([dict(r, flag="*" if r["flag"] else "",
                           why="[%d]" % notes[r["explanation"]] if r["explanation"] else "") for r in figures],
                     ["rank", "figure", "ranksight", "hta", "diff", "flag", "why"])
        for text, n in notes.items():
            print(f"[{n}] {text}")
        context = {}
        for r in figures:
            if r.get("rank_context"):
                context.setdefault(r["rank"], r["rank_context"])
        for rank, text in context.items():
            print(f"rank {rank}: {text}")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"traces": trace_dir, "sizes_mb": sizes, "generated": gen_info, "hta_version": a.hta_version,
                       "hta_include_last_step": a.hta_include_last_step, "ranksight_cmd": ours_cmd, "rounds": rounds, "medians": med,
                       "ratios": ratios, "figures": figures, "hta_phases_s": hta_out.get("phases_s")}, f, indent=1)
    if a.keep:
        print(f"\nkept: {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["ok"] for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
