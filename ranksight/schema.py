"""Every record type ranksight writes, ships or stores, in one place.

Data flows one way: trainer -> probes -> agent -> store -> analyzers -> surfaces.
Each hop speaks these types, so a field added here is visible end to end.

Records are msgspec Structs: typed, fast to encode/decode as JSON lines (the
trainer's spool) and cheap to turn into dicts for pandas/Parquet (the store).

Conventions
- Wall-clock times are Unix seconds (float, ``time.time()``), durations are
  milliseconds and named ``*_ms``; sizes are bytes.
- Each table has a natural key the head deduplicates on (``ranksight/tables.py: KEYS``);
  step records: ``rank`` + ``attempt`` + ``step`` within a run, so steps redone after a
  restart are kept; collectives: ``rank`` + ``attempt`` + ``step`` + ``group`` + ``seq``.
- ``simulated`` is True for anything that did not come from real hardware
  (GPU telemetry on a CPU machine, a peak-FLOPs estimate); every surface prints it.
- msgspec encodes NaN/inf floats as JSON null, so non-finite values carry a flag
  (``loss_nonfinite``) instead of relying on the number.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Literal, Union

import msgspec

# Bumped when a stored table changes incompatibly; readers refuse newer stores.
SCHEMA_VERSION = 1

Severity = Literal["info", "warning", "critical"]
SEVERITY_ORDER = {"info": 0, "warning": 1, "critical": 2}

# Kinds of fault the trainer can inject (ground truth for every analyzer).
FAULT_KINDS = (
    "slow_rank",  # compute x factor on one rank
    "slow_link",  # extra delay_ms on one rank's collectives / p2p
    "throttle",  # compute slowdown + simulated GPU clocks and throttle reasons
    "fp16_overflow",  # forces inf gradients
    "nan_loss",  # NaN loss on a rank
    "hang",  # a rank stops at a collective
    "data_stall",  # extra data-loader wait on a rank
    "xid",  # an XID event on a node's simulated GPU
    "few_microbatches",  # pipeline run with too few micro-batches (config fault)
)

# Finding kinds are a public contract (diagnose --json): add, never rename.
FINDING_KINDS = (
    "straggler",
    "comm_bottleneck",
    "pipeline_bubble",
    "mfu_drop",
    "fp16_overflow",
    "hang",
    "gpu_health",
    "data_stall",
    "memory_pressure",
    # from logs a user brings (ranksight logs; diagnose over logs stored with a run)
    "nccl_error",  # an NCCL WARN/error: IB completion, QP/MR setup, socket, CUDA, system, internal
    "network_fallback",  # traffic on a slower transport than the hardware offers (Socket instead of IB, no GDR)
    "topology",  # info: nodes, ranks, transports, NICs, GDR
    "collective_mismatch",  # ranks disagree on a collective: op type, size, sequence number
    "nan",  # NaN/Inf in loss or gradients (a framework's assertion, not an injected fault)
    "slowdown",  # iterations slower over time (a per-iteration training log)
    "benchmark",  # a collective benchmark's result against what the interconnect should give
    "clock_skew",  # a node's clock off from the head's (live): liveness is judged on the head's clock
)

# Store tables: each is a directory of Parquet files under <store>/<run-id>/.
STORE_TABLES = (
    "steps",
    "collectives",
    "communicators",
    "events",
    "gpu",
    "xid",
    "host",
    "nccl_events",
    "trace_summaries",
    "findings",
    "actions",
)


class Record(msgspec.Struct, kw_only=True, tag_field="kind", forbid_unknown_fields=False):
    """Base of every record that travels through the spool/OTLP path."""


# --------------------------------------------------------------------------
# Written by the trainer (one spool file per rank)
# --------------------------------------------------------------------------


class StepRecord(Record, tag="step", kw_only=True):
    """One training step on one rank. Timings come from the rank itself."""

    run_id: str
    rank: int
    step: int
    node: int
    host: str
    attempt: int = 0  # torchrun restart count (TORCHELASTIC_RESTART_COUNT)
    world_size: int
    pp_stage: int = 0
    dp_rank: int = 0
    tp_rank: int = 0
    t_start: float
    t_end: float
    step_ms: float
    data_ms: float = 0.0  # waiting for the next batch
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    optimizer_ms: float = 0.0
    comm_ms: float = 0.0  # time blocked in collectives (exposed communication)
    pipeline_wait_ms: float = 0.0  # time blocked in pipeline p2p (bubble)
    compute_ms: float = 0.0  # step_ms - data - comm - pipeline wait: the rank's own work
    sync_arrival: float | None = None  # wall time this rank reached the step's gradient sync
    sync_wait_ms: float | None = None  # how long it then waited for the slowest peer
    tokens: int = 0
    loss: float | None = None
    loss_nonfinite: bool = False
    grad_norm: float | None = None
    loss_scale: float | None = None  # GradScaler scale after the step (fp16 only)
    overflow: bool = False  # GradScaler found inf/nan gradients
    skipped: bool = False  # optimizer step skipped
    lr: float = 0.0
    mem_bytes: int = 0  # peak memory this step (CUDA max allocated, or RSS on CPU)
    flops: float = 0.0  # model FLOPs this rank did this step (PaLM convention)
    profiling: bool = False  # the profiler was active during this step
    microbatches: int = 1
    # The device's own busy time this step, free of host scheduling noise. CUDA: the training stream's span over
    # the step less the spans it waited for communication, pipeline peers and input copies (CUDA events, read back
    # without a device sync). CPU runs (a SIMULATED device): the training thread's CPU time (intra-op threads = 1)
    # less the CPU it spent inside collectives. Nothing is added or subtracted from knowledge of a fault.
    # None where not measured: analyzers fall back to compute_ms.
    device_ms: float | None = None


class CollectiveRecord(Record, tag="collective", kw_only=True):
    """One collective (or p2p op) as one rank saw it: when it arrived, how long it took."""

    run_id: str
    rank: int
    step: int
    seq: int  # per-rank, per-group sequence number
    op: str  # all_reduce, reduce_scatter, all_gather, send, recv, ...
    group: str  # dp, tp, pp, world
    # The group's members: named by ``comm_id`` (its ``CommunicatorRecord``, stored once per group) by what
    # ranksight.instrument writes; a list here is the older form (and what other writers may still send).
    group_ranks: list[int] = []
    nbytes: int = 0
    t_arrive: float  # wall time the rank entered the collective
    t_done: float | None = None  # None: never completed (hang)
    duration_ms: float | None = None
    attempt: int = 0  # torchrun restart count: a re-formed job's process groups (and seq numbers) are new ones
    comm_id: str = ""  # the group's CommunicatorRecord (``communicator_id``); "" in the older form
    # How many op instances this record stands for. 1: one op, as the rank recorded it. More: a node agent folded a
    # step's ops of one kind on one communicator into one record (ranksight/collective_fold.py): t_arrive, t_done
    # and duration_ms are then the ops' means, nbytes their total, seq the first op's.
    ops: int = 1


class CommunicatorRecord(Record, tag="communicator", kw_only=True):
    """One process group's members, written once per group (by its lowest rank) so that collective records carry
    only its id: the members of the world group are not repeated in every record of every rank."""

    run_id: str
    comm_id: str  # communicator_id(group, ranks, attempt): the same on every member
    group: str  # dp, tp, pp, world, pp:<src>><dst>
    ranks: list[int]
    attempt: int = 0
    rank: int  # who wrote it
    step: int = 0  # the step of its first collective


def communicator_id(group: str, ranks: list[int], attempt: int = 0) -> str:
    """A process group's id, the same on every member: a hash of the attempt, the group's name and its members."""
    h = hashlib.blake2b(f"{attempt}|{group}|{','.join(map(str, sorted(ranks)))}".encode(), digest_size=8)
    return h.hexdigest()


class EventRecord(Record, tag="event", kw_only=True):
    """Something that happened on a rank: fault injected, checkpoint saved, control request applied, ..."""

    run_id: str
    rank: int
    step: int
    t: float
    event: str  # fault_start, fault_end, checkpoint, resume, control, evicted, overflow, profile_start, profile_stop, exit
    detail: dict[str, Any] = {}


SpoolRecord = Union[StepRecord, CollectiveRecord, EventRecord, CommunicatorRecord]

# --------------------------------------------------------------------------
# Written by probes in the node agent
# --------------------------------------------------------------------------


class GpuSample(Record, tag="gpu", kw_only=True):
    """One GPU at one instant, from NVML, DCGM or the simulator (``source``)."""

    node: int
    host: str
    gpu: int
    t: float
    source: str  # nvml | dcgm | simulated-nvml | python-sim
    simulated: bool
    name: str = ""
    uuid: str = ""
    util_pct: float | None = None
    mem_util_pct: float | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    temp_c: float | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    max_sm_clock_mhz: float | None = None
    throttle_reasons: int = 0  # NVML clocksThrottleReasons bitmask
    throttle_names: list[str] = []
    ecc_sbe: int | None = None  # volatile single-bit ECC errors
    ecc_dbe: int | None = None  # volatile double-bit ECC errors
    retired_pages: int | None = None
    remapped_rows: int | None = None
    pcie_tx_bytes_s: float | None = None
    pcie_rx_bytes_s: float | None = None
    nvlink_tx_bytes_s: float | None = None
    nvlink_rx_bytes_s: float | None = None
    xid_total: int = 0  # XID events counted by the probe since it started


class XidEvent(Record, tag="xid", kw_only=True):
    node: int
    host: str
    gpu: int
    t: float
    code: int
    source: str
    simulated: bool


class HostSample(Record, tag="host", kw_only=True):
    node: int
    host: str
    t: float
    cpu_pct: float
    load1: float
    mem_used_bytes: int
    mem_total_bytes: int
    net_rx_bytes: int
    net_tx_bytes: int
    disk_read_bytes: int
    disk_write_bytes: int


class NcclEvent(Record, tag="nccl", kw_only=True):
    """One meaningful line (or group of lines) from an NCCL_DEBUG log."""

    host: str
    pid: int
    t: float | None  # NCCL lines carry no date; None when unknown
    category: str  # version, init, transport, channel, ring, tree, plugin, warn, error, watchdog, unclassified
    rank: int | None = None
    nranks: int | None = None
    peer: int | None = None
    comm_id: str = ""
    transport: str = ""  # P2P/IPC, P2P/CUMEM, SHM, NET/IB, NET/Socket, NVLS, CollNet, PXN
    error_class: str = ""  # ib_completion, ibv_failure, socket, cuda, system, timeout, abort, ...
    message: str = ""
    fields: dict[str, Any] = {}
    source_file: str = ""
    line_no: int = 0


class TraceSummary(Record, tag="trace_summary", kw_only=True):
    """What the profiler probe made of one rank's Kineto trace."""

    run_id: str
    rank: int
    step_start: int
    step_end: int
    trace_file: str
    wall_ms: float
    compute_ms: float
    comm_ms: float
    overlap_ms: float  # communication hidden under compute
    idle_ms: float  # the window with nothing on the device: no kernel, no memcpy, no memset
    copy_ms: float = 0.0  # GPU: memcpy/memset time not under a kernel (busy, neither compute nor communication)
    top_ops: list[dict[str, Any]] = []  # [{"name", "total_ms", "count"}]
    collectives: list[dict[str, Any]] = []  # [{"name", "ts", "dur_ms", "bytes"}]
    device: str = "cpu"
    truncated: bool = False  # the trace ended early; the numbers cover what was read
    notes: list[str] = []  # how the summary was made (truncation, rank source, caps)


# --------------------------------------------------------------------------
# Produced by analyzers and the action policy
# --------------------------------------------------------------------------


class Finding(msgspec.Struct, kw_only=True):
    """What an analyzer concluded. Same shape on every surface (diagnose --json, API, TUI, alerts)."""

    analyzer: str
    kind: str  # one of FINDING_KINDS
    severity: Severity
    ranks: list[int] = []
    nodes: list[int] = []
    step_start: int | None = None
    step_end: int | None = None
    evidence: dict[str, Any] = {}  # numbers, not adjectives
    recommendation: str = ""
    confidence: float = 1.0
    summary: str = ""  # one line a person reads first
    hosts: list[str] = []  # host names where nodes are not numbered (logs a user brings)
    gpus: list[str] = []  # GPU ids as the input names them: index, PCI bus id, UUID
    inputs: list[str] = []  # the files a finding from logs rests on
    run_id: str = ""
    t: float = 0.0  # when it was first detected
    simulated: bool = False  # rests on simulated telemetry or a simulated peak
    # Live findings (the head): one episode keeps its id across analysis rounds while its step_end, severity and
    # evidence move; ``updated`` is the round that last changed it, ``status`` "open" while the condition is still
    # seen at the run's latest steps, "closed" once it is not. Post-mortem (diagnose) leaves them empty.
    id: str = ""
    status: str = ""
    updated: float = 0.0


class Action(msgspec.Struct, kw_only=True):
    """A request the head sent (or would send, in dry-run) to the job, and its fate."""

    run_id: str
    id: str
    t: float
    action: Literal["checkpoint", "profile", "evict"]
    node: int | None = None
    ranks: list[int] = []
    steps: int = 0  # for profile: how many steps
    reason: str = ""
    finding_kind: str = ""
    dry_run: bool = False
    status: str = "requested"  # requested, applied, refused, failed
    applied_step: int | None = None
    requested_by: str = ""
    # an evict a person forced past the policy's limits (already evicted, cooldown, eviction budget, last node);
    # ``reason`` says why and ``requested_by`` who. False in rows stored before the field existed.
    force: bool = False


# --------------------------------------------------------------------------
# The control channel: agent -> trainer, read by rank 0 at step boundaries
# --------------------------------------------------------------------------


# A profile request's steps travel to every rank as an int64 tensor and name a number of profiled steps: no profile
# needs more than this, and a larger value (2**63) made every rank fail at the same step, at every restart
MAX_PROFILE_STEPS = 100_000


class ControlRequest(msgspec.Struct, kw_only=True):
    id: str
    action: Literal["checkpoint", "profile", "evict"]
    t: float
    steps: int = 0  # profile: number of steps to trace
    node: int | None = None  # evict: the node whose ranks leave the job
    reason: str = ""


class ControlAck(msgspec.Struct, kw_only=True):
    id: str
    action: str
    applied_step: int
    t: float
    status: str = "applied"  # applied | refused
    detail: str = ""


# --------------------------------------------------------------------------
# The run manifest (run.json)
# --------------------------------------------------------------------------


class FaultSpec(msgspec.Struct, kw_only=True):
    """One injected fault, as given with ``--inject KIND:key=value,...``."""

    kind: str
    rank: int | None = None
    node: int | None = None
    factor: float | None = None
    delay_ms: float | None = None
    rate_mbit: float | None = None  # slow_link on a node with its own network namespace: the egress rate limit
    code: int | None = None
    start: int = 0
    end: int | None = None  # inclusive last step; None = until the end
    onset_t: float | None = None  # wall time the fault first took effect (filled in by the trainer)


class RankPlacement(msgspec.Struct, kw_only=True):
    rank: int
    node: int
    host: str
    local_rank: int
    pp_stage: int
    dp_rank: int
    tp_rank: int
    gpu: int | None = None


class Manifest(msgspec.Struct, kw_only=True):
    run_id: str
    schema_version: int = SCHEMA_VERSION
    ranksight_version: str = ""
    created: float
    start_time: float
    config: dict[str, Any] = {}
    layout: dict[str, Any] = {}  # {"dp", "tp", "pp", "world", "pp_schedule", "microbatches", "virtual_stages"}
    nodes: int = 1
    ranks: list[RankPlacement] = []
    backend: str = "gloo"
    device: str = "cpu"
    flops_per_token: float = 0.0
    params: int = 0
    peak_flops: float = 0.0  # per device
    peak_source: str = ""  # e.g. "device table: H100 SXM bf16" or "measured fp32 matmul on this CPU"
    peak_simulated: bool = False
    faults: list[FaultSpec] = []
    attempts: list[dict[str, Any]] = []  # one entry per (re)start: {"attempt", "t", "world_size", "resumed_step"}
    finished: float | None = None


# --------------------------------------------------------------------------
# Encoding helpers
# --------------------------------------------------------------------------

_spool_decoder = msgspec.json.Decoder(SpoolRecord)
_encoder = msgspec.json.Encoder()


def encode(obj: msgspec.Struct) -> bytes:
    return _encoder.encode(obj)


def decode_spool_line(line: bytes) -> SpoolRecord:
    """Decode one spool line; raises msgspec.DecodeError on garbage."""
    return _spool_decoder.decode(line)


def read_manifest(path: str | os.PathLike) -> Manifest | None:
    """The manifest at ``path`` (a run's run.json), or None while it is missing or unreadable (not written yet,
    being replaced, or not a manifest)."""
    try:
        with open(path, "rb") as f:
            return msgspec.json.decode(f.read(), type=Manifest)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def to_dict(obj: msgspec.Struct) -> dict[str, Any]:
    return msgspec.to_builtins(obj)


def severity_at_least(sev: str, floor: str) -> bool:
    return SEVERITY_ORDER[sev] >= SEVERITY_ORDER[floor]
