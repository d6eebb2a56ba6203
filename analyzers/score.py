"""Score findings against injected ground truth (``Manifest.faults``): precision, recall, latency.

- A finding *matches* a fault when its kind is one the fault explains (``FAULT_KINDS_MAP``), it names
  the fault's target, and its steps overlap the fault's (± ``tolerance``).
  Naming the target: for rank- and node-scoped kinds (straggler, comm_bottleneck, data_stall, hang,
  gpu_health) every rank it names must be the faulty rank (or a rank of the faulty node) — a finding
  that also blames a victim is a false positive; world-scoped kinds (fp16_overflow, mfu_drop,
  pipeline_bubble, and a comm_bottleneck about the whole job: ``scored_kind``) must include the target when they
  name ranks.
- *Recall*: faults matched by a finding of a *primary* kind at or above ``min_severity``.
- *Precision*: findings at or above ``min_severity`` that match some fault (primary or a consequence,
  e.g. the MFU drop a straggler causes), over all such findings. A clean run's findings are all false.
- *Latency*: steps from the fault's start to the step the finding was confirmed
  (``evidence.detected_at_step``, else its ``step_start``); *onset error*: its named onset minus the start.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from ranksight.schema import SEVERITY_ORDER, FaultSpec, Finding, Manifest

# fault kind -> (primary finding kinds, consequence kinds)
FAULT_KINDS_MAP: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "slow_rank": (("straggler",), ("mfu_drop",)),
    # a slow link between pipeline stages makes the bubble: the stages wait for each other's transfers; and the job's
    # communication grows (a world-scoped comm finding, which names no culprit: "comm_world")
    "slow_link": (("comm_bottleneck",), ("mfu_drop", "pipeline_bubble", "comm_world")),
    "throttle": (("gpu_health", "straggler"), ("mfu_drop", "straggler", "gpu_health")),
    "fp16_overflow": (("fp16_overflow",), ()),
    "nan_loss": (("fp16_overflow",), ()),
    "hang": (("hang",), ()),
    "data_stall": (("data_stall",), ("mfu_drop",)),
    "xid": (("gpu_health",), ("hang",)),
    "few_microbatches": (("pipeline_bubble",), ("mfu_drop",)),
}
SCOPED_KINDS = {"straggler", "comm_bottleneck", "data_stall", "hang", "gpu_health"}


def scored_kind(finding: Finding) -> str:
    """The kind a finding is scored as: a comm_bottleneck about the whole job (exposed communication, its growth:
    ``evidence.scope == "world"``) blames nobody in particular, so it is "comm_world", world-scoped like mfu_drop."""
    if finding.kind == "comm_bottleneck" and (finding.evidence or {}).get("scope") == "world":
        return "comm_world"
    return finding.kind


@dataclass
class FaultResult:
    fault: dict[str, Any]
    detected: bool
    latency_steps: int | None = None
    onset_error_steps: int | None = None
    finding: str = ""
    kinds: list[str] = field(default_factory=list)


@dataclass
class Score:
    precision: float | None
    recall: float | None
    true_positives: int
    false_positives: int
    faults: list[FaultResult]
    false_findings: list[str]
    latencies: list[int]

    @property
    def median_latency(self) -> float | None:
        return statistics.median(self.latencies) if self.latencies else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["median_latency"] = self.median_latency
        return d


def _as_fault(f: Any) -> FaultSpec:
    if isinstance(f, FaultSpec):
        return f
    return FaultSpec(**{k: v for k, v in dict(f).items() if k in FaultSpec.__struct_fields__})


def _targets(fault: FaultSpec, rank_node: dict[int, int]) -> set[int] | None:
    if fault.rank is not None:
        return {int(fault.rank)}
    if fault.node is not None:
        return {r for r, n in rank_node.items() if n == fault.node} or None
    return None


def matches(finding: Finding, fault: FaultSpec, rank_node: dict[int, int], tolerance: int = 3,
            primary_only: bool = False) -> bool:
    primary, secondary = FAULT_KINDS_MAP.get(fault.kind, ((), ()))
    kinds = primary if primary_only else primary + secondary
    kind = scored_kind(finding)
    if kind not in kinds:
        return False
    targets = _targets(fault, rank_node)
    if targets is not None:
        ranks = set(int(r) for r in finding.ranks)
        node_fault = fault.node if fault.node is not None else rank_node.get(fault.rank) if fault.rank is not None else None
        if kind in SCOPED_KINDS:
            if ranks:
                if not ranks <= targets:
                    return False
            elif node_fault is None or list(finding.nodes) != [node_fault]:
                return False
        elif ranks and not (ranks & targets):
            return False
    end = fault.end if fault.end is not None else 10**12
    if finding.step_start is not None and finding.step_start > end + tolerance:
        return False
    f_end = finding.step_end if finding.step_end is not None else finding.step_start
    if f_end is not None and f_end < fault.start - tolerance:
        return False
    return True


def detection_step(f: Finding) -> int | None:
    d = (f.evidence or {}).get("detected_at_step")
    if isinstance(d, (int, float)):
        return int(d)
    return f.step_start


def score(findings: Iterable[Finding], faults: Iterable[Any], rank_node: dict[int, int] | None = None,
          manifest: Manifest | None = None, min_severity: str = "warning", tolerance: int = 3) -> Score:
    if rank_node is None:
        rank_node = {p.rank: p.node for p in manifest.ranks} if manifest is not None else {}
    fs = [f for f in findings if SEVERITY_ORDER[f.severity] >= SEVERITY_ORDER[min_severity]]
    faults = [_as_fault(x) for x in faults]
    results = []
    for fault in faults:
        hits = [f for f in fs if matches(f, fault, rank_node, tolerance, primary_only=True)]
        if not hits:
            results.append(FaultResult(fault=_fault_dict(fault), detected=False))
            continue
        best = min(hits, key=lambda f: (detection_step(f) if detection_step(f) is not None else 10**12))
        ds = detection_step(best)
        results.append(FaultResult(
            fault=_fault_dict(fault), detected=True,
            latency_steps=(ds - fault.start) if ds is not None else None,
            onset_error_steps=(best.step_start - fault.start) if best.step_start is not None else None,
            finding=best.summary, kinds=sorted({f.kind for f in hits}),
        ))
    tp = [f for f in fs if any(matches(f, fault, rank_node, tolerance) for fault in faults)]
    fp = [f for f in fs if f not in tp]
    precision = len(tp) / len(fs) if fs else (None if faults else 1.0)
    recall = sum(r.detected for r in results) / len(results) if results else None
    lat = [r.latency_steps for r in results if r.detected and r.latency_steps is not None]
    return Score(precision=precision, recall=recall, true_positives=len(tp), false_positives=len(fp), faults=results,
                 false_findings=[f"{f.severity} {f.kind} ranks={f.ranks}: {f.summary}" for f in fp], latencies=lat)


def _fault_dict(f: FaultSpec) -> dict[str, Any]:
    import msgspec

    return msgspec.to_builtins(f)
