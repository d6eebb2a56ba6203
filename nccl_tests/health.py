"""Health-check mode (--check): pairwise sendrecv bandwidth of every rank pair, one pair at a
time (the others wait), then an all_reduce inside each node's group, then the verdict of
``health_report.analyze``. Exit status 0 when nothing is below threshold x median, else 1."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from nccl_tests.health_report import analyze, comment, format_report
from nccl_tests.runtime import Hooks, Identity, all_identities, sync


def _exchange(buf, rbuf, peer: int, hooks: Hooks | None) -> None:
    if hooks is not None:
        hooks.before_comm()
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, peer), dist.P2POp(dist.irecv, rbuf, peer)])
    for r in reqs:
        r.wait()


def quantile(values: list[float], q: float) -> float:
    """The q-quantile of ``values`` (linear interpolation; q=0.5 is the median)."""
    v = sorted(values)
    if not v:
        raise ValueError("no samples")
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def measure_pairs(me: Identity, size: int, iters: int, warmup: int, hooks: Hooks, progress=None,
                  pairs: list[tuple[int, int]] | None = None, q: float = 0.5) -> dict[tuple[int, int], float]:
    """Seconds per bidirectional exchange of ``size`` bytes for every pair i < j (or the given
    ``pairs``, the same list on every rank): the q-quantile of the pair's samples (the slower
    of the two ranks' figures).

    One pair exchanges at a time while the others wait at a barrier. The samples are taken in
    rounds (round k measures every pair once), so a burst of load from something else on the
    host lands on one sample of many pairs rather than on all samples of one pair.
    """
    n, dev = me.world, me.device
    if pairs is None:
        pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    buf = torch.ones(max(size, 1), dtype=torch.uint8, device=dev)
    rbuf = torch.empty_like(buf)
    tiny = torch.ones(1, dtype=torch.uint8, device=dev)
    rtiny = torch.empty_like(tiny)
    mine = [(i, j) for i, j in pairs if me.rank in (i, j)]
    samples: dict[tuple[int, int], list[float]] = {p: [] for p in mine}
    for k in range(warmup + iters):
        for i, j in pairs:
            dist.barrier()
            if me.rank in (i, j):
                peer = j if me.rank == i else i
                # align the two ranks with a 1-byte exchange (untimed, no self-test delay), so the
                # timed exchange does not include waiting for a peer that left the barrier late
                _exchange(tiny, rtiny, peer, None)
                sync(dev)
                t0 = time.perf_counter()
                _exchange(buf, rbuf, peer, hooks)
                sync(dev)
                if k >= warmup:
                    samples[(i, j)].append(time.perf_counter() - t0)
        if progress is not None:
            progress()
    times = torch.zeros(n, n, dtype=torch.float64, device=dev)
    for (i, j), ss in samples.items():
        times[i, j] = times[j, i] = quantile(ss, q)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    t = times.cpu()
    return {(i, j): float(t[i, j]) for i, j in pairs}


def measure_node_groups(me: Identity, idents: list[Identity], size: int, iters: int, warmup: int, hooks: Hooks,
                        q: float = 0.5) -> dict[str, float]:
    """all_reduce busbw inside each node's group (all groups at once), for nodes with >= 2 ranks."""
    n = me.world
    by_node: dict[str, list[int]] = {}
    for i in idents:
        by_node.setdefault(i.node, []).append(i.rank)
    groups = {}
    for node in sorted(by_node):  # every rank creates every group, in the same order
        ranks = by_node[node]
        if len(ranks) >= 2:
            groups[node] = (ranks, dist.new_group(ranks) if len(ranks) < n else dist.group.WORLD)
    if not groups:
        return {}
    count = max(size // 4, 1)
    buf = torch.ones(count, dtype=torch.float32, device=me.device)
    mine = None
    for node, (ranks, grp) in groups.items():
        if me.rank in ranks:
            mine = (node, ranks, grp)
    secs = 0.0
    dist.barrier()
    if mine is not None:
        node, ranks, grp = mine
        for _ in range(warmup):
            hooks.before_comm()
            dist.all_reduce(buf, group=grp)
        sync(me.device)
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            hooks.before_comm()
            dist.all_reduce(buf, group=grp)
            sync(me.device)
            samples.append(time.perf_counter() - t0)
        secs = quantile(samples, q)
    t = torch.zeros(n, dtype=torch.float64, device=me.device)
    t[me.rank] = secs
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    t = t.cpu()
    out = {}
    for node, (ranks, _grp) in groups.items():
        worst = max(float(t[r]) for r in ranks)
        k = len(ranks)
        nbytes = count * 4
        out[node] = (nbytes / worst / 1e9) * 2 * (k - 1) / k if worst > 0 else 0.0
    return out


def run(args, me: Identity, backend: str) -> int:
    hooks = Hooks(me.rank)
    idents = all_identities(me)
    n = me.world
    hosts = [i.host for i in idents]
    nodes = [i.node for i in idents]
    size = args.check_bytes
    rank0 = me.rank == 0
    if rank0:
        print("\n".join(comment(f"ranksight nccl_tests health check: pairwise sendrecv over {n * (n - 1) // 2} rank "
                                f"pairs, one pair at a time; backend {backend} (torch {torch.__version__})")), flush=True)
        print("\n".join(comment(f"{n} ranks on {len(set(nodes))} node(s); message {size} B; warmup {args.warmup_iters}, "
                                f"iters {args.iters}; pair time = {args.quantile:g}-quantile of its samples; threshold "
                                f"{args.threshold:g} x median")), flush=True)
        print("#", flush=True)
        for i in idents:
            print(f"#  Rank {i.rank:2d} Pid {i.pid:6d} on {i.host:>10s} node {i.node:>8s} device {i.device:>6s} [{i.device_name}]", flush=True)
        for note in hooks.notes():
            print("\n".join(comment(f"note: {note}")), flush=True)
    if n < 2:
        if rank0:
            print("nccl_tests: the health check needs at least 2 ranks (launch with torchrun --nproc-per-node N)", file=sys.stderr)
            from nccl_tests.json_out import write_error

            write_error(args, "the health check needs at least 2 ranks (launch with torchrun --nproc-per-node N)", 2)
        return 2

    progress = tick = None
    if rank0 and sys.stdout.isatty() and not args.no_progress:
        from rich.progress import Progress

        progress = Progress(transient=True)
        progress.start()
        task = progress.add_task("rounds over all pairs", total=args.warmup_iters + args.iters)
        tick = lambda: progress.advance(task)  # noqa: E731
    try:
        pair_s = measure_pairs(me, size, args.iters, args.warmup_iters, hooks, tick, q=args.quantile)
    finally:
        if progress is not None:
            progress.stop()
    group_bw = measure_node_groups(me, idents, size, args.iters, args.warmup_iters, hooks, args.quantile)
    # A single node group has nothing to be compared with: report it without a verdict.
    groups_judged = group_bw if len(group_bw) >= 2 else None

    def bw_of(times):
        return {k: (size / v / 1e9 if v > 0 else 0.0) for k, v in times.items()}

    rep = analyze(bw_of(pair_s), nodes, args.threshold, groups_judged)
    # Confirmation: every rank holds the same matrix, so every rank sees the same suspects. When
    # there are any, measure every pair again (so the suspects are judged against a reference
    # measured under the same conditions) and keep each pair's better time: a transient hiccup,
    # e.g. another job's burst on a shared host, does not fail the check; a slow rank or link
    # stays slow in every pass.
    for _ in range(args.confirm):
        suspects = rep.flagged()
        if not suspects:
            break
        if rank0:
            print(f"# confirming {len(suspects)} suspect(s): measuring every pair again", flush=True)
        again = measure_pairs(me, size, args.iters, args.warmup_iters, hooks, None, q=args.quantile)
        for k, v in again.items():
            pair_s[k] = min(pair_s[k], v)
        rep = analyze(bw_of(pair_s), nodes, args.threshold, groups_judged)
    pair_bw = bw_of(pair_s)
    if rank0:
        lines = format_report(rep, hosts, nodes, pair_bw, size, args.iters, backend)
        if len(group_bw) == 1:
            (node, bw), = group_bw.items()
            at = max(i for i, ln in enumerate(lines) if ln == "#")  # before the verdict
            lines[at:at] = comment(f"Node group {node}: all_reduce busbw {bw:.3f} GB/s (one node: nothing to compare with)")
        print("\n".join(lines), flush=True)
        if args.json:
            _write_json(args, rep, pair_bw, pair_s, group_bw, idents, backend)
        if args.store:
            from nccl_tests import store

            paths = store.write_health(args.store, args.run_id, rep, pair_bw, pair_s, group_bw, idents, backend, args)
            for p in paths:
                print(f"# wrote {p}", flush=True)
    return 0 if rep.ok else 1


def _write_json(args, rep, pair_bw, pair_s, group_bw, idents, backend) -> None:
    from dataclasses import asdict

    from nccl_tests.json_out import write_result

    doc = {
        "tool": "ranksight nccl_tests health check",
        "backend": backend,
        "nranks": len(idents),
        "ranks": [asdict(i) for i in idents],
        "size": args.check_bytes,
        "iters": args.iters,
        "threshold": rep.threshold,
        "ok": rep.ok,
        "pairs": [{"rank_a": i, "rank_b": j, "time_us": pair_s[(i, j)] * 1e6, "bw": bw} for (i, j), bw in sorted(pair_bw.items())],
        "node_groups": group_bw,
        "entities": [asdict(e) for e in rep.entities()],
        "flagged": [asdict(e) for e in rep.flagged()],
    }
    write_result(args, doc)
