"""What the trainer's instrumentation costs per step, measured against its own baseline in one process.

Runs the real training loop (``trainer.train.train_loop``) in this process on a gloo world of one rank
(DDP, 127.0.0.1) and lets ``OverheadToggle`` switch the Recorder ON and OFF in ABBA blocks of steps,
as ``bench/overhead.py`` does across processes. By default the model is the overhead benchmark's cut
to two layers, with tiny batches (d_model 128, 2 layers, seq 8, batch 1; two DDP buckets, as the 4-layer
model has), so a step is short and the instrumentation's fixed cost per step stands out of the noise.
The per-call costs grow with the step: between long steps of tensor work the instrumentation's code
and data are out of the CPU caches, so ``--n-layers 4 --seq-len 64 --batch-size 8 --passes parts``
(the overhead benchmark's steps) shows what it costs there.

Two passes over the same loop:

1. **totals**: nothing added. Per step: wall time loop top to loop top, and the main thread's CPU time
   (both from OverheadToggle's rows). Reported: mean ON and OFF, and ON - OFF in microseconds per
   step, with a 95 % bootstrap CI over block pairs.
2. **parts**: each instrumentation call on the step path is timed with ``perf_counter_ns`` by a
   wrapper (its own cost is the same ON and OFF for the parts that run in both): Recorder
   ``Session.begin_step``, the step record built and written (``Session.end_step``: comm_summary, the memory
   sample and ``write_record`` included), ``MemoryProbe.sample``,
   ``SimulatedGpu.update``, ``ControlChannel.poll`` (its broadcast is a timed collective ON), and the
   loop's own forward / backward / optimizer timers (the DDP comm hook runs inside backward).

Ratios and differences only: the absolute times on a shared machine move a lot from run to run.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/recorder_cost.py
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ranksight.layout import RunDir  # noqa: E402
from trainer import simdevice, train  # noqa: E402
from trainer import control as control_mod  # noqa: E402
from trainer.config import ModelConfig, TrainConfig  # noqa: E402
from ranksight.instrument.memory import MemoryProbe  # noqa: E402
from ranksight.instrument import session as session_mod  # noqa: E402
from ranksight.instrument.recorder import Recorder  # noqa: E402
from ranksight.instrument.session import Session  # noqa: E402

# (label, owner, attribute): the instrumentation calls timed in the parts pass
PARTS = [
    ("begin_step", Session, "begin_step"),
    ("step record: Session.end_step, all of it", Session, "end_step"),
    ("  in it: comm_summary", session_mod, "comm_summary"),
    ("  in it: mem.sample", MemoryProbe, "sample"),
    ("  in it: write_record (encode + write)", Session, "write_record"),
    ("simgpu.update", simdevice.SimulatedGpu, "update"),
    ("control.poll (broadcast)", control_mod.ControlChannel, "poll"),
]
LOOP_TIMERS = ("forward", "backward", "optimizer")  # Recorder.t accumulators the loop fills ON and OFF


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_rank_env() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", TORCHELASTIC_RESTART_COUNT="0")


def _config(args, store: str, run_id: str) -> TrainConfig:
    return TrainConfig(model=ModelConfig(d_model=args.d_model, n_layers=args.n_layers, n_heads=4, seq_len=args.seq_len),
                       batch_size=args.batch_size, steps=args.warmup + args.steps, store=store, run_id=run_id,
                       quiet=True, resume=False)


class PartTimer:
    """Wraps the instrumentation calls with perf_counter_ns timing, summed per step."""

    def __init__(self):
        self.per_step: dict[int, dict[str, int]] = {}
        self.cur: dict[str, int] = {}
        self.saved: list[tuple[object, str, object]] = []

    def _wrap(self, label: str, fn):
        cur_of = self  # the current step's dict changes every step: look it up at call time

        @functools.wraps(fn)
        def timed(*a, **kw):
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **kw)
            finally:
                d = cur_of.cur
                d[label] = d.get(label, 0) + time.perf_counter_ns() - t0

        return timed

    def install(self) -> None:
        for label, owner, attr in PARTS:
            orig = getattr(owner, attr)
            self.saved.append((owner, attr, orig))
            setattr(owner, attr, self._wrap(label, orig))
        begin = Recorder.begin_step  # (already wrapped) : also closes the previous step's loop timers

        def begin_step(rec, step):
            # the loop timers of the step that just ended, before begin_step resets them
            for name in LOOP_TIMERS:
                self.cur[name] = int(getattr(rec.t, name) * 1e9)
            self.cur = self.per_step.setdefault(step, {})
            return begin(rec, step)

        Recorder.begin_step = begin_step

    def uninstall(self) -> None:
        for owner, attr, orig in reversed(self.saved):
            setattr(owner, attr, orig)
        self.saved.clear()


def run_loop(args, store: str, run_id: str) -> list[tuple]:
    """One in-process training run with the toggle; returns OverheadToggle's rows."""
    out = Path(store) / f"{run_id}-toggle"
    os.environ.update(RANKSIGHT_OVERHEAD_BLOCK=str(args.block), RANKSIGHT_OVERHEAD_WARMUP=str(args.warmup),
                      RANKSIGHT_OVERHEAD_OUT=str(out))
    os.environ.pop("RANKSIGHT_OVERHEAD_PAUSE_PIDS", None)
    _one_rank_env()
    cfg = _config(args, store, run_id)
    backend, device = train.pick_backend()
    train.init_distributed(backend, 60.0)
    # The MFU denominator is not measured here (seconds of matmuls that tell this benchmark nothing).
    orig_peak = train.measure_cpu_peak
    train.measure_cpu_peak = lambda: (1e11, "recorder_cost.py: not measured", False)
    try:
        train.train_loop(cfg, [], RunDir(store, run_id), backend, device)
    finally:
        train.measure_cpu_peak = orig_peak
    return json.loads((out / "toggle-rank-0.json").read_text())["rows"]


def _records_per_step(run: RunDir) -> str:
    """What one ON step writes, e.g. 'step 1, all_reduce/dp 2, broadcast/world 1' (the last full step)."""
    from collections import Counter

    from ranksight.schema import decode_spool_line

    recs = [decode_spool_line(line) for line in run.spool(0).read_bytes().splitlines()]
    last = max(r.step for r in recs if type(r).__name__ == "StepRecord")
    kinds = Counter(f"{r.op}/{r.group}" if type(r).__name__ == "CollectiveRecord" else type(r).__name__
                    for r in recs if r.step == last and type(r).__name__ != "EventRecord")
    return ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))


def pairs_of(steps_on: dict[int, bool], warmup: int, block: int) -> list[tuple[list[int], list[int]]]:
    """(ON steps, OFF steps) of each ABBA block pair after the warm-up."""
    by_block: dict[int, list[int]] = {}
    for s in steps_on:
        if s > warmup:
            by_block.setdefault((s - warmup - 1) // block, []).append(s)
    out = []
    for b in range(0, max(by_block, default=-1) + 1, 2):
        both = by_block.get(b, []) + by_block.get(b + 1, [])
        on = [s for s in both if steps_on[s]]
        off = [s for s in both if not steps_on[s]]
        if on and off:
            out.append((on, off))
    return out


def pair_diffs(values: dict[int, float], pairs) -> np.ndarray:
    return np.array([np.mean([values.get(s, 0.0) for s in on]) - np.mean([values.get(s, 0.0) for s in off])
                     for on, off in pairs])


def boot_ci(d: np.ndarray, n: int = 4000, seed: int = 7) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(n, len(d)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def mean_over(values: dict[int, float], pairs, on: bool) -> float:
    steps = [s for p in pairs for s in (p[0] if on else p[1])]
    return float(np.mean([values.get(s, 0.0) for s in steps]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3000, help="toggled steps per pass (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--block", type=int, default=10, help="steps per ON or OFF block")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--passes", default="totals,parts")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    passes = args.passes.split(",")
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="recorder-cost-") as store:
        print(f"recorder_cost: 1 rank, gloo, DDP; d_model {args.d_model}, {args.n_layers} layers, seq {args.seq_len}, "
              f"batch {args.batch_size}; {args.steps} toggled steps per pass in ABBA blocks of {args.block} "
              f"after {args.warmup} warm-up steps; 95 % CIs: bootstrap over block pairs")
        if "totals" in passes:
            rows = run_loop(args, store, "totals")
            on = {r[0]: bool(r[1]) for r in rows}
            pairs = pairs_of(on, args.warmup, args.block)
            print(f"\nspool records per ON step: {_records_per_step(RunDir(store, 'totals'))}")
            print(f"\ntotals ({len(pairs)} pairs), us per step:  ON     OFF    ON-OFF [95 % CI]")
            for col, name in ((2, "wall"), (3, "main-thread CPU")):
                vals = {r[0]: r[col] * 1000.0 for r in rows}
                d = pair_diffs(vals, pairs)
                lo, hi = boot_ci(d)
                print(f"  {name:<34s} {mean_over(vals, pairs, True):7.0f} {mean_over(vals, pairs, False):7.0f} "
                      f"{d.mean():7.1f} [{lo:.1f}, {hi:.1f}]")
        if "parts" in passes:
            timer = PartTimer()
            timer.install()
            try:
                rows = run_loop(args, store, "parts")
            finally:
                timer.uninstall()
            on = {r[0]: bool(r[1]) for r in rows}
            pairs = pairs_of(on, args.warmup, args.block)
            per_step = {s: timer.per_step.get(s, {}) for s in on}
            print(f"\nparts ({len(pairs)} pairs; each call timed, wrapper included), us per step:  ON     OFF    "
                  f"ON-OFF [95 % CI]")
            labels = [p[0] for p in PARTS] + [f"loop: {n}" for n in LOOP_TIMERS]
            keys = [p[0] for p in PARTS] + list(LOOP_TIMERS)
            for label, key in zip(labels, keys):
                vals = {s: per_step[s].get(key, 0) / 1000.0 for s in on}
                d = pair_diffs(vals, pairs)
                lo, hi = boot_ci(d)
                print(f"  {label:<40s} {mean_over(vals, pairs, True):7.1f} {mean_over(vals, pairs, False):7.1f} "
                      f"{d.mean():7.1f} [{lo:.1f}, {hi:.1f}]")
            vals = {r[0]: r[2] * 1000.0 for r in rows}
            print(f"  {'(wall, this pass)':<40s} {mean_over(vals, pairs, True):7.0f} {mean_over(vals, pairs, False):7.0f}")
    print(f"\n{time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
