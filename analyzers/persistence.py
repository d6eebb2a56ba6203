"""Persistence: flagged steps become an episode only when enough of them come close together.

A check flags steps (a rank's transfer time far above its peers', a data wait over its share); one flagged step
is noise, ``persist`` flagged steps within any ``window`` consecutive steps are an episode. The episode's first
flagged step is its onset; the step at which it had collected ``persist`` flags is when it was confirmed.
"""

from __future__ import annotations

import pandas as pd


def persistent_runs(flags: pd.Series, persist: int, window: int) -> list[tuple[int, int, int]]:
    """Runs of flagged steps that persist.

    ``flags`` is a boolean Series indexed by step (sorted). A run is a maximal chain of
    flagged steps in which consecutive flagged steps are at most ``window - persist + 1``
    steps apart, so that "``persist`` flagged steps out of any ``window``" holds along it;
    a run counts only with at least ``persist`` flagged steps. Returns (first step,
    last step, flagged count) of each run; the first step is the onset.
    """
    flagged = [int(s) for s, f in flags.items() if bool(f)]
    if not flagged or persist <= 0:
        return []
    max_gap = max(1, window - persist + 1)
    runs: list[list[int]] = [[flagged[0]]]
    for s in flagged[1:]:
        if s - runs[-1][-1] <= max_gap:
            runs[-1].append(s)
        else:
            runs.append([s])
    return [(r[0], r[-1], len(r)) for r in runs if len(r) >= persist]


def rows_with_runs(flags: pd.DataFrame, persist: int) -> list:
    """The rows (labels, in order) of a rank x step frame of flags that can hold a persistent run: those with at
    least ``persist`` flagged steps (``persistent_runs`` of any other row is empty). The checks compute their
    flags for every rank at once and walk only these rows, not every rank every round."""
    if flags.empty:
        return []
    counts = flags.to_numpy(dtype=bool).sum(axis=1)
    return [r for r, c in zip(flags.index, counts) if c >= max(persist, 1)]


def confirmation_step(flags: pd.Series, start: int, persist: int) -> int:
    """The step at which a run starting at ``start`` had collected ``persist`` flagged steps."""
    n = 0
    for s, f in flags.items():
        if s < start or not bool(f):
            continue
        n += 1
        if n >= persist:
            return int(s)
    return int(start)
