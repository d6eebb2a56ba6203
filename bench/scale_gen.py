"""A synthetic run store of R ranks x S steps, written through the head's real store writer (``RunStore``), for
``bench/scale_diagnose.py`` and ``tests/test_scale_diagnose.py``.

The job (stated, so results can be read against it):

- layout TP 8 x PP 4 x DP rest (TP and PP shrink for small worlds), 8 ranks (GPUs) per node, one step per
  ``step_s`` simulated seconds, synchronous: every rank of a step starts together;
- per step per rank two collectives on their communicators: the TP all-reduce (8 ranks) and the DP gradient
  all-reduce (DP ranks); the ``communicators`` table holds each group's members once, the collective records carry
  ``comm_id`` (the packed form node agents ship);
- a GPU sample per GPU per simulated second, a host sample per node per second, a manifest (``run.json``) with the
  layout, placements, a peak, and the injected fault;
- a straggler: rank ``straggler`` computes ``factor`` x longer from step ``onset`` on; the peers of its TP group
  and then of its DP groups wait for it (their ``sync_wait_ms`` grows, it arrives last).

Rows are built as numpy structured arrays of the packed-v1 layouts (``ranksight.wire``) and handed to
``RunStore.enqueue_packed``: the head's own path for agents' packed batches (write-ahead log, dedupe, Arrow, Parquet
part files in hour partitions of the simulated clock). The communicators go through ``RunStore.add``. The store is
flushed every ``flush_s`` simulated seconds (and when ``flush_rows`` are buffered, as the head does); at the end the
head's store closes, which compacts every partition into one file per table (``compact``; without it the part files
stay as a head flushing every few seconds leaves them, as during a live run).
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from head.store.run_store import RunStore  # noqa: E402
from ranksight import schema, wire  # noqa: E402
from ranksight.layout import atomic_write  # noqa: E402

RUN = "scale"
RANKS_PER_NODE = 8
T0 = 1.8e9


@dataclass(frozen=True)
class Job:
    ranks: int
    steps: int
    step_s: float = 1.0
    flush_s: float = 5.0
    straggler: int = 5
    factor: float = 1.3
    onset: int | None = None  # default: a third of the way in
    seed: int = 0
    # True: the store as the head leaves a finished run (every hour partition compacted into one file per table
    # when it closes); False: the flushed parts as they are (a live run, or a head stopped before compacting)
    compact: bool = True
    # True: each flush's step and collective rows reach the head in a random order (ranks ship independently, as
    # on a real job), so its parts are not in the loader's key order; False: in (step, rank) order
    shuffled: bool = False

    @property
    def tp(self) -> int:
        return min(8, self.ranks)

    @property
    def pp(self) -> int:
        return max(1, min(4, self.ranks // self.tp))

    @property
    def dp(self) -> int:
        return self.ranks // (self.tp * self.pp)

    @property
    def start(self) -> int:
        return self.steps // 3 if self.onset is None else self.onset

    def name(self) -> str:
        return (f"r{self.ranks}-s{self.steps}-st{self.step_s:g}-f{self.flush_s:g}-x{self.straggler}-{self.factor:g}"
                + ("-shuffled" if self.shuffled else "") + ("-compacted" if self.compact else "-parts"))


def _layout(kind: str, fields: list[tuple[str, str]]) -> wire.PackedLayout:
    return wire.packed_layout_of(kind, ",".join(f"{n}:{c}" for n, c in fields))


STEP = _layout("step", [
    ("rank", "i8"), ("step", "i8"), ("node", "i8"), ("host", "S16"), ("world_size", "i8"), ("pp_stage", "i8"),
    ("dp_rank", "i8"), ("tp_rank", "i8"), ("t_start", "f8"), ("t_end", "f8"), ("step_ms", "f8"), ("data_ms", "f8"),
    ("forward_ms", "f8"), ("backward_ms", "f8"), ("optimizer_ms", "f8"), ("comm_ms", "f8"),
    ("compute_ms", "f8"), ("sync_arrival", "f8"), ("sync_wait_ms", "f8"), ("tokens", "i8"), ("loss", "f8"),
    ("grad_norm", "f8"), ("lr", "f8"), ("mem_bytes", "i8"), ("flops", "f8"), ("device_ms", "f8")])
COLL = _layout("collective", [
    ("rank", "i8"), ("step", "i8"), ("seq", "i8"), ("op", "S16"), ("group", "S8"), ("nbytes", "i8"),
    ("t_arrive", "f8"), ("t_done", "f8"), ("duration_ms", "f8"), ("attempt", "i8"), ("comm_id", "S16")])
GPU = _layout("gpu", [
    ("node", "i8"), ("host", "S16"), ("gpu", "i8"), ("t", "f8"), ("source", "S8"), ("simulated", "b1"),
    ("name", "S24"), ("util_pct", "f8"), ("mem_util_pct", "f8"), ("power_w", "f8"), ("power_limit_w", "f8"),
    ("temp_c", "f8"), ("sm_clock_mhz", "f8"), ("mem_clock_mhz", "f8"), ("max_sm_clock_mhz", "f8"),
    ("throttle_reasons", "i8"), ("xid_total", "i8")])
HOST = _layout("host", [
    ("node", "i8"), ("host", "S16"), ("t", "f8"), ("cpu_pct", "f8"), ("load1", "f8"), ("mem_used_bytes", "i8"),
    ("mem_total_bytes", "i8"), ("net_rx_bytes", "i8"), ("net_tx_bytes", "i8"), ("disk_read_bytes", "i8"),
    ("disk_write_bytes", "i8")])


def _hosts(nodes: np.ndarray) -> np.ndarray:
    return np.char.add(b"node", np.char.zfill(nodes.astype("S6"), 5))


def _communicators(job: Job) -> tuple[list[schema.CommunicatorRecord], np.ndarray, np.ndarray]:
    """The TP and DP groups, and each rank's TP and DP comm_id."""
    grid = np.arange(job.ranks).reshape(job.dp, job.pp, job.tp)
    tp_id = np.empty(job.ranks, "S16")
    dp_id = np.empty(job.ranks, "S16")
    recs = []
    for group, members_of in (("tp", grid.reshape(-1, job.tp)),
                              ("dp", grid.transpose(1, 2, 0).reshape(-1, job.dp))):
        for members in members_of:
            ms = sorted(int(x) for x in members)
            cid = schema.communicator_id(group, ms)
            (tp_id if group == "tp" else dp_id)[members] = cid.encode()
            recs.append(schema.CommunicatorRecord(run_id=RUN, comm_id=cid, group=group, ranks=ms, rank=ms[0]))
    return recs, tp_id, dp_id


def _manifest(job: Job) -> schema.Manifest:
    ranks = np.arange(job.ranks)
    place = [schema.RankPlacement(rank=int(r), node=int(r // RANKS_PER_NODE), host=f"node{r // RANKS_PER_NODE:05d}",
                                  local_rank=int(r % RANKS_PER_NODE), pp_stage=int((r // job.tp) % job.pp),
                                  dp_rank=int(r // (job.tp * job.pp)), tp_rank=int(r % job.tp),
                                  gpu=int(r % RANKS_PER_NODE)) for r in ranks]
    return schema.Manifest(
        run_id=RUN, created=T0, start_time=T0, nodes=-(-job.ranks // RANKS_PER_NODE), ranks=place,
        layout=dict(dp=job.dp, tp=job.tp, pp=job.pp, world=job.ranks, microbatches=8), backend="nccl",
        device="cuda", flops_per_token=6 * 7e9, params=7_000_000_000, peak_flops=989e12,
        peak_source="device table: H100 SXM bf16",
        faults=[schema.FaultSpec(kind="slow_rank", rank=job.straggler, factor=job.factor, start=job.start)],
        finished=T0 + job.steps * job.step_s)


def step_rows(job, R: int, steps: np.ndarray, ts: np.ndarray, step_ms: np.ndarray, compute: np.ndarray,
              data_ms: np.ndarray, comm_ms: np.ndarray, sync_arrival: np.ndarray, sync_wait_ms: np.ndarray,
              rng) -> np.ndarray:
    """The step records of ``steps`` x ``R`` ranks (step-major) from their flat per-row times (ms; ``ts``, the
    steps' starts, and ``sync_arrival`` in seconds): placement, the step's parts and the constant fields."""
    n = len(steps)
    rank = np.tile(np.arange(R), n)
    st = np.zeros(n * R, STEP.dtype)
    st["rank"], st["step"], st["node"] = rank, np.repeat(steps, R), rank // RANKS_PER_NODE
    st["host"] = np.tile(_hosts(np.arange(R) // RANKS_PER_NODE), n)
    st["world_size"] = R
    st["pp_stage"], st["dp_rank"], st["tp_rank"] = (rank // job.tp) % job.pp, rank // (job.tp * job.pp), rank % job.tp
    st["t_start"] = ts
    st["step_ms"] = step_ms
    st["t_end"] = ts + step_ms / 1000.0
    st["data_ms"] = data_ms
    st["forward_ms"], st["backward_ms"], st["optimizer_ms"] = compute / 3, 2 * compute / 3, 5.0
    st["comm_ms"] = comm_ms
    st["compute_ms"] = compute
    st["device_ms"] = compute * 0.97
    st["sync_arrival"] = sync_arrival
    st["sync_wait_ms"] = sync_wait_ms
    st["tokens"] = 8192
    st["loss"] = np.repeat(2.0 + 2.0 / np.sqrt(1.0 + steps), R) + rng.normal(0, 0.01, n * R)
    st["grad_norm"] = 1.0
    st["lr"] = 3e-4
    st["mem_bytes"] = 60 << 30
    st["flops"] = 6 * 7e9 * 8192 / R
    return st


def _block(job: Job, rng: np.random.Generator, s0: int, s1: int, tp_id: np.ndarray, dp_id: np.ndarray):
    """Step and collective rows of steps s0..s1-1 (all ranks), vectorized over (step, dp, pp, tp)."""
    R, n = job.ranks, s1 - s0
    steps = np.arange(s0, s1)
    shape = (n, job.dp, job.pp, job.tp)
    compute = 800.0 * rng.lognormal(0.0, 0.01, size=shape)
    slow = np.zeros(R, bool)
    slow[job.straggler] = True
    late = (steps >= job.start)[:, None] & slow[None, :]
    compute = np.where(late.reshape(shape), compute * job.factor, compute)
    data_ms = 2.0 + rng.exponential(0.5, size=shape)
    t_start = T0 + steps * job.step_s
    arrive_tp = data_ms + compute  # ms after the step's start
    tp_xfer = 3.0 + rng.exponential(0.2, size=shape[:3] + (1,))
    tp_done = arrive_tp.max(axis=3, keepdims=True) + tp_xfer  # every TP member leaves together
    arrive_dp = np.broadcast_to(tp_done, shape)
    dp_xfer = 25.0 + rng.exponential(1.0, size=(n, 1) + shape[2:])
    dp_done = arrive_dp.max(axis=1, keepdims=True) + dp_xfer
    dp_done = np.broadcast_to(dp_done, shape)
    step_ms = dp_done + 5.0  # the optimizer
    comm_ms = (tp_done - arrive_tp) + (dp_done - arrive_dp)
    flat = lambda a: np.ascontiguousarray(np.broadcast_to(a, shape)).reshape(n * R)  # noqa: E731
    rank = np.tile(np.arange(R), n)
    step = np.repeat(steps, R)
    ts = np.repeat(t_start, R)
    st = step_rows(job, R, steps, ts, flat(step_ms), flat(compute), flat(data_ms), flat(comm_ms),
                   ts + flat(arrive_dp) / 1000.0, flat(dp_done - arrive_dp), rng)
    co = np.zeros(2 * n * R, COLL.dtype)
    for j, (group, ids, arr, done, nbytes) in enumerate((("tp", tp_id, arrive_tp, tp_done, 64 << 20),
                                                         ("dp", dp_id, arrive_dp, dp_done, 1 << 30))):
        part = co[j::2]  # seq order within a rank-step: tp then dp
        part["rank"], part["step"], part["seq"] = rank, step, step
        part["op"], part["group"], part["nbytes"] = b"all_reduce", group.encode(), nbytes
        a, d = flat(arr), flat(done)
        part["t_arrive"] = ts + a / 1000.0
        part["t_done"] = ts + d / 1000.0
        part["duration_ms"] = d - a
        part["comm_id"] = np.tile(ids, n)
    return st, co


def _samples(job: Job, rng: np.random.Generator, t0: float, t1: float):
    """GPU samples (one per GPU per second) and host samples (one per node per second) in [t0, t1)."""
    secs = np.arange(np.ceil(t0 - T0), np.ceil(t1 - T0)) + T0
    nodes = -(-job.ranks // RANKS_PER_NODE)
    gpus = np.arange(job.ranks)
    g = np.zeros(len(secs) * job.ranks, GPU.dtype)
    g["node"] = np.tile(gpus // RANKS_PER_NODE, len(secs))
    g["host"] = np.tile(_hosts(gpus // RANKS_PER_NODE), len(secs))
    g["gpu"] = np.tile(gpus % RANKS_PER_NODE, len(secs))
    g["t"] = np.repeat(secs, job.ranks)
    g["source"], g["simulated"], g["name"] = b"nvml", 0, b"NVIDIA H100 80GB HBM3"
    g["util_pct"] = 97.0 + rng.normal(0, 1, len(g))
    g["mem_util_pct"], g["power_w"], g["power_limit_w"], g["temp_c"] = 60.0, 650.0, 700.0, 62.0
    g["sm_clock_mhz"] = g["max_sm_clock_mhz"] = 1980.0
    g["mem_clock_mhz"] = 2619.0
    h = np.zeros(len(secs) * nodes, HOST.dtype)
    h["node"] = np.tile(np.arange(nodes), len(secs))
    h["host"] = np.tile(_hosts(np.arange(nodes)), len(secs))
    h["t"] = np.repeat(secs, nodes)
    h["cpu_pct"] = 35.0 + rng.normal(0, 2, len(h))
    h["load1"] = 12.0
    h["mem_used_bytes"], h["mem_total_bytes"] = 400 << 30, 2048 << 30
    return g, h


def _packed(lay: wire.PackedLayout, arr: np.ndarray) -> list[wire.PackedBatch]:
    return [wire.PackedBatch(lay, arr.tobytes(), len(arr))]


def generate(job: Job, store: Path, log=print) -> Path:
    """Write the run into ``store/RUN`` (replacing it); returns the run directory."""
    root = store / RUN
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    t_wall = time.time()
    sim = {"t": T0}
    # the head's clock is the simulated one: rows land in the hour partitions of the simulated time
    rs = RunStore(root, RUN, clock=lambda: sim["t"])
    if not job.compact:
        rs.compact = lambda *a, **k: None  # noqa: E731 - the parts as flushed: no compaction at close
    rs.write_manifest(_manifest(job), None)
    comms, tp_id, dp_id = _communicators(job)
    rs.add("communicators", comms)
    rng = np.random.default_rng(job.seed)
    per_flush = max(1, int(round(job.flush_s / job.step_s)))
    done = 0
    while done < job.steps:
        s1 = min(job.steps, done + per_flush)
        st, co = _block(job, rng, done, s1, tp_id, dp_id)
        g, h = _samples(job, rng, T0 + done * job.step_s, T0 + s1 * job.step_s)
        if job.shuffled:
            st, co = st[rng.permutation(len(st))], co[rng.permutation(len(co))]
        rs.enqueue_packed("steps", _packed(STEP, st))
        rs.enqueue_packed("collectives", _packed(COLL, co))
        rs.enqueue_packed("gpu", _packed(GPU, g))
        rs.enqueue_packed("host", _packed(HOST, h))
        sim["t"] = T0 + s1 * job.step_s
        rs.flush()
        # The head's gpu/host indexes are exact sets of every key seen (``SetIndex``), ~120 B a sample: the
        # generator never repeats a key, so it forgets them to keep its own memory in check.
        rs.indexes["gpu"].keys.clear()
        rs.indexes["host"].keys.clear()
        done = s1
        if log is not None and (done == job.steps or done % max(per_flush, job.steps // 10 // per_flush * per_flush) == 0):
            log(f"  generated {done}/{job.steps} steps ({time.time() - t_wall:.0f} s)")
    rs.close()
    atomic_write(root / "generated.json", f'{{"job": "{job.name()}"}}'.encode())
    return root


def cached(job: Job, cache: Path, log=print) -> Path:
    """The store of ``job`` under ``cache`` (generated once; a partial one is regenerated)."""
    store = cache / job.name()
    if not (store / RUN / "generated.json").exists():
        if log is not None:
            log(f"generating {job.ranks} ranks x {job.steps} steps into {store}")
        generate(job, store, log)
    return store
