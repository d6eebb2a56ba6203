"""The head's ingest: decoded OTLP requests from the node agents into the store and the live windows.

Log records (``POST /v1/logs``) carry record batches (``ranksight.wire``): table rows are logged and
queued in the run's store (deduplicated at its next processing, which feeds the live window), and
control records (manifest, heartbeat, control acks) are applied at once. Metric points
(``POST /v1/metrics``) only update the latest value of each gauge.
"""

from __future__ import annotations

import logging
import time

from head.actions import ActionsBook
from head.runs import LiveRuns
from ranksight import wire, wire_decode, wire_rejections
from ranksight.tables import SPECS

log = logging.getLogger("ranksight.head")

_TABLE_OF_KIND = {k: t for k, (_, t) in wire.BATCH_KINDS.items() if t}


class Ingest:
    """What the receiver hands over: ``logs`` and ``metrics`` requests (parsed protobuf)."""

    def __init__(self, live: LiveRuns, actions: ActionsBook, stats: dict[str, int]):
        self.live = live
        self.actions = actions
        self.stats = stats
        self.metrics_latest: dict[tuple, float] = {}  # (node, metric name, attrs) -> value, from OTLP metrics

    def logs(self, request) -> tuple[int, int, list[wire_rejections.Rejection]]:
        """Apply an ExportLogsServiceRequest. Returns (records accepted, log records rejected, the rejections: which
        log record, which of its rows, why; ``wire_rejections.rejections_message`` makes them the partial success's message).

        Record batches are grouped per (run, table) so each table's write-ahead-log write happens once
        per request, not once per log record. Batches are only logged and queued here: the store
        dedupes a whole flush of them at once, vectorized, and feeds the live window
        (``head.runs.LiveRuns.store_of``, ``head.store.RunStore.on_new``).
        """
        stats = self.stats
        stats["log_requests"] += 1
        refused: dict[int, wire_rejections.Rejection] = {}  # log record index -> what of it was refused
        accepted = 0
        groups: dict[tuple[str, str], list[tuple[int, wire_decode.Batch]]] = {}
        # the bundles' packed sections: (run, table) -> layout -> [payloads, records]; and per run the log records
        # they came from (a run the store refuses refuses them) and the bundles' heartbeats
        fast: dict[tuple[str, str], dict[wire.PackedLayout, list]] = {}
        fast_from: dict[str, list[int]] = {}
        beats: dict[str, list[tuple[int, list]]] = {}
        bundle_type = wire_decode.Bundle
        table_of = _TABLE_OF_KIND
        for i, batch, reason in wire_decode.iter_indexed(request, bundles=True):
            if batch is None:
                refused[i] = wire_rejections.Rejection(i=i, why=reason or "refused")
                continue
            if type(batch) is bundle_type:  # the volume path: one per agent and ship cycle
                run_id = batch.run_id
                for kind, lay, payload, count in batch.packed:
                    key = (run_id, table_of[kind])
                    by_lay = fast.get(key)
                    if by_lay is None:
                        by_lay = fast[key] = {}
                    got = by_lay.get(lay)
                    if got is None:
                        by_lay[lay] = [[payload], count]
                    else:
                        got[0].append(payload)
                        got[1] += count
                src = fast_from.get(run_id)
                if src is None:
                    fast_from[run_id] = [i]
                else:
                    src.append(i)
                if batch.heartbeats:
                    beats.setdefault(run_id, []).append((i, batch.heartbeats))
                if not batch.others:
                    continue
                others = batch.others
            else:
                others = (batch,)
            for batch in others:
                accepted += self._take(i, batch, groups, refused)
        by_run: dict[str, list[tuple[str, list[tuple[int, wire_decode.Batch]]]]] = {}
        for (run_id, table), batches in groups.items():
            by_run.setdefault(run_id, []).append((table, batches))
        for run_id in fast_from:
            by_run.setdefault(run_id, [])
        for run_id, tables in by_run.items():
            packed = {table: by_lay for (rid, table), by_lay in fast.items() if rid == run_id}
            try:
                accepted += self._queue(run_id, [(table, [b for _, b in batches]) for table, batches in tables], packed)
            except ValueError as e:
                for _, batches in tables:
                    for i, _ in batches:
                        refused[i] = wire_rejections.Rejection(i=i, why=str(e))
                for i in fast_from.get(run_id, ()):
                    refused[i] = wire_rejections.Rejection(i=i, why=str(e))
        for run_id, hbs in beats.items():
            try:
                self.live.run(run_id).heartbeats([hb for _, got in hbs for hb in got])
            except ValueError as e:
                for i, _ in hbs:
                    refused[i] = wire_rejections.Rejection(i=i, why=str(e))
        rejected = len(refused)
        if rejected:
            stats["rejected"] += rejected
            log.warning("head: rejected %d log record(s): %s", rejected, "; ".join(r.why for r in list(refused.values())[:3]))
        return accepted, rejected, list(refused.values())

    def _take(self, i: int, batch: wire_decode.Batch, groups: dict, refused: dict) -> int:
        """One batch that is not a bundle's packed section: a table batch into ``groups``, a control record applied
        at once; what is refused goes to ``refused``. Returns the records accepted now (control records)."""
        table = _TABLE_OF_KIND.get(batch.kind)
        if table is not None and type(batch.items) is wire.PackedBatch:  # the volume path: straight to its group
            key = (batch.run_id, table)
            same = groups.get(key)
            if same is None:
                groups[key] = [(i, batch)]
            else:
                same.append((i, batch))
            return 0
        try:
            if table is None:
                return self._apply_control(batch)
            if batch.refused:  # rows that did not decode; the rest of the batch is kept
                refused[i] = wire_rejections.Rejection(i=i, why=batch.refused[0][1], rows=[j for j, _ in batch.refused])
            if type(batch.items) is not wire.PackedBatch and SPECS[table].has_run_id:
                # records of another run in the batch are refused one by one; the rest of the batch is kept
                # (refusing it whole once lost a node's data inside a 200)
                run_id = batch.run_id
                foreign = [j for j, r in enumerate(batch.items) if r.run_id != run_id]
                if foreign:
                    why = (f"{len(foreign)} {batch.kind} record(s) of run {batch.items[foreign[0]].run_id!r} "
                           f"shipped as run {run_id!r}: refused, the batch's other "
                           f"{len(batch.items) - len(foreign)} kept")
                    if len(foreign) == len(batch.items) and not batch.refused:
                        refused[i] = wire_rejections.Rejection(i=i, why=why)
                        return 0
                    rows = sorted(set((refused[i].rows if i in refused else []) + _body_rows(batch, foreign)))
                    refused[i] = wire_rejections.Rejection(i=i, why=why, rows=rows)
                    kept = [r for r in batch.items if r.run_id == run_id]
                    if not kept:
                        return 0
                    # re-encoded by the store (body None): the body as received holds the refused rows too
                    batch = wire_decode.Batch(run_id=run_id, kind=batch.kind, items=kept, attrs=batch.attrs, body=None)
            groups.setdefault((batch.run_id, table), []).append((i, batch))
        except ValueError as e:  # e.g. a run id the store refuses, records of another run
            refused[i] = wire_rejections.Rejection(i=i, why=str(e))
        return 0

    def _queue(self, run_id: str, tables: list[tuple[str, list[wire_decode.Batch]]],
               bundled: dict[str, dict[wire.PackedLayout, list]] | None = None) -> int:
        """Log and queue a request's batches of one run (one write-ahead-log write for all its tables); the store
        dedupes them at its next processing (every flush, or before a view reads the live window). ``bundled``: the
        bundles' packed sections, table -> layout -> [payloads, records], queued first."""
        rs = self.live.store_of(run_id)
        work, n = [], 0
        bundled = bundled or {}
        for table, by_lay in bundled.items():
            packed = [wire.PackedBatch(lay, p[0] if len(p) == 1 else b"".join(p), count)
                      for lay, (p, count) in by_lay.items()]
            n += sum(count for _, count in by_lay.values())
            work.append((table, packed, []))
        for table, batches in tables:
            by_layout: dict[wire.PackedLayout, list[wire.PackedBatch]] = {}
            decoded = []
            for b in batches:
                it = b.items
                if type(it) is wire.PackedBatch:
                    same = by_layout.get(it.layout)
                    if same is None:
                        by_layout[it.layout] = [it]
                    else:
                        same.append(it)
                    n += it.count
                else:
                    decoded.append((it, b.body))
                    n += len(it)
            # the request's bodies of one layout joined: one WAL entry and one queued buffer each, not one per agent
            packed = [g[0] if len(g) == 1 else wire.PackedBatch(lay, b"".join([x.payload for x in g]),
                                                                 sum([x.count for x in g]))
                      for lay, g in by_layout.items()]
            work.append((table, packed, decoded))
        rs.enqueue(work)
        self.live.runs[run_id].last_seen = time.time()
        return n

    def _apply_control(self, b: wire_decode.Batch) -> int:
        """Manifest, heartbeat and control acks: small, rare, applied one by one."""
        run_id = b.run_id
        live = self.live.run(run_id)
        if b.kind == "heartbeat":
            live.heartbeat(b.items)
            return 0
        if b.kind == "manifest":
            if b.items.run_id != run_id:
                raise ValueError(f"manifest of {b.items.run_id!r} shipped as run {run_id!r}")
            live.manifest = b.items
            self.live.store.run(run_id).write_manifest(b.items, b.attrs.get(wire.A_MTIME))
            return 0
        if b.kind == "ack":
            self.actions.apply_acks(run_id, b.items)
            return len(b.items)
        raise ValueError(f"unknown kind {b.kind!r}")

    def metrics(self, request) -> int:
        """Keep the latest value of each gauge/sum point (the live GPU/host view); history is in the logs path."""
        self.stats["metric_requests"] += 1
        n = 0
        for rm in request.resource_metrics:
            res = wire_decode.attributes(rm.resource.attributes)
            node = res.get(wire.R_NODE)
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    kind = m.WhichOneof("data")
                    if kind not in ("gauge", "sum", "histogram"):
                        continue
                    for p in getattr(m, kind).data_points:
                        attrs = tuple(sorted((a.key, str(wire_decode.any_value(a.value))) for a in p.attributes))
                        if kind == "histogram":
                            val = p.sum / p.count if p.count else 0.0
                        else:
                            val = p.as_double if p.WhichOneof("value") == "as_double" else float(p.as_int)
                        self.metrics_latest[(node, m.name, attrs)] = val
                        n += 1
        self.stats["metric_points"] += n
        return n


def _body_rows(batch: wire_decode.Batch, positions: list[int]) -> list[int]:
    """Rows of the body as received of ``batch.items[positions]``: the same positions unless rows were already
    refused (``batch.refused``), which ``items`` lacks."""
    if not batch.refused:
        return positions
    gone = sorted(j for j, _ in batch.refused)
    body_row, n = [], 0
    for j in range(len(batch.items) + len(gone)):
        if gone and j == gone[0]:
            gone.pop(0)
            continue
        body_row.append(j)
        n += 1
    return [body_row[p] for p in positions]
