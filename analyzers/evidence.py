"""How numbers and ranks are written into a finding's evidence and summary (and shown by the report)."""

from __future__ import annotations

import math
from typing import Any, Iterable


def fnum(x: Any, nd: int = 2) -> Any:
    """Round a number for evidence (JSON-safe: NaN/inf become None)."""
    if x is None:
        return None
    try:
        xf = float(x)
    except (TypeError, ValueError):
        return x
    if not math.isfinite(xf):
        return None
    if float(xf).is_integer() and abs(xf) < 2**53 and nd == 0:
        return int(xf)
    return round(xf, nd)


def fmt_ranks(ranks: Iterable[int]) -> str:
    """Ranks (or nodes, GPUs) as a sorted comma-separated list without repeats; "-" for none."""
    ranks = sorted(set(int(r) for r in ranks))
    if not ranks:
        return "-"
    return ",".join(str(r) for r in ranks)
