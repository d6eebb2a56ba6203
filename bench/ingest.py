"""Step records per second through the head: decode -> dedupe -> store, on one core.

    .venv/bin/python bench/ingest.py [--ranks 16384] [--seconds 6] [--ranks-per-node 8] [--http]

What is measured (CPU seconds of this process, pyarrow limited to one thread):

- **head path, packed bodies** (current agents): ``Head.ingest.logs`` on OTLP/HTTP request
  bodies exactly as the node agents send them (gzip, ExportLogsServiceRequest built by the
  OpenTelemetry SDK's encoder, one log record per agent and kind; step records as a
  ``packed-v1`` bytes body, see docs/otlp-mapping.md): gunzip, protobuf parse, layout/length
  check, write-ahead log, queue; and once per simulated second the flush: vectorized dedupe,
  Arrow conversion, live-window update, Parquet write (amortized in).
- **head path, JSON bodies** (older agents: the body is the JSON array of the spool lines),
  same fleet, same run: what the head cost before packed bodies, and what it costs for an old
  agent now.
- **baselines, same payloads, same run**: gunzip + protobuf parse alone (what any OTLP
  receiver must pay), for both encodings, and for JSON that plus the msgspec body decode.
- optionally (``--http``) the packed requests through the head's stdlib HTTP server over
  loopback, to show what the transport adds.

The fleet shape: ``--ranks`` ranks at one step per second, ``--ranks-per-node`` ranks per
node agent, one request per agent per second, each step record followed by its two
collective records (as the trainer writes them; collectives travel as JSON). Goal: 16,384
ranks in < 10 % of a core. The script checks that both encodings store the same steps table
and that the live window saw the last step.
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

import msgspec  # noqa: E402
import pyarrow as pa  # noqa: E402

pa.set_cpu_count(1)
pa.set_io_thread_count(1)

from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs  # noqa: E402
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402

from head import receiver as otlp_receiver  # noqa: E402
from ranksight import wire, wire_decode  # noqa: E402
from head.service import Head, tune_gc  # noqa: E402
from ranksight import schema  # noqa: E402

RUN = "bench"


def step_lines(rank: int, node: int, step: int, world: int) -> list[bytes]:
    t = 1.8e9 + step
    s = schema.StepRecord(run_id=RUN, rank=rank, step=step, node=node, host=f"node{node:05d}", world_size=world,
                          dp_rank=rank, t_start=t, t_end=t + 0.95, step_ms=950.0, data_ms=3.0, forward_ms=300.0,
                          backward_ms=550.0, optimizer_ms=40.0, comm_ms=57.0, compute_ms=890.0, sync_arrival=t + 0.9,
                          sync_wait_ms=12.0, tokens=16384, loss=2.3456, grad_norm=0.71, lr=3e-4, mem_bytes=71_000_000_000,
                          flops=1.2e15)
    c1 = schema.CollectiveRecord(run_id=RUN, rank=rank, step=step, seq=2 * step, op="all_reduce", group="dp",
                                 nbytes=1 << 28, t_arrive=t + 0.9, t_done=t + 0.94, duration_ms=40.0)
    c2 = schema.CollectiveRecord(run_id=RUN, rank=rank, step=step, seq=2 * step + 1, op="broadcast", group="world",
                                 nbytes=24, t_arrive=t + 0.94, t_done=t + 0.95, duration_ms=10.0)
    return [schema.encode(c1), schema.encode(c2), schema.encode(s)]


COLLECTIVES_PER_STEP = 2


ENCODING = "packed"  # "packed": step records as current agents ship them; "json": as older agents did
_step_decoder = msgspec.json.Decoder(schema.StepRecord)


def agent_records(node: int, ranks_per_node: int, step: int, world: int) -> list:
    """One node agent's log records for one second, as node.agent ships them: one log record per
    kind holding every local rank's records (steps packed, or JSON spool lines with ENCODING=json)."""
    res = Resource.create({"service.name": "ranksight-agent", wire.R_NODE: node, wire.R_HOST: f"node{node:05d}"})
    colls, steps = [], []
    for lr in range(ranks_per_node):
        c1, c2, s = step_lines(node * ranks_per_node + lr, node, step, world)
        colls += [c1, c2][:COLLECTIVES_PER_STEP]
        steps.append(s)
    packed = wire.pack_records("step", RUN, [_step_decoder.decode(s) for s in steps]) if ENCODING == "packed" else None
    if packed is not None:
        out = [wire.make_log_record(RUN, "step", packed[1], node=node, count=len(steps), step_min=step,
                                    step_max=step, resource=res, layout=packed[0])]
    else:
        out = [wire.make_log_record(RUN, "step", wire.join_array(steps), node=node, count=len(steps),
                                    step_min=step, step_max=step, resource=res)]
    if colls:
        out.append(wire.make_log_record(RUN, "collective", wire.join_array(colls), node=node, count=len(colls),
                                        step_min=step, step_max=step, resource=res))
    return out


def agent_request(nodes: range, ranks_per_node: int, step: int, world: int) -> bytes:
    """One OTLP request: one agent's records, or (Collector batching) several agents' merged."""
    recs = [r for n in nodes for r in agent_records(n, ranks_per_node, step, world)]
    return gzip.compress(encode_logs(recs).SerializeToString(), compresslevel=6)


def build_payloads(ranks: int, ranks_per_node: int, seconds: int, agents_per_request: int) -> list[list[bytes]]:
    nodes = ranks // ranks_per_node
    k = agents_per_request
    return [[agent_request(range(n, min(n + k, nodes)), ranks_per_node, step, ranks) for n in range(0, nodes, k)]
            for step in range(seconds)]


def cpu(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=16384)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--seconds", type=int, default=6, help="simulated seconds (steps per rank)")
    ap.add_argument("--agents-per-request", type=int, default=1,
                    help="requests carry this many agents' records (1: agents ship straight to the head; "
                         ">1: an OpenTelemetry Collector's batch processor in between merges them)")
    ap.add_argument("--collectives-per-step", type=int, default=2, choices=(0, 1, 2),
                    help="collective records shipped with each step record (the trainer writes 2 for DP)")
    ap.add_argument("--repeat", type=int, default=3, help="head-path runs (fresh store each); min and median shown")
    ap.add_argument("--http", action="store_true", help="also measure through the HTTP server (loopback)")
    args = ap.parse_args()
    global COLLECTIVES_PER_STEP
    COLLECTIVES_PER_STEP = args.collectives_per_step
    try:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, really
    except (AttributeError, OSError):
        pass

    global ENCODING
    t0 = time.time()
    built = {}
    for enc in ("json", "packed"):
        ENCODING = enc
        built[enc] = build_payloads(args.ranks, args.ranks_per_node, args.seconds, args.agents_per_request)
    ENCODING = "packed"
    flat_of = {enc: [p for sec in pl for p in sec] for enc, pl in built.items()}
    n_steps = args.ranks * args.seconds
    per_step = 1 + COLLECTIVES_PER_STEP
    n_records = per_step * n_steps
    for enc, flat in flat_of.items():
        print(f"built {len(flat)} requests ({sum(map(len, flat)) / 1e6:.1f} MB gzip, step records {enc}) for "
              f"{args.ranks} ranks x {args.seconds} s", flush=True)
    print(f"(payloads built in {time.time() - t0:.1f} s)", flush=True)

    # -- baselines: gunzip + protobuf parse, touching every body; + msgspec decode of JSON bodies ------
    def parse_only(flat):
        for body in flat:
            req = ExportLogsServiceRequest()
            req.ParseFromString(otlp_receiver.decompress(body, "gzip"))
            for rl in req.resource_logs:
                for sl in rl.scope_logs:
                    for lr in sl.log_records:
                        getattr(lr.body, lr.body.WhichOneof("value"))  # noqa: B018 - materialize the body

    def parse_decode(flat):
        for body in flat:
            req = ExportLogsServiceRequest()
            req.ParseFromString(otlp_receiver.decompress(body, "gzip"))
            for _b, _err in wire_decode.iter_batches(req):
                pass

    base_parse = min(cpu(lambda: parse_only(flat_of["json"])) for _ in range(2))
    base_decode = min(cpu(lambda: parse_decode(flat_of["json"])) for _ in range(2))
    base_parse_packed = min(cpu(lambda: parse_only(flat_of["packed"])) for _ in range(2))

    # -- the head path: decode -> dedupe -> WAL -> live window -> Parquet ----------------------
    tmp = Path(tempfile.mkdtemp(prefix="ranksight-bench-"))
    tune_gc()  # as `ranksight head` does

    def measure_head(store: Path, enc: str) -> tuple[float, float, int]:
        global RUN, ENCODING
        payloads = built[enc]
        head = Head(store, "t", analyzer=None, flush_rows=10**9)
        # warm-up (imports, pyarrow's first conversions) on another run id, outside the timing
        RUN, ENCODING = "warmup", enc
        try:
            warm = agent_request(range(4), args.ranks_per_node, 0, 64)
        finally:
            RUN, ENCODING = "bench", "packed"
        accepted, rejected, msg = head.ingest.logs(otlp_receiver.parse("logs", otlp_receiver.decompress(warm, "gzip"), ""))
        assert rejected == 0 and accepted > 0, msg
        head.store.flush_all()

        def head_path():
            for sec in payloads:
                for body in sec:
                    req = otlp_receiver.parse("logs", otlp_receiver.decompress(body, "gzip"), "application/x-protobuf")
                    head.ingest.logs(req)
                head.store.flush_all()  # once per simulated second: the head's flush interval

        c = cpu(head_path)
        rs = head.store.run(RUN)
        assert rs.rows_stored["steps"] == n_steps
        # the live window was fed: every rank's latest step is the last simulated second
        assert head.live.run(RUN).max_step() == args.seconds - 1

        def again():  # an agent resending everything of one second (all duplicates), then the flush
            for b in payloads[0]:
                head.ingest.logs(otlp_receiver.parse("logs", otlp_receiver.decompress(b, "gzip"), ""))
            head.store.flush_all()

        dup = cpu(again)
        assert rs.stored_and_buffered("steps") == n_steps
        head.close()
        nbytes = sum(p.stat().st_size for p in (store / RUN).rglob("*.parquet"))  # parts, or the hour merged at close
        return c, dup * args.seconds, nbytes

    try:
        res = {}
        for enc in ("json", "packed"):
            runs = [measure_head(tmp / f"store-{enc}{i}", enc) for i in range(args.repeat)]
            cpus = sorted(r[0] for r in runs)
            res[enc] = (cpus[0], cpus[len(cpus) // 2], min(r[1] for r in runs), runs[0][2])
        # Both encodings store the same table.
        from ranksight.tables import read_table

        a = read_table(tmp / "store-json0", RUN, "steps").sort_values(["rank", "step"]).reset_index(drop=True)
        b = read_table(tmp / "store-packed0", RUN, "steps").sort_values(["rank", "step"]).reset_index(drop=True)
        assert a.equals(b), "packed and JSON paths stored different steps tables"
        http_cpu = None
        if args.http:
            http_cpu = bench_http(tmp / "store-http", flat_of["packed"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def rate(c):
        return n_steps / c if c > 0 else float("inf")

    print()
    print(f"fleet: {args.ranks} ranks x 1 step/s, {args.ranks_per_node} ranks/agent, "
          f"{args.agents_per_request} agent(s)/request -> {len(built['json'][0])} requests/s, "
          f"{n_records // args.seconds} records/s (1 step + {COLLECTIVES_PER_STEP} collectives per rank-step)")
    print(f"{'path':62s} {'CPU s':>8s} {'step rec/s':>12s} {'all rec/s':>12s} {'core for fleet':>15s}")
    jmin, jmed, jdup, _ = res["json"]
    pmin, pmed, pdup, pbytes = res["packed"]
    rows = [
        ("baseline: gunzip + protobuf parse (JSON bodies)", base_parse),
        ("baseline: + msgspec decode of the JSON bodies", base_decode),
        ("head, JSON bodies (older agents): full path (min)", jmin),
        (f"head, JSON bodies: median of {args.repeat}", jmed),
        ("baseline: gunzip + protobuf parse (packed bodies)", base_parse_packed),
        ("head, packed bodies (current agents): full path (min)", pmin),
        (f"head, packed bodies: median of {args.repeat}", pmed),
    ]
    for name, c in rows:
        print(f"{name:62s} {c:8.3f} {rate(c):12,.0f} {per_step * rate(c):12,.0f} {100 * args.ranks / rate(c):14.1f}%")
    for name, c in (("head, JSON: every request again (all duplicates)", jdup),
                    ("head, packed: every request again (all duplicates)", pdup)):
        print(f"{name:62s} {c:8.3f} {rate(c):12,.0f} {'':12s} {100 * args.ranks / rate(c):14.1f}%")
    if http_cpu is not None:
        print(f"{'head over HTTP, packed (loopback, client excluded)':62s} {http_cpu:8.3f} {rate(http_cpu):12,.0f} "
              f"{per_step * rate(http_cpu):12,.0f} {100 * args.ranks / rate(http_cpu):14.1f}%")
    print(f"Parquet written: {pbytes / 1e6:.1f} MB for {n_records} records; packed vs JSON head path: "
          f"{jmin / pmin:.2f}x less CPU; packed head / parse-only baseline: {pmin / base_parse_packed:.2f}x")
    print(f"RESULT: {rate(pmin):,.0f} step records/s per core; {args.ranks} ranks at 1 step/s take "
          f"{100 * args.ranks / rate(pmin):.1f}% of one core (goal < 10%)")


def bench_http(store: Path, flat: list[bytes]) -> float:
    """Head CPU time (server process only) for the same requests over loopback HTTP."""
    import http.client
    import subprocess

    import psutil


    port_sock = __import__("socket").socket()
    port_sock.bind(("127.0.0.1", 0))
    port = port_sock.getsockname()[1]
    port_sock.close()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    p = subprocess.Popen([sys.executable, "-m", "cli.main", "head", "--store", str(store), "--port", str(port),
                          "--token", "t", "--log-level", "WARNING", "--analyze-interval", "3600"], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        proc = psutil.Process(p.pid)
        for _ in range(100):
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/api/health")
                c.getresponse().read()
                break
            except OSError:
                time.sleep(0.1)
        ct0 = proc.cpu_times()
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        hdr = {"Authorization": "Bearer t", "Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"}
        for body in flat:
            c.request("POST", "/v1/logs", body=body, headers=hdr)
            r = c.getresponse()
            r.read()
            assert r.status == 200, r.status
        ct1 = proc.cpu_times()
        return (ct1.user + ct1.system) - (ct0.user + ct0.system)
    finally:
        p.terminate()
        p.wait(30)


if __name__ == "__main__":
    main()
