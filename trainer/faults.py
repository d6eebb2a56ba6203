"""Fault injection: ``--inject KIND:key=value,...`` -> ranksight.schema.FaultSpec, when each is active, what it does.

Faults are ground truth for the analyzers, so each one does something real on the
rank (sleeps, infs, NaNs, hangs) and is recorded (manifest + spool event) with its
onset step and wall time. Semantics of every kind are in docs/trainer.md.

The training loop applies the faults that act on its own work (data_stall, nan_loss, fp16_overflow,
slow_rank without a pipeline); those that act where the rank communicates (hang, slow_link) or inside a
pipeline stage's chunk (slow_rank) are applied by the instrumentation's hooks, which call this rank's
``FaultState`` there (its ``trainer.instrument.recorder.FaultHook`` methods).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ranksight.schema import FAULT_KINDS, FaultSpec

# Kinds the trainer injects at run time, and the one configuration fault: few_microbatches
# runs the pipeline with the fewest micro-batches its schedule allows (M = pp), so the
# bubble (P-1)/(M+P-1) is as large as it gets. It applies to the whole job.
RUNTIME_KINDS = ("slow_rank", "slow_link", "throttle", "fp16_overflow", "nan_loss", "hang", "data_stall", "xid")
CONFIG_KINDS = ("few_microbatches",)
# Every kind the schema promises to the analyzers is injectable here.
assert set(RUNTIME_KINDS + CONFIG_KINDS) == set(FAULT_KINDS), "trainer.faults out of sync with ranksight.schema"
KEYS = {"rank": int, "node": int, "factor": float, "delay_ms": float, "rate_mbit": float, "code": int, "start": int,
        "end": int}
# Which target each kind needs, and which parameter (with its default when omitted).
NEEDS_TARGET = {k: "rank" for k in RUNTIME_KINDS}
NEEDS_TARGET["xid"] = "node"
DEFAULTS = {
    "slow_rank": {"factor": 2.0},
    "throttle": {"factor": 1.5},
    "slow_link": {"delay_ms": 50.0},
    "data_stall": {"delay_ms": 200.0},
    "xid": {"code": 79},
}


class FaultSpecError(ValueError):
    pass


def parse_fault(text: str) -> FaultSpec:
    """Parse one ``KIND:key=value,...``; raises FaultSpecError with the reason on bad input."""
    kind, sep, rest = text.strip().partition(":")
    kind = kind.strip()
    if kind in CONFIG_KINDS:
        if rest.strip():
            raise FaultSpecError(f"--inject {text!r}: {kind} takes no keys (it applies to the whole job from step 1)")
        return FaultSpec(kind=kind, start=1)
    if kind not in RUNTIME_KINDS:
        known = ", ".join(RUNTIME_KINDS + CONFIG_KINDS)
        raise FaultSpecError(f"--inject {text!r}: unknown fault kind {kind!r}; kinds: {known}")
    values: dict = dict(DEFAULTS.get(kind, {}))
    if rest.strip():
        for item in rest.split(","):
            key, eq, val = item.partition("=")
            key = key.strip()
            if not eq or key not in KEYS:
                raise FaultSpecError(f"--inject {text!r}: bad item {item!r}; use key=value with keys {', '.join(KEYS)}")
            try:
                values[key] = KEYS[key](val.strip())
            except ValueError:
                raise FaultSpecError(f"--inject {text!r}: {key}={val!r} is not a valid {KEYS[key].__name__}") from None
    target = NEEDS_TARGET[kind]
    if values.get(target) is None and not (kind != "xid" and values.get("node") is not None):
        raise FaultSpecError(f"--inject {text!r}: {kind} needs {target}=N")
    if values.get("factor") is not None and values["factor"] < 1.0:
        raise FaultSpecError(f"--inject {text!r}: factor must be >= 1 (a slowdown), got {values['factor']}")
    if values.get("delay_ms") is not None and values["delay_ms"] < 0:
        raise FaultSpecError(f"--inject {text!r}: delay_ms must be >= 0")
    if values.get("rate_mbit") is not None and values["rate_mbit"] <= 0:
        raise FaultSpecError(f"--inject {text!r}: rate_mbit must be > 0")
    start = values.pop("start", 0)
    end = values.pop("end", None)
    if start < 0 or (end is not None and end < start):
        raise FaultSpecError(f"--inject {text!r}: need 0 <= start <= end")
    return FaultSpec(kind=kind, start=start, end=end, **values)


def parse_faults(items: list[str]) -> list[FaultSpec]:
    return [parse_fault(t) for t in items]


def active(spec: FaultSpec, step: int) -> bool:
    return step >= spec.start and (spec.end is None or step <= spec.end)


def apply_config_faults(cfg, specs: list[FaultSpec]) -> None:
    """Configuration faults change the config before anything is built."""
    if any(s.kind == "few_microbatches" for s in specs):
        p = cfg.parallel
        if p.pp < 2:
            raise FaultSpecError("--inject few_microbatches needs --pp > 1 (it starves the pipeline)")
        p.microbatches = p.pp


def targets(spec: FaultSpec, rank: int, node: int) -> bool:
    """A fault hits this rank if it names the rank, or names the node (all its ranks).
    A configuration fault hits every rank."""
    if spec.kind in CONFIG_KINDS:
        return True
    if spec.rank is not None:
        return spec.rank == rank
    return spec.node is not None and spec.node == node


class FaultState:
    """This rank's view of the injected faults at the current step."""

    def __init__(self, specs: list[FaultSpec], rank: int, node: int):
        self.specs, self.rank, self.node = specs, rank, node
        self.step = 0

    def set_step(self, step: int) -> None:
        self.step = step

    def mine(self, kind: str) -> list[FaultSpec]:
        if kind in CONFIG_KINDS:
            return []
        return [s for s in self.specs if s.kind == kind and targets(s, self.rank, self.node) and active(s, self.step)]

    def compute_factor(self) -> float:
        """Multiplier on this rank's compute time (slow_rank and throttle compound)."""
        f = 1.0
        for s in self.mine("slow_rank") + self.mine("throttle"):
            f *= s.factor or 1.0
        return f

    def link_delay_s(self) -> float:
        return sum((s.delay_ms or 0.0) for s in self.mine("slow_link")) / 1000.0

    def data_delay_s(self) -> float:
        return sum((s.delay_ms or 0.0) for s in self.mine("data_stall")) / 1000.0

    def has(self, kind: str) -> bool:
        return bool(self.mine(kind))

    # -- what the faults do, where the instrumentation calls them (trainer.instrument.recorder.FaultHook) ----
    def before_arrival(self, op: str, group: str, announce: Callable[[str, dict], None]) -> None:
        """hang: the rank stops *before* arriving at ``op`` on ``group``: it never arrives, so its peers block in
        it until the process-group timeout fires. ``announce`` writes the ``hang_entered`` event first, so the
        spool shows everything up to the hang. Sleeping in a plain loop keeps the process killable."""
        if self.has("hang"):
            announce("hang_entered", {"op": op, "group": group, "simulated_fault": True})
            while True:
                time.sleep(3600)

    def delay_send(self) -> float:
        """slow_link: this rank's data leaves late. Sleeps the delay; returns the seconds actually slept."""
        delay = self.link_delay_s()
        if delay <= 0:
            return 0.0
        t0 = time.perf_counter()
        time.sleep(delay)
        return time.perf_counter() - t0

    def slow_compute(self, compute_s: float) -> float:
        """slow_rank / throttle: this rank's compute takes factor x as long. ``compute_s`` is the CPU time of the
        work being slowed, so the slow-down is a fixed share of the simulated device's time, not of the host's
        scheduling noise. Sleeps ``(factor - 1) x compute_s``; returns that, the simulated device's extra busy
        time (a sleep's overshoot on a busy host is host scheduling noise, which device time leaves out)."""
        f = self.compute_factor()
        if f > 1.0 and compute_s > 0:
            time.sleep((f - 1.0) * compute_s)
            return (f - 1.0) * compute_s
        return 0.0
