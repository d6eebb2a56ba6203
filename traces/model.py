"""One rank's trace as numpy columns: what ``load`` produces and every analysis reads.

Times are microseconds on the trace's clock (Kineto's ``ts``/``dur``), float64. No per-event Python object is
kept: names are ids into a per-rank table (``RankTrace.names``).

GPU activity (``GpuOps``), one row per event, sorted by start:

- ``kind``: ``KIND_COMPUTE`` (cat ``kernel`` not NCCL), ``KIND_COMM`` (cat ``kernel`` named ``ncclKernel_*`` /
  ``ncclDevKernel_*``), ``KIND_MEMCPY`` (``gpu_memcpy``), ``KIND_MEMSET`` (``gpu_memset``). Copy and set time is
  GPU activity, never idle (issue 14, bullet 1).
- ``launch_ts``/``launch_end``: the CPU runtime event (``cuda_runtime``/``cuda_driver``) with the same
  ``correlation``; NaN when the trace has none (such kernels are kept and counted, unlike HTA).

Collectives (``Collectives``): every NCCL kernel, uncapped (issue 14, bullet 2), with its args: collective name,
process group name and ranks, element count, dtype, and the sequence number within its group on this rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

KIND_COMPUTE = 0
KIND_COMM = 1
KIND_MEMCPY = 2
KIND_MEMSET = 3
KIND_NAMES = ("compute", "comm", "memcpy", "memset")

NCCL_PREFIXES = ("ncclKernel", "ncclDevKernel")

DTYPE_SIZE = {
    "float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2, "bfloat16": 2,
    "c10::half": 2, "c10::bfloat16": 2, "long": 8, "long int": 8, "int64": 8, "int": 4, "int32": 4,
    "short": 2, "int16": 2, "char": 1, "signed char": 1, "int8": 1, "byte": 1, "unsigned char": 1, "uint8": 1,
    "bool": 1, "c10::float8_e4m3fn": 1, "c10::float8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def is_nccl_kernel(name: str) -> bool:
    return name.startswith(NCCL_PREFIXES)


@dataclass
class GpuOps:
    ts: np.ndarray  # float64 us
    dur: np.ndarray  # float64 us
    kind: np.ndarray  # int8, KIND_*
    stream: np.ndarray  # int64 (-1 when the trace gives none)
    name_id: np.ndarray  # int32 into RankTrace.names
    corr: np.ndarray  # int64 (-1 when none)
    launch_ts: np.ndarray  # float64, NaN without a launch event
    launch_end: np.ndarray  # float64, NaN without a launch event

    @property
    def end(self) -> np.ndarray:
        return self.ts + self.dur

    def __len__(self) -> int:
        return len(self.ts)

    @staticmethod
    def empty() -> "GpuOps":
        f = np.zeros(0)
        i = np.zeros(0, dtype=np.int64)
        return GpuOps(f, f, np.zeros(0, dtype=np.int8), i, np.zeros(0, dtype=np.int32), i, f, f)


@dataclass
class Collectives:
    """One row per NCCL kernel, in start order; ``op`` indexes GpuOps."""

    op: np.ndarray  # int64 index into GpuOps
    coll_id: np.ndarray  # int32 into RankTrace.names ("allreduce", "send", ...; "" when absent)
    pg_id: np.ndarray  # int32 into RankTrace.names: the process group name ("" when absent)
    pg_ranks_id: np.ndarray  # int32 into RankTrace.names: the group's ranks as written ("[0, 1]")
    nelems: np.ndarray  # int64, -1 when absent
    nbytes: np.ndarray  # int64, -1 when unknown
    seq: np.ndarray  # int64: ordinal of this collective within (pg, kernel name) on this rank, from 0

    def __len__(self) -> int:
        return len(self.op)

    @staticmethod
    def empty() -> "Collectives":
        i = np.zeros(0, dtype=np.int64)
        j = np.zeros(0, dtype=np.int32)
        return Collectives(i, j, j, j, i, i, i)


@dataclass
class Steps:
    """``ProfilerStep#N`` CPU annotations, sorted by step number."""

    num: np.ndarray  # int64
    ts: np.ndarray  # float64
    end: np.ndarray  # float64

    def __len__(self) -> int:
        return len(self.num)


@dataclass
class RankTrace:
    path: str
    rank: int
    rank_source: str  # "distributedInfo", "file name", "order"
    world_size: int | None
    gpu: GpuOps
    coll: Collectives
    steps: Steps
    names: list[str]
    pg_config: list[dict] = field(default_factory=list)  # distributedInfo.pg_config as written
    backend: str = ""
    truncated: bool = False
    n_events: int = 0  # trace events decoded
    n_launches: int = 0  # runtime events with a correlation id
    notes: list[str] = field(default_factory=list)

    def name(self, i: int) -> str:
        return self.names[i]

    def slim(self) -> None:
        """Keep only the GPU events the cross-rank checks read (the NCCL kernels, through ``coll.op``), once this rank's
        own analysis is done: a set of large traces is then held one rank at a time, not all at once."""
        keep = self.coll.op
        g = self.gpu
        self.gpu = GpuOps(ts=g.ts[keep], dur=g.dur[keep], kind=g.kind[keep], stream=g.stream[keep],
                          name_id=g.name_id[keep], corr=g.corr[keep], launch_ts=g.launch_ts[keep],
                          launch_end=g.launch_end[keep])
        self.coll.op = np.arange(len(keep), dtype=np.int64)

    @property
    def span(self) -> tuple[float, float]:
        """First GPU event start to last GPU event end (0, 0 without GPU events)."""
        if not len(self.gpu):
            return 0.0, 0.0
        return float(self.gpu.ts.min()), float((self.gpu.ts + self.gpu.dur).max())


__all__ = ["KIND_COMPUTE", "KIND_COMM", "KIND_MEMCPY", "KIND_MEMSET", "KIND_NAMES", "GpuOps", "Collectives", "Steps",
           "RankTrace", "is_nccl_kernel", "DTYPE_SIZE", "NCCL_PREFIXES"]
