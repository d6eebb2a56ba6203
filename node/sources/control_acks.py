"""The trainer's acknowledgements of control requests (``RunDir.control_acks/<id>.json``), shipped back to the
head (kind ``ack``) so it can update the action's status."""

from __future__ import annotations

import logging
import os
import time

import msgspec

from node.outbox import Item
from node.state import AgentState
from ranksight import schema
from ranksight.layout import RunDir

log = logging.getLogger("ranksight.agent")


class AckSource:
    """Every ack file not shipped yet (``AgentState.acks_shipped``: the last 10,000 file names)."""

    def __init__(self, rd: RunDir, state: AgentState):
        self.rd = rd
        self.state = state
        self._pending: list[str] = []

    def collect(self) -> list[Item]:
        self._pending = []
        d = self.rd.control_acks
        try:
            names = sorted(n for n in os.listdir(d) if n.endswith(".json") and not n.startswith("."))
        except FileNotFoundError:
            return []
        done = set(self.state.acks_shipped)
        acks = []
        for n in names:
            if n in done:
                continue
            try:
                acks.append(msgspec.json.decode((d / n).read_bytes(), type=schema.ControlAck))
                self._pending.append(n)
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
                log.warning("agent: unreadable control ack %s: %s", n, e)
        if not acks:
            return []
        return [Item(kind="ack", body=msgspec.json.encode(acks), count=len(acks), t_first=time.time())]

    def commit(self, acknowledged: bool) -> bool:
        had = bool(self._pending)
        if had:
            self.state.acks_shipped = sorted(set(self.state.acks_shipped) | set(self._pending))[-10_000:]
        self._pending = []
        return had
