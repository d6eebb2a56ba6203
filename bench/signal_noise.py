"""Per-step noise of the straggler analyzer's two compute signals, side by side on the same runs.

For every recorded run that carries ``device_ms``: each rank's score per step is log(its signal / the
leave-one-out median of its comparable peers in that step) (peers: the ranks of the same pipeline stage),
exactly as analyzers/checks/stragglers.py scores it; the noise is the scores' robust sigma over time, median over
ranks (``analyzers.stats.temporal_sigma``), over the steps before any injected fault starts (the first
step, a warm-up, left out). Printed for wall-clock ``compute_ms`` and for ``device_ms``, and their ratio.

A second table: the noise of the comm analyzer's communicators signature (``analyzers.checks.links.slow_communicators``),
per run and kind of communicator, as it computes it: ``op_transfers`` (collectives' last-arriver durations, p2p
transfers), per kind with at least two communicators the windowed median transfer per communicator and step
(``link_window`` steps, at least ``link_min_ops`` ops: ``CommConfig`` defaults), and its ``temporal_sigma`` in
ms; over the same pre-fault steps (the comm analyzer's warm-up left out), for every run (any compute signal).

    .venv/bin/python bench/signal_noise.py --store bench/results/detect-runs
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from analyzers.builder import Placement  # noqa: E402
from analyzers.checks.comm import CommConfig  # noqa: E402
from analyzers.checks.links import kind_windowed_medians, op_transfers  # noqa: E402
from analyzers.loader import LoadError, known_runs, load_run  # noqa: E402
from analyzers.stats import leave_one_out_median, temporal_sigma  # noqa: E402


def sigma(data, steps, col: str) -> float:
    comp = steps.pivot_table(index="rank", columns="step", values=col, aggfunc="last").sort_index(axis=1)
    scores = []
    for members in Placement(data).peer_groups(list(comp.index)).values():
        if len(members) < 2:
            continue
        sub = comp.loc[members]
        with np.errstate(divide="ignore", invalid="ignore"):
            scores.append(np.log(sub / leave_one_out_median(sub)))
    if not scores:
        return float("nan")
    import pandas as pd

    return temporal_sigma(pd.concat(scores))


def comm_sigmas(data, steps, cfg: CommConfig) -> dict[str, tuple[int, float, float]]:
    """kind -> (communicators, sigma of their windowed median transfer in ms, median transfer in ms), as
    ``slow_communicators`` computes its sigma, over ``steps``."""
    tr = op_transfers(data.collectives, steps[0], cfg.match_tol_ms)
    if tr.empty:
        return {}
    tr = tr[tr["step"].isin(steps)]
    out = {}
    for cls, sub, med in kind_windowed_medians(tr, steps, cfg):
        out[str(cls)] = (int(sub["gkey"].nunique()), temporal_sigma(med), float(np.nanmedian(med.to_numpy())))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default=str(ROOT / "bench" / "results" / "detect-runs"))
    args = ap.parse_args(argv)
    rows = []
    comm_rows = []
    cfg = CommConfig()
    for run_id in known_runs(args.store):
        try:
            data = load_run(args.store, run_id, progress=False)
        except LoadError as e:
            print(f"{run_id}: skipped ({e})")
            continue
        onset = min((f.start for f in data.manifest.faults), default=None) if data.manifest else None
        lay = data.layout
        name = f"dp{lay.get('dp')}" + (f"tp{lay['tp']}" if lay.get("tp", 1) > 1 else "") + (f"pp{lay['pp']}" if lay.get("pp", 1) > 1 else "")
        cfirst = int(data.steps["step"].min()) + cfg.warmup_steps
        csteps = sorted(int(s) for s in data.steps["step"].unique() if s >= cfirst and (onset is None or s < onset))
        if len(csteps) >= 5:
            for cls, (n, sg, m) in sorted(comm_sigmas(data, csteps, cfg).items()):
                comm_rows.append((run_id, name, cls, n, len(csteps), sg, m))
        if data.compute_signal() != "device_ms":
            continue
        first = int(data.steps["step"].min()) + 1
        st = data.steps[(data.steps["step"] >= first) & ((data.steps["step"] < onset) if onset else True)]
        if st["step"].nunique() < 5:
            continue
        rows.append((run_id, name, sigma(data, st, "compute_ms"), sigma(data, st, "device_ms")))
    print("| run | layout | sigma, wall-clock compute_ms | sigma, device_ms | ratio |")
    print("|---|---|---:|---:|---:|")
    for run_id, name, w, d in rows:
        print(f"| {run_id} | {name} | {w:.3f} | {d:.3f} | {w / d if d else float('nan'):.1f}x |")
    for name in sorted({r[1] for r in rows}):
        ws = [r[2] for r in rows if r[1] == name]
        ds = [r[3] for r in rows if r[1] == name]
        print(f"- {name}: median sigma wall-clock {statistics.median(ws):.3f}, device {statistics.median(ds):.3f} "
              f"over {len(ws)} runs")
    print()
    print(f"Communicators signature noise (link_window {cfg.link_window}, link_min_ops {cfg.link_min_ops}, "
          f"pre-fault steps from step {cfg.warmup_steps} after the first):")
    print()
    print("| run | layout | kind | communicators | steps | sigma of windowed median transfer, ms | median transfer, ms |")
    print("|---|---|---|---:|---:|---:|---:|")
    for run_id, name, cls, n, ns, sg, m in comm_rows:
        print(f"| {run_id} | {name} | {cls} | {n} | {ns} | {sg:.3f} | {m:.2f} |")
    print()
    for name, cls in sorted({(r[1], r[2]) for r in comm_rows}):
        sg = [r[5] for r in comm_rows if (r[1], r[2]) == (name, cls)]
        print(f"- {name} {cls}: sigma median {statistics.median(sg):.3f} ms, range {min(sg):.3f}-{max(sg):.3f} "
              f"over {len(sg)} runs")
    return 0 if rows or comm_rows else 1


if __name__ == "__main__":
    sys.exit(main())
