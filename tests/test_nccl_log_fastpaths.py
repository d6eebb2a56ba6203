"""probes.nccl_log fast paths (COLL runs, channel repeats, emit_collectives): each must give
exactly what the line-by-line recognisers give, however the input is cut into chunks."""

from __future__ import annotations

import random
from pathlib import Path

from probes.nccl_log import NcclLogParser

FIX = Path(__file__).parent / "fixtures" / "nccl"

COLL = (b"h:1:1 [0] NCCL INFO %s: opCount %x sendbuff 0x1 recvbuff 0x1 count %d datatype 7 op 0 root 0 "
        b"comm %s [nranks=4] stream 0x9\n")


def _coll(op: bytes, n: int, comm: bytes = b"0xabc") -> bytes:
    return COLL % (op, n, 100 + n, comm)


def _feed_all(raw: bytes, size: int, **kw):
    p = NcclLogParser(source_file="x", **kw)
    evs = []
    for i in range(0, len(raw), size):
        evs += p.feed(raw[i : i + size])
    evs += p.close()
    return p, evs


def _key(evs):
    return [(e.line_no, e.category, e.error_class, e.rank, e.peer, e.comm_id, e.message, repr(sorted(e.fields.items())))
            for e in evs]


def _mixed_log() -> bytes:
    raw = b"".join((FIX / n).read_bytes() for n in ("v218_ib.log", "v226_newprefix.log", "torchrun_watchdog.log"))
    out = bytearray(raw)
    # Two interleaved COLL runs (two communicators), application output in between.
    for n in range(40):
        out += _coll(b"AllReduce" if n % 3 else b"ReduceScatter", n)
        out += _coll(b"Broadcast", n, b"0xdef")
        if n % 7 == 0:
            out += b"step %d loss 1.0\n" % n
    return bytes(out)


def test_chunk_boundaries_do_not_change_anything():
    raw = _mixed_log()
    for kw in ({}, {"emit_collectives": True}):
        whole, a = _feed_all(raw, len(raw) + 1, **kw)
        for size in (1, 2, 3, 11, 97, 4096):
            p, b = _feed_all(raw, size, **kw)
            assert _key(b) == _key(a)
            assert p.collective_lines == whole.collective_lines
            assert p.collective_counts == whole.collective_counts
            assert p.last_collective == whole.last_collective
            assert p.bytes_parsed == len(raw) and p.pending_bytes == 0


def test_coll_runs_are_folded_per_thread_and_communicator():
    raw = _mixed_log()
    p, evs = _feed_all(raw, 1 << 20)
    assert not [e for e in evs if e.category == "collective"]
    assert p.collective_counts[("h", 1, "0xabc")] == 40
    assert p.collective_counts[("h", 1, "0xdef")] == 40
    assert p.last_collective[("h", 1, "0xabc")]["opCount"] == 39
    assert p.last_collective[("h", 1, "0xdef")]["op"] == "Broadcast"
    q, evs = _feed_all(raw, 1 << 20, emit_collectives=True)
    coll = [e for e in evs if e.category == "collective"]
    assert len(coll) == 80 + p.collective_lines - 80  # fixtures' own COLL lines are events too
    assert q.collective_lines == p.collective_lines
    assert {e.fields["op"] for e in coll} >= {"AllReduce", "ReduceScatter", "Broadcast"}
    assert coll[-1].fields["comm"] == "0xdef" and coll[-1].fields["tid"] == 1


def test_a_coll_like_line_that_breaks_the_run_is_still_parsed():
    run = _coll(b"AllReduce", 1) + _coll(b"AllReduce", 2)
    odd = [
        b"h:1:1 [0] NCCL INFO AllReduce: opCount 3 comm 0xabc [nranks=4] stream 0x9 \xff\xfe\n",  # other tail
        b"h:1:1 [0] NCCL INFO comm 0xabc [nranks=4] stream 0x9\n",  # same head+tail, no ": opCount "
        b"h:1:1 [0] NCCL INFO AllReduce: opCount 4 sendbuff 0x1 recvbuff 0x1 count 5 datatype 7 op 0 root 0 "
        b"comm 0xabc [nranks=4] stream 0x9\r\n",  # CRLF: a different tail, its own counter
    ]
    p, evs = _feed_all(run + b"".join(odd) + run, 1 << 20)
    assert p.collective_lines == 6  # the first odd line is a COLL line too, with its own tail
    assert p.collective_counts == {("h", 1, "0xabc"): 6}
    assert [e.category for e in evs] == ["unclassified"]  # the line without ": opCount "
    assert p.line_no == 7


def test_crlf_lines_parse_like_lf_lines():
    raw = (FIX / "v218_ib.log").read_bytes()
    _, lf = _feed_all(raw, 1 << 20)
    _, crlf = _feed_all(raw.replace(b"\n", b"\r\n"), 333)
    assert [(e.category, e.error_class, e.rank, e.message, e.fields.get("channels")) for e in crlf] == [
        (e.category, e.error_class, e.rank, e.message, e.fields.get("channels")) for e in lf]


def test_channel_repeats_fold_with_their_channel_numbers():
    head = b"h:1:2 [0] NCCL INFO comm 0x1 rank 0 nranks 2 cudaDev 0 busId 1000 commId 0x2 - Init START\n"
    lines = b"".join(b"h:1:2 [0] NCCL INFO Channel %s : 0[1000] -> 1[2000] via P2P/IPC\n" % ch
                     for ch in (b"00/0", b"01/0", b"5/0", b"100/0", b"07", b"x/0", b"02/1"))
    for size in (1 << 20, 5):
        _, evs = _feed_all(head + lines + lines, size)
        tr = [e for e in evs if e.category == "transport"]
        # one event; every later channel appended, read the same way whichever path saw it
        assert len(tr) == 1
        assert tr[0].fields["channels"] == [0, 1, 5, 100, 7, 2] + [0, 1, 5, 100, 7, 2]
    # A new communicator on the same thread: the same connection is a new event.
    again = head.replace(b"0x1 rank", b"0x9 rank").replace(b"commId 0x2", b"commId 0x3")
    _, evs = _feed_all(head + lines + again + lines, 1 << 20)
    tr = [e for e in evs if e.category == "transport"]
    assert [e.comm_id for e in tr] == ["0x2", "0x3"]
    assert tr[1].fields["channels"] == [0, 1, 5, 100, 7, 2]


def test_a_line_longer_than_the_chunk_and_longer_than_the_cap():
    long_info = b"h:1:2 [0] NCCL INFO " + b"y" * 200_000 + b"\n"
    blob = b"x" * 70_000 + b"\n"
    raw = blob + long_info + _coll(b"AllReduce", 1) + b"h:1:2 [0] NCCL WARN socket \xff\xfe failed\n"
    for size in (1000, 65_536, 1 << 20):
        p, evs = _feed_all(raw, size)
        assert [e.category for e in evs][-1] == "error"
        assert p.collective_lines == 1
        assert all(len(e.message) <= 200_100 for e in evs)


def test_invalid_utf8_everywhere_never_raises():
    rng = random.Random(3)
    base = _mixed_log().split(b"\n")
    for _ in range(20):
        lines = rng.sample(base, 60)
        raw = bytearray(b"\n".join(lines))
        for _ in range(40):
            raw[rng.randrange(len(raw))] = rng.choice(b"\xff\xc3\x80\n\r :[]")
        for kw in ({}, {"emit_collectives": True}):
            _, a = _feed_all(bytes(raw), 1 << 20, **kw)
            _, b = _feed_all(bytes(raw), rng.randint(1, 500), **kw)
            assert _key(a) == _key(b)
            for e in a:
                e.message.encode("utf-8")  # decoded with replacement, always valid text


def test_emit_collectives_fast_path_matches_the_recognisers():
    # Lines the fast path must leave to the full recognisers: a timestamped prefix (not cached),
    # an op name that another recogniser could claim, and an unknown prefix.
    raw = (_coll(b"AllReduce", 1) + _coll(b"ReduceScatter", 2)
           + b"[2025-03-12 10:11:12] h:1:1 [0] NCCL INFO AllGather: opCount 3 sendbuff 0x1 recvbuff 0x1 count 5 "
             b"datatype 7 op 0 root 0 comm 0xabc [nranks=4] stream 0x9\n"
           + _coll(b"Send", 4) + _coll(b"nccl", 5))
    p = NcclLogParser(emit_collectives=True)
    fast = p.feed(raw) + p.close()
    slow = [ev for line in raw.splitlines() if (ev := NcclLogParser(emit_collectives=True).feed_line(line))]
    assert [e.category for e in fast][:4] == ["collective"] * 4
    assert [(e.category, e.message, e.fields.get("opCount")) for e in fast] == [
        (e.category, e.message, e.fields.get("opCount")) for e in slow]
    assert fast[2].t is not None and fast[0].t is None
    assert p.last_collective[("h", 1, "0xabc")]["opCount"] == 5  # "nccl: opCount 5" is no comm line


def test_timestamped_coll_lines_share_one_counter():
    # NCCL >= 2.26 stamps every line ("[%F %T] "): a long tail must not keep a counter per distinct time
    raw = b"".join(b"[2026-11-22 09:%02d:%02d] " % (n // 60 % 60, n % 60) + _coll(b"AllReduce", n) for n in range(3000))
    raw += b"[rank1]: " + _coll(b"AllReduce", 3000)  # a launcher tag before the host: the same process, same counter
    for size in (1 << 20, 97):
        p, evs = _feed_all(raw, size)
        assert not evs
        assert len(p._coll_stats) == 1
        assert p.collective_counts == {("h", 1, "0xabc"): 3001}
        assert p.last_collective[("h", 1, "0xabc")]["opCount"] == 3000
