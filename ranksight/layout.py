"""The run directory: the file contract between the trainer, the agent and the head.

Files are the interface between a training rank and its node agent: a rank only
ever appends to files it owns and never waits on the agent. Everything a run
writes lives under ``<store>/<run-id>/``:

    run.json                       the manifest (ranksight.schema.Manifest)
    spool/rank-<R>.jsonl           step / collective / event records of rank R, one JSON object per line
    nccl/<host>.<pid>.log          NCCL_DEBUG_FILE of each rank (NCCL backend only)
    traces/rank-<R>.<tag>.json[.gz] PyTorch profiler (Kineto) traces
    simgpu/node-<N>/gpu-<I>.state  simulated GPU state (CPU machines), read by the simulated NVML library
    control/requests/<id>.json     control requests for the trainer (checkpoint, profile, evict)
    control/acks/<id>.json         the trainer's acknowledgement (step at which it acted)
    checkpoints/step-<S>/          torch.distributed.checkpoint directories; ``latest`` names the newest complete one
    agent/node-<N>.state           the node agent's saved offsets
    agent/node-<N>.outbox/         records the agent could not deliver yet (head away), oldest first
    agent/node-<N>.exit.json       what the agent left undelivered when it stopped
    <table>/run=<run-id>/hour=<H>/*.parquet   the head's run store tables (ranksight.schema.STORE_TABLES), Hive
                                   partitions; flat <table>/part-*.parquet in older stores (docs/store.md)
    remote.json                    where the head put compacted partitions, when on object storage
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

DEFAULT_STORE = Path("./runs")
# A run id names a directory on every node and the head, and travels in URLs, metric labels and file names: a
# letter or digit first (no hidden or relative names), then letters, digits, '-', '_' and '.', at most 128 in all.
# (A NUL or a newline in one once broke every later listing of the runs.)
RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
RUN_ID_RULE = "a letter or digit, then letters, digits, '-', '_' or '.'; at most 128 characters"


class RunDir:
    """Paths inside one run directory. Pure path arithmetic: creates nothing unless asked."""

    def __init__(self, store: str | os.PathLike, run_id: str):
        if not isinstance(run_id, str) or not RUN_ID_RE.fullmatch(run_id):
            raise ValueError(f"invalid run id {run_id!r}: {RUN_ID_RULE}")
        self.store = Path(store)
        self.run_id = run_id
        self.root = self.store / run_id

    # -- written by the trainer -------------------------------------------
    @property
    def manifest(self) -> Path:
        return self.root / "run.json"

    @property
    def spool_dir(self) -> Path:
        return self.root / "spool"

    def spool(self, rank: int) -> Path:
        return self.spool_dir / f"rank-{rank}.jsonl"

    @property
    def nccl_dir(self) -> Path:
        return self.root / "nccl"

    @property
    def traces_dir(self) -> Path:
        return self.root / "traces"

    @property
    def simgpu_dir(self) -> Path:
        return self.root / "simgpu"

    def simgpu_node_dir(self, node: int) -> Path:
        return self.simgpu_dir / f"node-{node}"

    @property
    def checkpoints_dir(self) -> Path:
        return self.root / "checkpoints"

    # -- control channel -----------------------------------------------------
    @property
    def control_requests(self) -> Path:
        return self.root / "control" / "requests"

    @property
    def control_acks(self) -> Path:
        return self.root / "control" / "acks"

    # -- agent and head -------------------------------------------------------
    def agent_state(self, node: int) -> Path:
        return self.root / "agent" / f"node-{node}.state"

    def agent_rejected(self, node: int) -> Path:
        """The records the head refused, kept aside by the node agent (JSON lines: node/rejected.py)."""
        return self.root / "agent" / f"node-{node}.rejected.jsonl"

    def agent_exit_report(self, node: int) -> Path:
        """What the node agent left undelivered when it stopped (JSON: node.agent.ExitReport)."""
        return self.root / "agent" / f"node-{node}.exit.json"

    def table(self, name: str) -> Path:
        return self.root / name


def atomic_write(path: Path, data: bytes, durable: bool = True) -> None:
    """Write ``data`` to ``path`` so a reader sees the old file or the new one, never half of one.

    ``durable`` also fsyncs before the rename, so the new file survives a power loss. State
    that is rewritten every step and worthless after a crash (the simulated GPU) skips it:
    an fsync per step is milliseconds on the training hot path.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    # the temporary name is the writer's own (process and thread): two threads of the head once wrote the same
    # manifest at once through one name, and the second rename found nothing to rename
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}.{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
