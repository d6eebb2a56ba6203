"""A synthetic run of thousands of ranks, built column-wise (numpy), for the report's scale tests: data-parallel
steps where rank ``slow`` computes 1.5x from step 10 on and arrives late at the gradient sync, its GPU's SM clock
drops, and a straggler finding names it."""

from __future__ import annotations

import numpy as np
import pandas as pd

from analyzers.loader import RunData
from ranksight.schema import Finding, Manifest, RankPlacement

T0 = 1_700_000_000.0


def big_run(world: int = 4096, steps: int = 30, per_node: int = 8, slow: int = 1234, seed: int = 0,
            gpu: bool = True) -> tuple[RunData, list[Finding]]:
    rng = np.random.default_rng(seed)
    rank = np.tile(np.arange(world), steps)
    step = np.repeat(np.arange(steps), world)
    late = (rank == slow) & (step >= 10)
    comp = 100.0 * (1 + 0.01 * rng.standard_normal(world * steps))
    comp[late] *= 1.5
    t0 = T0 + step * 0.3
    arrive = t0 + (2.0 + comp) / 1000
    last = pd.Series(arrive).groupby(step).transform("max").to_numpy()
    end = last + 0.01
    wait = (last - arrive) * 1000
    node = rank // per_node
    steps_df = pd.DataFrame({
        "run_id": "big", "rank": rank, "step": step, "node": node, "host": pd.Series(node).map("node{}".format),
        "world_size": world, "pp_stage": 0, "dp_rank": rank, "t_start": t0, "t_end": end, "step_ms": (end - t0) * 1000,
        "data_ms": 2.0, "compute_ms": comp, "comm_ms": wait + 10, "pipeline_wait_ms": 0.0, "sync_arrival": arrive,
        "sync_wait_ms": wait, "forward_ms": comp / 3, "backward_ms": comp * 2 / 3, "tokens": 4096,
        "loss": 5.0 - 0.01 * step, "flops": 5e12, "attempt": 0})
    placements = [RankPlacement(rank=r, node=r // per_node, host=f"node{r // per_node}", local_rank=r % per_node,
                                pp_stage=0, dp_rank=r, tp_rank=0, gpu=r % per_node) for r in range(world)]
    manifest = Manifest(run_id="big", created=T0, start_time=T0, nodes=(world + per_node - 1) // per_node,
                        ranks=placements, layout={"dp": world, "tp": 1, "pp": 1, "world": world}, peak_flops=100e12,
                        peak_source="synthetic", finished=T0 + steps)
    frames = {}
    if gpu:
        frames["gpu"] = pd.DataFrame({"node": node, "gpu": rank % per_node, "host": "h", "t": t0 + 0.1,
                                      "sm_clock_mhz": np.where(late, 1280.0, 1980.0), "temp_c": 60.0 + 5.0 * late,
                                      "simulated": True, "source": "simulated-nvml"})
    data = RunData(run_id="big", manifest=manifest, steps=steps_df, **frames)
    finding = Finding(analyzer="stragglers", kind="straggler", severity="warning", ranks=[slow], nodes=[slow // per_node],
                      step_start=10, step_end=steps - 1, summary=f"rank {slow} is the straggler", recommendation="evict",
                      evidence={"rank_median_compute_ms": 150.0, "peers_median_compute_ms": 100.0, "ratio": 1.5,
                                "onset_step": 10})
    return data, [finding]
