"""The communicator table: the head's ingest CPU for collective records that carry their group's member list (what
the trainer sent before) against records that name their group by ``comm_id`` (members stored once per group, in
the ``communicators`` table), same fleet, same run, interleaved.

    .venv/bin/python bench/communicators.py [--ranks 2048] [--seconds 4] [--repeat 3] [--modes lists,ids]

The fleet: ``--ranks`` ranks in pure data parallelism (the dp group is the world, the worst case for member lists)
at one step per second, 8 ranks per node agent, one OTLP request per agent per second holding the agent's packed
step records and its collective records (two per rank-step: the gradient all-reduce on the dp group and a
broadcast on the world group), as node agents ship them: with member lists as JSON, with ids packed (``packed-v1``,
the member list left out of the layout). With ``ids`` the lowest rank also ships the two communicator records once. Measured: CPU seconds of ``Head.ingest.logs`` on the gzip'd protobuf request bodies plus
the store's flush once per simulated second (dedupe, Arrow, live window, Parquet), one core, pyarrow on one thread;
printed as the share of one core the fleet costs at 1 step/s. The check: both modes store the same collectives
(the members the analyzers see, ``analyzers.loader`` attaching them from the communicators table in ``ids`` mode).
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyarrow as pa  # noqa: E402

pa.set_cpu_count(1)
pa.set_io_thread_count(1)

from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402

from head import receiver as otlp_receiver  # noqa: E402
from head.service import Head, tune_gc  # noqa: E402
from ranksight import schema, wire  # noqa: E402

RUN = "bench"
RANKS_PER_NODE = 8


def agent_request(node: int, step: int, world: int, mode: str, members: list[int], ids: dict[str, str]) -> bytes:
    res = Resource.create({"service.name": "ranksight-agent", wire.R_NODE: node, wire.R_HOST: f"node{node:05d}"})
    steps, colls = [], []
    for lr in range(RANKS_PER_NODE):
        rank = node * RANKS_PER_NODE + lr
        t = 1.8e9 + step
        steps.append(schema.StepRecord(run_id=RUN, rank=rank, step=step, node=node, host=f"node{node:05d}",
                                       world_size=world, dp_rank=rank, t_start=t, t_end=t + 0.95, step_ms=950.0,
                                       comm_ms=57.0, compute_ms=890.0, sync_arrival=t + 0.9, sync_wait_ms=12.0,
                                       tokens=16384, loss=2.3, lr=3e-4, flops=1.2e15))
        for seq, (op, group, nbytes) in enumerate((("all_reduce", "dp", 1 << 28), ("broadcast", "world", 24))):
            kw = dict(group_ranks=members) if mode == "lists" else dict(comm_id=ids[group])
            colls.append(schema.CollectiveRecord(
                run_id=RUN, rank=rank, step=step, seq=2 * step + seq, op=op, group=group, nbytes=nbytes,
                t_arrive=t + 0.9, t_done=t + 0.94, duration_ms=40.0, **kw))
    layout, body = wire.pack_records("step", RUN, steps)
    recs = [wire.make_log_record(RUN, "step", body, node=node, count=len(steps), step_min=step, step_max=step,
                                 resource=res, layout=layout)]
    # as node/sources/spool.py ships them: packed when they can be (no member list), else the JSON spool lines
    packed = wire.pack_records("collective", RUN, colls)
    c_layout, c_body = packed if packed is not None else (None, wire.join_array([schema.encode(c) for c in colls]))
    recs.append(wire.make_log_record(RUN, "collective", c_body, node=node, count=len(colls), step_min=step,
                                     step_max=step, resource=res, layout=c_layout))
    if mode == "ids" and node == 0 and step == 0:  # rank 0, the lowest member, writes both groups once
        comms = [schema.encode(schema.CommunicatorRecord(run_id=RUN, comm_id=ids[g], group=g, ranks=members, rank=0))
                 for g in ("dp", "world")]
        recs.append(wire.make_log_record(RUN, "communicator", wire.join_array(comms), node=node, count=2,
                                         step_min=0, step_max=0, resource=res))
    return gzip.compress(encode_logs(recs).SerializeToString(), compresslevel=6)


def build(ranks: int, seconds: int, mode: str) -> list[list[bytes]]:
    members = list(range(ranks))
    ids = {g: schema.communicator_id(g, members) for g in ("dp", "world")}
    return [[agent_request(n, s, ranks, mode, members, ids) for n in range(ranks // RANKS_PER_NODE)]
            for s in range(seconds)]


def measure(store: Path, payloads: list[list[bytes]]) -> float:
    head = Head(store, "t", analyzer=None, flush_rows=10**9)
    t0 = time.process_time()
    for sec in payloads:
        for body in sec:
            head.ingest.logs(otlp_receiver.parse("logs", otlp_receiver.decompress(body, "gzip"),
                                                 "application/x-protobuf"))
        head.store.flush_all()
    c = time.process_time() - t0
    head.close()
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2048)
    ap.add_argument("--seconds", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--modes", default="lists,ids", help="lists, ids or both (comma-separated)")
    a = ap.parse_args()
    modes = a.modes.split(",")
    try:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    except (AttributeError, OSError):
        pass
    t0 = time.time()
    payloads = {m: build(a.ranks, a.seconds, m) for m in modes}
    for m, p in payloads.items():
        print(f"{m}: {sum(len(b) for s in p for b in s) / 1e6:.1f} MB gzip for {a.ranks} ranks x {a.seconds} s",
              flush=True)
    print(f"(built in {time.time() - t0:.1f} s)", flush=True)
    tune_gc()
    tmp = Path(tempfile.mkdtemp(prefix="ranksight-comm-"))
    cpus: dict[str, list[float]] = {m: [] for m in modes}
    try:
        measure(tmp / "warm", [[agent_request(0, 0, 64, "ids", list(range(64)),
                                              {g: schema.communicator_id(g, list(range(64))) for g in ("dp", "world")})]])
        for i in range(a.repeat):  # interleaved rounds
            for m in modes:
                cpus[m].append(measure(tmp / f"{m}{i}", payloads[m]))
        if len(modes) == 2:
            from analyzers.loader import load_run

            seen = {}
            for m in modes:
                co = load_run(tmp / f"{m}0", RUN).collectives.sort_values(["rank", "step", "seq"])
                seen[m] = [(int(r), int(s), q, len(g)) for r, s, q, g in
                           zip(co["rank"], co["step"], co["seq"], co["group_ranks"])]
            assert seen[modes[0]] == seen[modes[1]], "the two modes stored different collectives"
            print(f"check: both modes give the analyzers the same {len(seen[modes[0]])} collectives with their "
                  f"{a.ranks} members each")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(f"{'collective records carry':34s} {'CPU s (min)':>12s} {'median':>8s} {'core at 1 step/s':>17s}")
    share = {}
    for m in modes:
        c = sorted(cpus[m])
        share[m] = 100 * c[0] / a.seconds
        label = "their group's member list" if m == "lists" else "a comm_id (members stored once)"
        print(f"{label:34s} {c[0]:12.3f} {c[len(c) // 2]:8.3f} {share[m]:16.1f}%")
    if len(modes) == 2:
        print(f"ratio lists / ids: {share[modes[0]] / share[modes[1]]:.1f}x")


if __name__ == "__main__":
    main()
