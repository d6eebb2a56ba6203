"""A drill-down answer (``ranksight.ops_query.OpsAnswer``: a rank's raw collective records over a step range, from its
node's spool) as rows to show: what ``ranksight ops`` prints and the TUI's ops screen (``tui/ops_screen.py``) lists.

Times are milliseconds after the first listed op's arrival (``t0``). ``vs_mean`` is an op's duration less the mean
duration of its fold group (the rank's ops of one attempt's step, one kind, one communicator): what the folded
record the head holds says for all of them (``ranksight.collective_fold``), so an op that stands out of its fold
shows here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class OpRow:
    step: int
    seq: int
    op: str
    group: str
    nbytes: int
    arrive_ms: float
    done_ms: float | None
    dur_ms: float | None
    vs_mean_ms: float | None


@dataclass
class OpsTable:
    title: str  # run, rank (node), steps, and the filters asked for
    t0: float | None  # the first listed op's arrival (Unix seconds); None without ops
    rows: list[OpRow] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)  # more than one: a restarted job ran these steps again
    notes: list[str] = field(default_factory=list)  # what was cut or lost
    comms: list[tuple[str, str]] = field(default_factory=list)  # (group, communicator id) of the listed ops


def fmt_bytes(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _fold_key(r) -> tuple:
    """What an agent folds into one record (``ranksight.collective_fold``): a rank's ops of one attempt's step, of
    one kind, on one communicator."""
    return r.attempt, r.step, r.op, r.comm_id or r.group


def ops_model(answer, cut_hint: str = "ask for fewer steps, a --comm or an --op") -> OpsTable:
    """The rows of an ``OpsAnswer`` in the file's order, with each op's lead over its fold's mean."""
    ops = answer.ops
    steps = (f"step {answer.step_from}" if answer.step_from == answer.step_to
             else f"steps {answer.step_from}-{answer.step_to}")
    title = f"run {answer.run_id}  rank {answer.rank} (node {answer.node})  {steps}"
    if answer.comm:
        title += f"  comm {answer.comm}"
    if answer.op:
        title += f"  op {answer.op}"
    t0 = min(r.t_arrive for r in ops) if ops else None
    groups: dict[tuple, list[float]] = {}
    for r in ops:
        if r.duration_ms is not None:
            groups.setdefault(_fold_key(r), []).append(r.duration_ms)
    means = {k: sum(v) / len(v) for k, v in groups.items()}
    rows = []
    for r in ops:
        mean = means.get(_fold_key(r))
        rows.append(OpRow(step=r.step, seq=r.seq, op=r.op, group=r.group, nbytes=r.nbytes,
                          arrive_ms=(r.t_arrive - t0) * 1e3,
                          done_ms=(r.t_done - t0) * 1e3 if r.t_done is not None else None,
                          dur_ms=r.duration_ms,
                          vs_mean_ms=r.duration_ms - mean if mean is not None and r.duration_ms is not None else None))
    notes = []
    if answer.truncated:
        notes.append(f"cut at {answer.limit} records: {cut_hint}")
    if answer.damaged_lines:
        notes.append(f"{answer.damaged_lines} damaged spool line(s) in or next to this range (records lost there):")
        notes += [f"  {g.lines} line(s), {g.nbytes} bytes at offset {g.offset}, after step {g.after_step}"
                  for g in answer.gaps[:5]]
    return OpsTable(title=title, t0=t0, rows=rows, attempts=sorted({r.attempt for r in ops}), notes=notes,
                    comms=sorted({(r.group, r.comm_id) for r in ops if r.comm_id}))
