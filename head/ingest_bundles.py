"""A request's bundles of one run gathered into one payload per table and packed layout, for the write-ahead log and
the store's queue (``head.ingest.Ingest.logs``).

A Collector's request holds one ``bundle-v1`` log record per agent and ship cycle: thousands a second at fleet scale.
Bundles of a shape the head knows (``ranksight.wire_decode.shape_sections``: the same sections at the same offsets)
cost one list append each here; their sections are cut from all the request's bodies at once, with the offsets of
each shape's bundles computed in numpy, and joined in bundle order (the live window keeps arrival order). A bundle of
no known shape brings its sections as ``Bundle.packed`` and takes its place in the same order.
"""

from __future__ import annotations

import numpy as np

from ranksight import wire, wire_decode


class BundleGather:
    """The bundles of one run in one request, in arrival order."""

    __slots__ = ("records", "bodies", "groups")

    def __init__(self):
        self.records: list[int] = []  # the log record of each bundle (a run the store refuses refuses them)
        self.bodies: list[bytes] = []  # each bundle's packed sections lie in its body (a known shape) or in a body
        # made of its sections (``packed``)
        # the bundles of each shape: shape id -> [bundle index]; a bundle of no known shape is its own group, keyed
        # by its sections' plan (a tuple, not an int)
        self.groups: dict[int | tuple, list[int]] = {}

    def add(self, i: int, bundle: wire_decode.Bundle) -> None:
        self.records.append(i)
        if bundle.shape >= 0:
            key: int | tuple = bundle.shape
            self.bodies.append(bundle.body)
        else:
            pos, plan = 0, []
            for kind, lay, payload, count in bundle.packed:
                plan.append((kind, lay, pos, pos + len(payload), count))
                pos += len(payload)
            key = (len(self.bodies), tuple(plan))  # unique: the bundle's index is in it
            self.bodies.append(b"".join([p for _, _, p, _ in bundle.packed]))
        got = self.groups.get(key)
        if got is None:
            self.groups[key] = [len(self.bodies) - 1]
        else:
            got.append(len(self.bodies) - 1)

    def by_table(self, table_of: dict[str, str]) -> dict[str, dict[wire.PackedLayout, list]]:
        """table -> layout -> [[payload], records]: each (table, layout)'s sections of every bundle joined, in
        bundle order (and body order within a bundle)."""
        bodies = self.bodies
        n = len(bodies)
        if not n:
            return {}
        lens = np.fromiter(map(len, bodies), np.int64, n)
        offs = np.cumsum(lens) - lens
        joined = b"".join(bodies)
        view = memoryview(joined)
        found: dict[tuple[str, wire.PackedLayout], list] = {}
        for key, members in self.groups.items():
            plan = wire_decode.shape_sections(key) if isinstance(key, int) else key[1]
            idx = np.array(members, np.int64)
            base = offs[idx]
            for kind, lay, a, b, count in plan:
                got = found.get((kind, lay))
                part = (idx, base + a, base + b, count * len(members))
                if got is None:
                    found[(kind, lay)] = [part]
                else:
                    got.append(part)
        out: dict[str, dict[wire.PackedLayout, list]] = {}
        for (kind, lay), parts in found.items():
            if len(parts) == 1:
                _, starts, ends, count = parts[0]
            else:
                # several shapes (or one shape's sections of the same layout twice): back into bundle order; a
                # stable sort keeps body order within a bundle
                order = np.argsort(np.concatenate([p[0] for p in parts]), kind="stable")
                starts = np.concatenate([p[1] for p in parts])[order]
                ends = np.concatenate([p[2] for p in parts])[order]
                count = sum(p[3] for p in parts)
            if len(starts) == 1:
                payload = bytes(view[int(starts[0]):int(ends[0])])
            else:
                payload = b"".join([view[s:e] for s, e in zip(starts.tolist(), ends.tolist())])
            by_lay = out.setdefault(table_of[kind], {})
            got = by_lay.get(lay)
            if got is None:
                by_lay[lay] = [[payload], count]
            else:  # the same layout under another kind of one table: never sent, but kept whole
                got[0].append(payload)
                got[1] += count
        return out
