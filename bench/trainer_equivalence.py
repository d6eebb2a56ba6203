"""Does a change to the trainer keep what it writes? Runs layouts on two source trees and compares the spools.

``run TREE OUT``: for each layout in LAYOUTS, ``torchrun --standalone --nproc-per-node 4 -m trainer`` with
``PYTHONPATH=TREE`` (a git worktree of the commit to test) into the store ``OUT``.

``compare OUT_A OUT_B``: per layout, the *structure* of what every rank wrote, which must be identical:

- the sequence of record kinds in each spool (collective, step, event), in file order;
- per step and rank: the collective records in order, each as (op, group, group_ranks, seq, nbytes, done or
  not), and which of them is the step's first gradient-sync arrival (``sync_arrival`` names its ``t_arrive``:
  the sync flag as the records show it);
- per StepRecord: which fields are set (not None), and the fields that are not timings (placement, tokens,
  FLOPs, micro-batches, flags);
- per event: its name, step and detail keys (values too, except times, durations and error text);
- the files of the run directory (spool, simulated GPU state, manifest, ...) and the manifest (less its times
  and the store path).

Timing values differ from run to run and are not compared; for a fault layout the fault's effect is shown
instead (``effect``): the culprit's and the other ranks' median timings over the fault's steps, side by side
for both trees (``device_ms``, the training thread's CPU time, is the one least moved by other work on the
machine); for a hang, where each rank hung or what it was left waiting in.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ranksight.schema import CollectiveRecord, EventRecord, StepRecord, decode_spool_line

SMALL = ["--d-model", "64", "--n-layers", "2", "--n-heads", "2", "--seq-len", "16", "--batch-size", "4",
         "--quiet", "--steps", "6"]
# name -> (extra flags, fault culprit rank and first fault step, or None)
LAYOUTS: dict[str, tuple[list[str], tuple[int, int] | None]] = {
    "dp4": ([], None),
    "dp4-fsdp": (["--dp-mode", "fsdp"], None),
    "dp2-tp2": (["--tp", "2"], None),
    "tp4": (["--tp", "4", "--n-heads", "4"], None),
    "dp2-pp2-gpipe": (["--pp", "2", "--pp-schedule", "gpipe"], None),
    "dp2-pp2-1f1b": (["--pp", "2", "--pp-schedule", "1f1b"], None),
    "dp2-pp2-interleaved": (["--pp", "2", "--pp-schedule", "interleaved", "--n-layers", "4"], None),
    "pp2-tp2": (["--pp", "2", "--tp", "2"], None),
    "dp4-slow_rank": (["--inject", "slow_rank:rank=1,factor=3,start=3"], (1, 3)),
    "dp2-pp2-slow_rank": (["--pp", "2", "--inject", "slow_rank:rank=2,factor=3,start=3"], (2, 3)),
    "dp4-slow_link": (["--inject", "slow_link:rank=1,delay_ms=30,start=3"], (1, 3)),
    "dp4-fsdp-slow_link": (["--dp-mode", "fsdp", "--inject", "slow_link:rank=1,delay_ms=30,start=3"], (1, 3)),
    "dp2-tp2-slow_link": (["--tp", "2", "--inject", "slow_link:rank=1,delay_ms=30,start=3"], (1, 3)),
    "dp2-pp2-slow_link": (["--pp", "2", "--inject", "slow_link:rank=2,delay_ms=30,start=3"], (2, 3)),
    "dp4-hang": (["--inject", "hang:rank=1,start=4", "--pg-timeout", "8"], (1, 4)),
    "dp2-pp2-hang": (["--pp", "2", "--inject", "hang:rank=2,start=4", "--pg-timeout", "8"], (2, 4)),
    "dp4-no-instrument": (["--no-instrument"], None),
    "dp2-pp2-no-instrument": (["--pp", "2", "--no-instrument"], None),
}
TIMINGS = {"t_start", "t_end", "step_ms", "data_ms", "forward_ms", "backward_ms", "optimizer_ms", "comm_ms",
           "pipeline_wait_ms", "compute_ms", "sync_arrival", "sync_wait_ms", "mem_bytes", "device_ms",
           "loss", "grad_norm", "loss_scale"}  # loss / norm: summed by gloo in arrival order, may differ in the last bits
EFFECT = ("compute_ms", "comm_ms", "pipeline_wait_ms", "sync_wait_ms", "device_ms")


def run_tree(tree: Path, out: Path, only: list[str] | None, timeout: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    for name, (flags, _) in LAYOUTS.items():
        if only and name not in only:
            continue
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
               "--max-restarts=0", "--monitor-interval=0.5", "-m", "trainer", *SMALL, *flags,
               "--store", str(out), "--run-id", name]
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
        (out / f"{name}.log").write_bytes(log)
        print(f"{name}: rc={proc.returncode} in {time.monotonic() - t0:.0f}s", flush=True)


def _records(run: Path) -> dict[int, list]:
    out = {}
    for f in sorted((run / "spool").glob("rank-*.jsonl")):
        out[int(f.stem.split("-")[1])] = [decode_spool_line(x) for x in f.read_bytes().splitlines() if x.strip()]
    return out


def _event_view(e: EventRecord) -> tuple:
    detail = {}
    for k, v in sorted(e.detail.items()):
        if k in ("ms", "t") or k.endswith("_t"):
            v = "<time>"
        elif k == "reason" and isinstance(v, str) and ":" in v:
            v = v.split(":", 1)[0] + ": <error text>"
        detail[k] = v
    return (e.event, e.step, json.dumps(detail, sort_keys=True, default=str))


def structure(run: Path) -> dict:
    """Everything that must not change, per rank."""
    files = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()
                   and "checkpoints" not in p.parts and p.suffix not in (".lock",))
    ranks = {}
    for rank, recs in _records(run).items():
        kinds = [type(r).__name__[0] for r in recs]  # C S E
        by_step: dict[int, list] = {}
        for r in recs:
            if isinstance(r, CollectiveRecord):
                by_step.setdefault(r.step, []).append(r)
        steps = {}
        for r in recs:
            if not isinstance(r, StepRecord):
                continue
            colls = by_step.get(r.step, [])
            first_sync = [i for i, c in enumerate(colls) if r.sync_arrival is not None and c.t_arrive == r.sync_arrival]
            fields = {k: getattr(r, k) for k in r.__struct_fields__}
            steps[r.step] = {
                "collectives": [(c.op, c.group, list(c.group_ranks), c.seq, c.nbytes, c.t_done is not None,
                                 c.attempt) for c in colls],
                "first_sync_arrival_at": first_sync,
                "set": sorted(k for k, v in fields.items() if v is not None),
                "values": {k: v for k, v in fields.items() if k not in TIMINGS},
            }
        # collectives of steps without a step record (a hang: what the rank was stuck in)
        unfinished = {s: [(c.op, c.group, list(c.group_ranks), c.seq, c.nbytes, c.t_done is not None)
                          for c in cs] for s, cs in by_step.items() if s not in steps}
        ranks[rank] = {"kinds": "".join(kinds), "steps": steps, "unfinished": unfinished,
                       "events": [_event_view(e) for e in recs if isinstance(e, EventRecord)]}
    return {"files": files, "manifest": _manifest_view(run), "ranks": ranks}


def _manifest_view(run: Path) -> dict:
    m = json.loads((run / "run.json").read_text())
    config = {k: v for k, v in m["config"].items() if k != "store"}
    faults = [{k: v for k, v in f.items() if k != "onset_t"} for f in m.get("faults", [])]
    attempts = [sorted(a) for a in m.get("attempts", [])]
    return {"keys": sorted(m), "config": config, "layout": m["layout"], "ranks": m["ranks"], "faults": faults,
            "attempts": attempts, "finished": m.get("finished") is not None}


def effect(run: Path, culprit: int, start: int) -> dict[str, tuple[float, float]]:
    """Median of each timing over the fault's steps: (culprit, the other ranks)."""
    from statistics import median

    out = {}
    recs = _records(run)
    for k in EFFECT:
        mine, others = [], []
        for rank, rs in recs.items():
            vals = [getattr(r, k) for r in rs if isinstance(r, StepRecord) and r.step >= start]
            vals = [v for v in vals if v is not None]
            (mine if rank == culprit else others).extend(vals)
        out[k] = (median(mine) if mine else float("nan"), median(others) if others else float("nan"))
    return out


def hang_view(run: Path) -> dict[int, str]:
    """Per rank: where it hung (``hang_entered``) or what it was left waiting in (collectives never done)."""
    out = {}
    for rank, recs in _records(run).items():
        hung = [f"hang_entered at {e.detail['op']}/{e.detail['group']} in step {e.step}" for e in recs
                if isinstance(e, EventRecord) and e.event == "hang_entered"]
        stuck = [f"{c.op}/{c.group}#{c.seq}" for c in recs if isinstance(c, CollectiveRecord) and c.t_done is None]
        out[rank] = "; ".join(hung) or f"never done: {', '.join(stuck) or '-'}"
    return out


def _diff(a, b, path="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{path}/{k}: only in {'B' if k not in a else 'A'}")
            else:
                out += _diff(a[k], b[k], f"{path}/{k}")
        return out
    return [] if a == b else [f"{path}: A={a!r} B={b!r}"]


def compare(a: Path, b: Path, only: list[str] | None) -> int:
    bad = 0
    for name, (_, fault) in LAYOUTS.items():
        if only and name not in only:
            continue
        ra, rb = a / name, b / name
        if not ra.exists() or not rb.exists():
            print(f"{name}: missing in {'A' if not ra.exists() else 'B'}")
            bad += 1
            continue
        sa, sb = structure(ra), structure(rb)
        diffs = _diff(sa, sb)
        n_coll = sum(len(s["collectives"]) for r in sa["ranks"].values() for s in r["steps"].values())
        n_steps = sum(len(r["steps"]) for r in sa["ranks"].values())
        verdict = "identical" if not diffs else f"{len(diffs)} differences"
        print(f"{name}: {verdict} ({len(sa['ranks'])} spools, {n_steps} step records, {n_coll} collective records, "
              f"{len(sa['files'])} files)")
        for d in diffs[:20]:
            print("   ", d)
        bad += bool(diffs)
        if name.endswith("-hang"):
            ha, hb = hang_view(ra), hang_view(rb)
            for rank in sorted(ha):
                print(f"    rank {rank}  A {ha[rank]}   B {hb.get(rank)}")
        elif fault is not None:
            ea, eb = effect(ra, *fault), effect(rb, *fault)
            for k in EFFECT:
                (ca, oa), (cb, ob) = ea[k], eb[k]
                print(f"    effect {k:17s} culprit/others  A {ca:8.1f} / {oa:8.1f}   B {cb:8.1f} / {ob:8.1f}")
    print("ALL IDENTICAL" if not bad else f"{bad} layouts differ")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("tree", type=Path)
    r.add_argument("out", type=Path)
    r.add_argument("--only", nargs="*")
    r.add_argument("--timeout", type=float, default=300)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.add_argument("--only", nargs="*")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        run_tree(args.tree.resolve(), args.out.resolve(), args.only, args.timeout)
        return 0
    return compare(args.a, args.b, args.only)


if __name__ == "__main__":
    sys.exit(main())
