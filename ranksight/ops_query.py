"""The drill-down to raw collective records: the query and the answer of ``GET /ops`` (the node agent,
``node/control.py``) and of ``GET /api/runs/<id>/ops`` (the head, which forwards it: ``head/ops_proxy.py``).

Above 256 ranks an agent ships a rank's collectives of one step, kind and communicator as one folded record
(``ranksight.collective_fold``); every op stays in the rank's spool on the node. A drill-down asks the node for the
raw ops of one rank over a small step range. The query is checked the same way at the head and at the agent (one
parser, here), so a bad range is refused before anything is read or forwarded.
"""

from __future__ import annotations

import re
from typing import Mapping

import msgspec

from ranksight.schema import CollectiveRecord

DEFAULT_LIMIT = 10_000  # records per answer
MAX_LIMIT = 100_000
MAX_STEP_SPAN = 1_000  # steps per query: what a node reads for one answer stays small
COMM_RE = re.compile(r"[A-Za-z0-9_.:>-]{1,64}")  # a communicator id (hex) or a group name (tp, dp, pp:0>1)
OP_RE = re.compile(r"[A-Za-z0-9_]{1,32}")
STEPS_RE = re.compile(r"(\d{1,12})(?:-(\d{1,12}))?")


class OpsQuery(msgspec.Struct, kw_only=True, frozen=True):
    rank: int
    step_from: int
    step_to: int  # inclusive
    comm: str = ""  # a communicator id or a group name; "" any
    op: str = ""  # an op kind (all_reduce, ...); "" any
    limit: int = DEFAULT_LIMIT

    def params(self) -> dict[str, str]:
        """The query string's fields, as ``parse_ops_query`` reads them (what the head forwards)."""
        p = {"rank": str(self.rank), "steps": f"{self.step_from}-{self.step_to}", "limit": str(self.limit)}
        if self.comm:
            p["comm"] = self.comm
        if self.op:
            p["op"] = self.op
        return p

    def matches(self, r: CollectiveRecord) -> bool:
        return (self.step_from <= r.step <= self.step_to and r.rank == self.rank
                and (not self.comm or r.comm_id == self.comm or r.group == self.comm)
                and (not self.op or r.op == self.op))


def parse_ops_query(q: Mapping[str, str]) -> OpsQuery:
    """``rank=R&steps=A-B[&comm=ID][&op=KIND][&limit=N]`` (``steps=A`` is one step); ValueError saying what is
    wrong otherwise."""
    try:
        rank = int(q["rank"])
    except KeyError:
        raise ValueError("rank is required (rank=R)") from None
    except ValueError:
        raise ValueError(f"rank must be an integer, not {q['rank']!r}") from None
    if not 0 <= rank < 2**31:
        raise ValueError(f"rank must be in [0, 2^31), not {rank}")
    steps = q.get("steps")
    if not steps:
        raise ValueError("steps is required (steps=A-B, at most %d steps)" % MAX_STEP_SPAN)
    m = STEPS_RE.fullmatch(steps.strip())
    if m is None:
        raise ValueError(f"steps must be A-B (two step numbers, A <= B) or A, not {steps!r}")
    a = int(m.group(1))
    b = int(m.group(2)) if m.group(2) is not None else a
    if b < a:
        raise ValueError(f"steps {a}-{b}: the range ends before it starts")
    if b - a + 1 > MAX_STEP_SPAN:
        raise ValueError(f"steps {a}-{b}: {b - a + 1} steps, at most {MAX_STEP_SPAN} per query")
    comm = q.get("comm") or ""
    if comm and not COMM_RE.fullmatch(comm):
        raise ValueError("comm must be a communicator id or a group name (1-64 of [A-Za-z0-9_.:>-])")
    op = q.get("op") or ""
    if op and not OP_RE.fullmatch(op):
        raise ValueError("op must be an op kind such as all_reduce (1-32 of [A-Za-z0-9_])")
    try:
        limit = int(q.get("limit") or DEFAULT_LIMIT)
    except ValueError:
        raise ValueError(f"limit must be an integer, not {q.get('limit')!r}") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be in [1, {MAX_LIMIT}], not {limit}")
    return OpsQuery(rank=rank, step_from=a, step_to=b, comm=comm, op=op, limit=limit)


class OpsGap(msgspec.Struct, kw_only=True):
    """Consecutive spool lines in or next to the range that did not decode: records lost there, not skipped."""

    offset: int  # byte offset in the spool file
    lines: int
    nbytes: int
    after_step: int  # the last good record's step before them (-1: none read before them)
    sample: str = ""  # their first bytes, for a person


class OpsAnswer(msgspec.Struct, kw_only=True):
    """What ``GET /ops`` answers: the raw records in the spool's order (by step, then as the rank wrote them)."""

    run_id: str
    node: int
    rank: int
    step_from: int
    step_to: int
    comm: str = ""
    op: str = ""
    limit: int
    ops: list[CollectiveRecord]
    truncated: bool  # more records matched than ``limit``: ask again with a smaller range (or a filter)
    damaged_lines: int  # lines read that did not decode (each run of them is one of ``gaps``)
    gaps: list[OpsGap] = []
    bytes_read: int = 0  # of the spool file, for this answer
    spool_bytes: int = 0  # the spool file's size when read


def decode_answer(body: bytes) -> OpsAnswer:
    """An answer as the agent (or the head, forwarding it) sent it; ValueError when it is not one."""
    try:
        return msgspec.json.decode(body, type=OpsAnswer)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"not an ops answer: {e}") from None
