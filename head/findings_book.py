"""The head's findings of one run across analysis rounds: episodes that open, grow, escalate and close.

Every round the analyzers re-read the live window and report what they see *now*. The same slow rank
comes back each round with a later ``step_end`` (and, as evidence accumulates, a refined ``step_start``
or a higher severity). The book matches each reported finding to the episode it continues (same
analyzer, kind, ranks and nodes, overlapping or adjacent steps), keeps one record per episode with a
stable id, and tells the head what changed:

- ``new``: an episode seen for the first time (logged, stored, sent to alert listeners);
- ``changed``: an episode whose step span, severity or status moved (stored again with the same id, so
  the latest row per id in the ``findings`` table is its current state);
- an episode is **closed** when the run has moved ``close_after`` steps past its ``step_end`` without
  a round reporting it again; one that comes back within that gap re-opens as the same episode, and so does one
  that comes back within ``reopen_rounds`` rounds wherever its steps start (a finding that flickers, absent a round
  or two while the run moved many steps on, is one episode, so one alert).

A restarted head carries on from the run's stored episodes (``restore``), so a condition that persists across the
restart is not announced again.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import msgspec

from ranksight import schema


@dataclass
class RoundResult:
    new: list[schema.Finding] = field(default_factory=list)
    changed: list[schema.Finding] = field(default_factory=list)
    escalated: list[schema.Finding] = field(default_factory=list)  # severity went up: worth another alert


def _identity(f: schema.Finding) -> tuple:
    return (f.analyzer, f.kind, tuple(f.ranks), tuple(f.nodes))


class FindingsBook:
    """One run's finding episodes; ``observe`` takes each analysis round's findings."""

    def __init__(self, run_id: str, close_after: int = 5, reopen_rounds: int = 3):
        self.run_id = run_id
        self.close_after = close_after
        self.reopen_rounds = reopen_rounds
        self.episodes: list[schema.Finding] = []  # current state of every episode, first-seen order
        self.rounds = 0  # rounds observed
        self._last_round: list[int] = []  # per episode: the round that last reported it

    def restore(self, stored: list[schema.Finding]) -> None:
        """Carry on from the run's stored episodes (a restarted head): each keeps its id, span and severity, and
        counts as reported just before this head's first round."""
        for f in stored:
            if f.id and all(e.id != f.id for e in self.episodes):
                self.episodes.append(f)
                self._last_round.append(self.rounds)

    def _match(self, f: schema.Finding, taken: set[int] | None = None) -> int | None:
        """Index of the episode ``f`` continues: same identity, and its steps overlap the episode's or start
        within ``close_after`` steps of its end (a finding without steps continues any episode of its identity).
        With ``taken`` (episodes other findings of this round continue): else the latest episode of its identity
        that a round reported within ``reopen_rounds`` rounds, wherever its steps are."""
        ident = _identity(f)
        best = None
        for i, e in enumerate(self.episodes):
            if _identity(e) != ident:
                continue
            if taken is not None:
                if i not in taken and self._last_round[i] >= self.rounds - self.reopen_rounds:
                    best = i
                continue
            if f.step_start is None or e.step_end is None or e.step_start is None:
                best = i
                continue
            f_end = f.step_end if f.step_end is not None else f.step_start
            if f.step_start <= e.step_end + self.close_after and f_end >= e.step_start - self.close_after:
                best = i
        return best

    def observe(self, found: list[schema.Finding], last_step: int | None, now: float | None = None) -> RoundResult:
        """One analysis round's findings, and the latest step any rank of the run reported."""
        now = time.time() if now is None else now
        self.rounds += 1
        out = RoundResult()
        seen: set[int] = set()
        by_steps = [self._match(f) for f in found]
        taken = {i for i in by_steps if i is not None}
        for f, i in zip(found, by_steps):
            if i is None:
                i = self._match(f, taken)  # back after a round or two away: the same episode
                if i is not None:
                    taken.add(i)
            if i is None:
                ep = msgspec.structs.replace(f, run_id=f.run_id or self.run_id, t=f.t or now, id=uuid.uuid4().hex[:12],
                                             status=self._status(f.step_end, last_step), updated=now)
                self.episodes.append(ep)
                self._last_round.append(self.rounds)
                seen.add(len(self.episodes) - 1)
                out.new.append(ep)
                continue
            seen.add(i)
            self._last_round[i] = self.rounds
            old = self.episodes[i]
            start = old.step_start if f.step_start is None or old.step_start is None else min(old.step_start, f.step_start)
            end = old.step_end if f.step_end is None else (f.step_end if old.step_end is None else max(old.step_end, f.step_end))
            sev = f.severity if schema.SEVERITY_ORDER[f.severity] >= schema.SEVERITY_ORDER[old.severity] else old.severity
            status = self._status(end, last_step)
            moved = (start, end, sev, status) != (old.step_start, old.step_end, old.severity, old.status)
            # the latest analysis's evidence and summary; ``updated`` only moves when the episode did
            self.episodes[i] = ep = msgspec.structs.replace(
                f, run_id=old.run_id, t=old.t, id=old.id, step_start=start, step_end=end, severity=sev, status=status,
                updated=now if moved else old.updated)
            if moved:
                out.changed.append(ep)
                if schema.SEVERITY_ORDER[sev] > schema.SEVERITY_ORDER[old.severity]:
                    out.escalated.append(ep)
        # episodes no round reports any more: closed once the run has moved on past them
        for i, e in enumerate(self.episodes):
            if i in seen or e.status == "closed":
                continue
            status = self._status(e.step_end, last_step)
            if status != e.status:
                self.episodes[i] = msgspec.structs.replace(e, status=status, updated=now)
                out.changed.append(self.episodes[i])
        return out

    def _status(self, step_end: int | None, last_step: int | None) -> str:
        if step_end is None or last_step is None:
            return "open"
        return "open" if step_end >= last_step - self.close_after else "closed"

    def current(self) -> list[schema.Finding]:
        return list(self.episodes)


def latest_per_id(rows: list[dict]) -> list[dict]:
    """The current state of each live finding from the append-only ``findings`` table (rows of one id: its
    successive states); rows without an id (older stores) are kept as they are."""
    by_id: dict[str, dict] = {}
    out: list[dict] = []
    for r in rows:
        fid = r.get("id") or ""
        if not fid:
            out.append(r)
            continue
        prev = by_id.get(fid)
        if prev is None or (r.get("updated") or 0.0) >= (prev.get("updated") or 0.0):
            by_id[fid] = r
    return out + sorted(by_id.values(), key=lambda r: r.get("t") or 0.0)
