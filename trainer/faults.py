"""Fault injection: ``--inject KIND:key=value,...`` -> ranksight.schema.FaultSpec, when each is active, what it does.

Faults are ground truth for the analyzers, so each one acts physically on the rank and is then found like a real
one: extra compute (slow_rank, throttle), a slower transport (slow_link), a late loader (data_stall), infs and NaNs,
a rank that stops (hang). This module is the only code of the job that reads the fault spec: the instrumentation
(``ranksight.instrument``) and every signal know nothing of it. The onset of each fault is recorded for scoring
(manifest + a ``fault_start`` spool event). Semantics of every kind are in docs/trainer.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ranksight.schema import FAULT_KINDS, FaultSpec
from ranksight.simgpu import THROTTLE_HW_THERMAL, THROTTLE_SW_POWER_CAP

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
    """This rank's view of the injected faults at the current step, and what they do."""

    def __init__(self, specs: list[FaultSpec], rank: int, node: int, local_rank: int = 0, device: str = "cpu"):
        self.specs, self.rank, self.node, self.local_rank = specs, rank, node, local_rank
        self.step = 0
        self.burner = ComputeBurner(device)
        self.shaper = None  # trainer.netfault.LinkShaper when this node has its own network namespace
        self.shaping = False
        self._announced: set[int] = set()
        self._ended: set[int] = set()
        self._xids_done: set[int] = set()
        self._patched: list[tuple] = []  # (module, name, original) replaced by install_transport_delay

    def set_step(self, step: int) -> None:
        self.step = step

    def mine(self, kind: str) -> list[FaultSpec]:
        if kind in CONFIG_KINDS:
            return []
        return [s for s in self.specs if s.kind == kind and targets(s, self.rank, self.node) and active(s, self.step)]

    def has(self, kind: str) -> bool:
        return bool(self.mine(kind))

    def compute_factor(self) -> float:
        """Multiplier on this rank's compute time (slow_rank and throttle compound)."""
        f = 1.0
        for s in self.mine("slow_rank") + self.mine("throttle"):
            f *= s.factor or 1.0
        return f

    def data_delay_s(self) -> float:
        return sum((s.delay_ms or 0.0) for s in self.mine("data_stall")) / 1000.0

    def link_delay_s(self) -> float:
        """slow_link's delay per operation where it is not a rate limit on this node's own interface."""
        return sum((s.delay_ms or 0.0) for s in self.mine("slow_link")
                   if not (self.shaper is not None and s.rate_mbit)) / 1000.0

    # -- each step ---------------------------------------------------------------------------
    def begin_step(self, step: int, event: Callable[..., None], manifest=None) -> None:
        """Step ``step`` starts: announce faults that start or end here (``fault_start``/``fault_end`` events on
        the ranks they hit; their onset in rank 0's manifest, for scoring), shape this node's link for a
        slow_link, and stop here for a hang."""
        self.step = step
        for i, s in enumerate(self.specs):
            if i not in self._announced and active(s, step):
                self._announced.add(i)
                if manifest is not None and manifest.m is not None and manifest.m.faults[i].onset_t is None:
                    manifest.m.faults[i].onset_t = time.time()
                    manifest.write()
                if targets(s, self.rank, self.node):
                    event("fault_start", {"index": i, "fault": spec_dict(s), "simulated_fault": True})
            if i in self._announced and i not in self._ended and s.end is not None and step > s.end:
                self._ended.add(i)
                if targets(s, self.rank, self.node):
                    event("fault_end", {"index": i, "fault": spec_dict(s), "last_step": s.end})
        self._shape_link()
        if self.has("hang"):
            # the rank stops before its step's first collective: it never arrives, so its peers block there until
            # the process-group timeout fires. Sleeping in a plain loop keeps the process killable.
            event("hang_entered", {"step": step, "simulated_fault": True})
            while True:
                time.sleep(3600)

    def _shape_link(self) -> None:
        """slow_link on a node with its own network namespace: the egress rate limit of the node's interface is
        set as the fault starts and cleared as it ends, by the rank named (or local rank 0 of the node named)."""
        if self.shaper is None:
            return
        rates = [s.rate_mbit for s in self.mine("slow_link") if s.rate_mbit and (s.rank is not None or self.local_rank == 0)]
        if rates and not self.shaping:
            self.shaper.apply(min(rates))
            self.shaping = True
        elif not rates and self.shaping:
            self.shaper.clear()
            self.shaping = False

    def close(self) -> None:
        if self.shaping and self.shaper is not None:
            self.shaper.clear()
            self.shaping = False

    # -- where the rank works -----------------------------------------------------------------
    def slow_compute(self, compute_s: float) -> None:
        """slow_rank / throttle: do ``(factor - 1) x compute_s`` of extra work on this rank's device, so its
        compute *is* that much slower (``compute_s``: the measured compute being slowed)."""
        f = self.compute_factor()
        if f > 1.0 and compute_s > 0:
            self.burner.burn((f - 1.0) * compute_s)

    def wrap_stage_chunks(self, stage, measure: Callable[[], float]) -> None:
        """slow_rank under a pipeline: the extra work inside each of the stage's chunks (before it sends on).
        ``measure()``: this thread's compute time so far (CPU time, less what was spent in collectives)."""
        for name in ("forward_one_chunk", "backward_one_chunk"):
            run_chunk = getattr(stage, name)

            def chunk(*a, _run=run_chunk, **kw):
                c0 = measure()
                out = _run(*a, **kw)
                self.slow_compute(measure() - c0)
                return out

            setattr(stage, name, chunk)

    def install_transport_delay(self) -> bool:
        """slow_link without a network namespace: this rank's data leaves late, inside the transport path (the
        collective and p2p functions the hooks call), for ``delay_ms`` per operation while the fault is active.
        Installed before the instrumentation, so the rank is seen arriving on time and its collectives taking
        longer, as with a slow link; nothing is subtracted anywhere. Returns whether anything was installed."""
        if not any(s.kind == "slow_link" and targets(s, self.rank, self.node) for s in self.specs):
            return False
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        from torch.distributed.pipelining import schedules

        def delayed(fn):
            def call(*a, **kw):
                delay = self.link_delay_s()
                if delay > 0:
                    time.sleep(delay)
                return fn(*a, **kw)

            return call

        for mod, name in ((dist, "all_reduce"), (dist, "reduce_scatter_tensor"), (dist, "all_gather_into_tensor"),
                          (funcol, "all_reduce"), (schedules, "_batch_p2p")):
            orig = getattr(mod, name)
            self._patched.append((mod, name, orig))
            setattr(mod, name, delayed(orig))
        return True

    def remove_transport_delay(self) -> None:
        """Put the transport's functions back (tests; a rank's process ends with its delay in place)."""
        while self._patched:
            mod, name, orig = self._patched.pop()
            setattr(mod, name, orig)

    def simulated_device(self, state) -> bool:
        """The simulated GPU (CPU runs): a throttle lowers the SM clock by its factor and sets the thermal and
        power-cap throttle reasons; an xid appends (code, unix ms) to the node's devices. Whether any changed."""
        if not self.specs:
            return False
        before = (state.sm_clock_mhz, state.throttle_reasons, len(state.xids))
        state.sm_clock_mhz, state.throttle_reasons = state.max_sm_clock_mhz, 0
        throttles = self.mine("throttle")
        if throttles:
            factor = max(f.factor or 1.0 for f in throttles)
            state.sm_clock_mhz = int(state.max_sm_clock_mhz / factor)
            state.throttle_reasons = THROTTLE_HW_THERMAL | THROTTLE_SW_POWER_CAP
        for i, f in enumerate(self.specs):
            if f.kind == "xid" and f.node == self.node and i not in self._xids_done and self.step >= f.start:
                state.xids.append((int(f.code or 79), int(time.time() * 1000)))
                self._xids_done.add(i)
        return (state.sm_clock_mhz, state.throttle_reasons, len(state.xids)) != before


def carry_onsets(old, new) -> None:
    """A restarted attempt keeps the onsets its faults had (ManifestWriter.start's ``carry``)."""
    onsets = {(f.kind, f.rank, f.node, f.start): f.onset_t for f in old.faults}
    for f in new.faults:
        f.onset_t = onsets.get((f.kind, f.rank, f.node, f.start), f.onset_t)


def spec_dict(s: FaultSpec) -> dict:
    return {k: getattr(s, k) for k in ("kind", "rank", "node", "factor", "delay_ms", "rate_mbit", "code", "start",
                                        "end")}


class ComputeBurner:
    """Real extra work: on a CPU, matmuls until this thread's CPU time has grown by the amount asked; on CUDA,
    matmul kernels queued on the current stream, as many as take that long (timed once, at first use)."""

    def __init__(self, device: str):
        self.device = device
        self._a = self._b = None
        self._kernel_s = 0.0

    def burn(self, seconds: float) -> None:
        import torch

        if self.device == "cuda":
            if self._a is None:
                self._a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
                self._b = torch.empty_like(self._a)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(20):
                    torch.mm(self._a, self._a, out=self._b)
                end.record()
                end.synchronize()
                self._kernel_s = start.elapsed_time(end) / 1000.0 / 20
            for _ in range(max(1, round(seconds / max(self._kernel_s, 1e-6)))):
                torch.mm(self._a, self._a, out=self._b)
            return
        if self._a is None:
            self._a = torch.randn(96, 96)
            self._b = torch.empty_like(self._a)
        until = time.thread_time() + seconds
        while time.thread_time() < until:
            torch.mm(self._a, self._a, out=self._b)
