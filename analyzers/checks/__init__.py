"""The checks: one module per kind of problem, each ``analyze(frame: AnalysisFrame, cfg=None) -> list[Finding]``.

Each check reads the round's frame (``analyzers.builder``), keeps its thresholds in a config dataclass of its own
module, and names its findings' ranks, nodes, onset and evidence. Each also has ``coverage(frame, cfg=None) ->
Coverage``: whether the run's records carry what it needs (``frame.signals``), so a report can say which checks could
not judge the run and why, instead of calling a run healthy that nothing could look at. ``CHECKS`` is the registry
``run_all`` walks, in the order it runs them; ``TABLES`` names the run's tables each one reads.

- ``stragglers``: which rank (node, pipeline stage) computes slowly, and who only waits for it;
- ``kernel_time``: the same question from the profiler traces' device kernel time (merged into the stragglers
  finding of the same rank and steps);
- ``comm`` (with ``links``, ``op_instances`` and ``busbw``): exposed communication, slow links, bus bandwidth, NCCL
  transport problems;
- ``pipeline``: pipeline bubbles against the schedule's theory;
- ``mfu``: MFU drops and their likely cause;
- ``fp16``: overflow runs, loss-scale collapse, non-finite losses;
- ``hang``: ranks that stopped while others wait;
- ``gpu_health``: XIDs, ECC errors, throttling;
- ``data_stall``: ranks waiting for their next batch;
- ``memory_pressure``: memory near capacity or growing.
"""

from __future__ import annotations

from types import ModuleType

from analyzers.checks import (comm, data_stall, fp16, gpu_health, hang, kernel_time, memory_pressure, mfu, pipeline,
                              stragglers)

CHECKS: dict[str, ModuleType] = {m.NAME: m for m in (stragglers, kernel_time, comm, pipeline, mfu, fp16, hang, gpu_health,
                                                     data_stall, memory_pressure)}

# The run's tables (``RunData``'s frames) each check reads, itself or through the frame's step views and placement,
# besides ``steps`` (every frame is built over the step records). ``frame.signals`` is left out: it describes the
# whole run and is worked out once per round. What a check may start on as soon as these are loaded (the collectives
# are the biggest table, loaded last would let the others start first); tests/test_check_tables.py fails when a
# check reads a table it does not name here.
TABLES: dict[str, frozenset[str]] = {
    "stragglers": frozenset({"collectives"}),  # TP evidence: the TP collectives' waits
    "kernel_time": frozenset({"trace_summaries"}),
    "comm": frozenset({"collectives", "nccl_events", "nccl_tests"}),
    "pipeline": frozenset(),
    "mfu": frozenset({"gpu"}),
    "fp16": frozenset(),
    "hang": frozenset({"collectives", "events", "nccl_events"}),
    "gpu_health": frozenset({"gpu", "xid"}),
    "data_stall": frozenset(),
    "memory_pressure": frozenset({"gpu", "host"}),
}
