"""The health check's verdict, pure (no torch): which ranks, nodes and links are slow.

Input: the pairwise sendrecv bandwidth of every rank pair (GB/s per direction), the node of
each rank, and optionally the all_reduce busbw of each node's group. Everything is compared
with ``threshold x median`` of its own kind:

- link  (rank pair)      : its bandwidth against the median over all pairs;
- rank                   : the median bandwidth of its pairs against the median of those per-rank values;
- node link (node pair)  : the median over the rank pairs between the two nodes (or inside one
                           node) against the median over node pairs;
- node                   : the median of its ranks' values against the median over nodes;
- node group             : the all_reduce busbw inside the node against the median over nodes.

A slow link whose endpoint is a slow rank is reported as explained by that rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median

DEFAULT_THRESHOLD = 0.5


@dataclass
class Entity:
    kind: str  # "rank" | "node" | "link" | "node_link" | "node_group"
    name: str
    ranks: list[int]
    nodes: list[str]
    bw: float  # GB/s
    reference: float  # the median it is compared with
    ratio: float
    flagged: bool
    explained_by: str = ""


@dataclass
class HealthReport:
    threshold: float
    nranks: int
    links: list[Entity] = field(default_factory=list)
    ranks: list[Entity] = field(default_factory=list)
    node_links: list[Entity] = field(default_factory=list)
    nodes: list[Entity] = field(default_factory=list)
    node_groups: list[Entity] = field(default_factory=list)

    def entities(self) -> list[Entity]:
        return self.ranks + self.nodes + self.node_groups + self.node_links + self.links

    def flagged(self) -> list[Entity]:
        return [e for e in self.entities() if e.flagged]

    @property
    def ok(self) -> bool:
        return not self.flagged()


def _flag(kind, name, ranks, nodes, bw, ref, threshold) -> Entity:
    ratio = bw / ref if ref > 0 else (1.0 if bw == ref else 0.0)
    return Entity(kind, name, ranks, nodes, bw, ref, ratio, ratio < threshold)


def analyze(pair_bw: dict[tuple[int, int], float], nodes: list[str], threshold: float = DEFAULT_THRESHOLD,
            group_bw: dict[str, float] | None = None) -> HealthReport:
    """``pair_bw[(i, j)]`` for i < j; ``nodes[r]`` is rank r's node; ``group_bw[node]`` optional."""
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    n = len(nodes)
    rep = HealthReport(threshold=threshold, nranks=n)
    pairs = {tuple(sorted(k)): v for k, v in pair_bw.items() if k[0] != k[1]}
    if pairs:
        ref = median(pairs.values())
        for (i, j), bw in sorted(pairs.items()):
            rep.links.append(_flag("link", f"{i}<->{j}", [i, j], [nodes[i], nodes[j]], bw, ref, threshold))
        scores = {}
        for r in range(n):
            mine = [bw for (i, j), bw in pairs.items() if r in (i, j)]
            if mine:
                scores[r] = median(mine)
        ref_r = median(scores.values())
        for r, s in sorted(scores.items()):
            rep.ranks.append(_flag("rank", f"rank {r}", [r], [nodes[r]], s, ref_r, threshold))
        # node pairs
        by_np: dict[tuple[str, str], list[float]] = {}
        for (i, j), bw in pairs.items():
            key = tuple(sorted((nodes[i], nodes[j])))
            by_np.setdefault(key, []).append(bw)
        np_med = {k: median(v) for k, v in by_np.items()}
        ref_np = median(np_med.values())
        for (a, b), v in sorted(np_med.items()):
            name = f"{a} (intra-node)" if a == b else f"{a}<->{b}"
            ranks = sorted({r for (i, j) in pairs if tuple(sorted((nodes[i], nodes[j]))) == (a, b) for r in (i, j)})
            rep.node_links.append(_flag("node_link", name, ranks, sorted({a, b}), v, ref_np, threshold))
        # nodes
        node_scores: dict[str, list[float]] = {}
        for r, s in scores.items():
            node_scores.setdefault(nodes[r], []).append(s)
        nmed = {k: median(v) for k, v in node_scores.items()}
        ref_n = median(nmed.values())
        for nd, v in sorted(nmed.items()):
            rep.nodes.append(_flag("node", nd, [r for r in range(n) if nodes[r] == nd], [nd], v, ref_n, threshold))
    if group_bw:
        ref_g = median(group_bw.values())
        for nd, v in sorted(group_bw.items()):
            rep.node_groups.append(_flag("node_group", f"{nd} all_reduce group", [r for r in range(n) if nodes[r] == nd], [nd], v, ref_g, threshold))
    slow_ranks = {e.ranks[0] for e in rep.ranks if e.flagged}
    slow_nodes = {e.nodes[0] for e in rep.nodes if e.flagged}
    for e in rep.links:
        if e.flagged:
            culprits = [f"rank {r}" for r in e.ranks if r in slow_ranks]
            if culprits:
                e.explained_by = ", ".join(culprits)
    for e in rep.ranks:
        if e.flagged and e.nodes[0] in slow_nodes:
            e.explained_by = f"node {e.nodes[0]}"
    return rep


def format_report(rep: HealthReport, hosts: list[str], nodes: list[str], pair_bw: dict[tuple[int, int], float],
                  size: int, iters: int, backend: str) -> list[str]:
    n = rep.nranks
    thr = rep.threshold
    lines = ["#", f"# Pairwise sendrecv bandwidth (GB/s per direction, {size} B messages, {iters} samples per pair)"]
    head = f"# {'rank':>4s}  {'node':>10s}  {'host':>12s} " + "".join(f" {('r' + str(j)):>7s}" for j in range(n))
    lines.append(head)
    for i in range(n):
        cells = []
        for j in range(n):
            if i == j:
                cells.append(f" {'-':>7s}")
            else:
                cells.append(f" {pair_bw[tuple(sorted((i, j)))]:7.3f}")
        lines.append(f"  {i:4d}  {nodes[i][-10:]:>10s}  {hosts[i][-12:]:>12s} " + "".join(cells))

    def block(title: str, ents: list[Entity]) -> None:
        if not ents:
            return
        lines.append("#")
        lines.append(f"# {title}")
        lines.append(f"# {'':2s}{'name':<28s} {'GB/s':>9s} {'median':>9s} {'ratio':>6s}  status")
        for e in ents:
            status = "SLOW" if e.flagged else "ok"
            if e.explained_by:
                status += f" (explained by {e.explained_by})"
            lines.append(f"  {'!' if e.flagged else ' '} {e.name:<28s} {e.bw:9.3f} {e.reference:9.3f} {e.ratio:6.2f}  {status}")

    block("Per rank: median bandwidth over its pairs", rep.ranks)
    block("Per node: median over its ranks", rep.nodes)
    block("Node pairs: median bandwidth of the rank pairs between them", rep.node_links)
    block("Per node group: all_reduce busbw inside the node", rep.node_groups)
    slow_links = [e for e in rep.links if e.flagged]
    block(f"Links below {thr:g} x median", slow_links)
    lines.append("#")
    bad = rep.flagged()
    if not bad:
        lines.append(f"# Health check: OK - no rank, node or link below {thr:g} x median ({n} ranks, {len(set(nodes))} node(s), backend {backend})")
    else:
        parts = []
        sr = [e for e in rep.ranks if e.flagged]
        if sr:
            parts.append("slow rank(s): " + ", ".join(f"{e.ranks[0]} (host {hosts[e.ranks[0]]}, node {e.nodes[0]}, {e.ratio:.2f} x median)" for e in sr))
        sn = [e for e in rep.nodes + rep.node_groups if e.flagged]
        if sn:
            parts.append("slow node(s): " + ", ".join(f"{e.name} ({e.ratio:.2f} x median)" for e in sn))
        snl = [e for e in rep.node_links if e.flagged]
        if snl:
            parts.append("slow node link(s): " + ", ".join(f"{e.name} ({e.ratio:.2f} x median)" for e in snl))
        if slow_links:
            parts.append("slow link(s): " + ", ".join(f"{e.name} ({e.ratio:.2f} x median)" for e in slow_links))
        lines.append(f"# Health check: FAILED - " + "; ".join(parts))
    return lines
