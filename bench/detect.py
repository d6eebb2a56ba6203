"""Detection benchmark: run the real trainer with injected faults, score every analyzer against the manifest.

    python bench/detect.py                       # the full matrix (slow: one torchrun per cell)
    python bench/detect.py --layouts dp4 --faults slow_rank,data_stall --steps 20
    python bench/detect.py --replay --store DIR  # fast mode: re-score every run recorded in DIR (no trainer)
    python bench/detect.py --replay --store tests/fixtures/runs --no-results-md   # the CI slice

Each cell is one run of ``torchrun --standalone --nproc-per-node 4 -m trainer`` with one fault
(``--inject``) at one magnitude, on one parallel layout; slow_link cells run on a 2-node x 2-rank local cluster
(cli.local_cluster) with a network namespace per node, where node 1's link is rate-limited (``tc tbf``);
where namespaces are unavailable they fall back to the trainer's per-operation delay (``--slow-link delay``). Beside
every run, as a user runs ranksight, a head and one node agent per node ship and analyse it live
(``cli.datapath.DataPath``; ``--no-datapath``: the ranks alone). Clean runs of every layout are scored
too (any finding of warning or worse there is a false positive). Scoring is analyzers.score:
recall (faults found by a finding of their primary kind naming the right rank/node), precision
(warning+ findings that match an injected fault), latency in steps from the fault's start to
the step the finding was confirmed. Each run also reports its host's noise (``host_noise``: how much the device time of
the ranks no fault touched wandered), and the summary scores the quiet-host runs on their own as well.

Results: a JSON file per invocation under --results-dir and the per-run table with its summary in
bench/results/detect.md (rewritten whole by each invocation; bench/RESULTS.md holds the summary's
figures as rows). Runs are kept under --store (default bench/results/detect-runs) so ``--replay`` can score
them again after an analyzer change in seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from analyzers import run_all  # noqa: E402
from analyzers.builder import Placement  # noqa: E402
from analyzers.matrices import rank_step_matrix  # noqa: E402
from analyzers.loader import LoadError, load_run  # noqa: E402
from analyzers.score import score  # noqa: E402
from analyzers.stats import leave_one_out_median, temporal_sigma  # noqa: E402
from cli import netns  # noqa: E402
from cli.datapath import DataPath  # noqa: E402
from cli.local_cluster import LocalCluster  # noqa: E402
from ranksight.schema import FaultSpec  # noqa: E402

# d_model 128, 4 layers, batch 16: on 2 shared CPU cores compute (~250-400 ms a step per rank) then dominates the
# scheduling noise more than with a smaller model
MODEL = ["--d-model", "128", "--n-layers", "4", "--n-heads", "4", "--seq-len", "48", "--batch-size", "16"]
LAYOUTS = {
    "dp4": ["--dp", "4"],
    "dp2pp2": ["--dp", "2", "--pp", "2", "--microbatches", "4"],
    "dp2tp2": ["--dp", "2", "--tp", "2"],
}
# slow_link by rate: node 1's egress (its veth, in its own network namespace) limited to this many Mbit/s; per layout
# the two rates make a step ~1.15x and ~1.5x slower (measured; bench/results/detect.md shows each run's slow-down)
SLOW_LINK_RATE = {"dp4": (450, 300), "dp2pp2": (70, 45), "dp2tp2": (300, 150)}
# fault -> (inject template, two magnitudes, extra trainer args)
FAULTS = {
    "slow_rank": ("slow_rank:rank=1,factor={m},start={start}", (1.15, 1.5), []),
    "slow_link": ("slow_link:node=1,rate_mbit={m},start={start}", SLOW_LINK_RATE["dp4"], []),
    "throttle": ("throttle:rank=2,factor={m},start={start}", (1.15, 1.5), []),
    "data_stall": ("data_stall:rank=3,delay_ms={m},start={start}", (30, 150), []),
    "fp16_overflow": ("fp16_overflow:rank=0,start={start}", (1,), ["--precision", "fp16"]),
    "nan_loss": ("nan_loss:rank=2,start={start}", (1,), []),
    "hang": ("hang:rank=3,start={start}", (1,), ["--pg-timeout", "20"]),
    "xid": ("xid:node=0,code={m},start={start}", (79, 13), []),
    # configuration fault: the trainer runs M = pp micro-batches (torch.distributed.pipelining needs M >= P),
    # theory bubble (P-1)/(M+P-1) = 33 % at P = M = 2; the magnitude is that M
    "few_microbatches": ("few_microbatches", (2,), []),
}

# slow_link without namespaces (--slow-link delay): the trainer's delay hits every collective and p2p op of the rank,
# and the layouts post very different numbers of them per step (d_model 128 on this CPU, clean runs: dp4 ~3 per
# ~400 ms step, dp2pp2 ~3 + ~8 p2p per ~150 ms step, dp2tp2 ~36 (FSDP + TP all-reduces) per ~650 ms step). Per
# layout, the two delays put roughly 15 % and 50 % of a step's time into the slow link.
SLOW_LINK_DELAY = "slow_link:rank=1,delay_ms={m},start={start}"
SLOW_LINK_MS = {"dp4": (20, 80), "dp2pp2": (2, 8), "dp2tp2": (3, 10)}


# data_stall is a delay per step: sized per layout the same way (dp2tp2 steps are ~4x longer than the others'), so the
# low magnitude is ~15 % of a step everywhere (a fixed 30 ms was 4.6 % of a dp2tp2 step: below the analyzer's threshold
# by design, and below the 1.15x the benchmark's goal is about).
DATA_STALL_MS = {"dp2tp2": (100, 300)}


def magnitudes(fault: str, layout: str, link_mode: str = "rate") -> tuple:
    if fault == "slow_link":
        return (SLOW_LINK_RATE if link_mode == "rate" else SLOW_LINK_MS).get(layout, FAULTS[fault][1])
    if fault == "data_stall" and layout in DATA_STALL_MS:
        return DATA_STALL_MS[layout]
    return FAULTS[fault][1]


def torchrun(store: Path, run_id: str, args: list[str], nproc: int = 4, timeout: float = 300) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0",
           "--monitor-interval=0.5", "-m", "trainer", *args, "--store", str(store), "--run-id", run_id, "--quiet"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def cluster_run(store: Path, run_id: str, args: list[str], use_netns: bool, timeout: float = 300) -> int:
    """One run on a local 2-node x 2-rank cluster (each node in its own network namespace when ``use_netns``): the
    exit code of its worst node, -1 on timeout. The namespaces are removed whatever happens."""
    env = dict(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cluster = LocalCluster(run_dir=store / run_id, nnodes=2, nproc_per_node=2, min_nodes=2, max_restarts=0,
                           trainer_args=[*args, "--store", str(store), "--run-id", run_id, "--quiet"], env=env,
                           netns=use_netns)
    deadline = time.monotonic() + timeout
    try:
        cluster.start()
        while not cluster.done:
            if time.monotonic() > deadline:
                return -1
            cluster.poll()
            time.sleep(0.5)
        codes = [c for c in cluster.exit_codes().values()]
        return max((c for c in codes if c is not None), key=abs, default=0)
    finally:
        cluster.stop()


def cells(layouts: list[str], faults: list[str], clean: bool, link_mode: str = "rate", seeds: int = 1) -> list[dict]:
    """The matrix: per layout a clean run (when ``clean``), and each fault at each of its magnitudes. slow_link cells
    run on the 2-node cluster (``cluster``), their clean reference too (``fault="clean"`` with ``cluster``). With
    ``seeds`` > 1 every cell runs that many times, with the trainer's seeds 1234, 1235, ..."""
    if seeds > 1:
        return [dict(c, seed=SEED + k) for k in range(seeds) for c in cells(layouts, faults, clean, link_mode)]
    out = []
    for lay in layouts:
        if clean:
            out.append(dict(layout=lay, fault="clean", magnitude=None))
            if "slow_link" in faults:
                out.append(dict(layout=lay, fault="clean", magnitude=None, cluster=link_mode))
        for f in faults:
            if f == "few_microbatches" and "pp" not in lay:
                continue
            for m in magnitudes(f, lay, link_mode):
                out.append(dict(layout=lay, fault=f, magnitude=m, **({"cluster": link_mode} if f == "slow_link" else {})))
    return out


def replay_cells(store: Path, planned: list[dict]) -> list[dict]:
    """Every recorded run in ``store``: the matrix's own runs by name, any other run described by its manifest."""
    from analyzers.loader import known_runs
    from ranksight.schema import read_manifest

    by_id = {run_id_of(c): c for c in planned}
    out = []
    for rid in known_runs(store):
        if rid in by_id:
            out.append(dict(by_id[rid], run_id=rid))
            continue
        m = read_manifest(store / rid / "run.json")
        if m is None:
            continue
        lay = m.layout or {}
        layout = "".join(f"{k}{lay[k]}" for k in ("dp", "tp", "pp") if lay.get(k, 1) and lay.get(k, 1) > 1) or "single"
        fault = m.faults[0] if m.faults else None
        mag = None if fault is None else (fault.factor or fault.rate_mbit or fault.delay_ms or fault.code)
        out.append(dict(layout=layout, fault=fault.kind if fault else "clean", magnitude=mag, run_id=rid))
    return out


# The host's own noise in a run. On this CPU, "device time" is the ranks' CPU time, and other virtual machines on the
# same physical cores slow a vCPU for several steps at a time: in the 13:25 matrix (RESULTS.md) untouched ranks held
# 1.2-1.3x for 6-12 steps, as large and as long as the smallest injected slow-down (1.15x), and no detector tells
# those apart. Each run reports that noise; the summary scores the quiet-host runs on their own as well as all runs.
NOISE_WINDOW = 6  # steps: a spell is this many steps' median
QUIET_SIGMA = 0.05  # quiet host: per-step device-time noise of the untouched ranks at most 5 % (a GPU's is 1-3 %)


def host_noise(data, faults: list[FaultSpec]) -> dict:
    """Device-time noise of the ranks no fault targets, from log(own / peers' median) per step (peers: the rank's
    pipeline stage, as the straggler analyzer compares): ``noise_sigma``, the median over those ranks of its robust
    spread over time, and ``noise_spell``, the largest ratio (own / peers, or its inverse) one of them held as a
    median over NOISE_WINDOW steps. Empty where the run has no device time (a GPU run, an old run). Victims of a
    fault are among the untouched ranks, so a fault that disturbs its peers' CPU time raises the figures too."""
    if data.compute_signal() != "device_ms":
        return {}
    st = data.steps[(data.steps["step"] > 1) & (data.steps["attempt"] == data.steps["attempt"].min())]
    comp = rank_step_matrix(st, "device_ms")
    targets = {f.rank for f in faults if f.rank is not None}
    groups = [comp.loc[g] for g in Placement(data).peer_groups(list(comp.index)).values()]
    # a rank compared with a single peer mirrors it: a target's only peer is not untouched either
    parts = [np.log(m / leave_one_out_median(m)) for m in groups
             if len(m) >= 3 or (len(m) == 2 and not targets & set(m.index))]
    frame = pd.concat(parts) if parts else pd.DataFrame()
    frame = frame.drop(index=[r for r in targets if r in frame.index])
    if frame.empty or frame.shape[1] < NOISE_WINDOW:
        return {}
    spell = float(frame.T.rolling(NOISE_WINDOW).median().abs().max().max())
    return dict(noise_sigma=round(temporal_sigma(frame), 4), noise_spell=round(float(np.exp(spell)), 3))


def quiet(row: dict) -> bool:
    return row.get("noise_sigma") is not None and row["noise_sigma"] <= QUIET_SIGMA


SEED = 1234  # the trainer's default seed


def run_id_of(cell: dict) -> str:
    mag = "" if cell["magnitude"] is None else f"-{cell['magnitude']}".replace(".", "p")
    where = {"rate": "-2n", "delay": "-2nd"}.get(cell.get("cluster"), "")
    seed = f"-s{cell['seed']}" if cell.get("seed", SEED) != SEED else ""
    return f"det-{cell['layout']}-{cell['fault']}{mag}{where}{seed}"


def slowdown(data, start: int) -> float | None:
    """The run's median step time from the fault's start on over its median before (from step 2: step 1 warms up)."""
    st = data.steps[(data.steps["step"] > 1) & (data.steps["attempt"] == data.steps["attempt"].min())]
    per_step = st.groupby("step")["step_ms"].median()
    before, after = per_step[per_step.index < start], per_step[per_step.index >= start]
    if len(before) < 2 or len(after) < 2 or before.median() <= 0:
        return None
    return round(float(after.median() / before.median()), 3)


def score_run(store: Path, run_id: str, cell: dict) -> dict:
    try:
        data = load_run(store, run_id)
    except LoadError as e:
        return dict(cell, run_id=run_id, error=str(e))
    findings = run_all(data)
    faults = list(data.manifest.faults) if data.manifest else []
    if cell["fault"] == "few_microbatches" and not any(f.kind == "few_microbatches" for f in faults):
        faults.append(FaultSpec(kind="few_microbatches", start=1))  # runs recorded before the trainer had the fault
    s = score(findings, faults, manifest=data.manifest)
    extra = {}
    if faults and faults[0].kind != "few_microbatches":
        extra["slowdown"] = slowdown(data, faults[0].start)
    return dict(cell, run_id=run_id, **host_noise(data, faults), **extra, precision=s.precision, recall=s.recall, latencies=s.latencies,
                false_findings=s.false_findings, faults=[r.__dict__ for r in s.faults],
                findings=[f"{f.severity} {f.kind} ranks={f.ranks} steps={f.step_start}-{f.step_end}" for f in findings])


def summarize(rows: list[dict]) -> str:
    lines = ["| layout | fault | magnitude | recall | precision | latency (steps) | false findings | host noise: sigma, spell "
             "| step slow-down |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        where = {"rate": " (2 nodes, netns)", "delay": " (2 nodes)"}.get(r.get("cluster"), "")
        if "error" in r:
            lines.append(f"| {r['layout']}{where} | {r['fault']} | {r['magnitude']} | error | | | {r['error'][:60]} | | |")
            continue
        rec = "-" if r["recall"] is None else f"{r['recall']:.0%}"
        prec = "-" if r["precision"] is None else f"{r['precision']:.0%}"
        lat = ",".join(str(x) for x in r["latencies"]) or "-"
        noise = (f"{r['noise_sigma']:.3f}, {r['noise_spell']:.2f}x" + ("" if quiet(r) else " (noisy)")
                 if r.get("noise_sigma") is not None else "-")
        slow = f"{r['slowdown']:.2f}x" if r.get("slowdown") else ""
        lines.append(f"| {r['layout']}{where} | {r['fault']} | {r['magnitude'] if r['magnitude'] is not None else ''} | {rec} | "
                     f"{prec} | {lat} | {len(r['false_findings'])} | {noise} | {slow} |")
    lines.append("")
    lines += _goal_lines(rows)
    quiet_rows = [r for r in rows if "error" not in r and quiet(r)]
    with_noise = [r for r in rows if "error" not in r and r.get("noise_sigma") is not None]
    if with_noise and len(quiet_rows) < len(with_noise):
        lines.append("")
        lines.append(f"Quiet-host runs only ({len(quiet_rows)} of {len(with_noise)}: device-time noise sigma of the untouched "
                     f"ranks <= {QUIET_SIGMA}; the others are marked (noisy) above):")
        lines.append("")
        lines += _goal_lines(quiet_rows)
    return "\n".join(lines)


def _goal_lines(rows: list[dict]) -> list[str]:
    """The issue's goals over ``rows``: recall, precision, false findings, clean runs, straggler latency."""
    lines: list[str] = []
    faulty = [r for r in rows if r["fault"] != "clean" and "error" not in r]
    clean = [r for r in rows if r["fault"] == "clean" and "error" not in r]
    strag = [x for r in faulty if r["fault"] == "slow_rank" for x in r["latencies"]]
    if faulty:
        lines.append(f"- recall over faulty runs: {statistics.mean(r['recall'] or 0 for r in faulty):.0%}")
        precs = [r["precision"] for r in faulty if r["precision"] is not None]
        if precs:
            lines.append(f"- precision over faulty runs: {statistics.mean(precs):.0%}")
        by_fault: dict[str, list[float]] = {}
        for r in faulty:
            by_fault.setdefault(r["fault"], []).append(r["recall"] or 0)
        lines.append("- faults found (runs with recall 100 %): " + ", ".join(
            f"{k} {sum(x >= 1 for x in v)}/{len(v)}" for k, v in sorted(by_fault.items())))
        lines.append(f"- false findings (warning+) on faulty runs: {sum(len(r['false_findings']) for r in faulty)} "
                     f"in {sum(bool(r['false_findings']) for r in faulty)} of {len(faulty)} runs")
    if clean:
        lines.append(f"- clean runs with a warning or worse: {sum(bool(r['false_findings']) for r in clean)} of {len(clean)}")
    if strag:
        lines.append(f"- straggler median latency: {statistics.median(strag)} steps")
    return lines


def write_results(rows: list[dict], md: str, args: argparse.Namespace, argv: list[str] | None = None) -> None:
    """The rows as JSON under --results-dir, and (unless --no-results-md) the table ``md`` as bench/results/detect.md,
    headed by the command, the model of the live runs and the load: a generated report, replaced whole each time."""
    out_dir = Path(args.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    (out_dir / f"detect-{stamp}.json").write_text(json.dumps(rows, indent=1, default=str))
    if args.no_results_md:
        return
    loads = [r["loadavg_1m"] for r in rows if r.get("loadavg_1m") is not None]
    load_txt = (f"load average (1 min) after each run: median {statistics.median(loads):.1f}, max {max(loads):.1f}" if loads
                else f"load average now {os.getloadavg()[0]:.1f} (replay: the runs' own load is in their notes)")
    cmd = "python bench/detect.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report = ROOT / "bench" / "results" / "detect.md"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(
        f"# Detection benchmark ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{'replay' if args.replay else 'live runs'}, {args.steps} steps, 4 ranks on this CPU)\n\n"
        f"Generated by bench/detect.py; do not edit. Command: `{cmd.strip()}`; model of the live runs: "
        f"`{' '.join(MODEL)}`; {load_txt}.\n\n{md}\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--start", type=int, default=8, help="step at which faults start")
    ap.add_argument("--no-clean", action="store_true")
    ap.add_argument("--store", default=str(ROOT / "bench" / "results" / "detect-runs"))
    ap.add_argument("--replay", action="store_true", help="score runs already in --store; run nothing")
    ap.add_argument("--no-results-md", action="store_true", help="do not write bench/results/detect.md")
    ap.add_argument("--results-dir", default=str(ROOT / "bench" / "results"), help="where the JSON results go")
    ap.add_argument("--seeds", type=int, default=1, help="runs per cell (the trainer's --seed 1234, 1235, ...)")
    ap.add_argument("--no-datapath", action="store_true",
                    help="run the ranks alone (default: a head and one node agent per node run beside them, as a "
                         "user runs ranksight, shipping and analysing live)")
    ap.add_argument("--slow-link", choices=("auto", "rate", "delay"), default="auto",
                    help="slow_link cells: rate = node 1's link rate-limited (needs a network namespace per node: root), "
                         "delay = the trainer's per-operation delay on 2 nodes sharing 127.0.0.1; auto = rate where it works")
    args = ap.parse_args(argv)
    store = Path(args.store)
    store.mkdir(parents=True, exist_ok=True)
    link_mode = args.slow_link
    if link_mode == "auto":
        ok, why = netns.available()
        link_mode = "rate" if ok else "delay"
        if not ok and "slow_link" in args.faults.split(",") and not args.replay:
            print(f"slow_link cells: per-operation delay (no network namespace per node: {why})", flush=True)
    todo = cells(args.layouts.split(","), [f for f in args.faults.split(",") if f], not args.no_clean, link_mode, args.seeds)
    if args.replay:
        todo = replay_cells(store, todo)
    rows = []
    for cell in todo:
        rid = cell.get("run_id") or run_id_of(cell)
        if not args.replay:
            shutil.rmtree(store / rid, ignore_errors=True)
            tmpl, _, extra = FAULTS.get(cell["fault"], (None, None, []))
            if cell["fault"] == "slow_link" and cell.get("cluster") == "delay":
                tmpl = SLOW_LINK_DELAY
            inject = ["--inject", tmpl.format(m=cell["magnitude"], start=args.start)] if tmpl else []
            t0 = time.time()
            trainer_args = [*MODEL, *LAYOUTS[cell["layout"]], "--steps", str(args.steps), *extra, *inject,
                            "--seed", str(cell.get("seed", SEED))]
            datapath = contextlib.nullcontext() if args.no_datapath else \
                DataPath(store, rid, 2 if cell.get("cluster") else 1)
            with datapath:
                if cell.get("cluster"):
                    rc = cluster_run(store, rid, trainer_args, use_netns=cell["cluster"] == "rate")
                else:
                    rc = torchrun(store, rid, trainer_args)
            cell = dict(cell, rc=rc, wall_s=round(time.time() - t0, 1), loadavg_1m=round(os.getloadavg()[0], 2))
        elif not (store / rid).exists():
            continue
        row = score_run(store, rid, cell)
        rows.append(row)
        print(f"{rid}: recall={row.get('recall')} precision={row.get('precision')} latency={row.get('latencies')} "
              f"false={len(row.get('false_findings', []))} {row.get('error', '')}", flush=True)
    md = summarize(rows)
    print(md)
    write_results(rows, md, args, argv)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
