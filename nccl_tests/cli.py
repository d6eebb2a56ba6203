"""Command line: ``python -m nccl_tests <op>_perf [flags]`` and ``ranksight nccl-tests <op> [flags]``.

Flags follow NVIDIA nccl-tests where they make sense for torch.distributed; launch one
process per device with torchrun (``torchrun --standalone --nproc-per-node 4 -m nccl_tests
all_reduce_perf -b 8 -e 1M -f 2``). Without torchrun it runs as a world of one process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import typer

from nccl_tests.formulas import (
    DTYPES,
    OPS,
    REDOPS,
    canonical_dtype,
    canonical_op,
    canonical_redop,
    parse_size,
    size_sequence,
)
from nccl_tests.health_report import DEFAULT_THRESHOLD

EPILOG = """\
examples:
  torchrun --standalone --nproc-per-node 4 -m nccl_tests all_reduce_perf -b 8 -e 1M -f 2
  torchrun --standalone --nproc-per-node 4 -m nccl_tests all_gather_perf -b 1K -e 4M -d bfloat16 --json ag.json
  torchrun --standalone --nproc-per-node 8 -m nccl_tests --check --store ./runs --run-id job42
operations: """ + ", ".join(f"{o}_perf" for o in OPS) + """
self-test hooks (environment): NCCL_TESTS_CORRUPT_RANK=r, NCCL_TESTS_DELAY_RANK=r NCCL_TESTS_DELAY_US=us
"""


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors once (rank 0), not once per rank; under a bare --json also as the JSON object."""

    json_errors = False

    def error(self, message: str):  # noqa: D401
        if _is_rank0():
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr)
            if self.json_errors:
                sys.stdout.write(json.dumps({"tool": "ranksight nccl_tests", "error": message, "usage_error": True,
                                             "exit_code": 2}) + "\n")
                sys.stdout.flush()
        raise SystemExit(2)


def _is_op(text: str) -> bool:
    try:
        canonical_op(text)
        return True
    except ValueError:
        return False


def wants_json_stdout(argv: list[str]) -> bool:
    """A bare ``--json``/``-J`` (last, or before another flag or an operation's name) or ``--json -``."""
    for i, a in enumerate(argv):
        if a in ("-J", "--json"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or nxt == "-" or (nxt.startswith("-") and len(nxt) > 1) or _is_op(nxt):
                return True
        elif a in ("--json=-", "-J-"):
            return True
    return False


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _choice(fn):
    def conv(text: str) -> str:
        try:
            return fn(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    conv.__name__ = fn.__name__
    return conv


def _int_in(lo: int, hi: int | None, what: str):
    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be an integer, got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise argparse.ArgumentTypeError(f"{what} must be {rng}, got {v}")
        return v

    return conv


def _threshold(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"threshold must be a number, got {text!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"threshold must be in (0, 1], got {v}")
    return v


def _quantile(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"quantile must be a number, got {text!r}") from None
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"quantile must be in [0, 1], got {v}")
    return v


def build_parser(prog: str = "python -m nccl_tests") -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description="Collective benchmarks with nccl-tests' output and formulas "
                "(torch.distributed: gloo on CPU, NCCL on GPU), and a pairwise health check (--check).",
                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("op", nargs="?", type=_choice(canonical_op),
                   help="all_reduce_perf, all_gather_perf, reduce_scatter_perf, alltoall_perf, broadcast_perf, reduce_perf, "
                        "sendrecv_perf (the _perf suffix is optional); omit with --check")
    p.add_argument("-b", "--minbytes", type=_size, default=parse_size("32M"), help="minimum size in bytes, K/M/G suffixes (default 32M)")
    p.add_argument("-e", "--maxbytes", type=_size, default=None, help="maximum size in bytes (default: the minimum)")
    p.add_argument("-f", "--stepfactor", type=_int_in(1, None, "step factor (-f)"), default=2, help="multiply the size by this (default 2)")
    p.add_argument("-i", "--stepbytes", type=_size, default=0, help="add this many bytes per step instead of -f")
    p.add_argument("-n", "--iters", type=_int_in(1, None, "iterations (-n)"), default=20, help="timed iterations per size (default 20)")
    p.add_argument("-w", "--warmup_iters", type=_int_in(0, None, "warm-up iterations (-w)"), default=1, help="warm-up iterations per size (default 1)")
    p.add_argument("-c", "--datacheck", dest="check", type=_int_in(0, 1, "check (-c)"), default=1,
                   help="check results against expected values: 0 or 1 (default 1; nccl-tests' long form --check is the health check here)")
    p.add_argument("-d", "--datatype", dest="dtype", type=_choice(canonical_dtype), default="float",
                   help=f"data type: {', '.join(DTYPES)} (default float)")
    p.add_argument("-o", "--op", dest="redop", type=_choice(canonical_redop), default="sum", help=f"reduction: {', '.join(REDOPS)} (default sum)")
    p.add_argument("-r", "--root", type=_int_in(0, None, "root (-r)"), default=0, help="root rank of broadcast and reduce (default 0)")
    p.add_argument("-a", "--average", type=_int_in(0, 3, "average mode (-a)"), default=3,
                   help="combine per-rank times: 0 rank 0, 1 mean, 2 min, 3 max (default 3: the slowest rank)")
    p.add_argument("-t", "--nthreads", type=_int_in(1, 1, "threads per process (-t)"), default=1,
                   help="accepted for compatibility; only 1 (one process per device, launch more with torchrun)")
    p.add_argument("-g", "--ngpus", type=_int_in(1, 1, "devices per process (-g)"), default=1,
                   help="accepted for compatibility; only 1 (one process per device, launch more with torchrun)")
    p.add_argument("-J", "--json", metavar="FILE", nargs="?", const="-", default=None,
                   help="also write the results as JSON to FILE (rank 0); a bare --json (or --json -) prints them as "
                        "one JSON object on stdout instead, the report going to stderr (docs/cli.md)")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto", help="process-group backend (default: nccl with GPUs, else gloo)")
    p.add_argument("--check", "--health", dest="health", action="store_true",
                   help="health check: pairwise sendrecv bandwidth matrix and per-node groups; exit 1 when a rank, node or link is slow")
    p.add_argument("--check-bytes", type=_size, default=None, help="health-check message size (default 1M on gloo, 64M on NCCL)")
    p.add_argument("--confirm", type=_int_in(0, None, "confirmation rounds"), default=1,
                   help="health check: when something looks slow, measure every pair again up to this many times, keeping each pair's best time (default 1)")
    p.add_argument("--quantile", type=_quantile, default=0.2,
                   help="health check: a pair's time is this quantile of its samples (default 0.2: robust to "
                        "bursts of load from elsewhere; 0.5 is the median)")
    p.add_argument("--threshold", type=_threshold, default=DEFAULT_THRESHOLD, help=f"health check: slow when below this x the median (default {DEFAULT_THRESHOLD})")
    p.add_argument("--store", default=None, help="run store directory: write the results as the bandwidth baseline (needs --run-id)")
    p.add_argument("--run-id", default=None, help="run id under --store")
    p.add_argument("--timeout", type=_int_in(1, None, "timeout"), default=300, help="seconds before a collective that never completes fails (default 300)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")
    return p


def parse_args(argv: list[str], prog: str = "python -m nccl_tests") -> argparse.Namespace:
    p = build_parser(prog)
    p.json_errors = wants_json_stdout(argv)
    args = p.parse_args(argv)
    if args.json not in (None, "-") and args.op is None and _is_op(args.json) and not os.path.exists(args.json):
        # `--json all_reduce_perf ...`: argparse gave the operation to the bare --json
        args.op, args.json = canonical_op(args.json), "-"
    if args.health:
        if args.op not in (None, "sendrecv"):
            p.error(f"--check runs the pairwise sendrecv health check; drop the operation {args.op!r} or run it separately")
        args.op = "sendrecv"
    elif args.op is None:
        p.error("name an operation (e.g. all_reduce_perf) or pass --check")
    if args.maxbytes is None:
        args.maxbytes = args.minbytes
    try:
        args.sizes = size_sequence(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    except ValueError as exc:
        p.error(str(exc))
    if args.redop == "avg" and OPS[args.op].reduces and not DTYPES[args.dtype][2]:
        p.error(f"-o avg needs a floating-point type, not {args.dtype}")
    if (args.store is None) != (args.run_id is None):
        p.error("--store and --run-id go together")
    if args.run_id is not None:
        from ranksight.layout import RunDir

        try:
            RunDir(args.store, args.run_id)
        except ValueError as exc:
            p.error(str(exc))
    if args.json and args.json != "-":
        parent = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(parent):
            p.error(f"--json: directory {parent} does not exist")
    return args


def main(argv: list[str] | None = None, prog: str = "python -m nccl_tests") -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv), prog)
    from nccl_tests.json_out import to_stdout, write_error

    if to_stdout(args):
        # stdout carries the one JSON object (rank 0): the report, the progress bar and "# wrote" lines go to stderr
        args.json_stream, sys.stdout = sys.stdout, sys.stderr
    # heavy imports only after the flags are known to be good
    from nccl_tests import runtime

    me, backend = runtime.init(args.backend, args.timeout)
    code = 2
    try:
        if args.root >= me.world and OPS[args.op].rooted and not args.health:
            if me.rank == 0:
                print(f"{prog}: error: root {args.root} is not a rank of this world of {me.world}", file=sys.stderr)
                write_error(args, f"root {args.root} is not a rank of this world of {me.world}", 2)
            code = 2
        elif args.health:
            from nccl_tests import health

            if args.check_bytes is None:
                from nccl_tests.formulas import parse_size as _ps

                args.check_bytes = _ps("64M" if backend == "nccl" else "1M")
            code = health.run(args, me, backend)
        else:
            from nccl_tests import perf

            code = perf.run(args, me, backend)
    except Exception as exc:  # report on this rank, still leave the group cleanly if we can
        import traceback

        traceback.print_exc()
        print(f"nccl_tests: rank {me.rank} failed: {exc}", file=sys.stderr)
        if me.rank == 0:
            write_error(args, f"rank 0 failed: {exc}", 1)
        sys.stderr.flush()
        os._exit(1)
    if me.rank == 0 and code != 0:
        write_error(args, f"no result (exit code {code}; the reason is on stderr)", code)
    runtime.finish(code)
    return code  # not reached: finish() exits


# A typer app with one command that hands every argument, --help included, to the argparse
# parser above, so `ranksight nccl-tests` and `python -m nccl_tests` take the same flags.
nccl_tests_command = typer.Typer(add_completion=False, rich_markup_mode=None)


@nccl_tests_command.command(
    name="nccl-tests",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
    add_help_option=False,
)
def _nccl_tests(ctx: typer.Context) -> None:
    """Collective benchmarks (nccl-tests output) and the pre-flight health check.

    Run under torchrun; see `ranksight nccl-tests --help` for the flags.
    """
    sys.exit(main(list(ctx.args), prog="ranksight nccl-tests"))
