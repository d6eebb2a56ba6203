"""A 16,384-rank job's telemetry through the real data path in real time: agents' export bodies → HTTP → the head
(ingest, store, live window) → live analysis; the head's CPU by part and its analysis round time.

    .venv/bin/python bench/scale.py [--ranks 16384] [--tp 8] [--pp 4] [--seconds 30] [--warmup 8]
        [--agents-per-request 1] [--tp-ops 16] [--dp-ops 4] [--collectives auto]
        [--connections 8] [--by-kind] [--no-bundle]

The fleet (synthetic, every figure below is from this generated telemetry, not from a GPU job): ``--ranks`` ranks
in TP × PP × DP (``--tp`` ranks of one tensor-parallel group per node: 8 ranks per node agent; ``--pp`` pipeline
stages; DP the rest: 512 ranks per data-parallel group at 16,384 ranks), one step per second. Per rank and step the
instrumentation records its step and its collectives: ``--tp-ops`` TP all-reduces on its node's TP group,
``--dp-ops`` gradient buckets (all-reduces) on its DP group, one p2p send to the next stage and one recv from the
previous (groups ``pp:<src>><dst>``); each names its group by ``comm_id``, and the lowest member of each group
writes the group's member list once (the ``communicators`` table: 2,048 TP groups, 32 DP groups of 512, 12,288 p2p
links at 16,384 ranks). The agents ship the collectives as their ``--collectives`` mode would
(``node/sources/spool.py``: by default one record per op up to 256 ranks, folded per step above:
``ranksight/collective_fold.py``). Each agent also ships one simulated GPU sample per GPU per second and a
heartbeat; its packed batches (steps, collectives, GPU samples) and the heartbeat travel in one ``bundle-v1`` log
record, as ``node.shipping`` sends them (``--no-bundle``: one log record each, as older agents do). Rank 3 computes 1.3× from second ``--slow-from`` (its DP peers wait for it): the head must name it.

The agent stage: the CPU one node agent spends turning a second of its ranks' records into its export (records
made, folded where they are, packed, OTLP, zstd: what ``node.shipping`` sends), measured on the bodies this
script builds; the agent's spool reading is in bench/agent_cycle.py (A4).

The head: the real ``ranksight head`` in its own process (live analysis every 5 s, its default), fed over
loopback HTTP by ``--connections`` keep-alive client threads in this process, each second's requests spread over
the second (``--agents-per-request`` > 1: an OpenTelemetry Collector's batch processor merges that many agents'
exports into one request, docs/otel-collector.md), or, with ``--per-agent-connections``, one keep-alive connection per
request of a second (per agent, as agents without a Collector connect) from ``--sender-processes`` forked sender
processes (bench/agent_connections.py). After ``--warmup`` seconds the head's own
``ranksight_head_cpu_seconds_total{part}`` and ``ranksight_head_analysis_round_seconds`` are read from its
``/metrics`` and again at the end: the share of one core each part of the head took, and the analysis rounds'
mean and longest wall time (the live window then holds as many steps as seconds have passed, fewer than the 256 a
long run analyzes: bench/head_analysis.py measures full windows). Whether the senders kept to real time is
printed too: a head that cannot keep up makes them fall behind.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402

from cli.local_cluster import free_port  # noqa: E402
from node.sources.spool import FOLD_ABOVE_RANKS  # noqa: E402
from ranksight import schema, wire  # noqa: E402
from ranksight.collective_fold import fold_per_step  # noqa: E402

RUN = "bench-scale"
TOKEN = "bench-scale-token"
SLOW_RANK, SLOW_FACTOR = 3, 1.3
T0 = 1.8e9


class Fleet:
    """Rank layout and groups: rank = ((dp * pp) + stage) * tp + t; a node is one TP group."""

    def __init__(self, ranks: int, tp: int, pp: int, tp_ops: int, dp_ops: int, fold: bool, slow_from: int = 10):
        if ranks % (tp * pp):
            raise SystemExit(f"--ranks {ranks} is not a multiple of tp × pp = {tp * pp}")
        self.ranks, self.tp, self.pp, self.dp, self.tp_ops = ranks, tp, pp, ranks // (tp * pp), tp_ops
        self.nodes = ranks // tp
        self.slow_from = slow_from
        self.dp_ops, self.fold = dp_ops, fold
        self.groups: dict[str, tuple[str, list[int]]] = {}  # comm_id -> (group name, members)
        self.comm_of: dict[tuple[int, str], str] = {}  # (rank, role) -> comm_id
        for r in range(ranks):
            t, stage = r % tp, (r // tp) % pp
            self._add(r, "tp", "tp", [r - t + i for i in range(tp)])
            self._add(r, "dp", "dp", [(i * pp + stage) * tp + t for i in range(self.dp)])
            if stage + 1 < pp:
                self._add(r, "send", f"pp:{r}>{r + tp}", [r, r + tp])
            if stage > 0:
                self._add(r, "recv", f"pp:{r - tp}>{r}", [r - tp, r])

    def _add(self, rank: int, role: str, group: str, members: list[int]) -> None:
        cid = schema.communicator_id(group, members)
        self.groups.setdefault(cid, (group, members))
        self.comm_of[(rank, role)] = cid

    def node_records(self, node: int, step: int) -> dict[str, list]:
        """One node's records of one second: step, collective, gpu (and, at step 0, the communicators it writes)."""
        steps, colls, gpus, comms = [], [], [], []
        t = T0 + step
        for lr in range(self.tp):
            r = node * self.tp + lr
            slow = r == SLOW_RANK and step >= self.slow_from
            compute = 600.0 * (SLOW_FACTOR if slow else 1.0)
            # the slow rank's DP peers wait for it in the gradient sync; it arrives last and waits for nobody
            dp_peer_slow = (not slow and step >= self.slow_from and r != SLOW_RANK
                            and self.comm_of[(r, "dp")] == self.comm_of[(SLOW_RANK, "dp")])
            wait = 180.0 + (0.0 if slow else 10.0) if dp_peer_slow else 10.0 + (lr % 3)
            arrive = t + compute / 1000.0
            steps.append(schema.StepRecord(
                run_id=RUN, rank=r, step=step, node=node, host=f"node{node:05d}", world_size=self.ranks,
                dp_rank=r // (self.tp * self.pp), tp_rank=lr, pp_stage=(r // self.tp) % self.pp,
                t_start=t, t_end=arrive + (wait + 40.0) / 1000.0, step_ms=compute + wait + 40.0, comm_ms=wait + 40.0,
                compute_ms=compute, device_ms=compute, sync_arrival=arrive, sync_wait_ms=wait,
                tokens=16384, loss=2.3, lr=3e-4, flops=1.2e15))
            roles = [("tp", k) for k in range(self.tp_ops)] + [("dp", k) for k in range(self.dp_ops)] + \
                [(x, 0) for x in ("send", "recv") if (r, x) in self.comm_of]
            for role, k in roles:
                cid = self.comm_of[(r, role)]
                op = {"tp": "all_reduce", "dp": "all_reduce", "send": "send", "recv": "recv"}[role]
                per_step = {"tp": self.tp_ops, "dp": self.dp_ops}.get(role, 1)
                if role == "dp":  # gradient buckets from the sync on: the first one waits for the slowest peer
                    start, dur = arrive + 0.003 * k, (wait + 30.0) if k == 0 else 3.0
                else:  # TP all-reduces through the forward and backward passes; p2p at the stage boundaries
                    start, dur = t + (0.5 * compute / 1000.0) * (k + 1) / (per_step + 1), 2.0
                colls.append(schema.CollectiveRecord(
                    run_id=RUN, rank=r, step=step, seq=step * per_step + k, op=op, group=self.groups[cid][0],
                    nbytes=1 << 24, t_arrive=start, t_done=start + dur / 1000.0, duration_ms=dur, comm_id=cid))
                if step == 0 and k == 0 and min(self.groups[cid][1]) == r and role != "recv":
                    g, members = self.groups[cid]
                    comms.append(schema.CommunicatorRecord(run_id=RUN, comm_id=cid, group=g, ranks=members, rank=r))
            gpus.append(schema.GpuSample(node=node, host=f"node{node:05d}", gpu=lr, t=t + 0.5, source="python-sim",
                                         simulated=True, util_pct=97.0, temp_c=61.0, power_w=640.0,
                                         sm_clock_mhz=1980.0, max_sm_clock_mhz=1980.0))
        if self.fold:  # as the node agent ships them (node/sources/spool.py, ranksight/collective_fold.py)
            colls = fold_per_step(colls)
        return {"step": steps, "collective": colls, "gpu": gpus, "communicator": comms}


def agent_log_records(fleet: Fleet, node: int, step: int, resource, bundle: bool = True) -> list:
    """One agent's OTLP log records for one second, as node/shipping.py makes them: the packed batches and the
    heartbeat in one bundle-v1 log record (``bundle``; else one log record each, as older agents send them), the
    JSON batches one log record each."""
    recs, sections = [], []
    for kind, rows in fleet.node_records(node, step).items():
        if not rows:
            continue
        packed = wire.pack_records(kind, RUN, rows)
        layout, body = packed if packed is not None else (None, wire.join_array([schema.encode(x) for x in rows]))
        if bundle and layout is not None:
            sections.append((kind, layout, body, len(rows)))
            continue
        recs.append(wire.make_log_record(RUN, kind, body, node=node, count=len(rows), step_min=step, step_max=step,
                                         resource=resource, layout=layout))
    hb = wire.Heartbeat(node=node, host=f"node{node:05d}", url="", t=T0 + step,
                        ranks=list(range(node * fleet.tp, (node + 1) * fleet.tp)), lag_s=0.0, spooled_records=0,
                        dropped_records=0, ship_errors=0, garbage_lines=0, rejected_records=0)
    if bundle:
        sections.append(("heartbeat", None, msgspec.json.encode(hb), 1))
        recs.insert(0, wire.make_log_record(RUN, wire.KIND_BUNDLE, wire.pack_bundle(sections), node=node,
                                            count=sum(c for *_, c in sections), resource=resource, bundle=True))
    else:
        recs.append(wire.make_log_record(RUN, "heartbeat", msgspec.json.encode(hb), node=node, resource=resource))
    return recs


ENCODINGS = ("zstd", "deflate")


def compress_body(raw: bytes, encoding: str) -> bytes:
    """A request body as the agents send it (``node.otlp_session.CompressingSession``): zstd to a head that takes
    it, deflate (zlib level 6) to an older one."""
    if encoding == "zstd":
        from ranksight.zstd import zstd_codec

        return zstd_codec().compress(raw, asbytes=True)
    return zlib.compress(raw, 6)


def build_second(fleet: Fleet, step: int, per_request: int, resources: list,
                 bundle: bool = True, encoding: str = "zstd") -> tuple[list[bytes], float]:
    """The second's request bodies (protobuf, compressed as the agents send them: ``encoding``) and the CPU seconds
    the agents' side of it took (records packed, OTLP encoded, compressed)."""
    bodies, cpu = [], 0.0
    for n0 in range(0, fleet.nodes, per_request):
        t0 = time.process_time()
        recs = [r for n in range(n0, min(n0 + per_request, fleet.nodes))
                for r in agent_log_records(fleet, n, step, resources[n], bundle)]
        bodies.append(compress_body(encode_logs(recs).SerializeToString(), encoding))
        cpu += time.process_time() - t0
    return bodies, cpu


KINDS = ("step", "collective", "gpu", "heartbeat")


def ingest_by_kind(fleet: Fleet, seconds: int = 4) -> dict[str, float]:
    """In this process, on one core, no HTTP: the head's ingest + store flush CPU for each kind of record alone and
    for all together, as the share of one core one second of the fleet costs."""
    import pyarrow as pa

    from head import receiver
    from head.service import Head

    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    res = [Resource.create({"service.name": "ranksight-agent", wire.R_NODE: n}) for n in range(fleet.nodes)]

    def bodies(step: int, kinds: tuple) -> list[bytes]:
        return [zlib.compress(encode_logs([r for r in agent_log_records(fleet, n, step, res[n], bundle=False)
                                           if r.log_record.attributes.get(wire.A_KIND) in kinds]).SerializeToString(), 6)
                for n in range(fleet.nodes)]

    out = {}
    for kinds in [(k,) for k in KINDS] + [KINDS]:
        payloads = [bodies(s, kinds) for s in range(1, seconds + 1)]
        tmp = Path(tempfile.mkdtemp(prefix="ranksight-scale-kind-"))
        head = Head(tmp, TOKEN, analyzer=None, flush_rows=10**9)
        try:
            for body in bodies(0, KINDS + ("communicator",)):  # the communicators, and a warm start
                head.ingest.logs(receiver.parse("logs", receiver.decompress(body, "deflate"), "application/x-protobuf"))
            head.store.flush_all()
            t0 = time.process_time()
            for sec in payloads:
                for body in sec:
                    head.ingest.logs(receiver.parse("logs", receiver.decompress(body, "deflate"),
                                                    "application/x-protobuf"))
                head.store.flush_all()
            out["+".join(kinds) if len(kinds) > 1 else kinds[0]] = 100.0 * (time.process_time() - t0) / seconds
        finally:
            head.close()
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def ingest_in_process(seconds: list[list[bytes]], warmup: int, encoding: str, tree: Path, parts_every: int = 1) -> dict:
    """``bench/scale_inproc.py`` on these bodies, in a child whose head code comes from ``tree``; part files every
    ``parts_every`` seconds (the queue processed every second)."""
    with tempfile.TemporaryDirectory(prefix="ranksight-scale-bodies-") as d:
        path = Path(d) / "bodies.pickle"
        path.write_bytes(pickle_dumps(seconds))
        env = dict(os.environ, PYTHONPATH=str(tree))
        p = subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "scale_inproc.py"), str(path),
                            str(warmup), encoding, str(parts_every)],
                           env=env, cwd=tree, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise SystemExit(f"in-process ingest failed:\n{p.stdout}{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def pickle_dumps(obj) -> bytes:
    import pickle

    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def stored_rows(run_dir: Path) -> dict[str, int]:
    """Rows of the run's steps, collectives and GPU samples in the store (the files a reader reads)."""
    import pyarrow.parquet as pq

    from ranksight import store_layout

    out = {}
    for table in ("steps", "collectives", "gpu"):
        files = store_layout.table_files(run_dir / table) if (run_dir / table).exists() else []
        out[table] = sum(pq.ParquetFile(f.path).metadata.num_rows for f in files)
    return out


def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    text = urllib.request.urlopen(req, timeout=60).read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "ranksight_head_cpu_seconds_total":
                out["cpu:" + s.labels["part"]] = s.value
            elif s.name in ("ranksight_head_analysis_round_seconds_sum", "ranksight_head_analysis_round_seconds_count"):
                out[s.name.rsplit("_", 1)[1]] = s.value
            elif s.name == "ranksight_head_ingest_batches_total" and s.labels.get("signal") == "logs":
                out["requests"] = s.value
            elif s.name == "ranksight_head_analysis_round_seconds_bucket":
                out["le:" + s.labels["le"]] = s.value
    return out


def send_all(url: str, seconds: list[list[bytes]], connections: int, on_second,
             encoding: str = "zstd") -> list[float]:
    """Post each second's bodies over ``connections`` keep-alive connections, spread over that second; returns how
    far behind real time each second's last request was acknowledged (s)."""
    host, port = url.split("//", 1)[1].split(":")
    work: queue.Queue = queue.Queue(maxsize=4096)
    errors: list[str] = []

    def sender():
        c = http.client.HTTPConnection(host, int(port), timeout=120)
        hdr = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/x-protobuf",
               "Content-Encoding": encoding}
        while (item := work.get()) is not None:
            body, done = item
            c.request("POST", "/v1/logs", body=body, headers=hdr)
            r = c.getresponse()
            r.read()
            if r.status != 200:
                errors.append(f"HTTP {r.status}")
            done()

    threads = [threading.Thread(target=sender, daemon=True) for _ in range(connections)]
    for t in threads:
        t.start()
    behind = []
    start = time.monotonic()
    for i, bodies in enumerate(seconds):
        left = threading.Semaphore(0)
        for j, body in enumerate(bodies):
            due = start + i + j / len(bodies)
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            work.put((body, left.release))
        for _ in bodies:
            left.acquire()
        behind.append(max(0.0, time.monotonic() - (start + i + 1)))
        on_second(i)
    for _ in threads:
        work.put(None)
    if errors:
        raise SystemExit(f"the head refused requests: {errors[:3]} ({len(errors)} in all)")
    return behind


def cached_bodies(a, build) -> tuple[list[list[bytes]], list[float]]:
    """Every second's request bodies and the agents' CPU for each (``build(second)``), read from ``--bodies-cache``
    when an earlier run with the same fleet options and the same encoding code made them (a 16,384-rank fleet's
    40 s take a minute to build), else built (and written there)."""
    import hashlib
    import pickle

    if a.bodies_cache is None:
        built = [build(s) for s in range(a.seconds)]
        return [b for b, _ in built], [c for _, c in built]
    key = hashlib.sha256(repr((a.ranks, a.tp, a.pp, a.tp_ops, a.dp_ops, a.collectives, a.seconds,
                               a.agents_per_request, a.slow_from, a.no_bundle, a.encoding)).encode())
    for src in (Path(__file__), ROOT / "ranksight" / "wire.py", ROOT / "ranksight" / "schema.py",
                ROOT / "ranksight" / "collective_fold.py"):
        key.update(src.read_bytes())
    path = a.bodies_cache / f"scale-{key.hexdigest()[:16]}.pickle"
    if path.exists():
        return pickle.loads(path.read_bytes())
    built = [build(s) for s in range(a.seconds)]
    out = [b for b, _ in built], [c for _, c in built]
    a.bodies_cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
    tmp.replace(path)
    return out


def send_seconds(url: str, seconds: list[list[bytes]], a, on_second) -> tuple[list[float], float, str]:
    """The seconds' bodies to the head as ``a`` says: over ``--connections`` client threads here, or one connection
    per request of a second (``--per-agent-connections``). Returns (behind real time per second, the senders' CPU
    seconds, the connections in words)."""
    if not a.per_agent_connections:
        client0 = time.process_time()
        behind = send_all(url, seconds, a.connections, on_second, a.encoding)
        return behind, time.process_time() - client0, f"{a.connections} client threads in the bench's process"
    from bench.agent_connections import send_per_agent

    behind, cpu, connect_s = send_per_agent(url, TOKEN, seconds, on_second, processes=a.sender_processes,
                                            encoding=a.encoding)
    return behind, cpu, (f"{len(seconds[0])} keep-alive connections (one per request of a second) from "
                         f"{a.sender_processes} sender processes, opened in {connect_s:.1f} s")


class RoundWatch:
    """Each analysis round's wall time, from the head's ``ranksight_head_analysis_round_seconds`` read once a second
    after ``warmup`` seconds (a round's sum and count change together; rounds are seconds apart)."""

    def __init__(self, url: str, warmup: float):
        self.url, self.rounds = url, []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._watch, args=(warmup,), daemon=True)
        self._t.start()

    def _watch(self, warmup: float) -> None:
        if self._stop.wait(warmup):
            return
        prev = None
        while not self._stop.wait(1.0):
            try:
                m = scrape(self.url)
            except OSError:
                continue
            now = (m.get("count", 0.0), m.get("sum", 0.0))
            if prev is not None and now[0] > prev[0]:
                self.rounds.append((now[1] - prev[1]) / (now[0] - prev[0]))
            prev = now

    def stop(self) -> list[float]:
        self._stop.set()
        self._t.join(5)
        return list(self.rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=16384)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--tp-ops", type=int, default=16, help="TP all-reduces per rank and step")
    ap.add_argument("--dp-ops", type=int, default=4, help="gradient buckets (DP all-reduces) per rank and step")
    ap.add_argument("--collectives", choices=("auto", "per-op", "per-step"), default="auto",
                    help="as the node agents' --collectives: auto folds per step above %d ranks" % FOLD_ABOVE_RANKS)
    ap.add_argument("--seconds", type=int, default=30, help="seconds of real time (steps per rank)")
    ap.add_argument("--warmup", type=int, default=8, help="seconds before the head's CPU is read the first time")
    ap.add_argument("--agents-per-request", type=int, default=1)
    ap.add_argument("--connections", type=int, default=8,
                    help="client threads the requests share (a Collector's few connections)")
    ap.add_argument("--per-agent-connections", action="store_true",
                    help="one keep-alive connection per request of a second instead (per agent with "
                         "--agents-per-request 1, as agents connect: bench/agent_connections.py)")
    ap.add_argument("--sender-processes", type=int, default=4,
                    help="with --per-agent-connections: the sender processes the connections are spread over")
    ap.add_argument("--analyze-interval", type=float, default=5.0, help="the head's; 0: no live analysis")
    ap.add_argument("--slow-from", type=int, default=10, help="the second from which rank 3 computes 1.3x")
    ap.add_argument("--no-bundle", action="store_true",
                    help="one log record per batch, as agents before bundle-v1 (and agents facing an older head) send")
    ap.add_argument("--encoding", choices=ENCODINGS, default="zstd",
                    help="the request bodies' Content-Encoding: zstd, as agents send it to a head that takes it; "
                         "deflate, as they send it to an older head")
    ap.add_argument("--by-kind", action="store_true",
                    help="first, in this process on one core without HTTP: the head's ingest CPU per kind of record")
    ap.add_argument("--head-tree", type=Path, default=ROOT,
                    help="run the head from this checkout (a baseline's worktree); the senders stay this one's")
    ap.add_argument("--head-arg", action="append", default=[],
                    help="one more argument for the head's command line (repeat it)")
    ap.add_argument("--bodies-cache", type=Path,
                    help="keep the built request bodies in this folder and reuse them (same options and encoding)")
    ap.add_argument("--in-process", action="store_true",
                    help="instead of the HTTP run: the head's ingest and flush of the same bodies in one process, one "
                         "core, no HTTP (bench/scale_inproc.py, the head from --head-tree), as ms of CPU per second "
                         "of the fleet after --warmup seconds")
    ap.add_argument("--parts-every", type=int, default=1, metavar="N",
                    help="with --in-process: the queue processed every second, part files written every N seconds "
                         "(a head writing parts less often than it feeds its live window)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    a = ap.parse_args()
    if a.warmup >= a.seconds:
        raise SystemExit("--warmup must be shorter than --seconds")

    t_build = time.time()
    fold = a.collectives == "per-step" or (a.collectives == "auto" and a.ranks > FOLD_ABOVE_RANKS)
    fleet = Fleet(a.ranks, a.tp, a.pp, a.tp_ops, a.dp_ops, fold, a.slow_from)
    resources = [Resource.create({"service.name": "ranksight-agent", wire.R_NODE: n, wire.R_HOST: f"node{n:05d}"})
                 for n in range(fleet.nodes)]
    seconds, agent_cpu = cached_bodies(a, lambda s: build_second(fleet, s, a.agents_per_request, resources,
                                                                  bundle=not a.no_bundle, encoding=a.encoding))
    per_s = sum(len(b) for b in seconds[1]) / 1e6
    n_coll = len(fleet.node_records(0, 1)["collective"]) * fleet.nodes
    n_ops = fleet.nodes * sum(a.tp_ops + a.dp_ops + sum((r, x) in fleet.comm_of for x in ("send", "recv"))
                              for r in range(fleet.tp))
    print(f"fleet: {a.ranks} ranks (TP {a.tp} × PP {a.pp} × DP {fleet.dp}), {fleet.nodes} node agents, "
          f"{len(fleet.groups)} communicators; per second: {a.ranks} step records, {n_coll} collective records "
          f"({n_ops} ops, {'folded per step' if fold else 'one record per op'}), "
          f"{a.ranks} GPU samples, {fleet.nodes} heartbeats in {len(seconds[1])} requests ({per_s:.1f} MB, {a.encoding}); "
          f"built in {time.time() - t_build:.0f} s", flush=True)
    agent_ms = 1000.0 * sorted(agent_cpu[1:])[len(agent_cpu[1:]) // 2] / fleet.nodes
    # how each kind travels, as the agents send it (node/sources/spool.py, node/sources/samples.py): packed-v1 where
    # wire.pack_records packs the batch exactly, else JSON
    encodings = {kind: ("packed-v1" if wire.pack_records(kind, RUN, rows) else "JSON")
                 for kind, rows in fleet.node_records(0, 0).items() if rows}
    print(f"agents' export: OTLP/HTTP protobuf, {a.encoding}; bodies: "
          + ", ".join(f"{k} {v}" for k, v in encodings.items()) + ", heartbeat JSON"
          + ("" if a.no_bundle else "; the packed batches and the heartbeat in one bundle-v1 log record per agent"),
          flush=True)
    print(f"agent stage (records made{', folded' if fold else ''}, packed, OTLP, {a.encoding}; one node's second): "
          f"{agent_ms:.2f} ms CPU = "
          f"{agent_ms / 10:.2f} % of one core per node", flush=True)

    by_kind = {}
    if a.by_kind:
        by_kind = ingest_by_kind(fleet)
        print("head ingest + store flush in-process, one core, no HTTP (share of one core per second of the fleet):")
        for k, v in by_kind.items():
            print(f"  {k:32s} {v:6.1f} %")
        print(flush=True)

    if a.in_process:
        got = ingest_in_process(seconds, a.warmup, a.encoding, a.head_tree.resolve(), a.parts_every)
        print(f"head in-process (one core, no HTTP; {got['seconds']} s after {a.warmup} s of warm-up), CPU per second "
              f"of the fleet: ingest {got['ingest_ms']:.1f} ms, flush {got['flush_ms']:.1f} ms, total "
              f"{got['total_ms']:.1f} ms ({got['total_ms'] / 10:.1f} % of one core; part files every {a.parts_every} s: "
              f"{got.get('parts_ms', got['flush_ms']):.1f} ms of the flush); {got['accepted']} records "
              f"accepted, {got['rejected']} log records rejected; load average {os.getloadavg()[0]:.1f}")
        if a.json:
            a.json.write_text(json.dumps(dict(ranks=a.ranks, agents_per_request=a.agents_per_request,
                                              encoding=a.encoding, bundle=not a.no_bundle, in_process=got), indent=1))
        return

    tmp = Path(tempfile.mkdtemp(prefix="ranksight-scale-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tree = a.head_tree.resolve()
    env = dict(os.environ, PYTHONPATH=str(tree), RANKSIGHT_TOKEN=TOKEN)
    head = subprocess.Popen([sys.executable, "-m", "cli.main", "head", "--store", str(tmp / "store"), "--port",
                             str(port), "--token", TOKEN, "--log-level", "WARNING", "--analyze-interval", str(a.analyze_interval),
                             *a.head_arg],
                            env=env, cwd=tree,
                            stdout=subprocess.DEVNULL, stderr=open(tmp / "head.log", "wb"))
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(url + "/api/health", timeout=2).read()
                break
            except OSError:
                time.sleep(0.1)
        marks: dict[str, tuple[float, dict]] = {}

        def on_second(i: int) -> None:
            if i + 1 == a.warmup:
                marks["from"] = (time.monotonic(), scrape(url))

        # each round's time read from /metrics once a second; with live analysis off there is none to read, and a
        # scrape a second would make the head process its queue twice a second (a Prometheus scrape comes every
        # 15-60 s), which is not what is measured then
        rounds_seen = RoundWatch(url, a.warmup) if a.analyze_interval > 0 else None
        behind, client_cpu, connections = send_seconds(url, seconds, a, on_second)
        marks["to"] = (time.monotonic(), scrape(url))
        round_times = rounds_seen.stop() if rounds_seen is not None else []
        req = urllib.request.Request(f"{url}/api/runs/{RUN}/findings", headers={"Authorization": f"Bearer {TOKEN}"})
        findings = json.loads(urllib.request.urlopen(req, timeout=60).read())
        head.terminate()  # a head that stops flushes and compacts: then every record sent is in the store
        head.wait(300)
        stored = stored_rows(tmp / "store" / RUN)
    finally:
        if head.poll() is None:
            head.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    (t1, m1), (t2, m2) = marks["from"], marks["to"]
    span = t2 - t1
    parts = sorted({k for k in m2 if k.startswith("cpu:")})
    share = {k[4:]: max(0.0, 100.0 * (m2[k] - m1.get(k, 0.0)) / span) for k in parts}
    rounds = m2.get("count", 0) - m1.get("count", 0)
    mean_round = (m2.get("sum", 0) - m1.get("sum", 0)) / rounds if rounds else float("nan")
    longest = float("nan")  # the upper bound of the bucket the longest round fell in
    for le in sorted(float(k[3:]) for k in m2 if k.startswith("le:")):
        key = "le:" + ("+Inf" if le == float("inf") else repr(le))
        if rounds and m2.get(key, 0) - m1.get(key, 0) >= rounds:
            longest = le
            break
    found = findings if isinstance(findings, list) else findings.get("findings", [])
    named = [f for f in found if isinstance(f, dict) and f.get("kind") == "straggler"]
    print(f"\nhead over {span:.0f} s of real time (after {a.warmup} s of warm-up), share of one core by part:")
    for k, v in share.items():
        print(f"  {k:14s} {v:6.1f} %")
    print(f"  {'total':14s} {sum(share.values()):6.1f} %")
    answered = m2.get("requests", 0.0) - m1.get("requests", 0.0)
    http_us = 1e6 * (m2.get("cpu:http", 0.0) - m1.get("cpu:http", 0.0)) / answered if answered else float("nan")
    print(f"requests answered: {answered:.0f} ({answered / span:.0f}/s); http CPU per request {http_us:.0f} µs")
    print(f"analysis rounds: {rounds:.0f}, mean {mean_round:.2f} s, longest ≤ {longest} s (window ≤ {a.seconds} steps)")
    if round_times:
        srt = sorted(round_times)
        print(f"  each round after the warm-up (s): {', '.join(f'{x:.2f}' for x in round_times)}; "
              f"min {srt[0]:.2f}, median {srt[len(srt) // 2]:.2f}")
    print(f"connections: {connections}")
    print(f"senders behind real time at the end: {behind[-1]:.1f} s (most: {max(behind):.1f} s); the senders' own "
          f"CPU: {100 * client_cpu / (len(behind) + behind[-1]):.0f} % of one core; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"straggler findings naming rank {SLOW_RANK}: "
          f"{sum(SLOW_RANK in f.get('ranks', []) for f in named)} of {len(named)} straggler findings")
    # a node's collective records depend on its pipeline stage alone (node = dp * pp + stage)
    colls_per_s = sum(len(fleet.node_records(stage, 1)["collective"]) for stage in range(a.pp)) * (fleet.nodes // a.pp)
    sent = {"steps": a.ranks * a.seconds, "collectives": colls_per_s * a.seconds, "gpu": a.ranks * a.seconds}
    lost = {t: sent[t] - stored.get(t, 0) for t in sent if stored.get(t, 0) != sent[t]}
    print("store after the head stopped: " + ", ".join(f"{t} {stored.get(t, 0)} of {n} sent" for t, n in sent.items())
          + (f"; MISSING OR EXTRA: {lost}" if lost else "; every record sent is stored once"))
    if a.json:
        a.json.write_text(json.dumps(dict(ranks=a.ranks, tp=a.tp, pp=a.pp, agents_per_request=a.agents_per_request, bundle=not a.no_bundle, encoding=a.encoding,
                                          seconds=a.seconds, span_s=span, share_pct=share, connections=connections, round_s=round_times,
                                          requests=answered, http_us_per_request=http_us, client_cpu_s=client_cpu, ingest_by_kind_pct=by_kind, rounds=rounds,
                                          mean_round_s=mean_round, behind_s=behind, agent_ms_per_node=agent_ms,
                                          findings=named, stored=stored, sent=sent), indent=1))


if __name__ == "__main__":
    main()
