"""Collective records folded per step: what a node agent ships instead of every op.

A rank's completed collectives of one step, of one kind (``op``), on one communicator (e.g. the 128
tensor-parallel all-reduces of its step 12) become one ``CollectiveRecord`` standing for all of them (``ops``): their mean arrival,
completion and duration, their total bytes, and the first op's ``seq``. So what the head receives per step grows
with ranks × communicators, not with ranks × ops; the records of every op stay in the rank's spool file on the
node's disk (``ranksight.spool``), where ``diagnose`` run on the node reads them.

Why means: every member of a communicator does the same ops in the same order, so across members a difference of
the means is the mean of the per-op differences (who arrives later, who is done first: what the analyzers compare).
A total is ``ops`` × the mean; analyzers that add times up multiply back (``analyzers.loader`` keeps ``ops``).

Left as they are:
- pipeline p2p ops (``send``, ``recv``): a transfer is judged from both ends' records of it (the receiver's
  completion less the later of the two arrivals), and a mean over a step's transfers mixes those where the sender
  was late with those where the receiver was, which blurs the slow-link signature. A stage boundary carries a few
  transfers per micro-batch, not the hundreds of ops a TP or FSDP step makes;
- an op without a completion (a hang, an op in flight when the rank died): the hang check needs each one, with
  its own ``seq``;
- a record that already stands for several ops.

Records are folded within one call (one agent cycle): a step whose records a cycle's read cut in two (a backlog
read in 1 MiB slices) gives two folded records, each with its own first ``seq``. Members' cut points differ, so such
records do not line up across members, and the analyzers' matching (every member must hold the same op instance)
drops them, as it drops an op one rank recorded alone.
"""

from __future__ import annotations

import msgspec

from ranksight.schema import CollectiveRecord

UNFOLDED_OPS = frozenset({"send", "recv"})  # pipeline p2p: see the module's docstring


def _key(r: CollectiveRecord) -> tuple:
    # the communicator: its id, or (the older form) its name and member list
    comm = r.comm_id or (r.group, tuple(r.group_ranks))
    return (r.run_id, r.rank, r.attempt, r.step, r.group, comm, r.op)


def fold_per_step(records: list[CollectiveRecord]) -> list[CollectiveRecord]:
    """``records`` with each (rank, step, communicator, op) group of completed single ops folded into one record,
    placed where the group's first op was; everything else as it was, in order."""
    groups: dict[tuple, list[CollectiveRecord]] = {}
    order: list[tuple | CollectiveRecord] = []
    for r in records:
        if r.t_done is None or r.duration_ms is None or r.ops != 1 or r.op in UNFOLDED_OPS:
            order.append(r)
            continue
        k = _key(r)
        g = groups.get(k)
        if g is None:
            groups[k] = g = []
            order.append(k)
        g.append(r)
    if len(groups) == len(records):
        return list(records)  # nothing to fold: one op per group
    out = []
    for item in order:
        if isinstance(item, CollectiveRecord):
            out.append(item)
            continue
        g = groups[item]
        if len(g) == 1:
            out.append(g[0])
            continue
        n = len(g)
        first = min(g, key=lambda x: x.seq)
        # means as offsets from the first op's times: epoch seconds summed would lose microseconds
        a0, d0 = first.t_arrive, first.t_done
        out.append(msgspec.structs.replace(
            first,
            t_arrive=a0 + sum(x.t_arrive - a0 for x in g) / n,
            t_done=d0 + sum(x.t_done - d0 for x in g) / n,  # type: ignore[operator]
            duration_ms=sum(x.duration_ms for x in g) / n,  # type: ignore[misc]
            nbytes=sum(x.nbytes for x in g),
            ops=n))
    return out
