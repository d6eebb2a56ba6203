"""The head's ingest of ``bench/scale.py``'s request bodies in one process, on one core, without HTTP: CPU per second
of the fleet for the ingest (decompress, parse, ``Ingest.logs``: the WAL write and the queue) and for the store's
flush (dedupe, the live window, Arrow, Parquet), each second's bodies then one flush, as a head flushing every second.
With PARTS_EVERY N > 1 the queue is processed every second (dedupe, Arrow, the live window) and the part files are
written every N seconds: what parts written less often would save (``parts_ms``: the share of ``flush_ms`` spent in
the seconds that wrote parts).

Run by ``bench/scale.py --in-process`` with ``PYTHONPATH`` set to the head's checkout (``--head-tree``), so a baseline's
head code is measured on the same bodies: ``python bench/scale_inproc.py BODIES.pickle WARMUP ENCODING`` prints one JSON
object. No ``sys.path`` change here: the head comes from ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import pickle
import shutil
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    import pyarrow as pa

    from head import receiver
    from head.service import Head

    bodies_path, warmup, encoding = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    parts_every = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    seconds = pickle.loads(bodies_path.read_bytes())
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    tmp = Path(tempfile.mkdtemp(prefix="ranksight-scale-inproc-"))
    head = Head(tmp, "bench-scale-token", analyzer=None, flush_rows=10**9)
    ingest_s, flush_s, parts_s, accepted, rejected = [], [], [], 0, 0
    try:
        for i, sec in enumerate(seconds):
            t0 = time.process_time()
            for body in sec:
                acc, rej, _ = head.ingest.logs(receiver.parse("logs", receiver.decompress(body, encoding),
                                                              "application/x-protobuf"))
                accepted += acc
                rejected += rej
            t1 = time.process_time()
            if (i + 1) % parts_every == 0:
                head.store.flush_all()
                t_parts = t1
            else:  # RunStore.process: the queue into the buffers and the live window; no part written
                for rs in list(head.store.runs.values()):
                    rs.process()
                t_parts = None
            t2 = time.process_time()
            if i >= warmup:
                ingest_s.append(t1 - t0)
                flush_s.append(t2 - t1)
                parts_s.append(t2 - t1 if t_parts is not None else 0.0)
    finally:
        head.close()
        shutil.rmtree(tmp, ignore_errors=True)
    n = max(1, len(ingest_s))
    print(json.dumps(dict(seconds=len(ingest_s), accepted=accepted, rejected=rejected, parts_every=parts_every,
                          parts_ms=1000 * sum(parts_s) / n,
                          ingest_ms=1000 * sum(ingest_s) / n, flush_ms=1000 * sum(flush_s) / n,
                          total_ms=1000 * (sum(ingest_s) + sum(flush_s)) / n)))


if __name__ == "__main__":
    main()
