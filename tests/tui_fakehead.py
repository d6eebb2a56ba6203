"""A fake head for the TUI tests: a stdlib HTTP server on 127.0.0.1 answering the head's API shapes.

The data is deterministic (fixed clock T0): run ``run-a``, 8 ranks on 2 nodes, dp4×tp1×pp2, 40 steps;
rank 5 (node 1) computes 1.8x its peers from step 20 on, and a straggler finding says so. ``job_data`` makes other
shapes of the same story (a 4-rank job, a 4,096-rank job, a run that ended). Profiler summaries of
one capture (steps 30..34, cuda) say the same in kernel time; ``/traces`` serves them through the head's own
``analyzers.trace_windows`` (the same rows and bounds as the real endpoint).
POSTs to /api/runs/<id>/actions are recorded (headers and body) and answered like the real head.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

T0 = 1_700_000_000.0
RUN = "run-a"
TOKEN = "tui-test-token"


def step_record(rank: int, step: int, per_node: int = 4, world: int = 8, slow: int = 5) -> dict:
    node = rank // per_node
    stage = rank % 2
    compute = 100.0 + rank % 8 + (80.0 if rank == slow and step >= 20 else 0.0)
    step_ms = 220.0 if step >= 20 else 140.0
    comm = step_ms - compute - 10.0
    return {"kind": "step", "run_id": RUN, "rank": rank, "step": step, "node": node, "host": f"node{node}",
            "attempt": 0, "world_size": world, "pp_stage": stage, "dp_rank": rank // 2, "tp_rank": 0,
            "t_start": T0 + step * 0.2, "t_end": T0 + step * 0.2 + step_ms / 1000, "step_ms": step_ms,
            "data_ms": 10.0, "forward_ms": compute / 3, "backward_ms": compute * 2 / 3, "optimizer_ms": 1.0,
            "comm_ms": comm, "pipeline_wait_ms": 0.0, "compute_ms": compute, "sync_arrival": None,
            "sync_wait_ms": comm - 5.0, "tokens": 4096, "loss": (4.0 - step * 0.02) if stage == 1 else None,
            "loss_nonfinite": False, "grad_norm": 1.0, "loss_scale": None, "overflow": False, "skipped": False,
            "lr": 1e-3, "mem_bytes": 1 << 30, "flops": 2.0e12, "profiling": False, "microbatches": 4}


def gpu_state(node: int, gpu: int, **kw) -> dict:
    """One entry of GET /api/runs/<id>/gpus (simulated GPUs, like every CPU-machine run)."""
    d = {"node": node, "gpu": gpu, "host": f"node{node}", "ranks": [node * 4 + gpu], "name": "RankSight Simulated GPU",
         "uuid": f"GPU-sim-{node}-{gpu}", "source": "simulated-nvml", "simulated": True, "t": T0 + 8.0, "age_s": 1.0,
         "util_pct": 96.0, "mem_util_pct": 41.0, "mem_used_bytes": 30 * 2**30, "mem_total_bytes": 80 * 2**30,
         "power_w": 610.0, "power_limit_w": 700.0, "temp_c": 68.0, "sm_clock_mhz": 1980.0, "max_sm_clock_mhz": 1980.0,
         "sm_clock_frac": 1.0, "mem_clock_mhz": 2619.0, "throttle_reasons": 0, "throttle_names": [], "throttled": False,
         "ecc_sbe": 0, "ecc_dbe": 0, "retired_pages": 0, "remapped_rows": 0, "xid_total": 0, "xid_count": 0,
         "last_xid": None}
    d.update(kw)
    return d


def trace_summary(rank: int, a: int = 30, b: int = 34, device: str = "cuda", **kw) -> dict:
    """A TraceSummary (as the agent ships it) of ``rank`` over steps a..b: per step, kernel 100 + rank ms (rank 5:
    180), NCCL 40 of which 10 under compute, copy 2, idle 8 (wall = kernel + exposed + copy + idle)."""
    n = b - a + 1
    kernel = 180.0 if rank == 5 else 100.0 + rank
    d = {"kind": "trace_summary", "run_id": RUN, "rank": rank, "step_start": a, "step_end": b,
         "trace_file": f"/var/agent/{RUN}/traces/rank-{rank}.step{a}-{b}.json", "wall_ms": n * (kernel + 30 + 2 + 8),
         "compute_ms": n * kernel, "comm_ms": n * 40.0, "overlap_ms": n * 10.0, "idle_ms": n * 8.0,
         "copy_ms": n * 2.0, "top_ops": [{"name": "sm90_gemm", "total_ms": n * kernel * 0.6, "count": 4 * n}],
         "collectives": [], "device": device, "truncated": False, "notes": []}
    d.update(kw)
    return d


def default_data() -> dict:
    steps = [step_record(r, s) for s in range(40) for r in range(8)]
    ranks = [{"rank": r, "node": r // 4, "host": f"node{r // 4}", "step": 39, "attempt": 0, "t_end": T0 + 8.0,
              "step_ms": 220.0, "last_seen": T0 + 8.0, "age_s": 0.5, "state": "running"} for r in range(8)]
    ranks[7].update(step=31, age_s=42.0, state="stalled")
    return {
        "runs": [{"run_id": RUN, "status": "running", "start_time": T0, "world_size": 8,
                  "layout": {"dp": 4, "tp": 1, "pp": 2, "world": 8}, "nodes": 2, "last_step": 39,
                  "last_seen": T0 + 8.0, "ranks_live": 8, "steps_stored": 320,
                  "peak_flops": 1.0e14, "peak_source": "measured fp32 matmul on this CPU", "peak_simulated": True},
                 {"run_id": "run-b", "status": "finished", "start_time": T0 - 3600, "world_size": 4,
                  "layout": {"dp": 4, "tp": 1, "pp": 1, "world": 4}, "nodes": 1, "last_step": 99,
                  "last_seen": T0 - 1000, "ranks_live": 0, "steps_stored": 400}],
        "ranks": ranks,
        "steps": steps,
        "findings": [straggler_finding(5, 1),
            {"analyzer": "pipeline", "kind": "pipeline_bubble", "severity": "info", "ranks": [], "nodes": [],
             "step_start": 0, "step_end": 39, "evidence": {"measured_bubble": 0.21, "theory_bubble": 0.2, "pp": 2,
                                                        "microbatches": 8, "schedule": "1f1b"},
             "recommendation": "Nothing to do.", "confidence": 0.7, "summary": "bubble 21% vs 20% theory",
             "run_id": RUN, "t": T0 + 4.0, "simulated": False},
        ],
        "actions": [{"run_id": RUN, "id": "ck0001", "t": T0 + 2.0, "action": "checkpoint", "node": None, "ranks": [],
                     "steps": 0, "reason": "manual", "finding_kind": "", "dry_run": False, "status": "applied",
                     "applied_step": 12, "requested_by": "api:127.0.0.1"}],
        "health": {"ok": True, "stats": {}, "runs": 1},
        # an older capture of steps 10..14 first (ranks alike), then the newest, where rank 5's kernels are slow
        "traces": [trace_summary(r, 10, 14, compute_ms=5 * 100.0) for r in range(8)]
        + [trace_summary(r) for r in range(8)],
        # rank 5's GPU (node 1, GPU 1) throttles for heat; rank 7's (node 1, GPU 3) had XID 79 and stalled
        "gpus": [gpu_state(n, g) for n in (0, 1) for g in range(4)
                 if (n, g) not in ((1, 1), (1, 3))] + [
            gpu_state(1, 1, temp_c=92.0, sm_clock_mhz=1215.0, sm_clock_frac=1215 / 1980, throttle_reasons=0x60,
                      throttle_names=["sw_thermal_slowdown", "hw_thermal_slowdown"], throttled=True),
            gpu_state(1, 3, util_pct=0.0, power_w=90.0, xid_total=1, xid_count=1, last_xid=79, age_s=3.0)],
    }


def straggler_finding(rank: int, node: int) -> dict:
    return {"analyzer": "stragglers", "kind": "straggler", "severity": "warning", "ranks": [rank], "nodes": [node],
            "step_start": 20, "step_end": 39,
            "evidence": {"rank_median_compute_ms": 185.0, "peers_median_compute_ms": 103.5, "ratio": 1.787,
                         "onset_step": 20, "signal": "compute_ms", "cusum_threshold": 0.393},
            "recommendation": f"Inspect rank {rank} on node {node}: GPU clocks/throttling; if it persists, checkpoint "
                              f"and evict node {node}.",
            "confidence": 0.9, "summary": f"rank {rank} (node {node}) is the straggler since step 20: compute 185.0 ms "
                                          "vs peers 103.5 ms (1.79x)",
            "run_id": RUN, "t": T0 + 5.0, "simulated": False}


def job_data(world: int, per_node: int, slow: int, steps: int = 40, ended: bool = False) -> dict:
    """A job of ``world`` ranks, ``per_node`` per node (dp only), rank ``slow`` computing 1.8x from step 20 on, the
    last ``steps`` steps of 40 held by the head (a large job keeps the test's payload small). ``ended``: a run a user
    instrumented (no manifest) that finished: the head's status ``finished`` and every rank ``finished`` (its
    ``exit`` event says so)."""
    nodes = (world + per_node - 1) // per_node
    recs = [step_record(r, s, per_node, world, slow) for s in range(40 - steps, 40) for r in range(world)]
    state, age = ("finished", 95.0) if ended else ("running", 0.5)
    ranks = [{"rank": r, "node": r // per_node, "host": f"node{r // per_node}", "step": 39, "attempt": 0,
              "t_end": T0 + 8.0, "step_ms": 220.0, "last_seen": T0 + 8.0, "age_s": age, "state": state,
              "exit_reason": "finished" if ended else None} for r in range(world)]
    gpus = [gpu_state(r // per_node, r % per_node, ranks=[r]) for r in range(world)]
    slow_gpu = gpus[slow]
    slow_gpu.update(temp_c=92.0, sm_clock_mhz=1215.0, throttle_reasons=0x20, throttle_names=["sw_thermal_slowdown"],
                    throttled=True)
    return {
        "runs": [{"run_id": RUN, "status": "finished" if ended else "running", "start_time": T0, "world_size": world,
                  "layout": {} if ended else {"dp": world, "tp": 1, "pp": 1, "world": world}, "nodes": nodes,
                  "last_step": 39, "last_seen": T0 + 8.0, "ranks_live": 0 if ended else world,
                  "steps_stored": world * 40, "peak_flops": 1.0e14, "peak_source": "measured fp32 matmul on this CPU",
                  "peak_simulated": True}],
        "ranks": ranks, "steps": recs, "findings": [straggler_finding(slow, slow // per_node)], "actions": [],
        "health": {"ok": True, "stats": {}, "runs": 1}, "traces": [], "gpus": gpus,
    }


def traces_answer(d: dict, q: dict) -> list[dict]:
    """What the real head answers for these summaries (analyzers.trace_windows), nodes from the fake's rank list."""
    import msgspec

    from analyzers.trace_windows import DEFAULT_WINDOWS, trace_windows
    from ranksight import schema

    sums = msgspec.convert(d["traces"], list[schema.TraceSummary], strict=False)
    nodes = {r["rank"]: r.get("node") for r in d["ranks"]}
    rank = int(q["rank"]) if "rank" in q else None
    return trace_windows(sums, nodes.get, rank, int(q.get("windows", DEFAULT_WINDOWS)))


def plain(x) -> str:
    """The text of a cell or a widget's render (rich Text or Textual Content)."""
    return x.plain if hasattr(x, "plain") else str(x)


def make_app(fake: "FakeHead", run_id: str | None = RUN, token: str = TOKEN, **kw):
    from tui.app import RanksightApp
    from tui.client import HeadClient

    return RanksightApp(HeadClient(fake.url, token=token, timeout=2.0), run_id=run_id, interval=3600,
                        clock_fn=lambda: T0 + 9.0, **kw)


class FakeHead:
    def __init__(self, data: dict | None = None):
        self.data = data or default_data()
        self.posts: list[dict] = []
        self.gets: list[str] = []  # request paths with query, in order
        self.raw: dict[str, bytes] = {}  # path -> raw body to answer instead (malformed-response tests)
        # a string: an evict that is not forced (with a reason) is refused with 409 and this text, as the real head
        # answers when the evict policy's limits forbid it
        self.refuse_evict: str | None = None
        self.old_findings = False  # True: findings without evidence_sentences, as a head before them served
        self.ops = None  # GET .../ops: a function of the query -> (status, body); None: 404 (no such endpoint)
        fake = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, status: int, body: bytes):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                fake.gets.append(self.path)
                url = urlsplit(self.path)
                if url.path in fake.raw:
                    return self._send(200, fake.raw[url.path])
                q = {k: v[-1] for k, v in parse_qs(url.query).items()}
                parts = url.path.rstrip("/").split("/")
                d = fake.data
                if url.path == "/api/health":
                    return self._send(200, json.dumps(d["health"]).encode())
                if url.path == "/api/runs":
                    return self._send(200, json.dumps(d["runs"]).encode())
                if len(parts) == 5 and parts[1:3] == ["api", "runs"]:
                    what = parts[4]
                    if parts[3] != RUN:
                        return self._send(200, b"[]")
                    if what == "steps":
                        since = int(q.get("since", -1))
                        out = [s for s in d["steps"] if s["step"] > since
                               and ("rank" not in q or s["rank"] == int(q["rank"]))]
                        return self._send(200, json.dumps(out).encode())
                    if what == "findings" and what in d and not fake.old_findings:
                        # what the real head serves (head/api.py served_findings): the evidence in sentences too
                        from analyzers.report.sentences import explained

                        return self._send(200, json.dumps([explained(f) for f in d[what]]).encode())
                    if what in ("ranks", "findings", "actions", "gpus") and what in d:
                        return self._send(200, json.dumps(d[what]).encode())
                    if what == "traces" and "traces" in d:  # absent: a head from before the endpoint (404)
                        return self._send(200, json.dumps(traces_answer(d, q)).encode())
                    if what == "ops" and fake.ops is not None:  # the drill-down: (status, answer) from the test
                        status, answer = fake.ops(q)
                        return self._send(status, json.dumps(answer).encode())
                self._send(404, json.dumps({"error": f"no such endpoint: GET {url.path}"}).encode())

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n)
                fake.posts.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": json.loads(body)})
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._send(401, b'{"error": "missing or bad token"}')
                req = json.loads(body)
                if fake.refuse_evict and req.get("action") == "evict" and not (req.get("force") and req.get("reason")):
                    return self._send(409, json.dumps({"error": fake.refuse_evict}).encode())
                a = {"run_id": RUN, "id": f"act{len(fake.posts):04d}", "t": T0 + 9.0, "action": req["action"],
                     "node": req.get("node"), "ranks": req.get("ranks") or [], "steps": req.get("steps") or 0,
                     "reason": req.get("reason", ""), "finding_kind": "", "dry_run": bool(req.get("dry_run")),
                     "status": "requested", "applied_step": None, "requested_by": "api:127.0.0.1"}
                fake.data["actions"].append(a)
                self._send(202, json.dumps(a).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        self.stopped = False

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.server.shutdown()
            self.server.server_close()
