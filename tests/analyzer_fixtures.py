"""An in-memory builder of synthetic runs for the analyzer tests.

It models synchronous data-parallel (optionally pipeline-parallel) training the way the
real trainer records it: every rank computes, arrives at the gradient all-reduce, the
early ranks wait for the last one, and all leave together. So every rank's step time is
the same, and only compute_ms / sync_arrival / sync_wait_ms tell the culprit from the victims.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from analyzers.builder import Placement
from analyzers.loader import RunData
from ranksight.schema import (
    CollectiveRecord,
    FaultSpec,
    GpuSample,
    Manifest,
    RankPlacement,
    StepRecord,
)

T0 = 1_700_000_000.0


@dataclass
class Spec:
    world: int = 4
    steps: int = 30
    nodes: int = 1
    pp: int = 1
    microbatches: int = 8
    schedule: str = "1f1b"
    virtual_stages: int = 1
    compute_ms: float = 100.0
    stage_compute_ms: list[float] | None = None  # per pp stage, overrides compute_ms
    data_ms: float = 2.0
    transfer_ms: float = 10.0  # the all-reduce itself once everyone has arrived
    noise: float = 0.01
    # device_time: records carry device_ms (the device's own busy time: compute x compute_factor x noise); the
    # wall-clock compute then also carries host scheduling noise and host-only slow-downs (host_factor)
    device_time: bool = False
    host_noise: float = 0.0
    host_factor: Callable[[int, int], float] = lambda r, s: 1.0
    seed: int = 0
    nbytes: int = 64 * 1024 * 1024
    flops: float = 5e12  # per rank per step
    peak_flops: float = 100e12
    peak_source: str = "measured fp32 matmul on this CPU"
    peak_simulated: bool = False
    # (rank, step) -> multiplier of compute / extra ms
    compute_factor: Callable[[int, int], float] = lambda r, s: 1.0
    data_extra_ms: Callable[[int, int], float] = lambda r, s: 0.0
    link_delay_ms: Callable[[int, int], float] = lambda r, s: 0.0  # blocked before the sync (arrives late)
    send_delay_ms: Callable[[int, int], float] = lambda r, s: 0.0  # arrives on time, its data leaves late (DDP hook)
    mem_bytes: Callable[[int, int], int] = lambda r, s: 2 * 1024**3
    fp16: bool = False
    overflow: Callable[[int, int], bool] = lambda r, s: False
    nonfinite: Callable[[int, int], bool] = lambda r, s: False
    profiling: Callable[[int, int], bool] = lambda r, s: False
    stop: dict[int, int] = field(default_factory=dict)  # rank -> step at which it hangs (never arrives)
    faults: list[FaultSpec] = field(default_factory=list)
    finished: bool = True


def placements(spec: Spec) -> list[RankPlacement]:
    per_node = spec.world // spec.nodes
    dp = spec.world // spec.pp
    out = []
    for r in range(spec.world):
        out.append(RankPlacement(rank=r, node=r // per_node, host=f"node{r // per_node}", local_rank=r % per_node,
                                 pp_stage=r // dp, dp_rank=r % dp, tp_rank=0, gpu=r % per_node))
    return out


def build(spec: Spec | None = None, **kw) -> RunData:
    spec = spec or Spec(**kw)
    rng = np.random.default_rng(spec.seed)
    pl = placements(spec)
    dp = spec.world // spec.pp
    steps, colls, events = [], [], []
    t = T0
    scale = 65536.0
    hung_at: int | None = None
    for s in range(spec.steps):
        if hung_at is not None:
            break
        arrivals, rows = {}, {}
        # stage compute (per micro-batch schedule) first: pipeline wait depends on the slowest stage
        comp = {}
        for p in pl:
            base = spec.stage_compute_ms[p.pp_stage] if spec.stage_compute_ms else spec.compute_ms
            comp[p.rank] = base * spec.compute_factor(p.rank, s) * (1 + spec.noise * rng.standard_normal())
        device = dict(comp)
        for p in pl:
            jitter = max(0.2, 1 + spec.host_noise * rng.standard_normal()) if spec.host_noise else 1.0  # no extra draws
            comp[p.rank] *= spec.host_factor(p.rank, s) * jitter
        if spec.pp > 1:
            m, v = spec.microbatches, spec.virtual_stages
            stage_c = [max(comp[p.rank] for p in pl if p.pp_stage == st) for st in range(spec.pp)]
            span = max(stage_c) * (v * m + spec.pp - 1) / (v * m)
        for p in pl:
            data = spec.data_ms + spec.data_extra_ms(p.rank, s)
            wait_pp = (span - comp[p.rank]) if spec.pp > 1 else 0.0
            delay = spec.link_delay_ms(p.rank, s)
            arrivals[p.rank] = t + (data + comp[p.rank] + wait_pp + delay) / 1000.0
            rows[p.rank] = (data, wait_pp, delay)
        missing = [r for r, st in spec.stop.items() if s >= st]
        if missing:
            # the stopped ranks never arrive; the others enter the all-reduce and wait forever
            for p in pl:
                if p.rank in missing:
                    continue
                colls.append(CollectiveRecord(run_id="synth", rank=p.rank, step=s, seq=s + 1, op="all_reduce", group="dp",
                                              group_ranks=list(range(spec.world)), nbytes=spec.nbytes,
                                              t_arrive=arrivals[p.rank], t_done=None))
            hung_at = s
            break
        last = max(arrivals.values())
        sd = {p.rank: spec.send_delay_ms(p.rank, s) for p in pl}
        dmax = max(sd.values())
        end = last + (spec.transfer_ms + dmax) / 1000.0
        any_overflow = any(spec.overflow(r, s) for r in range(spec.world))
        if spec.fp16:
            scale = scale / 2 if any_overflow else scale
        for p in pl:
            data, wait_pp, delay = rows[p.rank]
            wait = (last - arrivals[p.rank]) * 1000.0 + (dmax - sd[p.rank])
            comm = wait + spec.transfer_ms + delay
            step_ms = (end - t) * 1000.0
            nonfinite = spec.nonfinite(p.rank, s)
            steps.append(StepRecord(
                run_id="synth", rank=p.rank, step=s, node=p.node, host=p.host, world_size=spec.world,
                pp_stage=p.pp_stage, dp_rank=p.dp_rank, t_start=t, t_end=end, step_ms=step_ms, data_ms=data,
                forward_ms=comp[p.rank] / 3, backward_ms=comp[p.rank] * 2 / 3, comm_ms=comm,
                pipeline_wait_ms=wait_pp, compute_ms=comp[p.rank] + sd[p.rank], sync_arrival=arrivals[p.rank], sync_wait_ms=wait,
                tokens=4096, loss=None if nonfinite else 5.0 - 0.01 * s, loss_nonfinite=nonfinite,
                loss_scale=scale if spec.fp16 else None, overflow=spec.fp16 and any_overflow,
                skipped=spec.fp16 and any_overflow, mem_bytes=spec.mem_bytes(p.rank, s), flops=spec.flops,
                profiling=spec.profiling(p.rank, s), microbatches=spec.microbatches,
                device_ms=device[p.rank] if spec.device_time else None,
            ))
            colls.append(CollectiveRecord(run_id="synth", rank=p.rank, step=s, seq=s + 1, op="all_reduce", group="dp",
                                          group_ranks=list(range(spec.world)), nbytes=spec.nbytes,
                                          t_arrive=arrivals[p.rank], t_done=end, duration_ms=(end - arrivals[p.rank]) * 1000))
        t = end + 0.001
    manifest = Manifest(
        run_id="synth", created=T0, start_time=T0, nodes=spec.nodes, ranks=pl,
        layout={"dp": dp, "tp": 1, "pp": spec.pp, "world": spec.world, "pp_schedule": spec.schedule,
                "microbatches": spec.microbatches, "virtual_stages": spec.virtual_stages},
        peak_flops=spec.peak_flops, peak_source=spec.peak_source, peak_simulated=spec.peak_simulated,
        faults=spec.faults, finished=(t if spec.finished and hung_at is None else None),
        config={"steps": spec.steps},
    )
    return RunData.from_records("synth", steps + colls + events, manifest=manifest)


def step_time(data: RunData, step: int) -> float:
    row = data.steps[data.steps["step"] == step].iloc[0]
    return float(row["t_start"]), float(row["t_end"])


def gpu_samples(data: RunData, every_s: float = 0.05, sm_clock: Callable[[int, int, float], float] | None = None,
                throttle: Callable[[int, int, float], int] | None = None, ecc_dbe: Callable[[int, int, float], int] | None = None,
                xid_total: Callable[[int, int, float], int] | None = None, simulated: bool = True) -> list[GpuSample]:
    """Samples for every GPU of every node across the run's time span."""
    t0 = float(data.steps["t_start"].min())
    t1 = float(data.steps["t_end"].max())
    out = []
    for node, ranks in Placement(data).node_ranks.items():
        for gpu in range(len(ranks)):
            t = t0
            while t <= t1:
                out.append(GpuSample(
                    node=node, host=f"node{node}", gpu=gpu, t=t, source="simulated-nvml" if simulated else "nvml",
                    simulated=simulated, util_pct=95.0, sm_clock_mhz=sm_clock(node, gpu, t) if sm_clock else 1980.0,
                    max_sm_clock_mhz=1980.0, throttle_reasons=throttle(node, gpu, t) if throttle else 0,
                    ecc_dbe=ecc_dbe(node, gpu, t) if ecc_dbe else 0, ecc_sbe=0, temp_c=60.0,
                    xid_total=xid_total(node, gpu, t) if xid_total else 0, mem_total_bytes=80 * 1024**3,
                    mem_used_bytes=10 * 1024**3,
                ))
                t += every_s
    return out


def with_records(data: RunData, records: list) -> RunData:
    """A copy of ``data`` with telemetry records added."""
    import pandas as pd

    from analyzers.loader import TABLE_TYPES

    extra = RunData.from_records(data.run_id, records, manifest=data.manifest)
    kw = {}
    for name, cls in TABLE_TYPES.items():
        a, b = getattr(data, name), getattr(extra, name)
        kw[name] = b if a.empty else (a if b.empty else pd.concat([a, b], ignore_index=True))
    return RunData(run_id=data.run_id, manifest=data.manifest, nccl_tests=data.nccl_tests, **kw)




def write_run(data: RunData, store, run_id: str | None = None, truncate_last: bool = False) -> str:
    """Write ``data`` as the trainer would: run.json + spool/rank-<R>.jsonl. Returns the run id."""
    import msgspec

    from ranksight.layout import RunDir
    from ranksight.schema import encode

    run_id = run_id or data.run_id
    rd = RunDir(store, run_id)
    rd.spool_dir.mkdir(parents=True, exist_ok=True)
    m = msgspec.structs.replace(data.manifest, run_id=run_id)
    rd.manifest.write_bytes(encode(m))
    lines: dict[int, list[bytes]] = {}
    for cls, df in ((StepRecord, data.steps), (CollectiveRecord, data.collectives)):
        fields = set(cls.__struct_fields__)
        for row in df.to_dict("records"):
            kw = {k: v for k, v in row.items() if k in fields and not (isinstance(v, float) and v != v)}
            kw["run_id"] = run_id
            rec = msgspec.convert(kw, cls, strict=False)
            lines.setdefault(int(row["rank"]), []).append(encode(rec))
    for r, ls in lines.items():
        body = b"\n".join(ls) + b"\n"
        if truncate_last and r == max(lines):
            body += ls[-1][: len(ls[-1]) // 2]  # a write cut short
        rd.spool(r).write_bytes(body)
    return run_id
