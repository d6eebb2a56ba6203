"""``ranksight trace``: profiler (Kineto) traces of one or many ranks, analysed as HTA does and further.

The data path, in the order a trace meets it (issue 14):

- ``load``: a trace file (plain or ``.gz``, possibly truncated) -> a ``model.RankTrace``: the fields the analyses use,
  decoded by a typed decoder into columns (kernels by stream, memcpy/memset, runtime launches with their correlation
  ids, ProfilerStep annotations), never a generic JSON event loop.
- ``breakdown``: per rank, HTA's analyses: temporal breakdown, idle-time breakdown, kernel breakdown, comm-compute
  overlap, CUDA launch statistics, queue length, per-step figures; the window policy stated and selectable.
- ``checks``: across ranks, what HTA leaves to the user: the straggler by kernel time and by who waits in NCCL
  kernels, the slow collective and its group, pipeline bubbles, exposed communication per step -> Findings.
- ``diff``: two runs or two step ranges, what got slower by kernel and by phase.
- ``perfetto``: one merged multi-rank trace that opens in Perfetto, findings marked on it.
- ``report``, ``cli``: JSON, text and HTML; the command.
"""
