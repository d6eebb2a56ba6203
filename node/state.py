"""What the node agent remembers across restarts: how far each source has shipped (``RunDir.agent_state(node)``).

One JSON object (``AgentState``), rewritten whole after every cycle that moved a position. Every source owns one
field and changes it only in its ``commit()`` (node/sources), that is once the records it read are acknowledged
by the head or durable in the outbox. A lost or unreadable file makes the agent read everything again from the
start; the head drops what it already has by natural key, so nothing is lost and nothing doubles.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec

from ranksight.layout import atomic_write
from ranksight.spool import TailPosition

log = logging.getLogger("ranksight.agent")


class AgentState(msgspec.Struct, kw_only=True):
    """The state file's content. Field names and types are the file format: an agent restarted after an upgrade
    resumes from the file its predecessor wrote, so fields are only ever added, with a default."""

    node: int
    positions: dict[int, TailPosition] = {}  # spool of rank -> where it was read up to (node.sources.spool)
    acks_shipped: list[str] = []  # control ack file names already shipped (node.sources.control_acks)
    manifest_mtime: float = 0.0  # mtime of the manifest the head acknowledged (node.sources.manifest)
    nccl: dict[str, list[int]] = {}  # NCCL log file name -> [offset, line_no, inode] (node.sources.nccl)
    traces_done: list[str] = []  # profiler trace files already summarized and shipped (node.sources.traces)


def load_state(path: Path, node: int) -> AgentState:
    try:
        st = msgspec.json.decode(path.read_bytes(), type=AgentState)
        if st.node != node:
            log.error("agent state %s belongs to node %d, not %d: starting from scratch", path, st.node, node)
            return AgentState(node=node)
        return st
    except FileNotFoundError:
        return AgentState(node=node)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
        # Re-reading from 0 re-ships records the head already has; it drops them. Nothing is lost.
        log.error("agent state %s unreadable (%s): re-reading spools from the start", path, e)
        return AgentState(node=node)


class StateFile:
    """The agent's state (``.state``, loaded at start) and the file it is saved to."""

    def __init__(self, path: Path, node: int):
        self.path = path
        self.state = load_state(path, node)
        self._saved: bytes | None = None  # the file's content as last written by this process

    def save(self) -> None:
        """Atomic, not fsynced, and skipped when nothing changed. The positions only ever move past records
        that are acknowledged by the head or durable (fsynced) in the outbox, so a state file that a power
        loss leaves stale or empty only makes the agent re-read records the head already has; it drops them
        by natural key (the same as a ``kill -9`` between shipping and saving)."""
        data = msgspec.json.encode(self.state)
        if data == self._saved:
            return
        atomic_write(self.path, data, durable=False)
        self._saved = data
