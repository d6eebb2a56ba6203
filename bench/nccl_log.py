"""Parse throughput of probes.nccl_log on a generated NCCL_DEBUG=INFO log.

    .venv/bin/python bench/nccl_log.py [--mb 256] [--repeat 3] [--keep FILE] [--reference TREE]

The log imitates a 64-rank job (8 hosts x 8 GPUs) run with NCCL_DEBUG=INFO and
NCCL_DEBUG_SUBSYS=INIT,NET,COLL, every process writing into one stream (the worst case: a
job's combined stdout). Per process: the init preamble (version, plugins, NET/IB devices,
comm Init START/COMPLETE, 32 ring-order lines, trees, 64 per-peer transport lines), then a
run of per-call COLL lines, a few WARN/failure lines, call traces, PyTorch watchdog lines and
application output. The composition is printed with the result.

Baseline, measured in the same run on the same file: reading it line by line in binary mode
(``for line in f``: the least any line parser must do). Reported: MB/s of both, and the ratio.
Best of --repeat runs for each, in CPU seconds of this process (time.process_time), so
that other work on a shared machine does not count. Memory is not measured here.

``--reference TREE`` also times the ``NcclLogParser`` of another source tree (say the commit
before a change: ``git archive <commit> | tar -x -C /tmp/ref``) on the same file, its runs
interleaved with this checkout's, and prints this checkout's speed relative to it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import sys
import tempfile
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from probes.nccl_log import NcclLogParser  # noqa: E402


def _process_block(rng: random.Random, host: str, pid: int, rank: int, dev: int, ncoll: int) -> list[str]:
    p = f"{host}:{pid}:{pid}"
    t = f"{host}:{pid}:{pid + 57}"
    lines = [
        f"{p} [{dev}] NCCL INFO Bootstrap : Using ibp12s0:10.0.{rank // 8}.{rank % 8 + 1}<0>",
        f"{p} [{dev}] NCCL INFO NET/Plugin : No plugin found (libnccl-net.so), using internal implementation",
        f"{p} [{dev}] NCCL INFO NCCL version 2.18.5+cuda12.2",
        f"{t} [{dev}] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_3:1/IB [2]mlx5_4:1/IB [3]mlx5_5:1/IB ; OOB ibp12s0:10.0.0.7<0>",
        f"{t} [{dev}] NCCL INFO Using network IB",
        f"{t} [{dev}] NCCL INFO comm 0x55d1e8a3c0e0 rank {rank} nranks 64 cudaDev {dev} nvmlDev {dev} busId 4e000 commId 0x7c1b9f0e4d2a6b31 - Init START",
        f"{t} [{dev}] NCCL INFO Setting affinity for GPU {dev} to ffffffff,00000000,ffffffff",
    ]
    order = "  ".join(f"{r:2d}" for r in range(64))
    lines += [f"{t} [{dev}] NCCL INFO Channel {c:02d}/32 :  {order}" for c in range(32)]
    lines.append(f"{t} [{dev}] NCCL INFO Trees [0] {(rank + 1) % 64}/-1/-1->{rank}->{(rank - 1) % 64} [1] {(rank + 1) % 64}/-1/-1->{rank}->{(rank - 1) % 64}")
    for c in range(32):
        nxt = (rank + 1) % 64
        if nxt // 8 == rank // 8:
            lines.append(f"{t} [{dev}] NCCL INFO Channel {c:02d}/0 : {rank}[4e000] -> {nxt}[87000] via P2P/IPC/read")
        else:
            lines.append(f"{t} [{dev}] NCCL INFO Channel {c:02d}/0 : {rank}[4e000] -> {nxt}[7000] [send] via NET/IB/{c % 4}/GDRDMA")
        prv = (rank - 1) % 64
        lines.append(f"{t} [{dev}] NCCL INFO Channel {c:02d}/0 : {prv}[c3000] -> {rank}[4e000] [receive] via NET/IB/{c % 4}/GDRDMA")
    lines += [
        f"{t} [{dev}] NCCL INFO Connected all rings",
        f"{t} [{dev}] NCCL INFO Connected all trees",
        f"{t} [{dev}] NCCL INFO 32 coll channels, 0 nvls channels, 32 p2p channels, 32 p2p channels per peer",
        f"{t} [{dev}] NCCL INFO comm 0x55d1e8a3c0e0 rank {rank} nranks 64 cudaDev {dev} nvmlDev {dev} busId 4e000 commId 0x7c1b9f0e4d2a6b31 - Init COMPLETE",
    ]
    for op in range(ncoll):
        kind = ("AllReduce", "AllGather", "ReduceScatter", "Broadcast")[op % 4]
        lines.append(
            f"{p} [{dev}] NCCL INFO {kind}: opCount {op:x} sendbuff 0x7f2a4{op % 16:x}000000 recvbuff 0x7f2a4{op % 16:x}000000 "
            f"count {rng.choice((1048576, 262144, 4096, 25165824))} datatype 7 op 0 root 0 comm 0x55d1e8a3c0e0 [nranks=64] stream 0x55d1e7f2a1c0"
        )
        if op % 97 == 0:
            lines.append(f"step {op // 97} loss {rng.random() * 3:.4f} lr 3.0e-4 tokens/s 182334")
    lines += [
        f"{p} [{dev}] NCCL WARN NET/IB : Got completion from peer 10.0.{rank // 8}.9<38745> with status=12 opcode=0 len=0 vendor err 129 (Send) localGid ::ffff:10.0.0.7 remoteGids ::ffff:10.0.0.9 hca mlx5_0",
        f"{p} [{dev}] NCCL INFO transport/net.cc:1298 -> 6",
        f"{p} [{dev}] NCCL WARN Connect to 10.0.0.2<43211> failed : Connection refused",
        f"{p} [{dev}] NCCL WARN Cuda failure 'out of memory'",
        f"[rank{rank}]:[E1122 05:55:37.123456 55301 ProcessGroupNCCL.cpp:632] [Rank {rank}] Watchdog caught collective operation timeout: "
        f"WorkNCCL(SeqNum={ncoll}, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, Timeout(ms)=600000) ran for 600012 milliseconds before timing out.",
    ]
    return lines


def make_log(path: str, mb: float) -> tuple[int, Counter]:
    """Write about ``mb`` MB: a ~4 MB template of 64 process blocks, repeated."""
    rng = random.Random(7)
    lines: list[str] = []
    for rank in range(64):
        lines += _process_block(rng, f"dgx-{rank // 8:02d}", 40000 + rank, rank, rank % 8, ncoll=300)
    kinds: Counter = Counter()
    for ln in lines:
        if " NCCL WARN " in ln:
            kinds["WARN"] += 1
        elif "opCount" in ln:
            kinds["COLL"] += 1
        elif " via " in ln:
            kinds["transport"] += 1
        elif "Channel" in ln:
            kinds["ring order"] += 1
        elif "Watchdog" in ln:
            kinds["watchdog"] += 1
        elif " NCCL INFO " in ln:
            kinds["other INFO"] += 1
        else:
            kinds["non-NCCL"] += 1
    block = ("\n".join(lines) + "\n").encode()
    reps = max(1, int(mb * 1e6 / len(block)))
    with open(path, "wb") as f:
        for _ in range(reps):
            f.write(block)
    return os.path.getsize(path), Counter({k: v * reps for k, v in kinds.items()})


def make_interleaved_log(path: str, mb: float) -> int:
    """A job's combined stdout: the 64 processes' lines interleaved round-robin (as they reach one stream), each with
    its launcher prefix ("[rankN]:" torchrun, "N: " srun, Ray "(RayTrainWorker pid=..., ip=...)" in turn by host),
    NCCL >= 2.26 timestamps and source locations on WARN lines. Returns the file size."""
    rng = random.Random(11)
    blocks = []
    for rank in range(64):
        host = f"dgx-{rank // 8:02d}"
        tag = (f"[rank{rank}]:", f"{rank}: ", f"(RayTrainWorker pid={40000 + rank}, ip=10.0.{rank // 8}.1) ")[rank // 8 % 3]
        out = []
        for ln in _process_block(rng, host, 40000 + rank, rank, rank % 8, ncoll=300):
            if " NCCL WARN " in ln:
                ln = "[2026-03-12 10:11:12] " + ln.replace(" NCCL WARN ", " transport/net_ib.cc:1295 NCCL WARN ", 1)
            out.append(tag + ln)
        blocks.append(out)
    lines = []
    for i in range(max(len(b) for b in blocks)):
        lines += [b[i] for b in blocks if i < len(b)]
    block = ("\n".join(lines) + "\n").encode()
    reps = max(1, int(mb * 1e6 / len(block)))
    with open(path, "wb") as f:
        for _ in range(reps):
            f.write(block)
    return os.path.getsize(path)


# CPU time of this process, not wall time: the machine this was written on is shared, and
# time spent waiting for a core says nothing about the parser. Wall time is printed too.
_clock = time.process_time


def reference_parser(tree: str) -> tuple[type, str]:
    """NcclLogParser as defined in another source tree (and its file), next to this checkout's in one process."""
    def ours() -> dict:
        return {k: m for k, m in sys.modules.items() if k == "probes" or k.startswith("probes.")}

    saved = ours()
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, os.path.abspath(tree))
    try:
        cls = importlib.import_module("probes.nccl_log").NcclLogParser
        where = sys.modules[cls.__module__].__file__
    finally:
        sys.path.remove(os.path.abspath(tree))
        for k in ours():
            del sys.modules[k]
        sys.modules.update(saved)
    return cls, where


def run_parser(path: str, parser_cls: type = NcclLogParser, **kw) -> tuple[float, int]:
    t0 = _clock()
    p = parser_cls(source_file=path, **kw)
    n = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                break
            n += len(p.feed(chunk))
    n += len(p.close())
    return _clock() - t0, n


def run_baseline(path: str) -> tuple[float, int]:
    t0 = _clock()
    n = 0
    with open(path, "rb") as f:
        for _line in f:
            n += 1
    return _clock() - t0, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=128.0, help="size of the generated log (MB)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", default="", help="write the log here and keep it")
    ap.add_argument("--reference", default="", help="also time the parser of this source tree, interleaved")
    a = ap.parse_args()
    ref, ref_file = reference_parser(a.reference) if a.reference else (None, "")
    path = a.keep or os.path.join(tempfile.mkdtemp(prefix="ranksight-bench-"), "nccl.bench.log")
    size, kinds = make_log(path, a.mb)
    total = sum(kinds.values())
    wall0 = time.perf_counter()
    try:
        base = min(run_baseline(path)[0] for _ in range(a.repeat))
        timed: dict[tuple[str, bool], list[tuple[float, int]]] = {}
        for emit in (False, True):
            for _ in range(a.repeat):
                for name, cls in (("this", NcclLogParser), ("reference", ref)):
                    if cls is not None:
                        timed.setdefault((name, emit), []).append(run_parser(path, cls, emit_collectives=emit))
        default, nev = min(timed[("this", False)])[0], timed[("this", False)][0][1]
        every, nev_all = min(timed[("this", True)])[0], timed[("this", True)][0][1]
    finally:
        if not a.keep:
            os.unlink(path)
            os.rmdir(os.path.dirname(path))
    ipath = os.path.join(tempfile.mkdtemp(prefix="ranksight-bench-"), "nccl.interleaved.log")
    try:
        isize = make_interleaved_log(ipath, a.mb)
        inter = min(run_parser(ipath)[0] for _ in range(a.repeat))
        ref_inter = min(run_parser(ipath, ref)[0] for _ in range(a.repeat)) if ref is not None else None
    finally:
        os.unlink(ipath)
        os.rmdir(os.path.dirname(ipath))
    mbs = size / 1e6
    print(f"interleaved job stdout (64 processes round-robin, launcher prefixes, stamped WARN), {isize / 1e6:.1f} MB: "
          f"parser {isize / 1e6 / inter:8.1f} MB/s  ({inter:.2f} s)"
          + (f"; reference {isize / 1e6 / ref_inter:8.1f} MB/s" if ref_inter else ""))
    print(f"file: {mbs:.1f} MB, {total} lines: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in kinds.most_common()))
    print(f"baseline (binary 'for line in f'):                        {mbs / base:8.1f} MB/s  ({base:.2f} s)")
    print(f"parser, default (COLL lines folded, {nev} events):        {mbs / default:8.1f} MB/s  ({default:.2f} s)  ratio to baseline {base / default:.3f}")
    print(f"parser, emit_collectives=True ({nev_all} events):   {mbs / every:8.1f} MB/s  ({every:.2f} s)  ratio to baseline {base / every:.3f}")
    if ref is not None:
        for emit, this_s in ((False, default), (True, every)):
            ref_s = min(timed[("reference", emit)])[0]
            nref = timed[("reference", emit)][0][1]
            print(f"reference {ref_file} (emit_collectives={emit}, {nref} events): {mbs / ref_s:8.1f} MB/s  ({ref_s:.2f} s);"
                  f"  this checkout / reference: {ref_s / this_s:.3f}x")
    try:
        print(f"load average during the run: {os.getloadavg()[0]:.2f}")
    except OSError:
        pass
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, best of {a.repeat}, CPU seconds (process_time); "
          f"all runs took {time.perf_counter() - wall0:.1f} s wall")


if __name__ == "__main__":
    main()
