"""The diagnose HTML page of a job of thousands of ranks: its size and the time to build and draw it, against the same
page drawn by an earlier commit's report code (the baseline), in the same run.

    .venv/bin/python bench/report_scale.py --ranks 1024 4096 --baseline-ref 7ccdc35 --baseline-max 1024 --rounds 3

The run is synthetic (``tests/report_scale_fixtures.big_run``: 30 steps, 8 ranks per node, one straggler with its
GPU clocked down, a GPU sample per rank and step) and built column-wise, so the figure is the report's alone. Each
measurement runs in a fresh child process (its imports, matplotlib's included, counted: what ``diagnose --html``
pays); the current and the baseline code alternate round by round. The baseline's tree is ``git archive`` of the ref
(only its ``analyzers`` and ``ranksight`` packages), so the fixture, which uses only the record schema and
``RunData``, is the same for both. Prints min and median seconds and the page's size per (code, ranks), and the
ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from report_scale_fixtures import big_run
from analyzers.report.model import build_report
from analyzers.report.render_html import render_html
data, findings = big_run(int(sys.argv[1]))
t1 = time.perf_counter()
page = render_html(build_report(data, findings, [], []))
t2 = time.perf_counter()
print(json.dumps({"seconds": t2 - t1, "with_imports": t2 - t0, "bytes": len(page)}))
"""


def measure(code_root: Path, ranks: int, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code_root), str(ROOT / "tests")]), "MPLBACKEND": "Agg"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(ranks)], env=env, capture_output=True, text=True,
                         timeout=timeout, cwd=str(code_root))
    if out.returncode != 0:
        raise RuntimeError(f"{code_root} at {ranks} ranks failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def baseline_tree(ref: str, into: Path) -> Path:
    """``analyzers`` and ``ranksight`` as they were at ``ref``."""
    archive = into / "base.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "-o", str(archive), ref, "analyzers", "ranksight"],
                   check=True)
    with tarfile.open(archive) as t:
        t.extractall(into / "tree", filter="data")
    return into / "tree"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline-ref", default="", help="git ref whose report code is the baseline (none: no baseline)")
    ap.add_argument("--baseline-max", type=int, default=1024, help="measure the baseline up to this many ranks only")
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    print(f"load average at start: {os.getloadavg()[0]:.2f} (2-core box: above 2, the timings carry other work)")
    with tempfile.TemporaryDirectory(prefix="report-scale-") as tmp:
        base = baseline_tree(args.baseline_ref, Path(tmp)) if args.baseline_ref else None
        for n in args.ranks:
            codes = [("current", ROOT)] + ([("baseline", base)] if base is not None and n <= args.baseline_max else [])
            got: dict[str, list[dict]] = {name: [] for name, _ in codes}
            for _ in range(args.rounds):  # interleaved: the box's load falls on both alike
                for name, root in codes:
                    got[name].append(measure(root, n, args.timeout))
            row = {}
            for name, runs in got.items():
                secs = [r["seconds"] for r in runs]
                row[name] = (min(secs), statistics.median(secs), runs[0]["bytes"])
                print(f"{n:6d} ranks  {name:8s}  build+draw min {min(secs):7.2f} s  median {statistics.median(secs):7.2f} s"
                      f"  (with imports, median {statistics.median(r['with_imports'] for r in runs):7.2f} s)"
                      f"  page {runs[0]['bytes'] / 1e6:7.2f} MB")
            if "baseline" in row:
                c, b = row["current"], row["baseline"]
                print(f"{n:6d} ranks  ratio     time (median) {b[1] / c[1]:.1f}x less, page {b[2] / c[2]:.1f}x smaller")
    print(f"load average at end: {os.getloadavg()[0]:.2f}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
