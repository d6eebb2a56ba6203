"""A copy of recorded runs with their collective records folded per step, as a node agent run with
``--collectives per-step`` would have shipped them (``ranksight.collective_fold``): so the analyzers can be scored on
folded records against the same runs unfolded (``bench/detect.py --replay --fold-collectives``).

    .venv/bin/python bench/fold_store.py STORE DEST

Each run directory is copied except its stored collectives, which are read, folded per rank and step with the
agent's own function, and written back as one part file.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from ranksight.collective_fold import fold_per_step  # noqa: E402
from ranksight.schema import CollectiveRecord  # noqa: E402
from ranksight.tables import SPECS, read_table  # noqa: E402


def _records(df) -> list[CollectiveRecord]:
    fields = set(CollectiveRecord.__struct_fields__)
    out = []
    for row in df.to_dict("records"):
        d = {k: v for k, v in row.items() if k in fields}
        if d.get("t_done") is not None and isinstance(d["t_done"], float) and math.isnan(d["t_done"]):
            d["t_done"] = None
        if d.get("duration_ms") is not None and isinstance(d["duration_ms"], float) and math.isnan(d["duration_ms"]):
            d["duration_ms"] = None
        gr = d.get("group_ranks")
        d["group_ranks"] = [] if gr is None else [int(x) for x in gr]
        out.append(msgspec.convert(d, CollectiveRecord, strict=False))
    return out


def fold_run(store: Path, run_id: str, dest: Path) -> tuple[int, int]:
    """Copy ``store/run_id`` to ``dest/run_id`` with its collectives folded; (records before, after)."""
    src, out = store / run_id, dest / run_id
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out, ignore=lambda d, names: ["collectives"] if Path(d) == src else [])
    df = read_table(store, run_id, "collectives")
    if df.empty:
        return 0, 0
    recs = _records(df.sort_values(["rank", "step", "seq"], kind="stable"))
    # per rank, in the order the rank wrote them (an agent folds what it read of each rank's spool)
    folded = fold_per_step(recs)
    (out / "collectives").mkdir(parents=True)
    pq.write_table(SPECS["collectives"].to_table(run_id, folded), out / "collectives" / "part-folded.parquet")
    return len(recs), len(folded)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store", type=Path)
    ap.add_argument("dest", type=Path)
    a = ap.parse_args()
    from analyzers.loader import known_runs

    for rid in known_runs(a.store):
        n, k = fold_run(a.store, rid, a.dest)
        print(f"{rid}: {n} collective records -> {k}")


if __name__ == "__main__":
    main()
