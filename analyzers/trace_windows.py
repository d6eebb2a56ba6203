"""The profiler capture windows of a run's trace summaries, per rank: what ``GET /api/runs/<id>/traces`` serves, the TUI's
traces screen shows, the diagnose report prints, and the ``kernel_time`` check compares.

A capture window is what one profile covered: the same ``(step_start, step_end)`` on every rank of a periodic
capture or of one on-demand request (``profile`` action). Agents ship each rank's summary when its trace file is
finished, so a window's ranks arrive one by one; the newest window may list fewer ranks than the job has.

Per-step figures divide the window's totals by its step count (``step_end - step_start + 1``, the ProfilerStep
numbers are inclusive); a trace without ProfilerStep annotations (``step_start == -1``) has no step count, so its
per-step figures are null and only the window totals are given. ``exposed_comm_ms`` is the communication not
hidden under compute (``comm_ms - overlap_ms``). On a CPU trace ``compute_ms`` is host op time, not device kernel
time: ``device`` says which, and the consumers must say it too.
"""

from __future__ import annotations

import json
import math
import os
import re
from statistics import median

DEFAULT_WINDOWS = 4  # capture windows served when the request does not say
MAX_WINDOWS = 32
TOP_OPS = 3

_RANK_PREFIX = re.compile(r"^rank-?\d+[._-]")


def _f(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def window_key(s) -> tuple:
    """Which capture a summary belongs to: its step range, and (for traces without ProfilerStep annotations, where
    every capture has the range -1..-1) the file name without its rank prefix. On-demand and periodic captures of
    the same steps are different windows."""
    base = os.path.basename(str(s.trace_file or ""))
    kind = "ondemand" if "ondemand" in base else "periodic"
    if s.step_start < 0:
        return (s.step_start, s.step_end, kind, _RANK_PREFIX.sub("", base))
    return (s.step_start, s.step_end, kind, "")


def trace_row(s, node: int | None) -> dict:
    """One rank's summary of one window, with the per-step figures."""
    steps = int(s.step_end - s.step_start + 1) if s.step_start >= 0 and s.step_end >= s.step_start else None
    wall, comp, comm = _f(s.wall_ms), _f(s.compute_ms), _f(s.comm_ms)
    overlap, copy, idle = _f(s.overlap_ms), _f(s.copy_ms), _f(s.idle_ms)
    exposed = max(0.0, comm - (overlap or 0.0)) if comm is not None else None

    def per_step(v):
        return v / steps if v is not None and steps else None

    top = []
    ops = s.top_ops
    if isinstance(ops, str):  # a stored table's JSON text column
        try:
            ops = json.loads(ops)
        except ValueError:
            ops = []
    for op in list(ops if isinstance(ops, (list, tuple)) else [])[:TOP_OPS]:
        if isinstance(op, dict):
            top.append({"name": str(op.get("name", "")), "total_ms": _f(op.get("total_ms")),
                        "count": op.get("count") if isinstance(op.get("count"), int) else None})
    base = os.path.basename(str(s.trace_file or ""))
    return {
        "rank": int(s.rank), "node": node, "step_start": int(s.step_start), "step_end": int(s.step_end), "steps": steps,
        "kind": "ondemand" if "ondemand" in base else "periodic", "device": s.device or "unknown",
        "wall_ms": wall, "kernel_ms": comp, "nccl_ms": comm, "overlap_ms": overlap, "exposed_comm_ms": exposed,
        "copy_ms": copy, "idle_ms": idle,
        "kernel_ms_per_step": per_step(comp), "nccl_ms_per_step": per_step(comm),
        "exposed_comm_ms_per_step": per_step(exposed), "copy_ms_per_step": per_step(copy),
        "idle_ms_per_step": per_step(idle),
        "idle_share": idle / wall if idle is not None and wall else None,
        "top_ops": top, "truncated": bool(s.truncated), "notes": [str(n) for n in (list(s.notes) if s.notes is not None else [])],
        "trace_file": base,  # the name only: the agent's paths stay on the agent
    }


def trace_windows(summaries, node_of, rank: int | None = None, windows: int = DEFAULT_WINDOWS) -> list[dict]:
    """The last ``windows`` capture windows of ``summaries`` (``TraceSummary`` records or rows with the same attributes,
    e.g. a DataFrame's ``itertuples()``; oldest first, as the live window keeps them), one row
    per rank per window, ordered window by window (the oldest first) and by rank within a window. Windows are
    ordered by their steps (``step_end``, then ``step_start``), then by when their newest summary arrived: a rank
    whose summary of an older capture ships late does not make that capture the newest, and captures without
    ProfilerStep marks (steps -1) go by arrival. A rank summarized twice for one window (a re-sent batch) counts
    once: the later one. ``node_of(rank)`` gives the rank's node or None."""
    last_seen: dict[tuple, int] = {}
    per_window: dict[tuple, dict[int, object]] = {}
    for i, s in enumerate(summaries):
        if rank is not None and s.rank != rank:
            continue
        k = window_key(s)
        last_seen[k] = i
        per_window.setdefault(k, {})[s.rank] = s
    keep = sorted(last_seen, key=lambda k: (k[1], k[0], last_seen[k]))[-max(1, windows):]
    out = []
    for k in keep:
        for r in sorted(per_window[k]):
            out.append(trace_row(per_window[k][r], node_of(r)))
    return out


def grouped(rows: list[dict]) -> list[dict]:
    """``trace_windows``' rows as one dict per window (oldest first): its steps, kind, device(s), ``cpu`` (every rank's
    trace is a CPU trace: "kernel" time is host op time) and its ``ranks`` (the rows, each with ``kernel_vs_median``:
    its kernel time against the median of the window's untruncated ranks)."""
    out: list[dict] = []
    for r in rows:
        key = (r["step_start"], r["step_end"], r["kind"],
               _RANK_PREFIX.sub("", r["trace_file"]) if r["step_start"] < 0 else "")
        if not out or out[-1]["key"] != key:
            out.append(dict(key=key, step_start=r["step_start"], step_end=r["step_end"], steps=r["steps"],
                            kind=r["kind"], ranks=[]))
        out[-1]["ranks"].append(r)
    for w in out:
        w.pop("key")
        devices = sorted({r["device"] for r in w["ranks"]})
        w["device"], w["cpu"] = "/".join(devices), devices == ["cpu"]
        kern = [r["kernel_ms"] for r in w["ranks"] if not r["truncated"] and r["kernel_ms"] is not None]
        med = median(kern) if kern else 0.0
        for r in w["ranks"]:
            r["kernel_vs_median"] = round(r["kernel_ms"] / med, 3) if med > 0 and r["kernel_ms"] is not None else None
    return out
