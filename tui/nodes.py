"""Ranks grouped by node, for a job too large to show rank by rank. Pure functions, no Textual.

Above ``AGGREGATE_ABOVE`` ranks (on more than one node) the rank table and the heat map show one row per node; the
user zooms into a node (its ranks, rank by rank) and back out. A node row stands for its worst rank: the heat map
colours a node by its slowest rank's compute at each step (a straggler must not be averaged away by its seven
healthy neighbours), and the table names that rank and shows its figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from tui.model import RankRow, RunView

AGGREGATE_ABOVE = 64  # ranks; more than this (on more than one node) and the main view shows nodes
# Worst first: the state a node row shows is the worst of its ranks' (with how many ranks are in it).
STATE_ORDER = ("failed", "evicted", "stale", "slow", "waiting", "ok", "done", "ended")


@dataclass(frozen=True)
class NodeRow:
    node: int | None
    ranks: tuple[int, ...]
    worst: RankRow  # the rank the row stands for: a culprit first, then the slowest compute
    step_lo: int | None  # the node's ranks' last steps span step_lo..step_hi
    step_hi: int | None
    state: str  # the worst of its ranks' states
    n_state: int  # how many of its ranks are in ``state``
    culprit: bool

    @property
    def state_label(self) -> str:
        return self.state if self.n_state == len(self.ranks) else f"{self.state} {self.n_state}/{len(self.ranks)}"


def aggregated(v: RunView | None) -> bool:
    """Show nodes rather than ranks: more than ``AGGREGATE_ABOVE`` ranks on more than one node."""
    return v is not None and len(v.rows) > AGGREGATE_ABOVE and len({r.node for r in v.rows}) > 1


def _worst_key(r: RankRow) -> tuple:
    return (r.culprit, r.compute_ms if r.compute_ms is not None else float("-inf"), -r.rank)


def node_rows(rows: list[RankRow]) -> list[NodeRow]:
    """One row per node, problems first (culprit nodes, then by their worst state), then by node: on 512 nodes the
    ones that matter are the ones in view."""
    by_node: dict[int | None, list[RankRow]] = {}
    for r in rows:
        by_node.setdefault(r.node, []).append(r)
    out = []
    for node in sorted(by_node, key=lambda n: (n is None, n or 0)):
        rs = by_node[node]
        states = [r.state for r in rs]
        state = min(states, key=lambda s: STATE_ORDER.index(s) if s in STATE_ORDER else len(STATE_ORDER))
        steps = [r.last_step for r in rs if r.last_step is not None]
        out.append(NodeRow(node=node, ranks=tuple(sorted(r.rank for r in rs)), worst=max(rs, key=_worst_key),
                           step_lo=min(steps) if steps else None, step_hi=max(steps) if steps else None,
                           state=state, n_state=states.count(state), culprit=any(r.culprit for r in rs)))
    order = {s: i for i, s in enumerate(STATE_ORDER)}
    # "ok" and "done" are not problems: those nodes keep their node order
    return sorted(out, key=lambda n: (not n.culprit, min(order.get(n.state, 99), order["ok"]),
                                      n.node is None, n.node or 0))


def node_heat(v: RunView) -> dict[int | None, list[float | None]]:
    """Per node, per step in view: the slowest of its ranks' compute time (None where none of them reported)."""
    nodes: dict[int | None, list[int]] = {}
    for r in v.rows:
        nodes.setdefault(r.node, []).append(r.rank)
    out = {}
    for node, ranks in nodes.items():
        rows = [v.heat[r] for r in ranks if r in v.heat]
        out[node] = [max((x for x in col if x is not None), default=None) for col in zip(*rows)] if rows \
            else [None] * len(v.steps)
    return out


def zoomed_rows(v: RunView, node: int | None) -> list[RankRow]:
    return [r for r in v.rows if r.node == node]
