"""Load one run into a :class:`RunData` bundle of DataFrames (the "loader" of loader -> builder -> checks).

Two sources, one result:

- the head's run store: ``<store>/<run-id>/<table>/*.parquet`` (``ranksight.schema.STORE_TABLES``),
  used when the ``steps`` table has rows;
- otherwise the trainer's spool files ``<store>/<run-id>/spool/rank-<R>.jsonl`` (so ``diagnose``
  works on a run launched without agents), plus the simulated GPUs' state files for XIDs.

Errors are typed (:class:`LoadError` and subclasses) so the CLI maps them to exit code 40 (``EXIT_LOAD_ERROR``).
A truncated last spool line (a rank killed mid-write) is tolerated and counted.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import msgspec
import numpy as np
import pandas as pd

from analyzers.collectives import group_key, group_keys, with_members
from analyzers.columnar import TABLES as COLUMNAR_TABLES, read_tables
from ranksight import tables
from ranksight.layout import RunDir
from ranksight.peaks import gpu_peak
from ranksight.spool import read_spool
from ranksight.schema import (
    SCHEMA_VERSION,
    CollectiveRecord,
    CommunicatorRecord,
    EventRecord,
    GpuSample,
    HostSample,
    Manifest,
    NcclEvent,
    StepRecord,
    TraceSummary,
    XidEvent,
)

# The store tables the analyzers read, with the record type that gives their columns (the head's own findings and
# actions are not analysed; the actions are read apart, as the job's history).
TABLE_TYPES: dict[str, type[msgspec.Struct]] = {name: typ for name, typ in tables.TABLE_TYPES.items()
                                                if name not in ("findings", "actions")}

PROGRESS_MIN_BYTES = 8 * 1024 * 1024  # show a progress bar when a run is bigger than this


@dataclass(frozen=True)
class Peak:
    """The peak FLOP/s per device MFU is measured against (0: none known), where it came from, and, without one,
    why not and how to give it."""

    flops: float
    source: str
    simulated: bool = False
    missing: str = ""  # why no peak is known (and how to give one); "" when there is one

    @property
    def known(self) -> bool:
        return self.flops > 0


HOW_TO_GIVE_PEAK = ("give it: a manifest (run.json) with peak_flops, as ranksight.init writes, or a node agent "
                    "(ranksight agent) reading NVML on a GPU listed in ranksight.peaks")


def find_peak(manifest: Manifest | None, gpu: pd.DataFrame, real_names: list[str]) -> Peak:
    """``RunData.peak``: the manifest's peak; else the device table's for the real GPU the samples name."""
    if manifest is not None and manifest.peak_flops and manifest.peak_flops > 0:
        src = manifest.peak_source or "source not stated"
        simulated = bool(manifest.peak_simulated) or ("measured" in src.lower() and "cpu" in src.lower())
        return Peak(float(manifest.peak_flops), src, simulated)
    for name in real_names:
        known = gpu_peak(name)
        if known is not None:
            return Peak(float(known[0]), known[1], False)
    if real_names:
        why = f"the GPU samples name {real_names[0]!r}, which is not in the peak table (ranksight.peaks)"
    elif not gpu.empty:
        why = "the GPU samples are simulated (a CPU run): their device name says nothing of its peak"
    elif manifest is not None:
        why = "the manifest has no peak_flops"
    else:
        why = "the run has no manifest (run.json) and no GPU samples name its device"
    return Peak(0.0, "", False, f"{why}; {HOW_TO_GIVE_PEAK}")


class LoadError(Exception):
    """The run cannot be read. ``diagnose`` exits 40 (``EXIT_LOAD_ERROR``) with this message."""


class UnknownRunError(LoadError):
    pass


class EmptyRunError(LoadError):
    pass


class NewerSchemaError(LoadError):
    pass


def columns_of(cls: type[msgspec.Struct]) -> list[str]:
    return [f.name for f in msgspec.structs.fields(cls)]


def empty_frame(cls: type[msgspec.Struct]) -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=object) for c in columns_of(cls)})


def frame_from_records(records: Iterable[msgspec.Struct], cls: type[msgspec.Struct]) -> pd.DataFrame:
    rows = [msgspec.structs.asdict(r) for r in records]
    if not rows:
        return empty_frame(cls)
    df = pd.DataFrame(rows)
    for c in columns_of(cls):
        if c not in df.columns:
            df[c] = None
    return df


@dataclass
class RunData:
    """Everything the analyzers look at, for one run (or one live window of it)."""

    run_id: str
    manifest: Manifest | None = None
    steps: pd.DataFrame = field(default_factory=lambda: empty_frame(StepRecord))
    collectives: pd.DataFrame = field(default_factory=lambda: empty_frame(CollectiveRecord))
    communicators: pd.DataFrame = field(default_factory=lambda: empty_frame(CommunicatorRecord))
    events: pd.DataFrame = field(default_factory=lambda: empty_frame(EventRecord))
    gpu: pd.DataFrame = field(default_factory=lambda: empty_frame(GpuSample))
    host: pd.DataFrame = field(default_factory=lambda: empty_frame(HostSample))
    nccl_events: pd.DataFrame = field(default_factory=lambda: empty_frame(NcclEvent))
    trace_summaries: pd.DataFrame = field(default_factory=lambda: empty_frame(TraceSummary))
    xid: pd.DataFrame = field(default_factory=lambda: empty_frame(XidEvent))
    nccl_tests: pd.DataFrame = field(default_factory=pd.DataFrame)
    actions: pd.DataFrame = field(default_factory=pd.DataFrame)  # the head's actions, current status per id (read, not analysed)
    source: str = "memory"  # store | spool | memory | live
    truncated_lines: int = 0  # spool lines cut short at the end of a file (tolerated)
    bad_lines: int = 0  # undecodable lines elsewhere (skipped)
    damaged_parts: int = 0  # store part files that could not be read (a failed page checksum, a torn file): skipped
    now: float | None = None  # live analysis: the wall clock of this round; None post-mortem
    # live analysis: per rank, the head's clock minus the rank's node's (measured from its agent's heartbeats: the
    # clock difference plus the quickest delivery). Liveness is judged on the head's clock by adding it to the rank's
    # timestamps, so a node whose clock is off is not "silent" for that reason.
    clock_offset_s: dict[int, float] = field(default_factory=dict)
    since: int | None = None
    until: int | None = None
    # tables the store's columnar reader (analyzers/columnar.py) already normalized: ``normalize`` leaves them as
    # they are (the columns it skips stay out, instead of being filled with a None per row)
    prepared: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self.normalize()

    # -- normalisation -------------------------------------------------------
    def normalize(self) -> None:
        """Give every table its full column set, drop duplicates, derive compute_ms when absent."""
        for name, cls in TABLE_TYPES.items():
            df = getattr(self, name)
            if name in self.prepared and df is not None:
                continue
            if df is None:
                df = empty_frame(cls)
            for c in columns_of(cls):
                if c not in df.columns:
                    df[c] = None
            setattr(self, name, df)
        st = self.steps
        if not st.empty and "steps" not in self.prepared:
            st = st.copy()
            for c in ("step_ms", "data_ms", "forward_ms", "backward_ms", "optimizer_ms", "comm_ms",
                      "pipeline_wait_ms", "compute_ms", "flops"):
                st[c] = pd.to_numeric(st[c], errors="coerce").fillna(0.0).astype(float)
            for c in ("sync_arrival", "sync_wait_ms", "loss", "loss_scale", "grad_norm", "t_start", "t_end", "device_ms"):
                st[c] = pd.to_numeric(st[c], errors="coerce").astype(float)
            for c in ("rank", "step", "node", "world_size", "pp_stage", "dp_rank", "tp_rank", "attempt", "microbatches"):
                st[c] = pd.to_numeric(st[c], errors="coerce").fillna(0).astype(int)
            for c in ("loss_nonfinite", "overflow", "skipped", "profiling"):
                st[c] = st[c].fillna(False).astype(bool)
            st["mem_bytes"] = pd.to_numeric(st["mem_bytes"], errors="coerce").fillna(0).astype(float)
            # compute_ms: the rank's own work; derive it if the writer left it out.
            missing = st["compute_ms"] <= 0
            if missing.any():
                parts = st["forward_ms"] + st["backward_ms"] + st["optimizer_ms"]
                derived = (st["step_ms"] - st["data_ms"] - st["comm_ms"] - st["pipeline_wait_ms"]).clip(lower=0)
                st.loc[missing, "compute_ms"] = np.where(parts[missing] > 0, parts[missing], derived[missing])
            # A restarted rank re-runs steps: keep the newest attempt of each (rank, step).
            st = st.sort_values(["rank", "step", "attempt", "t_end"]).drop_duplicates(["rank", "step"], keep="last")
            self.steps = st.reset_index(drop=True)
        co = self.collectives
        if not co.empty and "collectives" not in self.prepared:
            co = co.copy()
            for c in ("t_arrive", "t_done", "duration_ms"):
                co[c] = pd.to_numeric(co[c], errors="coerce").astype(float)
            for c in ("rank", "step", "seq", "attempt"):
                co[c] = pd.to_numeric(co[c], errors="coerce").fillna(0).astype(int)
            co["nbytes"] = pd.to_numeric(co["nbytes"], errors="coerce").fillna(0).astype(float)
            need = co["duration_ms"].isna() & co["t_done"].notna()
            co.loc[need, "duration_ms"] = (co.loc[need, "t_done"] - co.loc[need, "t_arrive"]) * 1000.0
            co["group_ranks"] = with_members(co, self.communicators)
            # A collective may be written at arrival and again when done: keep the completed one.
            # one communicator = group name + its member ranks (dp groups of different tp/pp coordinates share the name)
            co["gkey"] = group_keys(co["group"].tolist(), co["group_ranks"].tolist(), co["attempt"].tolist())
            co["_done"] = co["t_done"].notna()
            co = (co.sort_values(["rank", "attempt", "group", "seq", "_done"])
                  .drop_duplicates(["rank", "attempt", "group", "seq"], keep="last"))
            self.collectives = co.drop(columns="_done").reset_index(drop=True)
        for name in ("gpu", "host", "xid"):
            df = getattr(self, name)
            if not df.empty and name not in self.prepared:
                df = df.copy()
                df["t"] = pd.to_numeric(df["t"], errors="coerce").astype(float)
                setattr(self, name, df.sort_values("t").reset_index(drop=True))

    # -- signals ---------------------------------------------------------------
    def compute_signal(self) -> str:
        """The column that measures each rank's own work best: ``device_ms`` (the device's busy time, free of
        host scheduling noise) when every step record carries it, else the wall-clock ``compute_ms``."""
        st = self.steps
        if not st.empty and "device_ms" in st.columns and st["device_ms"].notna().all() and (st["device_ms"] > 0).all():
            return "device_ms"
        return "compute_ms"

    def device_time_label(self) -> str:
        """How reports name ``device_ms``: on a CPU run it is a simulated device's time, and says so."""
        cpu = self.device in ("cpu", "")
        return "device time (SIMULATED device: CPU time)" if cpu else "device time"

    @property
    def device(self) -> str:
        """The ranks' device kind: the manifest's; without one "cuda" when real (not simulated) GPU samples came
        from the run's nodes, else "" (not known)."""
        if self.manifest is not None:
            return self.manifest.device
        return "cuda" if self.real_gpu_names() else ""

    def real_gpu_names(self) -> list[str]:
        """The device names of the run's real (not simulated) GPU samples, most sampled first."""
        g = self.gpu
        if g.empty or "name" not in g.columns:
            return []
        # a pass over every GPU sample (a second on a big run), asked for by each user of ``peak``: kept while
        # ``gpu`` is the same frame
        memo = self.__dict__.get("_real_gpu_names")
        if memo is not None and memo[0] is g and memo[1] == len(g):
            return list(memo[2])
        real = ~g["simulated"].fillna(False).astype(bool).to_numpy()
        name = g["name"]
        if isinstance(name.dtype, pd.CategoricalDtype):  # the store's reader: counted by code, no string per row
            codes = name.cat.codes.to_numpy()[real]
            codes = codes[codes >= 0]
            counts = np.bincount(codes, minlength=len(name.cat.categories))
            cats = [str(c) for c in name.cat.categories]
            # value_counts' order: most first, equal counts in the order they first appear
            uniq, first_at = np.unique(codes, return_index=True)
            seen = [int(c) for c in uniq[np.argsort(first_at, kind="stable")]]
            out = [cats[c] for c in sorted(seen, key=lambda c: -counts[c]) if cats[c] != ""]
        else:
            names = g.loc[real, "name"].dropna().astype(str)
            names = names[names != ""]
            out = [str(n) for n in names.value_counts().index]
        self.__dict__["_real_gpu_names"] = (g, len(g), out)
        return list(out)

    @property
    def peak(self) -> Peak:
        """The per-device peak FLOP/s MFU is measured against, and where it came from: the manifest's; without
        one (or without a peak in it), the device table's for the GPU the samples name (``ranksight.peaks``)."""
        return find_peak(self.manifest, self.gpu, self.real_gpu_names())

    @property
    def layout(self) -> dict[str, Any]:
        return dict(self.manifest.layout) if self.manifest is not None else {}

    def inferred_layout(self) -> dict[str, Any]:
        """The layout the step records imply (for a run without a manifest): world size and the number of
        distinct dp / tp / pp coordinates."""
        st = self.steps
        if st.empty:
            return {}
        world = int(st["world_size"].max()) if (st["world_size"] > 0).any() else int(st["rank"].nunique())
        tp, pp = int(st["tp_rank"].nunique()), int(st["pp_stage"].nunique())
        dp = int(st["dp_rank"].nunique())
        if dp <= 1:  # a writer that left dp_rank at its default: the rest of the world is data-parallel
            dp = max(1, world // (tp * pp))
        return {"dp": dp, "tp": tp, "pp": pp, "world": world}

    @property
    def simulated_gpu(self) -> bool:
        return bool(not self.gpu.empty and self.gpu["simulated"].fillna(False).astype(bool).any()) or bool(
            not self.xid.empty and self.xid["simulated"].fillna(False).astype(bool).any()
        )

    def restrict(self, since: int | None = None, until: int | None = None) -> "RunData":
        """Keep steps since..until (inclusive) and the telemetry of that time span."""
        if since is None and until is None:
            return self

        def cut(df: pd.DataFrame, col: str = "step") -> pd.DataFrame:
            if df.empty or col not in df.columns:
                return df
            keep = pd.Series(True, index=df.index)
            v = pd.to_numeric(df[col], errors="coerce")
            if since is not None:
                keep &= v >= since
            if until is not None:
                keep &= v <= until
            return df[keep].reset_index(drop=True)

        steps = cut(self.steps)
        t0 = float(steps["t_start"].min()) if not steps.empty else None
        t1 = float(steps["t_end"].max()) if not steps.empty else None

        def cut_t(df: pd.DataFrame) -> pd.DataFrame:
            if df.empty or t0 is None:
                return df
            t = pd.to_numeric(df["t"], errors="coerce")
            keep = t.isna() | ((t >= t0 - 1.0) & (t <= t1 + 1.0))
            return df[keep].reset_index(drop=True)

        return RunData(
            run_id=self.run_id, manifest=self.manifest, steps=steps, collectives=cut(self.collectives),
            communicators=self.communicators,
            events=cut(self.events), gpu=cut_t(self.gpu), host=cut_t(self.host), nccl_events=self.nccl_events,
            trace_summaries=cut(self.trace_summaries, "step_start"), xid=cut_t(self.xid), nccl_tests=self.nccl_tests,
            actions=self.actions, source=self.source, truncated_lines=self.truncated_lines, bad_lines=self.bad_lines, damaged_parts=self.damaged_parts, now=self.now,
            clock_offset_s=self.clock_offset_s, since=since, until=until, prepared=self.prepared,
        )

    @classmethod
    def from_records(cls, run_id: str, records: Iterable[msgspec.Struct], manifest: Manifest | None = None,
                     **kw: Any) -> "RunData":
        """Build from record objects (the live head window, tests)."""
        buckets: dict[str, list] = {name: [] for name in TABLE_TYPES}
        by_type = {t: name for name, t in TABLE_TYPES.items()}
        for rec in records:
            name = by_type.get(type(rec))
            if name is not None:
                buckets[name].append(rec)
        frames = {name: frame_from_records(recs, TABLE_TYPES[name]) for name, recs in buckets.items()}
        return cls(run_id=run_id, manifest=manifest, **frames, **kw)


# --------------------------------------------------------------------------
# Reading a run from disk
# --------------------------------------------------------------------------


def known_runs(store: str | os.PathLike) -> list[str]:
    root = Path(store)
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.iterdir()):
        if p.is_dir() and not p.name.startswith(".") and (
            (p / "run.json").exists() or (p / "spool").is_dir() or (p / "steps").is_dir()
        ):
            out.append(p.name)
    return out


def _read_manifest(rd: RunDir) -> Manifest | None:
    path = rd.manifest
    if not path.exists():
        return None
    raw = path.read_bytes()
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise LoadError(f"run {rd.run_id}: {path} is not valid JSON ({e}); is the trainer still writing it?") from e
    version = obj.get("schema_version", SCHEMA_VERSION) if isinstance(obj, dict) else SCHEMA_VERSION
    if isinstance(version, int) and version > SCHEMA_VERSION:
        raise NewerSchemaError(
            f"run {rd.run_id} was written with schema version {version}; this ranksight reads up to "
            f"{SCHEMA_VERSION}. Upgrade ranksight to read it."
        )
    try:
        return msgspec.convert(obj, Manifest)
    except msgspec.ValidationError as e:
        raise LoadError(f"run {rd.run_id}: {path} does not match the manifest schema: {e}") from e


def _check_store_version(rd: RunDir, files: list[Path]) -> None:
    import pyarrow.parquet as pq

    for marker in (rd.root / "store.json", rd.store / "store.json"):
        if marker.exists():
            try:
                v = json.loads(marker.read_text()).get("schema_version")
            except (ValueError, AttributeError):
                v = None
            if isinstance(v, int) and v > SCHEMA_VERSION:
                raise NewerSchemaError(
                    f"store {marker} has schema version {v}; this ranksight reads up to {SCHEMA_VERSION}. Upgrade ranksight."
                )
    for f in files[:1] + files[-1:]:
        try:
            meta = pq.read_schema(f).metadata or {}
        except Exception:  # noqa: BLE001 - a half-written file is reported when read
            continue
        for key, val in meta.items():
            if b"schema_version" in key:
                try:
                    v = int(val)
                except ValueError:
                    continue
                if v > SCHEMA_VERSION:
                    raise NewerSchemaError(
                        f"store table {f.parent.name} of run {rd.run_id} has schema version {v}; this ranksight reads up "
                        f"to {SCHEMA_VERSION}. Upgrade ranksight."
                    )


class _Progress:
    """A rich progress bar over bytes, shown only for big runs on a terminal (or when forced)."""

    def __init__(self, total_bytes: int, show: bool | None):
        self.bar = None
        import sys

        tty = sys.stderr.isatty()
        if show is None:
            show = total_bytes >= PROGRESS_MIN_BYTES and tty
        if show:
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

            # on a terminal the bar goes away when done; asked for elsewhere (a log), its last state stays
            self.bar = Progress(TextColumn("loading {task.description}"), BarColumn(), DownloadColumn(),
                                TimeRemainingColumn(), console=Console(stderr=True), transient=tty)
            self.task = self.bar.add_task("run", total=total_bytes)
            self.bar.start()

    def advance(self, n: int, what: str = "") -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=n, description=what or "run")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _size(files: list[Path]) -> int:
    return sum(f.stat().st_size for f in files if f.exists())


def _read_table(files: list[Path], progress: _Progress, name: str) -> tuple[pd.DataFrame, int]:
    """A table's part files (``ranksight.tables.read_parts``), advancing the progress bar by each file's size."""
    return tables.read_parts(files, on_file=lambda f: progress.advance(f.stat().st_size if f.exists() else 0, name))


def _simgpu_xids(rd: RunDir, run_id: str) -> list[XidEvent]:
    """XID events recorded in the simulated GPUs' state files (runs without agents)."""
    from ranksight.simgpu import device_count, read_state

    out: list[XidEvent] = []
    if not rd.simgpu_dir.is_dir():
        return out
    for node_dir in sorted(rd.simgpu_dir.glob("node-*")):
        m = re.fullmatch(r"node-(\d+)", node_dir.name)
        if not m:
            continue
        node = int(m.group(1))
        for gpu in range(device_count(node_dir)):
            st = read_state(node_dir, gpu)
            if st is None:
                continue
            for code, ms in st.xids:
                out.append(XidEvent(node=node, host="", gpu=gpu, t=ms / 1000.0, code=code,
                                    source="simgpu-state", simulated=True))
    return out


def load_run(store: str | os.PathLike, run_id: str, since: int | None = None, until: int | None = None,
             progress: bool | None = None, source: str = "auto") -> RunData:
    """Read run ``run_id`` from ``store``. ``source``: auto (store tables if they have steps, else spool), store, spool."""
    try:
        rd = RunDir(store, run_id)
    except ValueError as e:
        raise UnknownRunError(str(e)) from e
    if not rd.root.is_dir():
        known = known_runs(store)
        listing = ", ".join(known[-20:]) if known else "none"
        raise UnknownRunError(f"unknown run id {run_id!r} in store {Path(store)}; known runs: {listing}")

    manifest = _read_manifest(rd)
    table_files = {name: tables.part_files(rd.table(name)) for name in TABLE_TYPES}
    all_files = [f for fs in table_files.values() for f in fs]
    _check_store_version(rd, all_files)
    spools = sorted(rd.spool_dir.glob("rank-*.jsonl")) if rd.spool_dir.is_dir() else []

    use_store = source == "store" or (source == "auto" and bool(table_files["steps"]))
    total = sum(f.stat().st_size for f in (all_files if use_store else spools + all_files))
    bar = _Progress(total, progress)
    frames: dict[str, pd.DataFrame] = {}
    prepared: set[str] = set()
    truncated = bad = damaged = 0

    def read_columnar(names: tuple[str, ...]) -> int:
        """The big tables through ``analyzers.columnar`` (normalized there); returns the damaged part files."""
        comms = frames.get("communicators", pd.DataFrame())
        got, nbad = read_tables({n: table_files[n] for n in names}, comms, group_key,
                                         on_files=lambda name, f: bar.advance(_size([f]), name))
        frames.update(got)
        prepared.update(got)
        return nbad

    try:
        if use_store:
            for name, files in table_files.items():
                if name in COLUMNAR_TABLES:
                    continue
                df, nbad = _read_table(files, bar, name)
                damaged += nbad
                if not df.empty:
                    frames[name] = df
            damaged += read_columnar(COLUMNAR_TABLES)
        if not use_store or "steps" not in frames or frames["steps"].empty:
            records: list[msgspec.Struct] = []
            for sp in spools:
                got = read_spool(sp)
                bar.advance(got.nbytes, sp.name)
                records.extend(got.records)
                truncated += got.truncated
                bad += got.bad
            for name, cls in (("steps", StepRecord), ("collectives", CollectiveRecord), ("events", EventRecord),
                              ("communicators", CommunicatorRecord)):
                recs = [r for r in records if isinstance(r, cls)]
                if recs:
                    frames[name] = frame_from_records(recs, cls)
            # Telemetry written by agents, if any ran, still comes from the store tables.
            for name in ("nccl_events", "trace_summaries", "xid"):
                if name not in frames and table_files[name]:
                    df, nbad = _read_table(table_files[name], bar, name)
                    damaged += nbad
                    if not df.empty:
                        frames[name] = df
            damaged += read_columnar(tuple(n for n in ("gpu", "host") if n not in frames))
            src = "spool"
        else:
            src = "store"
        if "xid" not in frames and ("gpu" not in frames or frames["gpu"].empty):
            xids = _simgpu_xids(rd, run_id)
            if xids:
                frames["xid"] = frame_from_records(xids, XidEvent)
        nccl_tests = _read_nccl_tests(rd)
        actions = _read_actions(rd, bar)
    finally:
        bar.close()

    if "steps" not in frames or frames["steps"].empty:
        where = []
        where.append(f"{len(spools)} spool file(s)" if spools else "no spool files")
        where.append(f"{len(table_files['steps'])} steps parquet file(s)" if table_files["steps"] else "no store tables")
        extra = f"; {truncated} truncated line(s)" if truncated else ""
        raise EmptyRunError(
            f"run {run_id} has no step records yet ({', '.join(where)}{extra}); "
            "was it started, or did it die before its first step?"
        )

    data = RunData(run_id=run_id, manifest=manifest, nccl_tests=nccl_tests, actions=actions, source=src,
                   truncated_lines=truncated, bad_lines=bad, damaged_parts=damaged, prepared=frozenset(prepared),
                   **{k: v for k, v in frames.items() if k in TABLE_TYPES})
    data = data.restrict(since, until)
    if data.steps.empty:
        raise EmptyRunError(f"run {run_id} has no steps in the range since={since} until={until}")
    return data


def _read_actions(rd: RunDir, progress: _Progress) -> pd.DataFrame:
    """The head's actions (checkpoint, profile, evict) with their current status: the table has one row per status
    change of an action, appended in order, so the last row of each id is its state now."""
    df, _bad = _read_table(tables.part_files(rd.table("actions")), progress, "actions")
    if df.empty or "id" not in df.columns:
        return pd.DataFrame()
    return df.drop_duplicates("id", keep="last").sort_values("t", kind="stable").reset_index(drop=True)


def _read_nccl_tests(rd: RunDir) -> pd.DataFrame:
    """The collective benchmarks' bandwidth baseline of this run (or of the store): the nccl_tests ``perf`` table
    (``ranksight.tables.PERF_SCHEMA``) as op, size_bytes, busbw (GB/s) and nranks."""
    files = (tables.part_files(rd.root / tables.NCCL_TESTS_DIR / "perf")
             or tables.part_files(rd.store / tables.NCCL_TESTS_DIR / "perf"))
    df, _bad = tables.read_parts(files, columns=["op", "size", "busbw", "nranks"])
    if df.empty:
        return pd.DataFrame()
    out = pd.DataFrame()
    out["op"] = df["op"].astype(str).str.replace("nccl:", "", regex=False).str.lower()
    out["size_bytes"] = pd.to_numeric(df["size"], errors="coerce")
    out["busbw"] = pd.to_numeric(df["busbw"], errors="coerce")
    out["nranks"] = pd.to_numeric(df["nranks"], errors="coerce")
    return out.dropna(subset=["size_bytes", "busbw"]).reset_index(drop=True)
