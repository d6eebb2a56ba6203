"""The run's manifest (``RunDir.manifest``, run.json): shipped to the head each time its mtime changes."""

from __future__ import annotations

import logging

import msgspec

from node.sources import Snapshot
from node.state import AgentState
from ranksight import schema, wire
from ranksight.layout import RunDir

log = logging.getLogger("ranksight.agent")


class ManifestSource:
    """The manifest as a ``Snapshot`` (the file's bytes, its mtime as ``wire.A_MTIME``): the head keeps the newest
    one, so it is never put in the outbox; the mtime is committed only once the head acknowledged it."""

    def __init__(self, rd: RunDir, state: AgentState):
        self.rd = rd
        self.state = state
        self._pending: float | None = None

    def collect(self) -> list[Snapshot]:
        self._pending = None
        try:
            mtime = self.rd.manifest.stat().st_mtime
        except FileNotFoundError:
            return []
        if mtime == self.state.manifest_mtime:
            return []
        try:
            body = self.rd.manifest.read_bytes()
            msgspec.json.decode(body, type=schema.Manifest)  # never ship a half-written or foreign file
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("agent: manifest not shippable yet: %s", e)
            return []
        self._pending = mtime
        return [Snapshot(kind="manifest", body=body, attributes={wire.A_MTIME: mtime})]

    def commit(self, acknowledged: bool) -> bool:
        if self._pending is None:
            return False
        if acknowledged:
            self.state.manifest_mtime = self._pending
        self._pending = None
        return True
