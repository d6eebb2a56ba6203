"""The <op>_perf benchmark: sizes x (out-of-place, in-place), timing, checks, report."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from nccl_tests import data, output
from nccl_tests.collectives import Collective
from nccl_tests.formulas import AVG_MODE_NAMES, DTYPES, OPS, aggregate, algbw, busbw, busbw_factor, element_count, row_bytes
from nccl_tests.runtime import Hooks, Identity, all_gather_single, sync


def _gather_floats(values: list[float], device: str, n: int) -> list[list[float]]:
    """Every rank's ``values`` (same length everywhere), on every rank."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    out = torch.empty(n * len(values), dtype=torch.float64, device=device)
    all_gather_single(out, mine)
    return out.view(n, len(values)).cpu().tolist()


def _time(coll: Collective, send, recv, in_place: bool, iters: int, warmup: int, device: str) -> float:
    for _ in range(warmup):
        coll.run(send, recv, in_place)
    sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        coll.run(send, recv, in_place)
    sync(device)
    return (time.perf_counter() - t0) / max(iters, 1)


def _check(coll: Collective, args, count: int, in_place: bool, hooks: Hooks) -> int:
    send, recv = coll.buffers(args.dtype, count, in_place, fill=True)
    coll.run(send, recv, in_place)
    sync(coll.device)
    if hooks.corrupt:
        data.corrupt_(recv)
    want = data.expected(coll.op, args.redop, args.dtype, coll.rank, coll.n, count, args.root)
    if want is None:
        return 0
    return data.count_wrong(recv, want, args.dtype, coll.n)


def header_lines(args, me: Identity, idents: list[Identity], backend: str, coll: Collective, hooks: Hooks) -> list[str]:
    nodes = sorted({i.node for i in idents})
    gpus = sum(1 for i in idents if i.device.startswith("cuda"))
    lines = [
        f"# ranksight nccl_tests {args.op}_perf: torch.distributed backend {backend} (torch {torch.__version__}); "
        "output and formulas of NVIDIA nccl-tests, not the nccl-tests binary",
        f"# nThread 1 nProcs {me.world} nGpus {gpus} (one device per process) nNodes {len(nodes)} "
        f"minBytes {args.minbytes} maxBytes {args.maxbytes} "
        + (f"step: {args.stepbytes}(bytes)" if args.stepbytes else f"step: {args.stepfactor}(factor)")
        + f" warmup iters: {args.warmup_iters} iters: {args.iters} agg iters: 1 validation: {args.check} graph: 0",
        f"# time = mean over {args.iters} iterations, {AVG_MODE_NAMES[args.average]} (-a {args.average}); "
        f"busbw factor for {me.world} ranks: {busbw_factor(args.op, me.world):g}",
        "#",
        "# Using devices",
    ]
    for i in idents:
        lines.append(f"#  Rank {i.rank:2d} Group {0:2d} Pid {i.pid:6d} on {i.host:>10s} node {i.node:>8s} device {i.device:>6s} [{i.device_name}]")
    notes = coll.notes + hooks.notes()
    if notes:
        lines.append("#")
        lines += [f"# note: {n}" for n in notes]
    lines.append("#")
    return lines


def run(args, me: Identity, backend: str) -> int:
    hooks = Hooks(me.rank)
    idents = _all_identities(me)
    n = me.world
    coll = Collective(args.op, args.redop, args.root, me.rank, n, backend, me.device, hooks)
    spec = OPS[args.op]
    tsize = DTYPES[args.dtype][1]
    redop_col = args.redop if spec.reduces else "none"
    root_col = args.root if spec.rooted else -1

    counts, seen = [], set()
    skipped = []
    for size in args.sizes:
        c = element_count(args.op, size, tsize, n)
        if c == 0:
            skipped.append(size)
            continue
        if c in seen:
            continue
        seen.add(c)
        counts.append(c)

    rank0 = me.rank == 0
    lines = header_lines(args, me, idents, backend, coll, hooks)
    if skipped:
        lines.insert(-1, f"# note: sizes {', '.join(map(str, skipped))} B hold no whole element per rank "
                         f"({tsize} B x {n if spec.chunked else 1}); skipped")
    if not counts:
        if rank0:
            print("\n".join(lines), flush=True)
            print(f"nccl_tests: no size in {args.minbytes}..{args.maxbytes} B holds a whole element per rank; raise -e", file=sys.stderr)
            from nccl_tests.json_out import write_error

            write_error(args, f"no size in {args.minbytes}..{args.maxbytes} B holds a whole element per rank", 2)
        return 2
    lines += output.table_header()

    progress = None
    if rank0:
        if sys.stdout.isatty() and not args.no_progress:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            console = Console(highlight=False)
            progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=console, transient=True)
            emit = lambda s: console.print(s, markup=False, highlight=False, soft_wrap=True)  # noqa: E731
            progress.start()
            task = progress.add_task(f"{args.op}_perf", total=len(counts))
        else:
            emit = lambda s: print(s, flush=True)  # noqa: E731
        for line in lines:
            emit(line)

    rows: list[output.Row] = []
    try:
        for count in counts:
            nbytes = row_bytes(count, tsize)
            per_rank = []
            wrongs = []
            for in_place in (False, True):
                send, recv = coll.buffers(args.dtype, count, in_place, fill=False)
                secs = _time(coll, send, recv, in_place, args.iters, args.warmup_iters, me.device)
                del send, recv
                wrong = _check(coll, args, count, in_place, hooks) if args.check else 0
                per_rank.append(secs)
                wrongs.append(wrong)
            table = _gather_floats(per_rank + [float(w) for w in wrongs], me.device, n)
            results = []
            for k in range(2):
                secs = aggregate([r[k] for r in table], args.average)
                wrong = int(sum(r[2 + k] for r in table)) if args.check else None
                results.append(output.Result(secs * 1e6, algbw(nbytes, secs), busbw(args.op, n, nbytes, secs), wrong))
            row = output.Row(args.op, nbytes, count, args.dtype, redop_col, root_col, results[0], results[1], t=time.time(),
                             per_rank_us={"out_of_place": [r[0] * 1e6 for r in table], "in_place": [r[1] * 1e6 for r in table]})
            rows.append(row)
            if rank0:
                emit(output.format_row(row))
                if progress is not None:
                    progress.advance(task)
    finally:
        if progress is not None:
            progress.stop()

    wrong = output.total_wrong(rows)
    if rank0:
        for line in output.footer(rows, bool(args.check)):
            emit(line)
        if args.json:
            _write_json(args, rows, idents, backend, coll, hooks)
        if args.store:
            from nccl_tests import store

            path = store.write_perf(args.store, args.run_id, rows, idents, backend, args)
            print(f"# wrote {path}", flush=True)
    return 1 if wrong else 0


def _all_identities(me: Identity) -> list[Identity]:
    from nccl_tests.runtime import all_identities

    return all_identities(me)


def _write_json(args, rows, idents, backend, coll, hooks) -> None:
    from nccl_tests.json_out import write_result

    n = len(idents)
    doc = {
        "tool": "ranksight nccl_tests",
        "op": args.op,
        "backend": backend,
        "nranks": n,
        "nodes": sorted({i.node for i in idents}),
        "ranks": [asdict(i) for i in idents],
        "type": args.dtype,
        "redop": args.redop if OPS[args.op].reduces else "none",
        "root": args.root if OPS[args.op].rooted else -1,
        "iters": args.iters,
        "warmup_iters": args.warmup_iters,
        "check": bool(args.check),
        "average": AVG_MODE_NAMES[args.average],
        "busbw_factor": busbw_factor(args.op, n),
        "notes": coll.notes + hooks.notes(),
        "results": [
            {
                "size": r.size, "count": r.count, "type": r.type_name, "redop": r.redop, "root": r.root, "t": r.t,
                "out_of_place": asdict(r.out_of_place) | {"per_rank_us": r.per_rank_us["out_of_place"]},
                "in_place": asdict(r.in_place) | {"per_rank_us": r.per_rank_us["in_place"]},
            }
            for r in rows
        ],
        "out_of_bounds_values": output.total_wrong(rows),
        "avg_bus_bandwidth": output.avg_busbw(rows),
    }
    write_result(args, doc)
