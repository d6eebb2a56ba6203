"""The drill-down's read of a big spool: ``GET /ops`` for a 100-step range of one rank's spool file.

Writes (once) a spool of ``--gb`` GB under ``--dir``: per step one step record and ``--ops`` collective records
(tensor-parallel all-reduces, data-parallel reduce-scatters and all-gathers, with communicator ids, as
``ranksight.instrument`` writes them). Then, in the same process, CPU time (``time.process_time``) of:

- the baseline: every line of the file decoded to find the range's records (what a reader without an index does:
  ``diagnose`` on the node, ``ranksight.spool.read_spool`` minus holding the file in memory);
- building the step index (``node.ops_reader.SpoolStepIndex``), the first query's extra cost;
- a 100-step query with the index built, at ``--queries`` places spread over the file;

those three interleaved, ``--rounds`` times; then
- wall time of ``GET /ops`` through a real agent endpoint (``node.control.ControlServer`` on 127.0.0.1): the first
  query (which builds the index), then the same ``--queries`` queries.

Prints min / median of each and the process's peak RSS. Timings vary with the machine's load; the load average is
printed with them.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import time
from pathlib import Path

import msgspec

from node.ops_reader import SpoolStepIndex, read_ops
from ranksight import schema
from ranksight.layout import RunDir
from ranksight.ops_query import OpsQuery
from ranksight.spool import SpoolWriter

RUN = "ops-bench"


def write_spool(path: Path, gb: float, ops_per_step: int) -> int:
    """A spool of about ``gb`` GB for rank 5 of a 1,024-rank job; its number of steps."""
    tp = schema.communicator_id("tp", list(range(0, 8)))
    dp = schema.communicator_id("dp", list(range(5, 1024, 8)))
    kinds = [("all_reduce", "tp", tp, 8 << 20)] * (ops_per_step - ops_per_step // 4) + \
            [("reduce_scatter", "dp", dp, 64 << 20)] * (ops_per_step // 8) + \
            [("all_gather", "dp", dp, 64 << 20)] * (ops_per_step // 4 - ops_per_step // 8)
    target = int(gb * 1e9)
    w = SpoolWriter(path)
    rnd = random.Random(5)
    step, seq, t = 0, 0, 1.7e9
    while os.fstat(w.fd).st_size < target:
        for _ in range(100):
            t0 = t
            for op, group, comm, nbytes in kinds:
                d = 0.5 + rnd.random()
                w.add(schema.CollectiveRecord(run_id=RUN, rank=5, step=step, seq=seq, op=op, group=group,
                                              nbytes=nbytes, t_arrive=t, t_done=t + d / 1e3, duration_ms=d,
                                              comm_id=comm))
                seq += 1
                t += 0.002
            w.add(schema.StepRecord(run_id=RUN, rank=5, step=step, node=0, host="node0", world_size=1024,
                                    t_start=t0, t_end=t, step_ms=(t - t0) * 1e3))
            step += 1
        w.flush()
    os.close(w.fd)
    return step


def full_scan(path: Path, q: OpsQuery) -> int:
    """The baseline: decode every line, keep the range's collective records (streaming, not the file in memory)."""
    n = 0
    with open(path, "rb") as f:
        for line in f:
            try:
                rec = schema.decode_spool_line(line)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if isinstance(rec, schema.CollectiveRecord) and q.matches(rec):
                n += 1
    return n


def http_queries(rd: RunDir, last: int, span: int, n: int) -> tuple[float, list[float]]:
    """Wall seconds of the first ``GET /ops`` on a fresh agent endpoint, and of ``n`` more."""
    import urllib.request

    from node.control import ControlServer
    from node.prom import AgentMetrics
    from ranksight.http_server import serve_in_thread, shutdown_server

    srv = ControlServer(("127.0.0.1", 0), rd=rd, node=0, token="bench", metrics=AgentMetrics(), local_ranks=lambda: [5])
    serve_in_thread(srv, "bench-agent-http")

    def get(lo: int) -> float:
        req = urllib.request.Request(f"{srv.url}/ops?rank=5&steps={lo}-{lo + span - 1}&limit=100000",
                                     headers={"Authorization": "Bearer bench"})
        t = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            body = r.read()
        assert len(msgspec.json.decode(body)["ops"]) > 0
        return time.perf_counter() - t

    try:
        first = get(last // 3)
        return first, [get((last - span) * i // max(1, n - 1)) for i in range(n)]
    finally:
        shutdown_server(srv)
        srv.server_close()


def cpu(fn):
    t = time.process_time()
    out = fn()
    return time.process_time() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/s10-drill"))
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--ops", type=int, default=64, help="collective records per step")
    ap.add_argument("--span", type=int, default=100, help="steps per query")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of baseline, index build and queries")
    ap.add_argument("--queries", type=int, default=9)
    ap.add_argument("--no-baseline", action="store_true", help="skip the full scan (minutes on a busy machine)")
    a = ap.parse_args()
    rd = RunDir(a.dir / f"store-{a.gb:g}gb-{a.ops}ops", RUN)
    path = rd.spool(5)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".part")
        tmp.unlink(missing_ok=True)
        t0 = time.time()
        steps = write_spool(tmp, a.gb, a.ops)
        tmp.rename(path)
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB, {steps} steps) in {time.time() - t0:.0f} s")
    size = path.stat().st_size
    ix = SpoolStepIndex(path)
    ix.refresh()
    last = max(ix.hi)
    print(f"spool {size / 1e9:.2f} GB, steps 0-{last}, {a.ops} collective records per step, {len(ix.starts)} blocks; "
          f"load average {os.getloadavg()[0]:.1f}")
    # rounds interleaved: a baseline scan, an index build, the queries; so load changes hit each alike
    q_mid = OpsQuery(rank=5, step_from=last // 2, step_to=last // 2 + a.span - 1, limit=100_000)
    baseline, builds, queries, counts, nread = [], [], [], set(), []
    for _ in range(a.rounds):
        if not a.no_baseline:
            t, n = cpu(lambda: full_scan(path, q_mid))
            baseline.append(t)
            counts.add(n)
        t, _ = cpu(lambda: SpoolStepIndex(path).refresh())
        builds.append(t)
        for i in range(a.queries):
            lo = (last - a.span) * i // max(1, a.queries - 1)
            q = OpsQuery(rank=5, step_from=lo, step_to=lo + a.span - 1, limit=100_000)
            t, ans = cpu(lambda: read_ops(ix, q, RUN, 0))
            queries.append(t)
            counts.add(len(ans.ops))
            nread.append(ans.bytes_read)
    if baseline:
        print(f"baseline, every line decoded to find {a.span} steps: min {min(baseline):.2f} s, median "
              f"{statistics.median(baseline):.2f} s CPU")
    print(f"index build (the first query's extra): min {min(builds):.2f} s, median {statistics.median(builds):.2f} s "
          f"CPU")
    print(f"{a.span}-step query, index built: min {min(queries) * 1e3:.1f} ms, median "
          f"{statistics.median(queries) * 1e3:.1f} ms CPU ({len(queries)} queries); {sorted(counts)} records; "
          f"{statistics.median(nread) / 1e6:.1f} MB read of {size / 1e9:.2f} GB")
    http_first, http = http_queries(rd, last, a.span, a.queries)
    print(f"GET /ops ({a.span} steps) through the agent's endpoint, wall: first query (index built) "
          f"{http_first:.2f} s; then min {min(http) * 1e3:.0f} ms, median {statistics.median(http) * 1e3:.0f} ms")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB; "
          f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
