"""Memory of the head's GPU sample dedupe keys per GPU-hour: the exact key set (before) against ``GpuIndex``
(newest time per GPU + the exact keys of the last horizon).

    python bench/dedupe_gpu_mem.py [--gpus 1024] [--seconds 3600]

Each index runs in its own process (RSS growth is its memory): one batch per second of one sample per GPU, through
``add_table`` (the keys the store marks seen). Prints RSS growth, bytes per GPU-hour, keys held and CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one(kind: str, gpus: int, seconds: int) -> dict:
    import numpy as np
    import pyarrow as pa

    from head.store.dedupe import GpuIndex, SetIndex
    from ranksight.tables import SPECS

    spec = SPECS["gpu"]
    g = np.arange(gpus, dtype=np.int64)
    base = {"run_id": pa.array(["r1"] * gpus), "node": g // 8, "gpu": g % 8}

    def batch(t):
        cols = dict(base, t=np.full(gpus, t))
        return pa.table([pa.array(cols[f.name], f.type) if f.name in cols else pa.nulls(gpus, f.type)
                         for f in spec.schema], schema=spec.schema)

    batch(0.0)
    idx = GpuIndex(spec) if kind == "gpu_index" else SetIndex(spec)
    before = _rss_mb()
    c0 = time.process_time()
    for s in range(seconds):
        idx.add_table(batch(1.7e9 + s))
    cpu = time.process_time() - c0
    grew = _rss_mb() - before
    return {"kind": kind, "gpus": gpus, "seconds": seconds, "keys": len(idx), "rss_growth_mb": round(grew, 1),
            "bytes_per_gpu_hour": round(grew * 2**20 / gpus * 3600 / seconds), "cpu_s": round(cpu, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--seconds", type=int, default=3600)
    ap.add_argument("--one", choices=["set", "gpu_index"])
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.gpus, a.seconds)))
        return
    for kind in ("set", "gpu_index"):
        out = subprocess.run([sys.executable, __file__, "--one", kind, "--gpus", str(a.gpus), "--seconds",
                              str(a.seconds)], capture_output=True, text=True, check=True)
        print(out.stdout.strip())


if __name__ == "__main__":
    main()
