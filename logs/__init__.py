"""``ranksight logs``: diagnose the logs users already have.

A user arrives after something went wrong, holding logs: NCCL debug output, PyTorch watchdog timeouts, Flight
Recorder dumps, an nccl-tests table, a kernel log with Xids, ``nvidia-smi`` output, a training log full of loss-scale
messages. ``analyze(paths)`` reads them all and gives one report across every input, in the findings schema
``diagnose`` uses (``ranksight.schema.Finding``; ``inputs`` names the files a finding rests on).

The data path, in the order a byte meets it:

- ``inputs``: paths -> files (directories walked, ``.gz`` undone) -> bytes.
- ``readers/<format>.py``: one module per format, each with ``NAME``, ``sniff(data) -> bool`` (cheap: could this input
  hold lines of mine?), ``read(inp) -> ReadResult`` (events, the lines it claimed, notes) and
  ``conclude(results) -> list[Finding]`` over every input it read (so lines from many ranks and hosts join into one
  finding). A file that mixes formats (a job's stdout: NCCL lines, watchdog lines, loss-scale messages and iteration
  lines interleaved) is read by every reader that sniffs it; each claims its own lines, and the rest are counted as
  unknown, never fatal.
- ``registry``: the readers, in order.
- ``report``: the verdict, the JSON shape, the text and HTML renderings; ``cli``: the command.

``diagnose <run-id>`` runs the same readers over the logs stored with a run (``<store>/<run-id>/logs/``).
"""

from __future__ import annotations

from logs.analysis import LogReport, analyze

__all__ = ["LogReport", "analyze"]
