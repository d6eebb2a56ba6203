"""ranksight.spool: the spool tailer survives partial lines, garbage, truncation, rotation and restarts."""

import os

import msgspec

from ranksight.spool import TailPosition, first_node, spool_ranks, tail
from ranksight import schema


def step(rank, s, node=0):
    return schema.StepRecord(run_id="r", rank=rank, step=s, node=node, host="h", world_size=2,
                             t_start=100.0 + s, t_end=100.5 + s, step_ms=500.0)


def line(rec):
    return schema.encode(rec) + b"\n"


def drain(path, pos=None, max_bytes=1 << 20):
    recs, gaps = [], []
    while True:
        r = tail(path, pos, max_bytes=max_bytes)
        recs += r.records
        gaps += r.gaps
        pos = r.position
        if r.eof:
            return recs, gaps, pos


def test_partial_last_line_is_not_consumed(tmp_path):
    p = tmp_path / "rank-0.jsonl"
    full = line(step(0, 1))
    second = line(step(0, 2))
    p.write_bytes(full + second[:17])
    r = tail(p)
    assert [x.step for x in r.records] == [1]
    assert r.position.offset == len(full)
    with open(p, "ab") as f:
        f.write(second[17:])
    r2 = tail(p, r.position)
    assert [x.step for x in r2.records] == [2] and r2.gaps == []
    assert r2.position.offset == len(full) + len(second)
    # the input position is not mutated (the caller saves it only after the head acked)
    assert r.position.offset == len(full)


def test_garbage_lines_are_counted_gaps_not_crashes(tmp_path):
    p = tmp_path / "rank-1.jsonl"
    p.write_bytes(line(step(1, 1)) + b"not json at all\n" + b'{"kind":"nope"}\n' + b"\n"
                  + line(step(1, 2)) + b"\xff\xfe binary\n" + line(step(1, 3)))
    recs, gaps, pos = drain(p)
    assert [x.step for x in recs] == [1, 2, 3]
    assert pos.garbage_lines == 3
    # two adjacent bad lines merge into one gap; each gap says where it sits in step order
    assert [(g.reason, g.lines, g.after_step) for g in gaps] == [("garbage", 2, 1), ("garbage", 1, 2)]
    assert gaps[0].sample.startswith("not json")
    assert gaps[0].offset == len(line(step(1, 1)))


def test_truncation_restarts_from_zero_and_is_recorded(tmp_path):
    p = tmp_path / "rank-0.jsonl"
    p.write_bytes(b"".join(line(step(0, s)) for s in range(5)))
    _, _, pos = drain(p)
    p.write_bytes(line(step(0, 10)))  # truncated and rewritten, shorter than the offset
    recs, gaps, pos2 = drain(p, pos)
    assert [x.step for x in recs] == [10]
    assert gaps[0].reason == "reset" and pos2.resets == 1
    assert pos2.offset == len(line(step(0, 10)))


def test_rotation_by_inode_change(tmp_path):
    p = tmp_path / "rank-0.jsonl"
    p.write_bytes(line(step(0, 1)))
    _, _, pos = drain(p)
    os.rename(p, tmp_path / "rank-0.jsonl.1")
    # the new file is longer than the old offset, so only the inode tells
    p.write_bytes(b"".join(line(step(0, s)) for s in range(20, 23)))
    recs, gaps, pos2 = drain(p, pos)
    assert [x.step for x in recs] == [20, 21, 22]
    assert [g.reason for g in gaps] == ["reset"]


def test_restart_from_saved_position_reads_each_record_once(tmp_path):
    p = tmp_path / "rank-0.jsonl"
    with open(p, "wb") as f:
        for s in range(100):
            f.write(line(step(0, s)))
    seen = []
    pos = None
    # small reads, position round-tripped through its encoded form as the agent's state file does
    while True:
        r = tail(p, pos, max_bytes=700)
        seen += [x.step for x in r.records]
        pos = msgspec.json.decode(msgspec.json.encode(r.position), type=TailPosition)
        if r.eof:
            break
    assert seen == list(range(100))
    assert pos.records == 100


def test_missing_file_and_oversized_line(tmp_path):
    r = tail(tmp_path / "rank-9.jsonl")
    assert r.records == [] and r.eof
    p = tmp_path / "rank-0.jsonl"
    p.write_bytes(b"x" * 5000 + b"\n" + line(step(0, 1)))
    recs, gaps, pos = drain(p, max_bytes=1000)
    assert [x.step for x in recs] == [1]
    assert gaps[0].reason == "oversized_line" and gaps[0].nbytes == 5001


def test_discovery_helpers(tmp_path):
    (tmp_path / "rank-3.jsonl").write_bytes(b"junk\n" + line(step(3, 0, node=1)))
    (tmp_path / "rank-10.jsonl").write_bytes(b"")
    (tmp_path / "other.txt").write_bytes(b"")
    assert spool_ranks(tmp_path) == [3, 10]
    assert first_node(tmp_path / "rank-3.jsonl") == 1
    assert first_node(tmp_path / "rank-10.jsonl") is None
