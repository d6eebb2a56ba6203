"""traces.perfetto.write_merged: one merged multi-rank trace for Perfetto, checked against the inputs read naively."""

from __future__ import annotations

import gzip
import json
import os
import sys
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from kineto_synth import generate  # noqa: E402

from ranksight.schema import Finding  # noqa: E402
from traces.perfetto import write_merged  # noqa: E402
from fuzz_settings import fuzz_settings

PROCESS_META = {"process_name", "process_labels", "process_sort_index"}


def _load(path: str) -> dict:
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rt") as f:
        return json.load(f)


def _key(ev: dict) -> str:
    return ev["ph"] + "/" + (ev.get("name", "") if ev["ph"] == "M" else ev.get("cat", ""))


def _expected_counts(path: str) -> Counter:
    """Events per ph/cat an input should contribute: all but the process metadata the merge replaces."""
    return Counter(_key(e) for e in _load(path)["traceEvents"]
                   if not (e["ph"] == "M" and e.get("name") in PROCESS_META))


def _rank_of_pid(merged: dict) -> dict[int, str]:
    """merged pid -> its process name (from the process_name metadata the merge writes)."""
    return {e["pid"]: e["args"]["name"] for e in merged["traceEvents"]
            if e["ph"] == "M" and e["name"] == "process_name"}


def _counts_by_label(merged: dict) -> dict[str, Counter]:
    names = _rank_of_pid(merged)
    out: dict[str, Counter] = {}
    for e in merged["traceEvents"]:
        if e.get("cat") == "ranksight" or (e["ph"] == "M" and e["name"] in PROCESS_META):
            continue
        label = names[e["pid"]].split(" (")[0]
        out.setdefault(label, Counter())[_key(e)] += 1
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    d = tmp_path_factory.mktemp("four")
    res = generate(str(d), ranks=4, steps=4, kernels=30, seed=3)
    return res


def test_merged_is_json_with_every_rank_and_its_events(four, tmp_path):
    out = str(tmp_path / "merged.json")
    r = write_merged(four.paths, [], out, chunk_bytes=20_000)  # small chunks: many splits
    merged = _load(out)
    names = _rank_of_pid(merged)
    # Every rank present, host and GPU processes each, with distinct pids.
    for rank in range(4):
        assert any(n.startswith(f"rank {rank} (GPU") for n in names.values())
        assert any(n.startswith(f"rank {rank} (host") for n in names.values())
    assert len(set(names)) == len(names)
    pids_per_rank = [set(m.pids.values()) for m in r.ranks]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not pids_per_rank[i] & pids_per_rank[j]
    # Event counts preserved per rank, per ph/cat.
    got = _counts_by_label(merged)
    for rank, path in enumerate(four.paths):
        assert got[f"rank {rank}"] == _expected_counts(path), rank
        assert r.ranks[rank].kept == dict(_expected_counts(path))
    assert not r.notes
    # Kernels keep their fields and args (durations unchanged).
    src = [e for e in _load(four.paths[1])["traceEvents"] if e.get("cat") == "kernel"]
    gpu_pid = next(p for p, n in names.items() if n.startswith("rank 1 (GPU"))
    dst = [e for e in merged["traceEvents"] if e.get("cat") == "kernel" and e["pid"] == gpu_pid]
    assert [(e["name"], e["dur"], e["args"]) for e in src] == [(e["name"], e["dur"], e["args"]) for e in dst]


def test_flows_stay_paired_within_a_rank_and_unique_across_ranks(four, tmp_path):
    out = str(tmp_path / "merged.json.gz")
    write_merged(four.paths, [], out)
    merged = _load(out)
    names = _rank_of_pid(merged)
    by_id: dict = {}
    for e in merged["traceEvents"]:
        if e["ph"] in ("s", "f"):
            by_id.setdefault(e["id"], []).append(names[e["pid"]].split(" (")[0])
    # Each flow id belongs to one rank only (ids repeat across the generator's ranks' files).
    assert all(len(set(v)) == 1 for v in by_id.values())
    ids_in = [{e["id"] for e in _load(p)["traceEvents"] if e["ph"] in ("s", "f")} for p in four.paths]
    assert len(by_id) == sum(len(s) for s in ids_in)


def _set_base(path: str, base: int) -> None:
    with open(path) as f:
        text = f.read()
    text = text.replace('"baseTimeNanoseconds": 1700000000000000000', '"baseTimeNanoseconds": %d' % base, 1)
    with open(path, "w") as f:
        f.write(text)


def test_clocks_aligned_on_base_time(tmp_path):
    res = generate(str(tmp_path / "t"), ranks=2, steps=2, kernels=10, seed=1)
    _set_base(res.paths[1], 1700000000000000000 + 2_500_000)  # rank 1's clock starts 2.5 ms later
    out = str(tmp_path / "m.json")
    r = write_merged(res.paths, [], out)
    assert r.ranks[1].offset_us == pytest.approx(2500.0) and r.ranks[0].offset_us == 0.0
    assert "baseTimeNanoseconds" in r.alignment
    merged = _load(out)
    assert merged["baseTimeNanoseconds"] == 1700000000000000000
    names = _rank_of_pid(merged)
    src = [e["ts"] for e in _load(res.paths[1])["traceEvents"] if e["ph"] == "X"]
    dst = [e["ts"] for e in merged["traceEvents"] if e["ph"] == "X" and names[e["pid"]].startswith("rank 1 ")]
    assert dst == pytest.approx([t + 2500.0 for t in src], abs=1e-6)


def _steps(path: str) -> dict[int, tuple[float, float]]:
    return {int(e["name"].split("#")[1]): (e["ts"], e["ts"] + e["dur"]) for e in _load(path)["traceEvents"]
            if e["ph"] == "X" and e["name"].startswith("ProfilerStep#")}


def test_findings_marked_at_their_steps(four, tmp_path):
    out = str(tmp_path / "m.json")
    straggler = Finding(analyzer="traces.checks", kind="straggler", severity="warning", ranks=[2], step_start=2,
                        step_end=3, summary="rank 2 is the straggler", evidence={"ratio": 1.5})
    comm = {"analyzer": "traces.checks", "kind": "comm_bottleneck", "severity": "critical", "ranks": [0, 1],
            "step_start": 3, "step_end": 4, "summary": "slow all-reduce"}
    glob = {"kind": "pipeline_bubble", "severity": "info", "summary": "no step"}
    r = write_merged(four.paths, [straggler, comm, glob], out)
    assert r.findings_marked == 3
    merged = _load(out)
    names = _rank_of_pid(merged)
    marks = [e for e in merged["traceEvents"] if e.get("cat") == "ranksight"]
    steps = [_steps(p) for p in four.paths]
    # The straggler: an instant on rank 2's host process at its step 2 start; a slice from step 2 to step 3's end.
    inst = [e for e in marks if e["ph"] == "i" and e["args"]["kind"] == "straggler"]
    assert len(inst) == 1 and inst[0]["s"] == "p"
    assert names[inst[0]["pid"]].startswith("rank 2 (host")
    assert inst[0]["ts"] == pytest.approx(steps[2][2][0])
    assert inst[0]["args"]["summary"] == "rank 2 is the straggler" and inst[0]["args"]["evidence"] == {"ratio": 1.5}
    sl = [e for e in marks if e["ph"] == "X" and e["args"]["kind"] == "straggler"]
    assert len(sl) == 1 and names[sl[0]["pid"]] == "ranksight findings"
    assert sl[0]["ts"] == pytest.approx(steps[2][2][0])
    assert sl[0]["ts"] + sl[0]["dur"] == pytest.approx(steps[2][3][1])
    # Two ranks: an instant on each at its own step start; the slice spans both ranks' steps 3..4.
    inst = sorted((e for e in marks if e["ph"] == "i" and e["args"]["kind"] == "comm_bottleneck"),
                  key=lambda e: e["ts"])
    assert sorted(e["ts"] for e in inst) == pytest.approx(sorted(steps[k][3][0] for k in (0, 1)))
    sl = next(e for e in marks if e["ph"] == "X" and e["args"]["kind"] == "comm_bottleneck")
    assert sl["ts"] == pytest.approx(min(steps[k][3][0] for k in (0, 1)))
    assert sl["ts"] + sl["dur"] == pytest.approx(max(steps[k][4][1] for k in (0, 1)))
    # Overlapping findings go on different lanes (threads) of the findings process.
    slices = [e for e in marks if e["ph"] == "X"]
    assert len({e["tid"] for e in slices}) == 2
    # No ranks, no steps: a global instant at the traces' first event, with a note where it is placed.
    g = next(e for e in marks if e["args"]["kind"] == "pipeline_bubble")
    assert g["ph"] == "i" and g["s"] == "g" and "first event" in g["args"]["placement"]
    first = min(e["ts"] for p in four.paths for e in _load(p)["traceEvents"] if e["ph"] != "M")
    assert g["ts"] == pytest.approx(first)


def _event_ends(path: str) -> list[int]:
    """Byte offsets where each event of the array ends (a naive scan with the json module)."""
    text = open(path).read()
    dec = json.JSONDecoder()
    i = text.index("[", text.index('"traceEvents"')) + 1
    ends = []
    while True:
        while text[i] in " \n\r\t,":
            i += 1
        if text[i] == "]":
            return ends
        _, i = dec.raw_decode(text, i)
        ends.append(i)


@pytest.mark.parametrize("gz", [False, True])
def test_truncated_input_merged_as_far_as_it_goes(tmp_path, gz):
    res = generate(str(tmp_path / "t"), ranks=2, steps=3, kernels=20, seed=2)
    ends = _event_ends(res.paths[1])
    cut = (ends[len(ends) // 2] + ends[len(ends) // 2 + 1]) // 2  # mid-event
    whole = sum(1 for e in ends if e <= cut)
    with open(res.paths[1], "rb") as f:
        data = f.read()[:cut]
    bad = str(tmp_path / ("cut.json.gz" if gz else "cut.json"))
    if gz:
        z = gzip.compress(data + b" " * 5000)  # a torn gzip stream: cut in the compressed bytes
        with open(bad, "wb") as f:
            f.write(z[: len(z) - 40])
        # what survives the torn stream: decompress as far as it goes
        import zlib
        data = zlib.decompressobj(wbits=47).decompress(z[: len(z) - 40])
        whole = sum(1 for e in ends if e <= len(data))
    else:
        with open(bad, "wb") as f:
            f.write(data)
    out = str(tmp_path / "m.json")
    r = write_merged([res.paths[0], bad], [], out, chunk_bytes=30_000)
    merged = _load(out)  # still valid JSON
    assert r.ranks[1].truncated and not r.ranks[0].truncated
    assert any("rank 1" in n and ("cut short" in n or "torn" in n) for n in r.notes)
    assert merged["ranksight"]["notes"] == r.notes
    full = _load(res.paths[1])["traceEvents"][:whole]
    expect = Counter(_key(e) for e in full if not (e["ph"] == "M" and e.get("name") in PROCESS_META))
    assert r.ranks[1].kept == dict(expect)
    assert _counts_by_label(merged)["rank 1"] == expect


def test_bare_array_tricky_strings_and_duplicate_ranks(tmp_path):
    evs = [{"ph": "X", "cat": "kernel", "name": 'k},{"x": [1]}', "pid": 0, "tid": 7, "ts": float(i), "dur": 1.0,
            "args": {"nested": [{"a": 1}, {"b": "]},{"}]}} for i in range(3000)]
    a = tmp_path / "rank-3.json"
    a.write_text(json.dumps(evs))  # bare array form: rank from the file name
    b = tmp_path / "other_rank3.json"
    # object form with a trailer after the array holding many "},{" (splits that must not be taken for events)
    b.write_text(json.dumps({"traceEvents": evs[:2500], "distributedInfo": {"rank": 3},
                             "deviceProperties": [{"id": i, "name": "GPU"} for i in range(40)]}))
    out = str(tmp_path / "m.json")
    r = write_merged([str(a), str(b)], [], out, chunk_bytes=500)  # files > chunk + slack: the chunked path
    merged = _load(out)
    assert [m.label for m in r.ranks] == ["rank 3", "rank 3 #2"]
    assert [m.kept for m in r.ranks] == [{"X/kernel": 3000}, {"X/kernel": 2500}]
    k = [e for e in merged["traceEvents"] if e.get("cat") == "kernel"]
    assert k[0]["name"] == evs[0]["name"] and k[0]["args"] == evs[0]["args"]
    assert any("claim rank 3" in n for n in r.notes)


def test_not_a_trace_gives_a_note_and_valid_output(tmp_path):
    junk = tmp_path / "junk.json"
    junk.write_bytes(b"hello, not json")
    empty = tmp_path / "empty.json"
    empty.write_bytes(b"")
    out = str(tmp_path / "m.json")
    r = write_merged([str(junk), str(empty)], [{"kind": "straggler", "severity": "warning", "ranks": [0]}], out)
    merged = _load(out)
    assert all(m.truncated and m.note for m in r.ranks)
    assert r.findings_marked == 0 and any("no event" in n for n in r.notes)
    assert list(_rank_of_pid(merged).values()) == ["ranksight findings"]


@fuzz_settings(60)
@given(cut=st.integers(min_value=0, max_value=40_000), noise=st.binary(max_size=64))
def test_random_cuts_and_bytes_never_crash(tmp_path, cut, noise):
    src = tmp_path / "src.json"
    if not src.exists():
        generate(str(tmp_path / "g"), ranks=1, steps=2, kernels=8, seed=5)
        os.replace(tmp_path / "g" / "rank-0.pt.trace.json", src)
    data = src.read_bytes()
    p = tmp_path / "in.json"
    p.write_bytes(data[:cut] + noise)
    out = str(tmp_path / "m.json")
    r = write_merged([str(p)], [], out, chunk_bytes=4096)
    _load(out)  # always valid JSON
    assert len(r.ranks) == 1


def test_loaded_traces_and_numpy_evidence(four, tmp_path):
    """What ``ranksight trace --perfetto`` passes: loaded traces (objects with a path), findings with numpy numbers."""
    import numpy as np

    class Loaded:
        def __init__(self, path):
            self.path = path

    f = Finding(analyzer="traces.checks", kind="straggler", severity="critical", ranks=[1], step_start=1,
                step_end=2, evidence={"ratio": np.float64(1.4), "n": np.int64(3)})
    out = str(tmp_path / "m.json")
    r = write_merged([Loaded(p) for p in four.paths], [f], out)
    assert [m.rank for m in r.ranks] == [0, 1, 2, 3] and r.findings_marked == 1
    marks = [e for e in _load(out)["traceEvents"] if e.get("cat") == "ranksight"]
    assert marks[0]["args"]["evidence"] == {"ratio": 1.4, "n": 3}
