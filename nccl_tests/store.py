"""The bandwidth baseline in the run store: <store>/<run-id>/nccl_tests/<table>/part-*.parquet.

Tables (columns documented in docs/nccl_tests.md; the communication analyzer reads them):

- ``perf``            one row per (op, size, in_place) of an <op>_perf run;
- ``health_pairs``    one row per rank pair of a health check (the bandwidth matrix);
- ``health_entities`` one row per rank, node, node pair, node group and link judged by it.

Each run appends one part file per table (written atomically), so several ops and checks under
one run id accumulate; ``pandas.read_parquet(<dir>)`` reads a table.
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from nccl_tests.formulas import AVG_MODE_NAMES, busbw_factor
from ranksight.layout import RunDir, atomic_write
from ranksight.schema import SCHEMA_VERSION
from ranksight.tables import ENTITIES_SCHEMA, NCCL_TESTS_DIR, PAIRS_SCHEMA, PERF_SCHEMA




def table_dir(store: str | os.PathLike, run_id: str, table: str) -> Path:
    return RunDir(store, run_id).table(NCCL_TESTS_DIR) / table


def _write(store, run_id: str, table: str, rows: list[dict], schema: pa.Schema, tag: str) -> Path:
    tbl = pa.Table.from_pylist(rows, schema=schema)
    sink = io.BytesIO()
    pq.write_table(tbl, sink)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    path = table_dir(store, run_id, table) / f"part-{stamp}-{tag}-{os.getpid()}.parquet"
    atomic_write(path, sink.getvalue())
    return path


def write_perf(store, run_id: str, rows, idents, backend: str, args) -> Path:
    n = len(idents)
    hosts = [i.host for i in idents]
    nodes = [i.node for i in idents]
    device = "cuda" if any(i.device.startswith("cuda") for i in idents) else "cpu"
    out = []
    for r in rows:
        for in_place, res in ((False, r.out_of_place), (True, r.in_place)):
            out.append({
                "run_id": run_id, "op": r.op, "size": r.size, "count": r.count, "dtype": r.type_name,
                "redop": r.redop, "root": r.root, "in_place": in_place, "time_us": res.time_us,
                "algbw": res.algbw, "busbw": res.busbw, "busbw_factor": busbw_factor(r.op, n),
                "wrong": -1 if res.wrong is None else res.wrong,
                "per_rank_time_us": r.per_rank_us["in_place" if in_place else "out_of_place"],
                "nranks": n, "nnodes": len(set(nodes)), "backend": backend, "device": device,
                "hosts": hosts, "nodes": nodes, "iters": args.iters, "warmup_iters": args.warmup_iters,
                "time_agg": AVG_MODE_NAMES[args.average], "t": r.t, "schema_version": SCHEMA_VERSION,
            })
    return _write(store, run_id, "perf", out, PERF_SCHEMA, rows[0].op if rows else "empty")


def write_health(store, run_id: str, rep, pair_bw, pair_s, group_bw, idents, backend: str, args) -> list[Path]:
    n = len(idents)
    t = time.time()
    link = {tuple(e.ranks): e for e in rep.links}
    pairs = []
    for (i, j), bw in sorted(pair_bw.items()):
        e = link.get((i, j))
        pairs.append({
            "run_id": run_id, "rank_a": i, "rank_b": j, "node_a": idents[i].node, "node_b": idents[j].node,
            "host_a": idents[i].host, "host_b": idents[j].host, "size": args.check_bytes, "iters": args.iters,
            "time_us": pair_s[(i, j)] * 1e6, "bw": bw, "median_bw": e.reference if e else bw,
            "ratio": e.ratio if e else 1.0, "flagged": bool(e and e.flagged), "threshold": rep.threshold,
            "nranks": n, "backend": backend, "t": t, "schema_version": SCHEMA_VERSION,
        })
    ents = [{
        "run_id": run_id, "kind": e.kind, "name": e.name, "ranks": e.ranks, "nodes": e.nodes, "bw": e.bw,
        "reference": e.reference, "ratio": e.ratio, "flagged": e.flagged, "explained_by": e.explained_by,
        "threshold": rep.threshold, "nranks": n, "backend": backend, "t": t, "schema_version": SCHEMA_VERSION,
    } for e in rep.entities()]
    if len(group_bw) == 1:  # reported, not judged (nothing to compare with)
        (node, bw), = group_bw.items()
        ents.append({
            "run_id": run_id, "kind": "node_group", "name": f"{node} all_reduce group",
            "ranks": [i.rank for i in idents if i.node == node], "nodes": [node], "bw": bw, "reference": bw,
            "ratio": 1.0, "flagged": False, "explained_by": "", "threshold": rep.threshold, "nranks": n,
            "backend": backend, "t": t, "schema_version": SCHEMA_VERSION,
        })
    return [_write(store, run_id, "health_pairs", pairs, PAIRS_SCHEMA, "check"),
            _write(store, run_id, "health_entities", ents, ENTITIES_SCHEMA, "check")]
