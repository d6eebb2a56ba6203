"""The node agent's sources: one object per signal it ships, walked in order every cycle (node/agent.py).

Like prometheus-client's registry of collectors, the agent holds a list of sources and asks each one for what it
has. A source here also remembers how far it has shipped, so the protocol has two calls:

- ``collect() -> list[Item | Snapshot]``: what is new since the last commit. The source reads from its
  committed position in the agent state and keeps the position after what it returned as *pending*; nothing
  in the state moves yet.
- ``commit(acknowledged) -> bool``: the items of the last ``collect()`` are safe, acknowledged by the head
  (``acknowledged=True``) or durable in the outbox (``False``); the source moves its field of the agent state
  (node/state.py) to the pending position. Returns True when it had something to commit (the state file is
  then saved).

``Item`` (node/outbox.py) is durable data: when the head is away it goes to the outbox and the positions move on
anyway. A ``Snapshot`` is the latest value of something the head keeps one of (the manifest; the agent adds its
heartbeat): it travels only in a direct export to the head, never in the outbox, and a source commits it only
when ``acknowledged``, so it is collected again until the head has it.

The sources, in the order the agent walks them (the order of the log records in an export):

- ``spool.SpoolSource``: the local ranks (discovery) and their spool records, spool gaps as events
- ``samples.SampleSource``: GPU, host and XID samples taken by the sampler thread (NVML, simulated, DCGM, /proc)
- ``nccl.NcclLogSource``: this host's NCCL debug logs, parsed
- ``traces.TraceSource``: summaries of the local ranks' finished profiler traces
- ``control_acks.AckSource``: the trainer's acknowledgements of control requests
- ``manifest.ManifestSource``: the run's manifest, when it changed
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from node.outbox import Item


class Snapshot(msgspec.Struct, frozen=True):
    """One OTLP log record sent only in a direct export to the head (never kept in the outbox).

    ``attributes``: log record attributes besides the ones every ranksight record has (run, kind, node)."""

    kind: str
    body: bytes
    attributes: dict = {}


class Source(Protocol):
    def collect(self) -> list[Item | Snapshot]:
        """What is new since the last commit; the position after it is kept as pending."""
        ...

    def commit(self, acknowledged: bool) -> bool:
        """Move this source's saved position to the pending one. True when there was something to commit."""
        ...
