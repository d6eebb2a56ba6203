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

import textwrap
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


WIDTH = 80  # the report's lines fit an 80-column terminal (the nccl-tests result tables are nccl-tests' own)
MATRIX_MAX_RANKS = 5  # the full matrix up to this many ranks (it fits WIDTH); above, one summary line per rank


def comment(text: str, width: int = WIDTH) -> list[str]:
    """``text`` as ``# `` comment lines of at most ``width`` characters, continued lines indented; a word longer
    than a line is kept whole (never cut)."""
    return textwrap.wrap(text, width=width, initial_indent="# ", subsequent_indent="#   ", break_long_words=False,
                         break_on_hyphens=False) or ["#"]


def fit_names(names: list[str], width: int) -> list[str]:
    """Names in ``width`` characters: the host part before the first dot when that still tells them apart, and a
    name still too long keeps its end behind an ellipsis ("…node-017": the end tells hosts apart)."""
    short = [x.split(".", 1)[0] or x for x in names]
    if len(set(short)) < len(set(names)):
        short = list(names)
    return [x if len(x) <= width else "…" + x[-(width - 1):] for x in short]


def _matrix(n: int, hosts: list[str], nodes: list[str], pair_bw: dict[tuple[int, int], float]) -> list[str]:
    hosts, nodes = fit_names(hosts, 12), fit_names(nodes, 10)
    lines = [f"# {'rank':>4s}  {'node':>10s}  {'host':>12s} " + "".join(f" {('r' + str(j)):>7s}" for j in range(n))]
    for i in range(n):
        cells = [f" {'-':>7s}" if i == j else f" {pair_bw[tuple(sorted((i, j)))]:7.3f}" for j in range(n)]
        lines.append(f"  {i:4d}  {nodes[i]:>10s}  {hosts[i]:>12s} " + "".join(cells))
    return lines


def _per_rank(n: int, hosts: list[str], nodes: list[str], pair_bw: dict[tuple[int, int], float]) -> list[str]:
    """One line per rank: its slowest pair (and the peer), the median and the fastest of its pairs."""
    hosts, nodes = fit_names(hosts, 12), fit_names(nodes, 10)
    lines = [f"# {'rank':>5s}  {'node':>10s}  {'host':>12s}  {'slowest pair':>14s}  {'median':>7s}  {'fastest':>7s}"]
    for i in range(n):
        mine = sorted((pair_bw[tuple(sorted((i, j)))], j) for j in range(n) if j != i)
        vals = [bw for bw, _ in mine]
        low, peer = mine[0]
        lines.append(f"  {i:5d}  {nodes[i]:>10s}  {hosts[i]:>12s}  {low:7.3f} {'r' + str(peer):>6s}  "
                     f"{median(vals):7.3f}  {vals[-1]:7.3f}")
    return lines


def format_report(rep: HealthReport, hosts: list[str], nodes: list[str], pair_bw: dict[tuple[int, int], float],
                  size: int, iters: int, backend: str, width: int = WIDTH) -> list[str]:
    """The report's lines, each at most ``width`` characters (hosts and nodes as ``fit_names`` gives them). The pairwise matrix up to MATRIX_MAX_RANKS ranks; above, one line per rank
    (its slowest pair and peer, median, fastest): the whole matrix is in ``--json`` and the store."""
    n = rep.nranks
    thr = rep.threshold
    lines = ["#"]
    if n <= MATRIX_MAX_RANKS:
        lines += comment(f"Pairwise sendrecv bandwidth (GB/s per direction, {size} B messages, {iters} samples per "
                         "pair)", width)
        lines += _matrix(n, hosts, nodes, pair_bw)
    else:
        lines += comment(f"Pairwise sendrecv bandwidth per rank over its {n - 1} pairs (GB/s per direction, {size} B "
                         f"messages, {iters} samples per pair; every pair: --json or the store)", width)
        lines += _per_rank(n, hosts, nodes, pair_bw)

    def block(title: str, ents: list[Entity]) -> None:
        if not ents:
            return
        nw = max(4, min(28, max(len(e.name) for e in ents)))
        lines.append("#")
        lines.extend(comment(title, width))
        lines.append(f"# {'':2s}{'name':<{nw}s} {'GB/s':>9s} {'median':>9s} {'ratio':>6s}  status")
        for e in ents:
            status = "SLOW" if e.flagged else "ok"
            flag, name = "!" if e.flagged else " ", e.name
            if len(name) > nw:  # a long name (two nodes' host names) on lines of its own, the numbers under it
                a, sep, b = name.partition("<->")
                if sep and len(name) + 4 > width:
                    lines.extend([f"  {flag} {a}<->", f"      {b}"])
                else:
                    lines.append(f"  {flag} {name}")
                name = ""
            line = f"  {flag} {name:<{nw}s} {e.bw:9.3f} {e.reference:9.3f} {e.ratio:6.2f}  {status}"
            why = f" (explained by {e.explained_by})" if e.explained_by else ""
            if len(line) + len(why) <= width:
                lines.append(line + why)
            else:  # the explanation on a line of its own rather than past the edge
                lines.append(line)
                lines.append(f"{'':6s}explained by {e.explained_by}")

    block("Per rank: median bandwidth over its pairs", rep.ranks)
    block("Per node: median over its ranks", rep.nodes)
    block("Node pairs: median bandwidth of the rank pairs between them", rep.node_links)
    block("Per node group: all_reduce busbw inside the node", rep.node_groups)
    slow_links = [e for e in rep.links if e.flagged]
    block(f"Links below {thr:g} x median", slow_links)
    lines.append("#")
    bad = rep.flagged()
    if not bad:
        lines += comment(f"Health check: OK - no rank, node or link below {thr:g} x median ({n} ranks, "
                         f"{len(set(nodes))} node(s), backend {backend})", width)
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
        lines += comment("Health check: FAILED - " + "; ".join(parts), width)
    return lines
