"""The spools of this node's ranks (``RunDir.spool(rank)``): which ranks are local, and their new records.

Discovery: a rank is local when the manifest's placement says ``node == N``; before the manifest lists it, when
the first record of its spool names this node (``ranksight.spool.first_node``). Collective records are folded per
step (``ranksight.collective_fold``: one record per rank, step, communicator and op kind) with ``--collectives
per-step``, and by default (``auto``) in a job of more than ``FOLD_ABOVE_RANKS`` ranks. Tailing is
``ranksight.spool.tail`` from the committed position; a spool gap (garbage lines, an oversized line, a truncated
or replaced file) becomes a ``spool_gap`` / ``spool_reset`` event. Step records also feed the Prometheus step
series and the OTLP step histogram.
"""

from __future__ import annotations

import logging
import time

from node.outbox import Item
from node.prom import AgentMetrics
from node.shipping import OtlpMetrics
from node.state import AgentState
from ranksight import schema, wire
from ranksight.collective_fold import fold_per_step
from ranksight.layout import RunDir
from ranksight.spool import SpoolGap, TailPosition, first_node, spool_ranks, tail

log = logging.getLogger("ranksight.agent")

# --collectives: per-op ships every collective record; per-step folds them (ranksight/collective_fold.py). auto:
# every op while the head can take them, folded above this many ranks (a job that size makes millions of op
# records a second; bench/scale.py). Folded records keep detection but for part of the slow-link signature's
# sensitivity (bench/RESULTS.md, the detection matrix replayed folded).
COLLECTIVE_MODES = ("auto", "per-op", "per-step")
FOLD_ABOVE_RANKS = 256
READ_BYTES_PER_RANK = 1024 * 1024  # per cycle: keeps one OTLP request well under the head's limit
DISCOVERY_INTERVAL_S = 2.0


class SpoolSource:
    """Collects one ``Item`` per record kind for all local ranks together: the per-record overhead of an OTLP log
    record (protobuf, attributes) is paid once per cycle, not once per rank (see bench/ingest.py). Step records
    travel packed (``wire.pack_records``), every other kind as the spool's JSON lines. ``backlog`` is True after
    a ``collect()`` that left bytes unread (the agent then runs the next cycle at once)."""

    def __init__(self, rd: RunDir, node: int, state: AgentState, metrics: AgentMetrics, otlp_metrics: OtlpMetrics,
                 collectives: str = "auto"):
        self.rd = rd
        if collectives not in COLLECTIVE_MODES:
            raise ValueError(f"collectives must be one of {COLLECTIVE_MODES}, not {collectives!r}")
        # per-step: a step's ops of one kind on one communicator shipped as one record (ranksight/collective_fold.py);
        # the records of every op stay in the spool files. auto: per-step once the job is larger than
        # FOLD_ABOVE_RANKS (its world size, from the step records)
        self.collectives = collectives
        self.world_size = 0
        self.node = node
        self.state = state
        self.metrics = metrics
        self.otlp_metrics = otlp_metrics
        self.local_ranks: list[int] = []
        self.garbage_lines = 0  # spool lines that did not decode, since this agent started
        self.backlog = False
        self._rank_nodes: dict[int, int] = {}
        self._last_discovery = 0.0
        self._pending: dict[int, TailPosition] = {}

    def discover(self, force: bool = False) -> list[int]:
        """The local ranks, looked up again at most every ``DISCOVERY_INTERVAL_S`` unless ``force``."""
        now = time.time()
        if not force and now - self._last_discovery < DISCOVERY_INTERVAL_S:
            return self.local_ranks
        self._last_discovery = now
        m = schema.read_manifest(self.rd.manifest)
        self.metrics.observe_manifest(self.rd.run_id, m)  # ranksight_run_finished: silences stall alerts after the end
        if m is not None and m.ranks:
            self._rank_nodes = {p.rank: p.node for p in m.ranks}
        for r in spool_ranks(self.rd.spool_dir):
            if r not in self._rank_nodes:
                pos = self.state.positions.get(r)
                n = pos.node if pos is not None and pos.node is not None else first_node(self.rd.spool(r))
                if n is not None:
                    self._rank_nodes[r] = n
        ranks = sorted(r for r, n in self._rank_nodes.items() if n == self.node)
        if ranks != self.local_ranks:
            log.info("agent node %d: tailing ranks %s", self.node, ranks)
        self.local_ranks = ranks
        self.metrics.ranks.labels(str(self.node)).set(len(ranks))
        return ranks

    def collect(self) -> list[Item]:
        self._pending = {}
        self.backlog = False
        now = time.time()
        by_kind: dict[str, _KindBatch] = {}

        def put(kind: str, raw: bytes, step: int, rank: int, t: float | None, rec) -> None:
            b = by_kind.get(kind)
            if b is None:
                b = by_kind[kind] = _KindBatch()
            b.raws.append(raw)
            b.steps.append(step)
            b.ranks.add(rank)
            if t:
                b.times.append(t)
            b.recs.append(rec)

        for rank in self.discover():
            res = tail(self.rd.spool(rank), self.state.positions.get(rank), max_bytes=READ_BYTES_PER_RANK)
            self._pending[rank] = res.position
            if not res.eof:
                self.backlog = True
            steps = []
            for rec, raw in zip(res.records, res.raw):
                put(type(rec).__struct_config__.tag, raw, rec.step, rank, _rec_time(rec), rec)
                if isinstance(rec, schema.StepRecord):
                    steps.append(rec)
                    self.world_size = max(self.world_size, rec.world_size)
            if steps:
                self.metrics.observe_steps(steps)  # each Prometheus series once per rank and cycle
                self.otlp_metrics.record_steps(steps)
            for g in res.gaps:
                ev = self._gap_event(rank, g)
                put("event", schema.encode(ev), ev.step, rank, now, ev)
                if g.reason == "reset":
                    self.metrics.resets.labels(str(self.node), str(rank)).inc()
                else:
                    self.metrics.garbage.labels(str(self.node), str(rank)).inc(g.lines)
                    self.garbage_lines += g.lines
                log.warning("agent node %d: rank %d spool %s at offset %d (%d lines, %d bytes) after step %d",
                            self.node, rank, g.reason, g.offset, g.lines, g.nbytes, g.after_step)
        items = []
        for kind, b in by_kind.items():
            if kind == "collective" and self.folds():
                b.fold()
            # Step records travel packed (the head stores them without a Python object per record);
            # anything that cannot be packed exactly, and every other kind, as the JSON spool lines.
            packed = wire.pack_records(kind, self.rd.run_id, b.recs) if kind in wire.PACKED_LAYOUTS else None
            layout, body = packed if packed is not None else (None, wire.join_array(b.raws))
            items.append(Item(kind=kind, body=body, rank=next(iter(b.ranks)) if len(b.ranks) == 1 else None,
                              count=len(b.raws), step_min=min(b.steps), step_max=max(b.steps),
                              t_first=min(b.times) if b.times else now, layout=layout))
        return items

    def folds(self) -> bool:
        """Whether this cycle's collective records are folded per step."""
        return self.collectives == "per-step" or (self.collectives == "auto" and self.world_size > FOLD_ABOVE_RANKS)

    def commit(self, acknowledged: bool) -> bool:
        had = bool(self._pending)
        self.state.positions.update(self._pending)
        self._pending = {}
        return had

    def _gap_event(self, rank: int, g: SpoolGap) -> schema.EventRecord:
        # Deterministic fields only (no "now"): a re-read after a crash yields the same key.
        return schema.EventRecord(run_id=self.rd.run_id, rank=rank, step=g.after_step, t=g.after_t,
                                  event="spool_reset" if g.reason == "reset" else "spool_gap",
                                  detail={"reason": g.reason, "offset": g.offset, "bytes": g.nbytes, "lines": g.lines,
                                          "inode": g.inode, "sample": g.sample, "node": self.node})


class _KindBatch:
    """The records of one kind read this cycle, over all local ranks."""

    __slots__ = ("raws", "steps", "ranks", "times", "recs")

    def __init__(self):
        self.raws: list[bytes] = []  # the spool lines
        self.steps: list[int] = []
        self.ranks: set[int] = set()
        self.times: list[float] = []  # wall times, where a record has one
        self.recs: list = []  # the decoded records (for packing)

    def fold(self) -> None:
        """Collective records folded per step (``fold_per_step``); the JSON lines made again from them."""
        folded = fold_per_step(self.recs)
        if len(folded) != len(self.recs):
            self.recs = folded
            self.raws = [schema.encode(r) for r in folded]
            self.steps = [r.step for r in folded]


def _rec_time(rec) -> float | None:
    return getattr(rec, "t_end", None) or getattr(rec, "t", None) or getattr(rec, "t_arrive", None)
