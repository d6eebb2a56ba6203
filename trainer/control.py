"""The control channel: requests from the agent/head, acted on by every rank at the same step.

At each step boundary rank 0 lists ``<run>/control/requests/*.json`` (ControlRequest),
takes the oldest one that has no ack yet, validates it, and broadcasts it as a small int
tensor ``[action, steps, node]``; every rank then acts on it at this same step. Rank 0
writes ``<run>/control/acks/<id>.json`` (ControlAck) with the step it acted at, or
status "refused" and the reason (then nothing is broadcast).

What this costs a step (it runs with ``--no-instrument`` too):

- rank 0 reads the requests folder only when it changed: its modification time moves whenever a
  request is written (``atomic_write`` renames into it). Listing and decoding every old request
  each step would cost time growing with the requests a run has seen. The folder is read every step
  while its last change is under ``RESCAN_RECENT_S`` old: a change within the same clock tick
  as the last read would not move the time stamp;
- the broadcast goes over a gloo group on the CPU when the job's device is a GPU: an int tensor
  broadcast with NCCL and read back with ``.cpu()`` would wait for the GPU's queue to drain at
  every step, so the host could never run ahead of the device.

Evict protocol (the launcher relies on it exactly; see docs/trainer.md):
  1. all ranks save a checkpoint at step S (complete, ``latest`` updated);
  2. ranks on node N write EventRecord "evicted", atomically write
     ``<run>/control/evicted/node-N``, and, under torchrun, SIGTERM their parent (the
     node's torchrun agent) and ``os._exit(0)``;
  3. ranks on other nodes write EventRecord "reform", sleep ~3 s (node N's agent must be
     gone before they re-rendezvous) and ``os._exit(75)`` so their torchrun restarts the
     worker group, which re-forms at the smaller world and resumes from ``latest``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from ranksight.layout import RunDir, atomic_write
from ranksight.schema import MAX_PROFILE_STEPS, ControlAck, ControlRequest, encode

ACTIONS = {"checkpoint": 1, "profile": 2, "evict": 3}
ACTION_NAMES = {v: k for k, v in ACTIONS.items()}
REFORM_EXIT_CODE = 75
REFORM_SLEEP_S = 3.0
RESCAN_RECENT_S = 2.0  # the requests folder is read every step while its last change is this recent


def evicted_marker(run: RunDir, node: int) -> Path:
    return run.root / "control" / "evicted" / f"node-{node}"


def pending_requests(run: RunDir) -> list[tuple[ControlRequest | None, Path, str]]:
    """Requests without an ack, oldest first (by their ``t``, then file name).
    Unreadable files come back as (None, path, error) so they can be refused."""
    out = []
    d = run.control_requests
    if not d.is_dir():
        return []
    for path in sorted(d.glob("*.json")):
        try:
            req = msgspec.json.decode(path.read_bytes(), type=ControlRequest)
        except (msgspec.DecodeError, msgspec.ValidationError, OSError) as e:
            if not (run.control_acks / path.name).exists():
                out.append((None, path, str(e)))
            continue
        if (run.control_acks / f"{req.id}.json").exists():
            continue
        out.append((req, path, ""))
    out.sort(key=lambda r: (r[0].t if r[0] is not None else 0.0, r[1].name))
    return out


def validate(req: ControlRequest, nodes: set[int], min_nodes: int) -> str:
    """'' if the request can be applied, else why it is refused."""
    if req.action == "profile" and not 1 <= req.steps <= MAX_PROFILE_STEPS:
        return f"profile needs 1 <= steps <= {MAX_PROFILE_STEPS} (got {req.steps})"
    if req.action == "evict":
        if req.node is None:
            return "evict needs a node"
        if req.node not in nodes:
            return f"unknown node {req.node}; nodes in this job: {sorted(nodes)}"
        left = len(nodes) - 1
        if left < min_nodes:
            return f"evicting node {req.node} would leave {left} node(s), below --min-nodes {min_nodes}"
    return ""


def write_ack(run: RunDir, req_id: str, action: str, step: int, status: str = "applied", detail: str = "") -> None:
    ack = ControlAck(id=req_id, action=action, applied_step=step, t=time.time(), status=status, detail=detail)
    atomic_write(run.control_acks / f"{req_id}.json", encode(ack))


class ControlChannel:
    def __init__(self, run: RunDir, rank: int, nodes: set[int], min_nodes: int, device, recorder=None):
        self.run, self.rank, self.nodes, self.min_nodes = run, rank, nodes, min_nodes
        self.device, self.recorder = device, recorder
        self.current: ControlRequest | None = None  # rank 0: the request being applied
        self._seen: tuple[int, int] | None = None  # rank 0: (inode, mtime ns) of the folder when nothing was pending
        # Collective: every rank builds its channel at the same point of the loop's set-up.
        self.group = dist.new_group(backend="gloo") if torch.device(device).type != "cpu" else None

    def _next_request(self, step: int) -> ControlRequest | None:
        """Rank 0: the oldest valid request without an ack (refusing the invalid ones on the way); None at once
        while the folder is as it was when the last read found nothing to do."""
        try:
            st = os.stat(self.run.control_requests)
        except OSError:
            return None  # no folder: no request
        key = (st.st_ino, st.st_mtime_ns)
        if key == self._seen and time.time_ns() - st.st_mtime_ns > RESCAN_RECENT_S * 1e9:
            return None
        self._seen = None
        for req, path, err in pending_requests(self.run):
            if req is None:
                write_ack(self.run, path.stem, "unknown", step, "refused", f"unreadable request: {err}")
                continue
            why = validate(req, self.nodes, self.min_nodes)
            if why:
                write_ack(self.run, req.id, req.action, step, "refused", why)
                continue
            return req
        self._seen = key  # nothing pending as of that state of the folder
        return None

    def poll(self, step: int) -> tuple[str | None, int, int | None]:
        """Collective: every rank calls it at the same step boundary. Returns (action, steps, node)."""
        msg = torch.zeros(3, dtype=torch.int64)
        self.current = None
        if self.rank == 0:
            req = self._next_request(step)
            if req is not None:
                self.current = req
                msg[0] = ACTIONS[req.action]
                msg[1] = req.steps
                msg[2] = -1 if req.node is None else req.node
        if self.group is None:
            msg = msg.to(self.device)
        if self.recorder is not None:
            self.recorder.timed("broadcast", "world", dist.broadcast, msg, src=0, group=self.group, nbytes=24)
        else:
            dist.broadcast(msg, src=0, group=self.group)
        code, steps, node = (int(v) for v in msg.cpu())
        if code == 0:
            return None, 0, None
        return ACTION_NAMES[code], steps, (None if node < 0 else node)

    def ack(self, step: int, detail: str = "") -> None:
        if self.rank == 0 and self.current is not None:
            write_ack(self.run, self.current.id, self.current.action, step, "applied", detail)
