"""Where ``--json`` sends the result document: a file (``--json FILE``, rank 0, written atomically), or standard output
(a bare ``--json``, or ``--json -``), where it is then the only thing printed: the nccl-tests report and the progress
bar go to standard error instead (``cli.main`` swaps the streams before the run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

STDOUT = "-"


def to_stdout(args) -> bool:
    return getattr(args, "json", None) == STDOUT


def write_result(args, doc: dict) -> None:
    """Write the result document where ``args.json`` says (an ``error`` key is added, None for a result)."""
    doc = {"error": None, **doc}
    if to_stdout(args):
        stream = getattr(args, "json_stream", None) or sys.__stdout__
        stream.write(json.dumps(doc) + "\n")
        stream.flush()
        args.json_written = True
        return
    from ranksight.layout import atomic_write

    atomic_write(Path(args.json), (json.dumps(doc, indent=1) + "\n").encode())


def write_error(args, message: str, code: int) -> None:
    """Under a bare ``--json``: the run ended without a result; say why as the one JSON object (once, rank 0)."""
    if to_stdout(args) and not getattr(args, "json_written", False):
        write_result(args, {"tool": "ranksight nccl_tests", "error": message, "exit_code": code})
