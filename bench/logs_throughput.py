"""Throughput of ``ranksight logs`` (every reader, ``logs.analyze``) on a job's combined stdout, against reading the
same bytes line by line.

    .venv/bin/python bench/logs_throughput.py [--mb 64] [--repeat 3]

The input imitates what a user hands over after a 64-rank job went wrong: its combined stdout, where every
process's lines are interleaved (bench/nccl_log.py's interleaved NCCL_DEBUG=INFO log: launcher prefixes, init,
transports, per-call COLL lines, stamped WARN lines, watchdog lines), with rank 0's per-iteration training lines,
loss-scale messages and tqdm progress bars spliced in every few hundred lines (the lines come from the project's own
fixture corpus, tests/fixtures/logs/iterations and loss_scale). The composition is printed with the result.

Baseline, in the same run on the same file: reading it line by line in binary mode (``for line in f``: the least
any line reader must do). Reported: MB/s of both and the ratio; best of --repeat, CPU seconds of this process
(time.process_time), so other work on a shared machine does not count.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from logs import analyze  # noqa: E402
from nccl_log import make_interleaved_log  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "logs"
EVERY = 300  # a training-log line spliced in after every EVERY lines of the NCCL stream


def training_lines() -> list[bytes]:
    """Rank 0's training output: the corpus's iteration and loss-scale lines, behind torchrun's prefix, plus a
    progress bar redrawn on one line."""
    out = []
    for d in ("iterations", "loss_scale"):
        for p in sorted((FIXTURES / d).glob("*.log")):
            out += [b"[rank0]:" + ln for ln in p.read_bytes().splitlines() if ln.strip()]
    out += [b"[rank0]:" + b"\r".join(b" %3d%%|###   | %d/1000 [00:%02d<01:00, 3.1it/s]" % (k, 10 * k, k % 60)
                                     for k in range(0, 100, 10))]
    return out


def make_log(path: str, mb: float) -> dict[str, int]:
    make_interleaved_log(path, mb)
    extra = training_lines()
    with open(path, "rb") as f:
        nccl = f.read().splitlines(keepends=True)
    mixed, k = [], 0
    for i, ln in enumerate(nccl):
        mixed.append(ln)
        if i % EVERY == EVERY - 1:
            mixed.append(extra[k % len(extra)] + b"\n")
            k += 1
    with open(path, "wb") as f:
        f.write(b"".join(mixed))
    return {"nccl_stream_lines": len(nccl), "training_lines": k}


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=64.0)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="ranksight-bench-logs-")
    path = os.path.join(d, "job.stdout.log")
    try:
        mix = make_log(path, a.mb)
        size = os.path.getsize(path) / 1e6

        def baseline():
            with open(path, "rb") as f:
                for _ in f:
                    pass

        report = analyze([path])
        base = best(baseline, a.repeat)
        ours = best(lambda: analyze([path]), a.repeat)
    finally:
        for p in Path(d).glob("*"):
            p.unlink()
        os.rmdir(d)
    inp = report.inputs[0]
    print(f"input: {size:.1f} MB, {inp.lines} lines ({mix['nccl_stream_lines']} of the interleaved 64-process NCCL "
          f"stream, {mix['training_lines']} training lines spliced in); claimed by reader: "
          + ", ".join(f"{k} {v}" for k, v in inp.formats.items()) + f"; unknown {inp.unknown_lines}")
    print(f"findings: {len(report.findings)} (" + ", ".join(sorted({f'{f.analyzer}/{f.kind}' for f in report.findings}))
          + f"); reader errors: {len(report.errors)}")
    print(f"baseline (binary 'for line in f'): {size / base:8.1f} MB/s  ({base:.2f} s)")
    print(f"ranksight logs (every reader):     {size / ours:8.1f} MB/s  ({ours:.2f} s)  ratio to baseline {base / ours:.3f}")
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, best of {a.repeat}, CPU seconds (process_time); "
          f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
