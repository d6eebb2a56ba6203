"""Two runs (two trace sets) or two step ranges of one: what got slower, by phase and by kernel.

Figures are per step and per rank (the mean over ranks of each rank's per-step mean) so that runs with different
numbers of steps or ranks compare; when a side has no ProfilerStep with GPU events, its whole window counts as
one step. Phases are the temporal breakdown's (compute, comm = exposed communication, memcpy, memset, idle, and
the window); kernels are compared by name on their total time per step. Rows are sorted by the change in ms,
largest slowdown first.
"""

from __future__ import annotations

from typing import Any

PHASES = ("window", "compute", "comm", "memcpy", "memset", "idle")


def _per_step(ranks: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, float]]:
    phases = {p: 0.0 for p in PHASES}
    kernels: dict[str, float] = {}
    n = max(1, len(ranks))
    for r in ranks:
        steps = max(1, len(r["steps"]))
        t = r["temporal"]
        for p in PHASES:
            phases[p] += t[f"{p}_ms"] / steps / n
        for k in r.get("all_kernels", r["kernels"]):
            kernels[k["name"]] = kernels.get(k["name"], 0.0) + k["total_ms"] / steps / n
    return phases, kernels


def _row(name: str, a: float, b: float) -> dict[str, Any]:
    return {"name": name, "base_ms": round(a, 4), "new_ms": round(b, 4), "delta_ms": round(b - a, 4),
            "delta_pct": round(100.0 * (b - a) / a, 2) if a > 0 else None}


def diff(base: list[dict[str, Any]], new: list[dict[str, Any]], top: int = 15) -> dict[str, Any]:
    """Per-step, per-rank change from ``base`` to ``new`` (lists of ``breakdown.analyse_rank`` results)."""
    pa, ka = _per_step(base)
    pb, kb = _per_step(new)
    phases = [_row(p, pa[p], pb[p]) for p in PHASES]
    kern = [_row(k, ka.get(k, 0.0), kb.get(k, 0.0)) for k in set(ka) | set(kb)]
    kern.sort(key=lambda r: -abs(r["delta_ms"]))
    slower = sorted((r for r in phases[1:] if r["delta_ms"] > 0), key=lambda r: -r["delta_ms"])
    w = phases[0]
    if w["delta_ms"] > 0 and slower:
        verdict = (f"step time {w['base_ms']:.3f} -> {w['new_ms']:.3f} ms ({w['delta_pct']:+.1f}%): mostly "
                   f"{slower[0]['name']} (+{slower[0]['delta_ms']:.3f} ms)")
    else:
        verdict = f"step time {w['base_ms']:.3f} -> {w['new_ms']:.3f} ms" + (
            f" ({w['delta_pct']:+.1f}%)" if w["delta_pct"] is not None else "")
    return {"verdict": verdict, "phases": phases, "kernels": kern[:top],
            "base_ranks": [r["rank"] for r in base], "new_ranks": [r["rank"] for r in new]}


__all__ = ["diff", "PHASES"]
