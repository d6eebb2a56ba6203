"""The builder: a run's tables (the loader's ``RunData``) become the ``AnalysisFrame`` every check reads.

loader (``analyzers/loader.py``: the run as DataFrames) -> builder (this module: what the checks share) -> checks
(``analyzers/checks/``: one kind of problem each). Most checks compare ranks step by step. They need rank x step
matrices of the same few step columns (the compute signal, the gradient sync's arrival and wait, transfer time),
each cell's reference (the leave-one-out median of the other ranks in that step), and where each rank runs (node,
host, pipeline stage). The frame computes each of those once per analysis round, on first use: a matrix two checks
need is built once, and one no check needs is never built.

What the frame hands out is shared by every check of the round: read it, never modify it in place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Iterable

import numpy as np
import pandas as pd

from analyzers.collectives import name_starts_with
from analyzers.loader import RunData
from analyzers.matrices import distinct_codes, step_grid
from analyzers.stats import median_rows
# the step views and their derived columns, part of the builder (imported from here by the checks)
from analyzers.step_view import (DERIVED_COLUMNS, MEDIAN_BLOCK_STEPS, ROW_WISE_DERIVED, StepView,  # noqa: F401
                                 data_share, grid_transfer_ms, total_wait_ms, transfer_ms)


# --------------------------------------------------------------------------
# The frame
# --------------------------------------------------------------------------


class Placement:
    """Where each rank runs: its node, host and pipeline stage (the manifest's placement, then the step records'
    for ranks it does not list), each map built on first use."""

    def __init__(self, data: RunData):
        self.manifest = data.manifest
        self.steps = data.steps

    def _by_rank(self, col: str, cast: Callable) -> dict:
        """rank -> its placement ``col`` (node, host, pp_stage): the manifest's, else its last step record's."""
        out: dict = {}
        if self.manifest is not None:
            out.update({p.rank: getattr(p, col) for p in self.manifest.ranks})
        if not self.steps.empty and not self._manifest_has_every_rank:
            for r, v in self.steps.groupby("rank")[col].last().items():
                out.setdefault(int(r), cast(v))
        return out

    @cached_property
    def _manifest_has_every_rank(self) -> bool:
        """Whether the manifest places every rank of the step records (then their own placement adds nothing: a
        groupby over every step record spared)."""
        if self.manifest is None or not self.manifest.ranks or self.steps.empty:
            return False
        listed = {int(p.rank) for p in self.manifest.ranks}
        rank = self.steps["rank"].to_numpy()
        grid = step_grid(rank, self.steps["step"].to_numpy())  # a grid's ranks are its first step's
        present = grid[0] if grid is not None else distinct_codes(rank)[0]
        return all(int(r) in listed for r in present.tolist())

    @cached_property
    def rank_node(self) -> dict[int, int]:
        return self._by_rank("node", int)

    @cached_property
    def rank_stage(self) -> dict[int, int]:
        return self._by_rank("pp_stage", int)

    @cached_property
    def rank_host(self) -> dict[int, str]:
        return self._by_rank("host", str)

    @cached_property
    def node_ranks(self) -> dict[int, list[int]]:
        """Each node's ranks, in rank order."""
        out: dict[int, list[int]] = {}
        for r, n in sorted(self.rank_node.items()):
            out.setdefault(n, []).append(r)
        return out

    @cached_property
    def n_nodes(self) -> int:
        """How many nodes the job runs on (a rank whose node is not known, -1, counts as none)."""
        return len([n for n in self.node_ranks if n >= 0])

    def can_evict(self, node: int | None) -> bool:
        """Whether evicting ``node`` leaves the job a node to go on with."""
        return node is not None and node >= 0 and self.n_nodes > 1

    def evict_advice(self, node: int | None) -> str:
        """The last resort a recommendation names for a bad ``node``: checkpoint and evict it where the job has
        other nodes to go on with; on a single-node job (or where the node is not known) there is nothing to
        evict, so: checkpoint and restart without the bad device, or on another machine."""
        if self.can_evict(node):
            return f"checkpoint and evict node {node}"
        why = "the job runs on one node: there is no node to evict" if self.n_nodes <= 1 else "its node is not known"
        return ("checkpoint and restart the job without the bad device (CUDA_VISIBLE_DEVICES, fewer ranks) or on "
                f"another machine ({why})")

    def nodes_of(self, ranks: Iterable[int]) -> list[int]:
        m = self.rank_node
        return sorted({m[r] for r in ranks if r in m})

    def gpu_ranks(self, node: int, gpu: int) -> list[int]:
        """Ranks that drive GPU ``gpu`` of ``node`` (manifest placement, else local rank order)."""
        if self.manifest is not None and self.manifest.ranks:
            by_gpu = [p.rank for p in self.manifest.ranks
                      if p.node == node and (p.gpu if p.gpu is not None else p.local_rank) == gpu]
            return sorted(by_gpu)
        on_node = self.node_ranks.get(node, [])
        return [on_node[gpu]] if gpu < len(on_node) else []

    def peer_groups(self, ranks: list[int]) -> dict[int, list[int]]:
        """Ranks compared with each other: the whole world, or one pipeline stage's ranks when pp > 1 (stages do
        different work)."""
        stage = self.rank_stage
        stages = {stage.get(r, 0) for r in ranks}
        if len(stages) <= 1:
            return {0: ranks}
        groups: dict[int, list[int]] = {}
        for r in ranks:
            groups.setdefault(stage.get(r, 0), []).append(r)
        return groups


def _from_step(st: pd.DataFrame, first: int) -> pd.DataFrame:
    """The rows of ``st`` from step ``first`` on, in their order: a slice (no copy of the columns) where the rows
    are in step order (a store's steps, a live round's: (step, rank) order), else a filter."""
    step = st["step"].to_numpy()
    if len(step) > 1 and bool((step[1:] >= step[:-1]).all()):
        # searched with the column's own integer type where ``first`` fits it (numpy otherwise widens every step to
        # the common type first: a copy of the column)
        if step.dtype.kind in "iu" and np.iinfo(step.dtype).min <= first <= np.iinfo(step.dtype).max:
            first = step.dtype.type(first)
        return st.iloc[int(np.searchsorted(step, first, side="left")):]
    return st[step >= first]


def two_values(col: pd.Series) -> bool:
    """``col.nunique() >= 2``: of an integer column, whether any value differs from the first (no hash of every
    row)."""
    values = col.to_numpy()
    if isinstance(col.dtype, np.dtype) and col.dtype.kind in "iu":
        return len(values) > 0 and bool((values != values[0]).any())
    return col.nunique() >= 2


def one_value(col: pd.Series) -> bool:
    """``col.nunique() == 1``: of an integer column, whether every value is the first (no hash of every row)."""
    values = col.to_numpy()
    if isinstance(col.dtype, np.dtype) and col.dtype.kind in "iu":
        return len(values) > 0 and bool((values == values[0]).all())
    return col.nunique() == 1


@dataclass(frozen=True)
class Signals:
    """Which measured fields a run's records carry: what each check's coverage (``coverage(frame)`` in every
    check module) rests on."""

    ranks: int
    steps: int
    compute_split: bool  # each rank's own work apart from waiting: device_ms, or compute_ms that is not step_ms
    device_time: bool  # device_ms in every step record (the compute signal)
    sync_arrival: bool  # StepRecord.sync_arrival or CollectiveRecord.t_arrive
    sync_wait: bool  # StepRecord.sync_wait_ms
    comm_time: bool  # comm_ms, or timed collective records
    collectives: bool
    flops: bool
    peak: bool
    loss: bool
    loss_scale: bool
    data_wait: bool  # data_ms
    memory: bool  # mem_bytes
    gpu_telemetry: bool  # GPU samples or XID events
    pp: int  # pipeline stages (the manifest's layout, else the step records' pp_stage)
    pp_stages: int  # distinct pp_stage values in the step records
    exits: bool  # some rank recorded an ``exit`` event
    precision: str  # the manifest's config precision ("" not known)
    device: str  # cpu | cuda | ... ("" not known: no manifest)


def signals_of(data: RunData) -> Signals:
    """The ``Signals`` of ``data``."""
    st, co = data.steps, data.collectives
    n = len(st)

    def some(col: str, positive: bool = True) -> bool:
        if n == 0 or col not in st.columns:
            return False
        v = pd.to_numeric(st[col], errors="coerce")
        return bool((v > 0).any()) if positive else bool(v.notna().any())

    device_time = n > 0 and data.compute_signal() == "device_ms"
    # waiting recorded apart from compute, or a compute_ms below the step time less the data wait: compute is the
    # rank's own work. A writer of step_ms alone leaves compute_ms = step_ms (the loader derives it), and in
    # synchronous training every rank's step time is the same.
    own = n > 0 and bool((st["compute_ms"] < (st["step_ms"] - st["data_ms"]) * 0.999 - 1e-6).any())
    split = device_time or own or some("comm_ms") or some("sync_wait_ms", False) or some("pipeline_wait_ms")
    timed_co = not co.empty and bool(co["duration_ms"].notna().any())
    arrival = some("sync_arrival", False) or (not co.empty and bool(co["t_arrive"].notna().any()))
    layout = data.layout
    pp = int(layout.get("pp") or 0) or (int(st["pp_stage"].nunique()) if n else 1)
    return Signals(
        ranks=int(st["rank"].nunique()) if n else 0, steps=int(st["step"].nunique()) if n else 0,
        compute_split=split, device_time=device_time, sync_arrival=arrival, sync_wait=some("sync_wait_ms", False),
        comm_time=some("comm_ms") or timed_co, collectives=not co.empty, flops=some("flops"), peak=data.peak.known,
        loss=some("loss", False) or (n > 0 and bool(st["loss_nonfinite"].any())), loss_scale=some("loss_scale", False),
        data_wait=some("data_ms"), memory=some("mem_bytes"), gpu_telemetry=not data.gpu.empty or not data.xid.empty,
        pp=pp, pp_stages=int(st["pp_stage"].nunique()) if n else 0,
        exits=not data.events.empty and bool((data.events["event"] == "exit").any()),
        precision=str((data.manifest.config or {}).get("precision") or "") if data.manifest is not None else "",
        device=data.device)


@dataclass
class Coverage:
    """Whether a check could judge the run: ``status`` "ran", "limited" (ran without some of what it uses),
    "not_applicable" (nothing of its kind to check: no pipeline, a CPU run's GPUs), "not_run" (the fields it
    needs are missing) or "error" (it raised); ``reason`` says why, and how to give it what it lacks."""

    check: str
    status: str
    reason: str = ""

    @property
    def ran(self) -> bool:
        return self.status in ("ran", "limited")

    def to_dict(self) -> dict:
        return {"check": self.check, "ran": self.ran, "status": self.status, "reason": self.reason}


@dataclass
class AnalysisFrame:
    """One analysis round's view of a run, for the checks: the loader's tables (``data``), where the ranks run
    (``placement``), the compute signal, and the step views with their matrices, built on first use."""

    data: RunData
    placement: Placement
    compute_signal: str  # the step column that measures each rank's own work (RunData.compute_signal)
    _judged: dict[int, StepView] = field(default_factory=dict, init=False, repr=False)
    _collectives_of: dict = field(default_factory=dict, init=False, repr=False)  # frames and row masks by prefixes

    @cached_property
    def signals(self) -> Signals:
        """Which measured fields the run's records carry (what the checks' coverage rests on)."""
        return signals_of(self.data)

    @cached_property
    def all_steps(self) -> StepView:
        """Every step row of the run (or window)."""
        return StepView(self.data.steps)

    def steps_from(self, first: int) -> StepView:
        """A view that holds every step row from step ``first`` on (and maybe more): a judged view that starts no
        later (whose matrices the checks share), else ``all_steps``. For matrices over steps ``first``.. and later
        (``StepView.sub_matrix``)."""
        st = self.data.steps
        for warmup, view in self._judged.items():
            if not st.empty and int(st["step"].min()) + warmup <= first:
                return view
        return self.all_steps

    def judged(self, warmup: int) -> StepView:
        """The steps a check judges: all but the run's first ``warmup`` steps (compilation, allocator and data
        loader warm-up)."""
        if warmup not in self._judged:
            st = self.data.steps
            rows = st if st.empty else _from_step(st, int(st["step"].min()) + warmup)
            self._judged[warmup] = StepView(rows)
        return self._judged[warmup]

    def attempts(self, warmup: int, restart_warmup: int) -> list[StepView]:
        """The steps of each attempt of the job, in order, less their first steps.

        A job that re-formed (a crash-restart, an eviction) is judged one attempt at a time: its ranks, their
        peers and their speed before the restart say nothing about the new process groups, and the first steps of
        an attempt are a warm-up (checkpoint load, allocator, DDP bucket rebuild) that every rank shows. Each step
        belongs to the newest attempt that ran it; rows of older attempts in those steps are dropped. The first
        attempt skips ``warmup`` steps, later ones ``restart_warmup``."""
        st = self.data.steps
        if st.empty:
            return []
        if one_value(st["attempt"]):
            return [self.judged(warmup)]  # the same rows: its matrices are shared with the other checks'
        step_attempt = st.groupby("step")["attempt"].max()
        out = []
        for i, (a, steps) in enumerate(step_attempt.groupby(step_attempt, sort=True)):
            seg = st[st["step"].isin(steps.index) & (st["attempt"] == a)]
            if seg.empty:
                continue
            skip = warmup if i == 0 else restart_warmup
            out.append(StepView(seg[seg["step"] >= int(seg["step"].min()) + skip]))
        return out

    @cached_property
    def step_ends(self) -> pd.Series:
        """The last wall time any rank ended each step, by step."""
        return self.data.steps.groupby("step")["t_end"].max().sort_index()

    def step_of_time(self, t: float | None) -> int | None:
        """The first step (any rank) that ended at or after wall time ``t``."""
        if self.data.steps.empty or t is None or not np.isfinite(t):
            return None
        ends = self.step_ends
        after = ends[ends >= t]
        if after.empty:
            return int(ends.index.max())
        return int(after.index[0])

    def collectives_of(self, prefixes: str | tuple[str, ...]) -> pd.DataFrame:
        """The collective records of the communicators whose name starts with ``prefixes`` ("tp", ("tp", "pp"))."""
        if prefixes not in self._collectives_of:
            self._collectives_of[prefixes] = self.data.collectives[self.group_mask(prefixes)]
        return self._collectives_of[prefixes]

    def group_mask(self, prefixes: str | tuple[str, ...]) -> np.ndarray:
        """Which collective records (a bool per row) are of communicators whose name starts with ``prefixes``: for a
        check that needs a few of those rows, without copying them all (``collectives_of``)."""
        key = ("mask", prefixes)
        if key not in self._collectives_of:
            self._collectives_of[key] = name_starts_with(self.data.collectives["group"], prefixes)
        return self._collectives_of[key]


# A node whose clock is off from the others' (live: from the head's) by more than this has its clock reported
# (checks.hang's clock_skew) and its ranks' arrival times left out of every comparison across nodes.
CLOCK_SKEW_S = 5.0


def skewed_ranks(data: RunData) -> set[int]:
    """Ranks whose wall clock is off by more than CLOCK_SKEW_S. Live: from the head's measured offsets
    (``RunData.clock_offset_s``). Post-mortem: from the steps themselves, since the ranks of one step end within about
    a step time of each other: each node's median step-end offset from node 0's; nodes are grouped where those
    offsets lie within max(CLOCK_SKEW_S, two step times) of each other, and the ranks outside the group holding the
    most ranks (ties: the group of the lowest node) are skewed."""
    if data.clock_offset_s:
        return {int(r) for r, off in data.clock_offset_s.items() if abs(off) > CLOCK_SKEW_S}
    st = data.steps
    if st.empty or not two_values(st["node"]) or st["t_end"].isna().all():
        return set()
    ends = step_node_median(st, "t_end")
    full = ends is not None  # a reshape: no NaN
    if ends is None:
        ends = st.pivot_table(index="step", columns="node", values="t_end", aggfunc="median")
    first = ends.columns[0]
    # each node's median offset from the first node's, all nodes in one call (a Series per node cost seconds at
    # thousands of nodes); without NaN, numpy's median of each node's column laid out as a row (pandas' goes through
    # a NaN-aware median along the columns: the same floats, several times slower at 2,048 nodes)
    offsets = ends.sub(ends[first], axis=0)
    if full and offsets.shape[0] and offsets.dtypes.eq(np.float64).all():
        med = pd.Series(median_rows(np.ascontiguousarray(offsets.to_numpy().T)), index=offsets.columns)
    else:
        med = offsets.median(axis=0)
    off = {n: float(med[n]) for n in ends.columns}
    off = {n: o for n, o in off.items() if np.isfinite(o)}
    tol = max(CLOCK_SKEW_S, 2.0 * float(st["step_ms"].median()) / 1000.0)
    groups: list[list] = []
    for n in sorted(off, key=lambda n: off[n]):
        if groups and off[n] - off[groups[-1][-1]] <= tol:
            groups[-1].append(n)
        else:
            groups.append([n])
    if len(groups) < 2:
        return set()
    ranks_of = st.groupby("node")["rank"].unique()
    size = {i: sum(len(ranks_of.get(n, [])) for n in g) for i, g in enumerate(groups)}
    keep = max(size, key=lambda i: (size[i], -min(groups[i])))
    return {int(r) for i, g in enumerate(groups) if i != keep for n in g for r in ranks_of.get(n, [])}


def step_node_median(st: pd.DataFrame, col: str) -> pd.DataFrame | None:
    """``st.pivot_table(index="step", columns="node", values=col, aggfunc="median")`` where it is a reshape: the
    rows a step x rank grid (``step_grid``), each rank on the same node in every step, each node's ranks next to
    each other and as many on every node, no NaN (a store's steps and a live round's). Each cell's median is the
    middle of its sorted values (the mean of the two middle ones for an even count, as pandas' and numpy's). None
    where the rows are not like that (pivot_table then: its generic groupby cost seconds at 16,384 ranks)."""
    x = st[col].to_numpy()
    if x.dtype.kind != "f" or len(x) == 0 or np.isnan(x).any():
        return None
    grid = step_grid(st["rank"].to_numpy(), st["step"].to_numpy())
    node = st["node"].to_numpy()
    if grid is None or node.dtype.kind not in "iu":
        return None
    ranks, steps = grid
    n = len(ranks)
    first = node[:n]
    if not bool((node.reshape(-1, n) == first).all()):
        return None
    starts = np.r_[0, np.flatnonzero(first[1:] != first[:-1]) + 1]
    sizes = np.diff(np.r_[starts, n])
    nodes = first[starts]
    if not bool((sizes == sizes[0]).all()) or (len(nodes) > 1 and not bool((nodes[1:] > nodes[:-1]).all())):
        return None
    per = int(sizes[0])
    srt = np.sort(x.astype(np.float64, copy=False).reshape(len(steps), len(nodes), per), axis=2)
    med = srt[:, :, per // 2] if per % 2 else (srt[:, :, per // 2 - 1] + srt[:, :, per // 2]) / 2.0
    return pd.DataFrame(med, index=pd.Index(steps, name="step"), columns=pd.Index(nodes, name="node"))


def without_skewed_arrivals(data: RunData) -> RunData:
    """``data`` with ``sync_arrival`` blanked for ``skewed_ranks``: arrival order across nodes compares their wall
    clocks, and node 1 at -120 s "arrived 120 s early yet its peers waited" (a slow link, which the evict policy acted
    on; bench/fault_injection.py). Checks that need arrival then judge those ranks without it."""
    st = data.steps
    if st.empty or "sync_arrival" not in st.columns or st["sync_arrival"].isna().all():
        return data
    skewed = skewed_ranks(data)
    if not skewed:
        return data
    st = st.copy()
    st.loc[st["rank"].isin(list(skewed)), "sync_arrival"] = np.nan
    return dataclasses.replace(data, steps=st)


def build_frame(data: RunData) -> AnalysisFrame:
    """The builder stage: the frame of one analysis round over ``data``."""
    data = without_skewed_arrivals(data)
    return AnalysisFrame(data=data, placement=Placement(data), compute_signal=data.compute_signal())
