"""Does a change to probes.nccl_log change what it parses? Dump everything one version yields, compare two dumps.

    PYTHONPATH=REF_TREE .venv/bin/python bench/nccl_log_equivalence.py dump /tmp/ref.json [--logs FILE...]
    PYTHONPATH=$PWD     .venv/bin/python bench/nccl_log_equivalence.py dump /tmp/new.json [--logs FILE...]
    .venv/bin/python bench/nccl_log_equivalence.py compare /tmp/ref.json /tmp/new.json

``dump`` imports ``probes.nccl_log`` from whatever tree is on PYTHONPATH (a reference tree:
``git archive <commit> | tar -x -C /tmp/ref``), so the script itself adds nothing to sys.path.
Inputs: every log under tests/fixtures/nccl, the ``--logs`` given (e.g. a log written by
``bench/nccl_log.py --keep FILE``), logs built here (COLL runs, channel repeats, CRLF, long
lines, timestamped and launcher-tagged prefixes) and seeded random mutations of them. For each
input and each parser mode (default, ``emit_collectives``, ``keep_unclassified=False``) and
several chunk sizes it records every event as returned by ``feed``/``close`` (at that moment:
the per-channel lists grow later) and again at the end, plus the parser's counters
(``collective_counts``, ``last_collective``, ``proc_rank``, offsets, notes); also
``parse_file``, ``feed_line``, ``prime`` and ``summarize`` JSON for single files and a log set
with unreadable members, and what ``python -m cli.main nccl-log [--json]`` prints (stdout,
stderr, exit code) for each fixture and for all of them with unreadable files.
``compare`` prints "identical" or the first differences.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgspec

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "nccl"
SMALL = 300_000  # inputs up to this size are also fed in tiny chunks and line by line

COLL = (b"h:1:1 [0] NCCL INFO %s: opCount %x sendbuff 0x1 recvbuff 0x1 count %d datatype 7 op 0 root 0 "
        b"comm %s [nranks=4] stream 0x9\n")


def _event(ev: Any) -> str:
    return json.dumps(msgspec.to_builtins(ev), default=repr)  # key order kept: it is what gets shipped


def _state(p: Any) -> dict[str, Any]:
    return {
        "line_no": p.line_no, "bytes_parsed": p.bytes_parsed, "pending_bytes": p.pending_bytes,
        "collective_lines": p.collective_lines, "unclassified": p.unclassified, "notes": list(p.notes),
        "collective_counts": sorted((repr(k), v) for k, v in p.collective_counts.items()),
        "last_collective": sorted((repr(k), json.dumps(v)) for k, v in p.last_collective.items()),
        "proc_rank": sorted((repr(k), v) for k, v in p.proc_rank.items()),
    }


def _feed(nl: Any, raw: bytes, size: int, **kw: Any) -> dict[str, Any]:
    p = nl.NcclLogParser(source_file="nccl.h.1.log", **kw)
    evs: list[Any] = []
    at_emit: list[str] = []
    for i in range(0, len(raw), size):
        got = p.feed(raw[i : i + size])
        at_emit += [_event(e) for e in got]
        evs += got
    got = p.close()
    at_emit += [_event(e) for e in got]
    evs += got
    return {"at_emit": at_emit, "final": [_event(e) for e in evs], "state": _state(p)}


def _built_logs() -> dict[str, bytes]:
    """Inputs aimed at the fast paths and the edges of the line splitter."""
    fx = {p.name: p.read_bytes() for p in sorted(FIXTURES.glob("*.log"))}
    mixed = bytearray(b"".join(fx[n] for n in ("v218_ib.log", "v226_newprefix.log", "torchrun_watchdog.log")))
    for n in range(60):
        mixed += COLL % (b"AllReduce" if n % 3 else b"ReduceScatter", n, 100 + n, b"0xabc")
        mixed += COLL % (b"Broadcast", n, 100 + n, b"0xdef")
        if n % 7 == 0:
            mixed += b"step %d loss 1.0\n" % n
    head = b"h:1:2 [0] NCCL INFO comm 0x1 rank 0 nranks 2 cudaDev 0 busId 1000 commId 0x2 - Init START\n"
    chans = b"".join(b"h:1:2 [0] NCCL INFO Channel %s : 0[1000] -> 1[2000] via P2P/IPC\n" % ch
                     for ch in (b"00/0", b"01/0", b"5/0", b"100/0", b"07", b"x/0", b"02/1"))
    again = head.replace(b"0x1 rank", b"0x9 rank").replace(b"commId 0x2", b"commId 0x3")
    stamped = b"".join(b"[2026-11-22 09:%02d:%02d] " % (n // 60 % 60, n % 60) + COLL % (b"AllReduce", n, n, b"0xabc")
                       for n in range(500))
    odd = (b"h:1:1 [0] NCCL INFO AllReduce: opCount 3 comm 0xabc [nranks=4] stream 0x9 \xff\xfe\n"
           b"h:1:1 [0] NCCL INFO comm 0xabc [nranks=4] stream 0x9\n"
           b"[2025-03-12 10:11:12] h:1:1 [0] NCCL INFO AllGather: opCount 3 sendbuff 0x1 recvbuff 0x1 count 5 "
           b"datatype 7 op 0 root 0 comm 0xabc [nranks=4] stream 0x9\n"
           + COLL % (b"Send", 4, 4, b"0xabc") + COLL % (b"nccl", 5, 5, b"0xabc")
           + COLL % (b"Channel 00", 6, 6, b"0xabc") + COLL % (b"NET/IB", 7, 7, b"0xabc")
           + COLL % (b"CollNetX", 8, 8, b"0xabc") + COLL % (b"Ring", 9, 9, b"0xabc")
           + b"[rank1]: " + COLL % (b"AllReduce", 10, 10, b"0xabc")
           + b"[default0]:h:1:2 [0] NCCL INFO Channel 03/0 : 0[1000] -> 1[2000] via P2P/IPC\n")
    long_lines = (b"x" * 70_000 + b"\n" + b"h:1:2 [0] NCCL INFO " + b"y" * 200_000 + b"\n"
                  + COLL % (b"AllReduce", 1, 1, b"0xabc") + b"h:1:2 [0] NCCL WARN socket \xff\xfe failed\n" + b"z" * 70_000)
    out = {
        "built:mixed": bytes(mixed),
        "built:mixed-crlf": bytes(mixed).replace(b"\n", b"\r\n"),
        "built:channels": head + chans + chans + again + chans,
        "built:stamped-coll": stamped,
        "built:odd-coll": odd * 3,
        "built:long-lines": long_lines,
    }
    rng = random.Random(11)
    base = bytes(mixed).split(b"\n") + odd.split(b"\n")
    for k in range(60):
        raw = bytearray(b"\n".join(rng.sample(base, 80)))
        for _ in range(60):
            raw[rng.randrange(len(raw))] = rng.choice(b"\xff\xc3\x80\n\r :[]>0/")
        out[f"fuzz:{k}"] = bytes(raw)
    return out


def dump(out_path: str, logs: list[str]) -> None:
    import probes.nccl_log as nl

    cases: dict[str, Any] = {}
    inputs = {f"fixture:{p.name}": p.read_bytes() for p in sorted(FIXTURES.glob("*.log"))}
    inputs.update(_built_logs())
    for path in logs:
        inputs[f"log:{os.path.basename(path)}"] = Path(path).read_bytes()
    modes = {"default": {}, "emit": {"emit_collectives": True}, "drop": {"keep_unclassified": False}}
    rng = random.Random(5)
    for name, raw in inputs.items():
        small = len(raw) <= SMALL
        fuzz = name.startswith("fuzz:")
        sizes = [1 << 20] + ([rng.randint(1, 500)] if fuzz else [1, 7, 333, 4096] if small else [65_536])
        for mode, kw in modes.items():
            for size in sizes:
                cases[f"{name} {mode} chunk={size}"] = _feed(nl, raw, size, **kw)
        if small and not fuzz:
            for mode, kw in modes.items():
                p = nl.NcclLogParser(**kw)
                evs = [p.feed_line(line) for line in raw.splitlines(keepends=True)]
                cases[f"{name} {mode} feed_line"] = {"events": [None if e is None else _event(e) for e in evs],
                                                     "state": _state(p)}
            cut = raw.rfind(b"\n", 0, len(raw) // 2) + 1
            p = nl.NcclLogParser(source_file="nccl.h.1.log")
            p.line_no = raw[:cut].count(b"\n")
            p.prime(raw[:cut])
            evs = p.feed(raw[cut:]) + p.close()
            cases[f"{name} prime"] = {"events": [_event(e) for e in evs], "state": _state(p)}
    with tempfile.TemporaryDirectory() as d:
        files = []
        for name, raw in inputs.items():
            if name.startswith("fuzz:"):
                continue
            path = os.path.join(d, "nccl." + name.replace(":", "_").replace("/", "_"))
            Path(path).write_bytes(raw)
            files.append(path)
            cases[f"{name} parse_file"] = [_event(e).replace(d, "TMP") for e in nl.parse_file(path)]
            cases[f"{name} summarize"] = _summary(nl, [path], d)
        gz = os.path.join(d, "v27.log.gz")
        Path(gz).write_bytes(gzip.compress((FIXTURES / "v27_ib.log").read_bytes()))
        cut = os.path.join(d, "cut.log.gz")
        Path(cut).write_bytes(gzip.compress((FIXTURES / "v218_ib.log").read_bytes())[:-30])
        bad = os.path.join(d, "bad.log.gz")
        Path(bad).write_bytes(b"\x1f\x8b\x08\x00 not really gzip")
        cases["parse_file gz"] = [_event(e).replace(d, "TMP") for e in nl.parse_file(gz)]
        everything = files + [gz, cut, bad, os.path.join(d, "missing.log"), d]
        cases["summarize everything"] = _summary(nl, everything, d)
        cases["summarize everything emit"] = _summary(nl, everything, d, emit_collectives=True)
        fixtures = [str(p) for p in sorted(FIXTURES.glob("*.log"))]
        for name, paths in [(os.path.basename(f), [f]) for f in fixtures] + [("all", fixtures + [gz, cut, bad, d])]:
            for flags in ([], ["--json"]):
                r = subprocess.run([sys.executable, "-m", "cli.main", "nccl-log", *flags, *paths], cwd=d,
                                   capture_output=True, text=True, timeout=300)
                cases[f"cli {' '.join(flags)} {name}"] = [r.returncode, r.stdout.replace(d, "TMP"), r.stderr.replace(d, "TMP")]
    names = ["/logs/nccl.node01.12345", "nccl.gpu-a7.99.log", "whatever.log", "nccl.h.1.txt", "a.b_7.out", ""]
    cases["host_pid_from_filename"] = [list(nl.host_pid_from_filename(n)) for n in names]
    Path(out_path).write_text(json.dumps(cases, sort_keys=True))
    print(f"{out_path}: {len(cases)} cases, probes.nccl_log from {os.path.dirname(nl.__file__)}")


def _summary(nl: Any, paths: list[str], tmpdir: str, **kw: Any) -> str:
    s = json.dumps(nl.summarize(paths, **kw), default=str)  # as `ranksight nccl-log --json` prints it
    return s.replace(tmpdir, "TMP")


def compare(a_path: str, b_path: str) -> int:
    a, b = json.loads(Path(a_path).read_text()), json.loads(Path(b_path).read_text())
    diffs = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if not diffs:
        print(f"identical ({len(a)} cases)")
        return 0
    print(f"{len(diffs)} of {len(set(a) | set(b))} cases differ:")
    for k in diffs[:20]:
        print(f"  {k}: {_first_difference(a.get(k), b.get(k))}")
    return 1


def _first_difference(x: Any, y: Any, path: str = "") -> str:
    if type(x) is not type(y):
        return f"{path or '.'}: {str(x)[:300]!r} != {str(y)[:300]!r}"
    if isinstance(x, dict):
        for k in sorted(set(x) | set(y)):
            if x.get(k) != y.get(k):
                return _first_difference(x.get(k), y.get(k), f"{path}.{k}")
    if isinstance(x, list):
        for i, (u, v) in enumerate(zip(x, y)):
            if u != v:
                return _first_difference(u, v, f"{path}[{i}]")
        return f"{path}: {len(x)} items != {len(y)} items"
    return f"{path or '.'}: {str(x)[:300]!r} != {str(y)[:300]!r}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out")
    d.add_argument("--logs", nargs="*", default=[])
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    a = ap.parse_args()
    if a.cmd == "dump":
        dump(a.out, a.logs)
    else:
        sys.exit(compare(a.a, a.b))


if __name__ == "__main__":
    main()
