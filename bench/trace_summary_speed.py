"""The agent's trace summarizer (``probes.profiler.summarize_trace``): the chunked typed reader against the former
ijson event loop, on the same traces (issue 14).

    python bench/trace_summary_speed.py [--gpu-mb 200] [--cpu-mb 100] [--rounds 3] [--old-rev REV] [--json OUT]

- **Traces**: a GPU-like trace of about ``--gpu-mb`` MB from ``bench/kineto_synth.py`` (one rank), and a CPU trace
  made by ``torch.profiler`` (gloo, world size 1, record_shapes) in this process and scaled up to about
  ``--cpu-mb`` MB by repeating its events, each copy shifted past the one before with its ProfilerStep numbers
  moved on (skipped when torch is missing). Both are written to a temporary directory and read once before the
  rounds so that every run finds them in the page cache.
- **Old path**: ``probes/profiler.py`` as of ``--old-rev`` (default: the last commit whose profiler imported ijson),
  taken with ``git show`` into a temporary module; it needs ``ijson`` installed (no longer a dependency).
- **Rounds**: new and old alternate, the order flipped every round, each run in a fresh process that reports its
  wall time, CPU time and peak RSS (``VmHWM``) around one ``summarize_trace`` call.
- **Equality**: the summaries of both (last round) are compared field by field: numbers within 1e-9 relative
  (float rounding: sums are made in another order), names, counts, collectives and notes exactly.

Prints per trace the rounds, medians, MB/s, the ratio new/old, and the comparison; ``--json OUT`` writes all of it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

# One summarize_trace call in a fresh process: prints {"wall_s", "cpu_s", "peak_rss", "summary"}.
_RUN = r"""
import importlib.util, json, resource, sys, time
impl, path = sys.argv[1], sys.argv[2]
if impl == "new":
    from probes.profiler import summarize_trace
else:
    spec = importlib.util.spec_from_file_location("old_profiler", impl)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    summarize_trace = mod.summarize_trace
import msgspec
def vm(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
r0 = resource.getrusage(resource.RUSAGE_SELF)
t0 = time.perf_counter()
s = summarize_trace(path, run_id="bench")
wall = time.perf_counter() - t0
r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"wall_s": wall, "cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
                  "peak_rss": vm("VmHWM:"), "summary": msgspec.to_builtins(s)}))
"""


def _old_rev() -> str:
    """The last commit whose probes/profiler.py imported ijson."""
    revs = subprocess.run(["git", "log", "--format=%H", "--", "probes/profiler.py"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.split()
    for rev in revs:
        src = subprocess.run(["git", "show", f"{rev}:probes/profiler.py"], cwd=REPO, capture_output=True,
                             text=True).stdout
        if "import ijson" in src:
            return rev
    raise SystemExit("no commit of probes/profiler.py imports ijson: give --old-rev")


def _write_old(rev: str, out_dir: str) -> str:
    src = subprocess.run(["git", "show", f"{rev}:probes/profiler.py"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    path = os.path.join(out_dir, "old_profiler.py")
    with open(path, "w") as f:
        f.write(src)
    return path


def _gpu_trace(out_dir: str, mb: float) -> str:
    from bench.kineto_synth import generate

    res = generate(os.path.join(out_dir, "gpu"), ranks=1, target_mb=mb, seed=3)
    return res.paths[0]


def _cpu_trace(out_dir: str, mb: float) -> str | None:
    """A real torch.profiler CPU trace (gloo all_reduce, matmuls), scaled up to about ``mb`` MB."""
    try:
        import torch
        import torch.distributed as dist
        from torch.profiler import ProfilerActivity, profile, schedule
    except ImportError:
        return None
    import socket

    src = os.path.join(out_dir, "cpu_src.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        a = torch.randn(128, 128)
        with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=4),
                     record_shapes=True, on_trace_ready=lambda p: p.export_chrome_trace(src)) as prof:
            for _ in range(5):
                for _ in range(8):
                    a = torch.tanh(a @ a)
                t = torch.ones(4096)
                dist.all_reduce(t)
                prof.step()
    finally:
        dist.destroy_process_group()
    with open(src) as f:
        doc = json.load(f)
    events = doc.pop("traceEvents")
    meta = [e for e in events if e.get("ph") == "M"]
    timed = [e for e in events if e.get("ph") != "M"]
    t_lo = min(e["ts"] for e in timed if "ts" in e)
    t_hi = max(e["ts"] + e.get("dur", 0) for e in timed if "ts" in e)
    span = (t_hi - t_lo) + 100.0
    nsteps = 4
    one = sum(len(json.dumps(e)) + 2 for e in timed)
    copies = max(1, int(mb * 1e6 / one))
    out = os.path.join(out_dir, "cpu_rank0.json")
    with open(out, "w") as f:
        f.write('{"distributedInfo": %s, "traceEvents": [\n' % json.dumps(doc.get("distributedInfo", {"rank": 0})))
        f.write(",\n".join(json.dumps(e) for e in meta))
        for c in range(copies):
            parts = []
            for e in timed:
                e2 = dict(e)
                if "ts" in e2:
                    e2["ts"] = round(e2["ts"] + c * span, 3)
                name = e2.get("name", "")
                if isinstance(name, str) and name.startswith("ProfilerStep#"):
                    e2["name"] = "ProfilerStep#%d" % (int(name.split("#")[1]) + c * nsteps)
                parts.append(json.dumps(e2))
            f.write(",\n" + ",\n".join(parts))
        f.write("\n]}\n")
    return out


def _run(impl: str, path: str) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO)
    p = subprocess.run([sys.executable, "-c", _RUN, impl, path], capture_output=True, text=True, env=env, cwd=REPO)
    if p.returncode != 0:
        raise SystemExit(f"{impl} on {path} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _differences(a, b, where: str = "") -> list[str]:
    """Where two summaries (builtins) differ: numbers beyond 1e-9 relative, anything else at all."""
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9,
                                                                                          abs_tol=1e-9):
            return []
        return [f"{where}: {a!r} != {b!r}"]
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k == "trace_file":
                continue
            out += _differences(a.get(k), b.get(k), f"{where}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items != {len(b)}"]
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out += _differences(x, y, f"{where}[{i}]")
        return out
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu-mb", type=float, default=200)
    ap.add_argument("--cpu-mb", type=float, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--old-rev", help="commit of the ijson profiler (default: the last that imported ijson)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    try:
        import ijson  # noqa: F401 - the old path needs it
    except ImportError:
        raise SystemExit("the old path needs ijson: pip install ijson")
    rev = a.old_rev or _old_rev()
    results = {"old_rev": rev, "rounds": a.rounds, "traces": {}}
    with tempfile.TemporaryDirectory(prefix="trace-speed-") as tmp:
        old = _write_old(rev, tmp)
        traces = {"gpu": _gpu_trace(tmp, a.gpu_mb)}
        cpu = _cpu_trace(tmp, a.cpu_mb) if a.cpu_mb > 0 else None
        if cpu:
            traces["cpu"] = cpu
        for kind, path in traces.items():
            with open(path, "rb") as f:  # into the page cache
                while f.read(1 << 24):
                    pass
            size = os.path.getsize(path)
            runs: dict[str, list[dict]] = {"new": [], "old": []}
            print(f"{kind} trace: {size / 1e6:.1f} MB ({path})")
            for r in range(a.rounds):
                order = ["new", "old"] if r % 2 == 0 else ["old", "new"]
                for impl in order:
                    out = _run("new" if impl == "new" else old, path)
                    runs[impl].append(out)
                    print(f"  round {r + 1} {impl}: {out['wall_s']:.2f} s wall, {out['cpu_s']:.2f} s CPU, "
                          f"{size / 1e6 / out['wall_s']:.1f} MB/s, peak RSS {out['peak_rss'] / 2**20:.0f} MiB")
            med = {impl: {k: statistics.median(x[k] for x in runs[impl]) for k in ("wall_s", "cpu_s", "peak_rss")}
                   for impl in runs}
            diffs = _differences(runs["new"][-1]["summary"], runs["old"][-1]["summary"])
            row = {"bytes": size, "median": med,
                   "mb_per_s": {i: size / 1e6 / med[i]["wall_s"] for i in med},
                   "speedup_wall": med["old"]["wall_s"] / med["new"]["wall_s"],
                   "speedup_cpu": med["old"]["cpu_s"] / med["new"]["cpu_s"],
                   "peak_rss_ratio_new_over_old": med["new"]["peak_rss"] / med["old"]["peak_rss"],
                   "summary_differences": diffs, "runs": {i: [{k: v for k, v in x.items() if k != "summary"}
                                                             for x in runs[i]] for i in runs}}
            results["traces"][kind] = row
            print(f"  median: new {row['mb_per_s']['new']:.1f} MB/s, old {row['mb_per_s']['old']:.1f} MB/s: "
                  f"{row['speedup_wall']:.1f}x less wall time, {row['speedup_cpu']:.1f}x less CPU; peak RSS "
                  f"{med['new']['peak_rss'] / 2**20:.0f} vs {med['old']['peak_rss'] / 2**20:.0f} MiB")
            print("  summaries: " + ("equal (numbers within 1e-9 relative)" if not diffs else
                                     f"{len(diffs)} differences: " + "; ".join(diffs[:10])))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
