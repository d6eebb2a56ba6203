"""A stored run's recent history back into a fresh live window: what a restarted head shows of a run it had before.

The live window (``head.live.RunLive``) is memory only. When the head meets a run its store already holds (the head
restarted, or a run is opened from the store), ``restore_window`` reads the newest part files of each table, newest
first, and stops as soon as it has what the window keeps: each rank's last ``window`` steps (and their collectives),
the last two minutes of GPU samples, the newest host samples, events, XIDs and trace summaries, and every
communicator.
Those rows enter the window through its usual ``add_arrow``, oldest first, so the views (ranks, steps, GPUs, the
TUI's panels) answer as they did before the restart.

Liveness is not restored: each rank's "last seen" is its last stored step's end (the rank's own clock; the head's
receive time is not stored), and the window is marked ``restored``. The live analysis leaves a restored window
alone (``analysis_due``) until new records arrive or an agent of the run has been heartbeating for a while, so a
dead run's history never raises a live hang alert, while a run that really hung across the restart is still looked
at once its agents are back.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from head.live import RunLive
from head.store.arrow import conform
from head.live_frames import numpy_column
from ranksight import store_layout
from ranksight.tables import SPECS, TABLE_TYPES

log = logging.getLogger("ranksight.history")

# GPU and host samples: this many seconds before the newest stored sample (the live window keeps about a minute of
# each GPU at the agents' 1 s sampling)
SAMPLE_HORIZON_S = 120.0
# events, XIDs and trace summaries: the newest this many rows (what the window's deques hold)
RECENT_ROWS = {"events": 2000, "xid": 2000, "trace_summaries": 8192, "host": 16 * 120}
# A restored window is analyzed once new records arrived, or once an agent has heartbeated and this long has passed
# since the restore: the agents' backlog (their outboxes resend what the dead head missed) is in by then, so silence
# is the run's, not the head's.
HISTORY_GRACE_S = 60.0


@dataclass
class Restored:
    """What ``restore_window`` read: rows per table, unreadable files skipped, and the wall time it took."""

    rows: dict[str, int] = field(default_factory=dict)
    bad_files: int = 0
    seconds: float = 0.0


def has_history(store_root, run_id: str) -> bool:
    """Whether the store holds step records of ``run_id`` (local tables; a run compacted to object storage keeps
    its local table directory)."""
    d = store_layout.join(store_root, run_id, "steps")
    try:
        return bool(store_layout.table_files(d))
    except (OSError, ValueError):
        return False


# (path, size, mtime) of a steps part file -> (rows, largest step or None): a part file never changes once written
_FOOTERS: dict[tuple[str, int, float], tuple[int, int | None]] = {}
_FOOTERS_MAX = 100_000


def _footer_progress(f) -> tuple[int, int | None]:
    """Rows and largest ``step`` of one part file, from its footer (row-group statistics; no data page read)."""
    key = (f.path, f.size, f.mtime)
    hit = _FOOTERS.get(key)
    if hit is not None:
        return hit
    with (f.fs.open_input_file(f.path) if f.fs is not None else open(f.path, "rb")) as fh:
        md = pq.ParquetFile(fh).metadata
    top = None
    names = [md.schema.column(i).name for i in range(md.num_columns)]
    if "step" in names:
        col = names.index("step")
        for g in range(md.num_row_groups):
            st = md.row_group(g).column(col).statistics
            if st is None or not st.has_min_max:
                top = None  # one row group without statistics: the file's largest step is unknown
                break
            top = int(st.max) if top is None else max(top, int(st.max))
    if len(_FOOTERS) >= _FOOTERS_MAX:  # files replaced by compaction leave stale keys: start over, never grow forever
        _FOOTERS.clear()
    _FOOTERS[key] = (md.num_rows, top)
    return md.num_rows, top


def stored_progress(store_root, run_id: str) -> tuple[int | None, int | None]:
    """(largest stored step, stored step rows) of a run the head has no live window for, from the steps part files'
    footers: what the runs list shows of a stored run before anything opens it. (None, None) when the store cannot
    say (no steps, or a file unreadable or without statistics: never a guess)."""
    try:
        files = store_layout.table_files(store_layout.join(store_root, run_id, "steps"))
    except (OSError, ValueError):
        return None, None
    if not files:
        return None, None
    rows, top = 0, None
    for f in files:
        try:
            n, t = _footer_progress(f)
        except FileNotFoundError:
            return None, None  # a compaction replaced it since the listing: the next call lists again
        except Exception as e:  # noqa: BLE001 - a damaged file: the run's progress is unknown, not a crash
            log.warning("history %s: steps file %s: footer not read: %s", run_id, f.path, e)
            return None, None
        if t is None and n:
            return None, None
        rows += n
        top = t if top is None else (top if t is None else max(top, t))
    return top, rows


def _newest_first(store_root, run_id: str, table: str):
    try:
        files = store_layout.table_files(store_layout.join(store_root, run_id, table))
    except (OSError, ValueError) as e:
        log.warning("history %s: cannot list %s: %s", run_id, table, e)
        return []
    return files[::-1]


def _read(f, schema: pa.Schema) -> pa.Table:
    """One part file as a table of ``schema`` (columns an older store lacks are null; extra ones dropped)."""
    return conform(pq.read_table(f.path, filesystem=f.fs) if f.fs is not None else pq.ParquetFile(f.path).read(),
                   schema)


class _Reader:
    """Reads one table's part files newest first until ``enough`` says stop; returns the rows oldest first."""

    def __init__(self, store_root, run_id: str, out: Restored):
        self.store_root, self.run_id, self.out = store_root, run_id, out

    def read(self, table: str, enough) -> pa.Table | None:
        schema = SPECS[table].schema
        got: list[pa.Table] = []
        for f in _newest_first(self.store_root, self.run_id, table):
            try:
                t = _read(f, schema)
            except FileNotFoundError:
                continue  # a compaction replaced it since the listing: its merged file holds the rows
            except Exception as e:  # noqa: BLE001 - a damaged or foreign file is skipped, counted and logged
                self.out.bad_files += 1
                log.warning("history %s: %s file %s not read: %s", self.run_id, table, f.path, e)
                continue
            if t.num_rows:
                got.append(t)
                if enough(got):
                    break
        if not got:
            return None
        return pa.concat_tables(got[::-1])


def _step_floor(window: int):
    """Stop once the rows read reach ``window`` steps below the newest step."""

    def enough(got: list[pa.Table]) -> bool:
        top = max(int(np.nanmax(numpy_column(t, "step"))) for t in got)
        return int(np.nanmin(numpy_column(got[-1], "step"))) <= top - window

    return enough


def _time_floor(col: str, horizon: float):
    def enough(got: list[pa.Table]) -> bool:
        top = max(float(np.nanmax(numpy_column(t, col))) for t in got)
        return float(np.nanmin(numpy_column(got[-1], col))) <= top - horizon

    return enough


def _row_count(n: int):
    return lambda got: sum(t.num_rows for t in got) >= n


def _last_per_rank(t: pa.Table, window: int) -> pa.Table:
    """Each rank's last ``window`` rows (file order: arrival order)."""
    rank = numpy_column(t, "rank").astype(np.int64)
    order = np.argsort(rank, kind="stable")
    rs = rank[order]
    start = np.r_[0, np.nonzero(rs[1:] != rs[:-1])[0] + 1]
    run_end = np.r_[start[1:], len(rs)]
    pos = np.arange(len(rs)) - np.repeat(start, run_end - start)
    from_end = np.repeat(run_end - start, run_end - start) - pos
    keep = np.zeros(len(rank), np.bool_)
    keep[order[from_end <= window]] = True
    return t if keep.all() else t.filter(pa.array(keep))


def _records(table: str, t: pa.Table, run_id: str) -> list:
    """Stored rows of a table the window keeps as records (events, XIDs, samples, communicators): JSON columns
    parsed, nulls left to the record's defaults; a row that does not read back is skipped and logged."""
    json_cols = {name for name, _, as_json in SPECS[table].fields if as_json}
    typ = TABLE_TYPES[table]
    out, bad = [], 0
    for row in t.to_pylist():
        row = {k: (json.loads(v) if k in json_cols and isinstance(v, str) else v) for k, v in row.items()
               if v is not None}
        try:
            out.append(msgspec.convert(row, typ, strict=False))
        except (msgspec.ValidationError, ValueError, TypeError):
            bad += 1
    if bad:
        log.warning("history %s: %d stored %s row(s) do not read back, skipped", run_id, bad, table)
    return out


def restore_window(live: RunLive, store_root, run_id: str) -> Restored:
    """Fill ``live`` (a window that has seen nothing yet) with the run's stored recent history; see the module's
    docstring. Never raises for a damaged store: what cannot be read is skipped, counted and logged."""
    out = Restored()
    t0 = time.monotonic()
    reader = _Reader(store_root, run_id, out)
    window = live.window
    seen = 0.0
    steps = reader.read("steps", _step_floor(window))
    if steps is not None:
        steps = _last_per_rank(steps, window)
        seen = float(np.nanmax(numpy_column(steps, "t_end")))
        live.add_arrow("steps", steps, now=seen)
        out.rows["steps"] = steps.num_rows
        low = int(np.nanmin(numpy_column(steps, "step")))
        colls = reader.read("collectives", _step_floor(window))
        if colls is not None:
            colls = colls.filter(pa.array(numpy_column(colls, "step") >= low))
            live.add_arrow("collectives", colls, now=seen)
            out.rows["collectives"] = colls.num_rows
    gpu = reader.read("gpu", _time_floor("t", SAMPLE_HORIZON_S))
    if gpu is not None:
        t = numpy_column(gpu, "t")
        gpu = gpu.filter(pa.array(t >= np.nanmax(t) - SAMPLE_HORIZON_S))
        live.add_arrow("gpu", gpu, now=seen)  # kept as Arrow by the window
        out.rows["gpu"] = gpu.num_rows
    recent = [("communicators", lambda got: False)]  # every group: collective records name theirs by id
    recent += [(table, _row_count(n)) for table, n in RECENT_ROWS.items()]
    for table, enough in recent:
        t = reader.read(table, enough)
        if t is not None:
            t = t.slice(max(0, t.num_rows - RECENT_ROWS.get(table, t.num_rows)))
            rows = _records(table, t, run_id)
            live.add(table, rows, now=seen)
            out.rows[table] = len(rows)
    if steps is not None:  # each rank last seen at its last stored step's end, not now
        live.mark_restored(numpy_column(steps, "rank"), numpy_column(steps, "t_end"))
    else:
        live.mark_restored(np.zeros(0, np.int64), np.zeros(0))
    out.seconds = time.monotonic() - t0
    log.info("history %s: the live window restored from the store in %.1f s: %s%s", run_id, out.seconds,
             ", ".join(f"{n} {k}" for k, n in out.rows.items()) or "nothing",
             f" ({out.bad_files} unreadable file(s) skipped)" if out.bad_files else "")
    return out


def analysis_due(live: RunLive, now: float | None = None) -> bool:
    """Whether the live analysis may look at ``live``: always, unless it holds only restored history (nothing new
    since the restore) and no agent of the run has been heartbeating for ``HISTORY_GRACE_S`` since."""
    if live.restored_mark is None:
        return True
    if any(a is not b for a, b in zip(live.data_mark(), live.restored_mark)):
        live.restored_mark = None  # new records: a live run again
        return True
    now = time.monotonic() if now is None else now
    return bool(live.agents) and now - live.restored_at >= HISTORY_GRACE_S
