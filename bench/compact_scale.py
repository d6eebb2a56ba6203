"""What compaction costs on a big partition: time, CPU and peak memory of merging a generated store's parts, per
source tree (this one and a baseline worktree), interleaved rounds.

    python bench/compact_scale.py --store DIR [--tree BASE] [--tree .] [--rounds 3] [--tables steps,collectives]

DIR: a store of parts (``bench/scale_gen.py`` with ``compact=False``; ``shuffled=True`` for rows out of order, as a
real head's parts are), e.g. ``python bench/scale_gen.py``'s cache entries ending ``-shuffled-parts``. Each round
runs each tree's ``head.store.compaction.merge_to`` in a fresh process over every partition of each table, writing
to a scratch file that is removed after (the parts stay); it reports wall and CPU seconds, the peak resident set
(VmHWM, reset when the merge starts) and the anonymous memory at the end, and whether the output is marked sorted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

PROBE = textwrap.dedent("""
    import json, os, resource, sys, time
    from pathlib import Path
    import pyarrow.parquet as pq
    from head.store import compaction
    from ranksight import store_layout
    from ranksight.tables import SPECS

    table_dir, table, scratch = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
        return 0
    by_part = {}
    for f in store_layout.visible(store_layout.list_table(table_dir)):
        by_part.setdefault(f.partition, []).append(f)
    open("/proc/self/clear_refs", "w").write("5")
    start_rss = status("VmRSS")
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    rows = marked = 0
    for part, fs in sorted(by_part.items()):
        out = scratch / "merged.parquet"
        _covers, n = compaction.merge_to(fs, out, False, SPECS[table].schema, table)
        rows += n
        marked += b"ranksight.sorted" in (pq.read_metadata(out).metadata or {})
        out.unlink()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"wall": time.monotonic() - t0, "cpu": r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime,
                      "peak": status("VmHWM"), "start": start_rss, "rows": rows, "partitions": len(by_part),
                      "files": sum(len(v) for v in by_part.values()), "marked": marked}))
""")


def run_one(tree: Path, table_dir: Path, table: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="compact-scale-", dir=os.environ.get("TMPDIR")) as scratch:
        p = subprocess.run([sys.executable, "-c", PROBE, str(table_dir), table, scratch], capture_output=True,
                           text=True, env=dict(os.environ, PYTHONPATH=str(tree)), cwd=str(tree), timeout=3600)
    if p.returncode != 0:
        raise SystemExit(f"{tree} {table}: {p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", type=Path, required=True, help="a generated store of parts (its run is 'scale')")
    ap.add_argument("--tree", type=Path, action="append", help="source trees to compare (default: this one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tables", default="steps,collectives")
    args = ap.parse_args(argv)
    trees = [t.resolve() for t in (args.tree or [Path(__file__).resolve().parent.parent])]
    run_root = args.store / "scale"
    results: dict[tuple[str, str], list[dict]] = {}
    for rnd in range(args.rounds):
        for table in args.tables.split(","):
            for tree in trees:
                got = run_one(tree, run_root / table, table)
                results.setdefault((str(tree), table), []).append(got)
                print(f"round {rnd + 1} {tree.name} {table}: {got['wall']:.1f} s wall, {got['cpu']:.1f} s CPU, "
                      f"peak {got['peak'] / 2**30:.2f} GiB (from {got['start'] / 2**30:.2f}), {got['rows']} rows "
                      f"in {got['files']} files, {got['marked']}/{got['partitions']} marked; load "
                      f"{os.getloadavg()[0]:.1f}", flush=True)
    for (tree, table), rs in results.items():
        def mm(k):
            v = [r[k] for r in rs]
            return min(v), statistics.median(v)
        (w, wm), (c, cm), (p, pm) = mm("wall"), mm("cpu"), mm("peak")
        print(f"{Path(tree).name} {table}: wall {w:.1f} (median {wm:.1f}) s, CPU {c:.1f} ({cm:.1f}) s, "
              f"peak {p / 2**30:.2f} ({pm / 2**30:.2f}) GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
