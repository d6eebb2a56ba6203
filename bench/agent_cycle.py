"""CPU cost of the node agent's per-cycle work, each path side by side with its baseline in one run.

A real head (``ranksight head`` as a child process, 127.0.0.1 only) receives the exports. Measured, as CPU time
per call (``time.thread_time``: this thread; ``time.process_time``: the whole bench process, which also catches
helper threads such as urllib3-future's keep-alive watcher), the arms of each pair alternating call by call in a
random order:

1. **OTLP export** of one realistic cycle (``--ranks`` x ``--records`` step records, packed as the agent's
   ``SpoolSource.collect`` packs them, plus a heartbeat as ``NodeAgent.cycle`` adds) through
   ``OTLPLogExporter.export``, the same exporter settings the agent uses (deflate, timeout, auth header), with
   three sessions: ``lean`` = ``node.otlp_session.LeanSession`` (what ``exporter_session`` picks for a plain-http
   head without a proxy), ``requests`` = a plain ``requests.Session()`` (what the SDK exporter uses when given no
   session: the baseline), ``env_once`` = ``env_once_session()`` (the agent's TLS / proxy path).
2. **Prometheus step series**: ``AgentMetrics.observe_steps`` (each series once per rank and cycle) vs the
   per-record updates of the code before (reproduced below in ``per_record_observe``).
3. ``NodeAgent.cycle()`` whole, with ``--records`` new step records per rank per cycle (written untimed), CPU
   per cycle and per step record (informational: no baseline).

Printed: medians with bootstrap 95 % CIs (calls resampled) and baseline / new ratios.

    .venv/bin/python bench/agent_cycle.py
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cli.datapath import DataPath  # noqa: E402
from node.agent import NodeAgent  # noqa: E402
from node.otlp_session import LeanSession, env_once_session, exporter_session  # noqa: E402
from node.prom import AgentMetrics  # noqa: E402
from ranksight import schema  # noqa: E402
from ranksight.layout import RunDir  # noqa: E402

TOKEN = "bench-agent-cycle"
RUN = "bench-cycle"


def step_record(rank: int, step: int, node: int = 0) -> schema.StepRecord:
    t = 1_700_000_000.0 + step * 0.06
    return schema.StepRecord(run_id=RUN, rank=rank, step=step, node=node, host="h", world_size=8, t_start=t,
                             t_end=t + 0.06, step_ms=60.0 + (step % 7), data_ms=1.2, forward_ms=20.0, backward_ms=30.0,
                             optimizer_ms=3.0, comm_ms=4.0, compute_ms=54.8 + (step % 7), tokens=768, loss=2.5,
                             grad_norm=1.1, lr=1e-3, mem_bytes=1 << 30, flops=1.2e12, device_ms=50.0)


def write_spool(rd: RunDir, rank: int, steps) -> None:
    rd.spool_dir.mkdir(parents=True, exist_ok=True)
    with open(rd.spool(rank), "ab") as f:
        for s in steps:
            f.write(schema.encode(step_record(rank, s)) + b"\n")


def per_record_observe(m: AgentMetrics, recs, cache: dict) -> None:
    """The Prometheus updates as the agent made them before ``observe_steps`` (agent/prom.py ``observe_step`` and
    ``_child`` at commit bba5a14^): every step record touches each of its ~15 series once, through a cache of
    labelled children keyed by (metric, run_id, rank, node); with today's label sets (node/prom.py: a few gauges per
    rank, the rest per node)."""

    per_rank = {id(x) for x in (m.step_compute, m.step_comm, m.last_step, m.last_step_time)}  # the rest: per node

    def c(metric, rec):
        key = (id(metric), rec.run_id, rec.rank, rec.node)
        ch = cache.get(key)
        if ch is None:
            ch = cache[key] = (metric.labels(rec.run_id, str(rec.rank), str(rec.node)) if id(metric) in per_rank
                               else metric.labels(rec.run_id, str(rec.node)))
        return ch

    for rec in recs:
        c(m.step_duration, rec).observe(rec.step_ms / 1000.0)
        c(m.step_compute, rec).set(rec.compute_ms / 1000.0)
        c(m.step_comm, rec).set(rec.comm_ms / 1000.0)
        c(m.step_data, rec).set(rec.data_ms / 1000.0)
        c(m.step_pipe, rec).set(rec.pipeline_wait_ms / 1000.0)
        c(m.steps, rec).inc()
        if rec.tokens:
            c(m.tokens, rec).inc(rec.tokens)
        if rec.flops:
            c(m.flops, rec).inc(rec.flops)
        if rec.overflow:
            c(m.overflow, rec).inc()
        c(m.loss, rec).set(float("nan") if rec.loss is None else rec.loss)
        if rec.grad_norm is not None:
            c(m.grad_norm, rec).set(rec.grad_norm)
        if rec.loss_scale is not None:
            c(m.loss_scale, rec).set(rec.loss_scale)
        c(m.last_step, rec).set(rec.step)
        c(m.last_step_time, rec).set(rec.t_end)
        if rec.mem_bytes:
            c(m.mem, rec).set(rec.mem_bytes)


def boot_median(x, n_boot: int = 2000, seed: int = 1) -> tuple[float, float, float]:
    x = np.asarray(x, float)
    rng = np.random.default_rng(seed)
    meds = np.median(rng.choice(x, size=(n_boot, len(x)), replace=True), axis=1)
    return float(np.median(x)), float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def boot_ratio(base, new, n_boot: int = 2000, seed: int = 2) -> tuple[float, float, float]:
    """median(base) / median(new), calls of each arm resampled independently."""
    b, n = np.asarray(base, float), np.asarray(new, float)
    rng = np.random.default_rng(seed)
    rb = np.median(rng.choice(b, size=(n_boot, len(b)), replace=True), axis=1)
    rn = np.median(rng.choice(n, size=(n_boot, len(n)), replace=True), axis=1)
    r = rb / rn
    return float(np.median(b) / np.median(n)), float(np.percentile(r, 2.5)), float(np.percentile(r, 97.5))


def fmt(t: tuple[float, float, float], scale: float = 1e3, digits: int = 3) -> str:
    return f"{t[0] * scale:.{digits}f} [{t[1] * scale:.{digits}f}, {t[2] * scale:.{digits}f}]"


def timed(fn, clocks):
    t0 = [c() for c in clocks]
    fn()
    return [c() - a for c, a in zip(clocks, t0)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exports", type=int, default=400, help="export calls per session arm")
    ap.add_argument("--prom-calls", type=int, default=2000, help="observe calls per Prometheus arm")
    ap.add_argument("--cycles", type=int, default=200, help="whole NodeAgent.cycle() calls")
    ap.add_argument("--ranks", type=int, default=1, help="local ranks per cycle")
    ap.add_argument("--records", type=int, default=20, help="step records per rank per cycle")
    args = ap.parse_args(argv)
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
    from opentelemetry.sdk._logs.export import LogRecordExportResult
    import requests

    clocks = (time.thread_time, time.process_time)
    random.seed(0)
    with tempfile.TemporaryDirectory(prefix="ranksight-agent-cycle-") as tmp:
        store = Path(tmp) / "store"
        # the head only receives and stores here (no live analysis), on 127.0.0.1, as ranksight launch starts it
        head = DataPath(store, RUN, nodes=0, token=TOKEN, head_args=["--analyze-interval", "0"]).start(timeout=60)
        try:
            url = head.head_url
            rd = RunDir(store, RUN)
            for r in range(args.ranks):
                write_spool(rd, r, range(args.records))
            agent = NodeAgent(rd, 0, url, TOKEN, sim_gpu="off", otlp_metrics=False, ship_timeout=5.0)
            # the exporter sends through it (node.shipping keeps responses; node.otlp_session.CompressingSession
            # compresses: zstd for this head)
            lean = agent.shipper.compressing.inner
            assert agent.shipper.exporter._client._transport._session is agent.shipper.session
            assert isinstance(lean, LeanSession), type(lean)
            assert isinstance(exporter_session(url + "/v1/logs"), LeanSession)
            items = agent.spool.collect()  # one cycle's items, positions not committed
            step_items = [i for i in items if i.kind == "step"]
            assert step_items and sum(i.count for i in step_items) == args.ranks * args.records, items
            recs = agent.shipper.log_records(items, [agent.heartbeat()])
            sessions = {"lean": lean, "requests": requests.Session(), "env_once": env_once_session()}
            exporters = {k: OTLPLogExporter(endpoint=url + "/v1/logs", headers={"Authorization": f"Bearer {TOKEN}"},
                                            timeout=5.0, compression=Compression.Deflate, session=s)
                         for k, s in sessions.items()}
            exporters["lean"] = agent.shipper.exporter
            for e in exporters.values():  # warm-up: connections open, code paths imported
                for _ in range(5):
                    assert e.export(recs) == LogRecordExportResult.SUCCESS
            exp_t: dict[str, list[list[float]]] = {k: [] for k in exporters}
            failed = 0
            for _ in range(args.exports):
                order = list(exporters)
                random.shuffle(order)
                for k in order:
                    out: list = []
                    dt = timed(lambda: out.append(exporters[k].export(recs)), clocks)
                    failed += out[0] != LogRecordExportResult.SUCCESS
                    exp_t[k].append(dt)

            # -- Prometheus step series -------------------------------------------------------
            batches = [[step_record(r, s) for s in range(i * args.records, (i + 1) * args.records)]
                       for i in range(8) for r in range(args.ranks)]
            m_new, m_old, cache = AgentMetrics(), AgentMetrics(), {}
            prom_t: dict[str, list[list[float]]] = {"batched": [], "per_record": []}
            arms = {"batched": lambda b: (lambda: [m_new.observe_steps(x) for x in b]),
                    "per_record": lambda b: (lambda: [per_record_observe(m_old, x, cache) for x in b])}
            per_cycle = [batches[i:i + args.ranks] for i in range(0, len(batches), args.ranks)]
            for b in per_cycle:  # warm-up: series created
                arms["batched"](b)()
                arms["per_record"](b)()
            for i in range(args.prom_calls):
                b = per_cycle[i % len(per_cycle)]
                order = list(arms)
                random.shuffle(order)
                for k in order:
                    prom_t[k].append(timed(arms[k](b), clocks))

            # -- whole cycle --------------------------------------------------------------------
            agent.cycle()  # ships the records written above, commits positions
            cyc: list[list[float]] = []
            next_step = args.records
            for _ in range(args.cycles):
                for r in range(args.ranks):
                    write_spool(rd, r, range(next_step, next_step + args.records))
                next_step += args.records
                cyc.append(timed(agent.cycle, clocks))
            shipped_ok = agent.shipper.errors == 0
            agent.close()
        finally:
            head.stop()

    n_rec = args.ranks * args.records
    print(f"# agent per-cycle CPU: {args.ranks} rank(s) x {args.records} step records per cycle, head at 127.0.0.1; "
          f"{args.exports} exports per session arm, {args.prom_calls} Prometheus calls per arm, {args.cycles} cycles; "
          f"failed exports {failed}, cycle ship errors {0 if shipped_ok else 'SOME'}")
    print("# ms of CPU per call: median [bootstrap 95 % CI]")
    print()
    print("| what | arm | thread CPU ms | process CPU ms |")
    print("|---|---|---:|---:|")
    for k in exporters:
        th, pr = np.array(exp_t[k]).T
        print(f"| OTLP export | {k} | {fmt(boot_median(th))} | {fmt(boot_median(pr))} |")
    for k in prom_t:
        th, pr = np.array(prom_t[k]).T
        print(f"| Prometheus step series, per cycle | {k} | {fmt(boot_median(th))} | {fmt(boot_median(pr))} |")
    th, pr = np.array(cyc).T
    print(f"| NodeAgent.cycle() | whole cycle | {fmt(boot_median(th))} | {fmt(boot_median(pr))} |")
    print(f"| NodeAgent.cycle() | per step record | {fmt(boot_median(th / n_rec), digits=4)} | "
          f"{fmt(boot_median(pr / n_rec), digits=4)} |")
    print()
    print("| ratio (baseline / new, median of each arm) | thread CPU | process CPU |")
    print("|---|---:|---:|")
    for base, new in (("requests", "lean"), ("env_once", "lean"), ("requests", "env_once")):
        b, n = np.array(exp_t[base]).T, np.array(exp_t[new]).T
        r1, r2 = boot_ratio(b[0], n[0]), boot_ratio(b[1], n[1])
        print(f"| OTLP export: {base} / {new} | {r1[0]:.2f}x [{r1[1]:.2f}, {r1[2]:.2f}] | "
              f"{r2[0]:.2f}x [{r2[1]:.2f}, {r2[2]:.2f}] |")
    b, n = np.array(prom_t["per_record"]).T, np.array(prom_t["batched"]).T
    r1, r2 = boot_ratio(b[0], n[0]), boot_ratio(b[1], n[1])
    print(f"| Prometheus: per_record / batched | {r1[0]:.2f}x [{r1[1]:.2f}, {r1[2]:.2f}] | "
          f"{r2[0]:.2f}x [{r2[1]:.2f}, {r2[2]:.2f}] |")
    return 0 if failed == 0 and shipped_ok else 1


if __name__ == "__main__":
    sys.exit(main())
