"""Flight Recorder reader: pickle/JSON dumps of two schema versions, torn and hostile dumps, fr_trace's text, and the
cross-rank conclusions (hang culprit, mismatch, long waits, healthy) with the numbers the fixtures were built with
(tests/make_flight_recorder_fixtures.py)."""

from __future__ import annotations

import os
import pickle

from hypothesis import given, strategies as st

from logs import analyze
from logs.inputs import InputFile
from logs.readers import flight_recorder as fr
from fuzz_settings import fuzz_settings

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "logs", "flight_recorder")


def _findings(*names):
    r = analyze([os.path.join(FIX, n) for n in names])
    assert not r.errors, r.errors
    return r


def test_sniff_by_content_not_name():
    with open(os.path.join(FIX, "v2_10_hang", "nccl_trace_rank_0"), "rb") as f:
        assert fr.sniff(f.read())
    with open(os.path.join(FIX, "v2_10_mismatch", "fr_rank0.json"), "rb") as f:
        assert fr.sniff(f.read())
    assert not fr.sniff(b"plain log line\n" * 100)
    assert not fr.sniff(b'{"loss": 1.0}')


def test_hang_names_the_rank_that_never_joined():
    r = _findings("v2_10_hang")
    crit = [f for f in r.findings if f.severity == "critical"]
    assert len(crit) == 1
    f = crit[0]
    assert f.kind == "hang" and f.ranks == [2]
    ev = f.evidence
    assert ev["seq"] == 120 and ev["op"] == "nccl:all_reduce" and ev["pg_desc"] == "default_pg"
    assert ev["pg_ranks"] == "0-3" and ev["states"] == {"started": "0-1", "scheduled": "3", "absent": "2"}
    assert ev["age_s"] == 1800.0 and ev["timeout_ms"] == 600000 and ev["input_sizes"] == [[1024]]
    assert ev["last_completed_seq"] == {"119": "0-3"}
    assert "rank(s) 2 never joined" in f.summary and len(f.inputs) == 4
    # pg 1's barrier was created at dump time: in flight, not a hang
    assert any(x.severity == "info" and "in flight" in x.summary and "dp_replicate" in x.summary for x in r.findings)


def test_size_mismatch_culprit_and_long_waits_from_json():
    r = _findings("v2_10_mismatch")
    mm = [f for f in r.findings if f.kind == "collective_mismatch" and f.severity == "critical"]
    assert len(mm) == 1 and mm[0].ranks == [3]
    ev = mm[0].evidence
    assert ev["seq"] == 57 and not ev["tie"]
    assert ev["variants"][0] == {"ranks": "0-2", "collective": "all_reduce in=[[1024]] out=[[1024]] Float"}
    assert ev["variants"][1]["collective"] == "all_reduce in=[[2048]] out=[[2048]] Float"
    slow = [f for f in r.findings if f.kind == "comm_bottleneck"]
    assert len(slow) == 1 and slow[0].ranks == [1] and slow[0].severity == "warning"
    assert slow[0].evidence["median_ms_by_rank"] == {"0": 2.0, "1": 40.0, "2": 2.0, "3": 2.0}


def test_old_version_healthy_is_info_only():
    r = _findings("v1_5_healthy")
    assert [f.severity for f in r.findings] == ["info"]
    assert "all 30 collectives #1..#30 matched and completed on 2 rank(s)" in r.findings[0].summary


def test_torn_dumps_keep_what_came_before_the_tear():
    r = _findings("torn")
    notes = [n for i in r.inputs for n in i.notes]
    assert any("torn pickle" in n for n in notes) and any("torn JSON" in n for n in notes)
    assert {f.severity for f in r.findings} == {"info"}
    healthy = next(f for f in r.findings if f.kind == "collective_mismatch")
    assert healthy.evidence["seqs"] == 23  # complete entries on both ranks up to the earlier tear
    topo = next(f for f in r.findings if f.kind == "topology")
    assert len(topo.evidence["torn"]) == 2


def test_unknown_version_is_read_with_a_note():
    r = _findings("unknown_version")
    assert any("version 3.0 is not one we know" in n for n in r.inputs[0].notes)
    assert "all 5 collectives" in r.findings[0].summary


def test_hostile_pickle_is_refused_and_nothing_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = _findings("hostile")
    assert any("refused" in n and "system" in n for n in r.inputs[0].notes)
    assert not (tmp_path / "FR_FIXTURE_PWNED").exists()
    assert not r.findings or all(f.severity == "info" for f in r.findings)


def test_allowed_torch_list_builders_map_to_identity():
    # what torch's jit pickler may emit for typed lists: GLOBAL torch.jit._pickle build_intlist + REDUCE
    blob = (b"\x80\x02}(X\x07\x00\x00\x00versionX\x04\x00\x00\x002.10X\x07\x00\x00\x00entries"
            b"ctorch.jit._pickle\nbuild_intlist\n]K\x01a\x85Ru.")
    obj, notes = fr.load_pickle(blob)
    assert obj == {"version": "2.10", "entries": [1]} and not notes


def test_fr_trace_text_output():
    r = _findings("fr_trace_output.txt")
    hang = next(f for f in r.findings if f.kind == "hang" and f.severity == "critical")
    assert hang.ranks == [2] and hang.evidence["seq"] == 120 and hang.evidence["expected_ranks"] == [0, 1, 2, 3]
    assert hang.evidence["group_info"] == "0:default_pg" and hang.evidence["collective_state"] == "started"
    mm = next(f for f in r.findings if f.kind == "collective_mismatch")
    assert mm.ranks == [1, 3] and "COLLECTIVE_TYPE_MISMATCH" in mm.summary and mm.evidence["seq"] == 57
    cd = next(f for f in r.findings if f.severity == "warning")
    assert cd.ranks == [6, 7]
    assert r.inputs[0].unknown_lines == 3  # the command line and two stack frames


def test_quoted_fr_trace_output():
    r = _findings("fr_trace_quoted.md")
    assert {f.kind for f in r.findings} == {"hang", "collective_mismatch"}


def _fixture_bytes():
    out = []
    for root, _, files in os.walk(FIX):
        for f in sorted(files):
            if not f.endswith(".py"):
                with open(os.path.join(root, f), "rb") as fh:
                    out.append((f, fh.read()))
    return out


FIXTURES = _fixture_bytes()


def _run(data: bytes, name: str = "nccl_trace_rank_0"):
    inp = InputFile(name, data)
    if fr.sniff(data):
        res = fr.read(inp)
        if res is not None:
            fr.conclude([res])


@fuzz_settings(150)
@given(st.binary(max_size=2000))
def test_fuzz_random_bytes(data):
    _run(data)
    _run(b"\x80\x02" + data)  # random bytes after a pickle header: nothing executes, nothing raises


@fuzz_settings(60)  # each example parses whole fixtures twice: the costliest fuzz in the suite
@given(st.integers(0, len(FIXTURES) - 1), st.floats(0, 1), st.binary(max_size=20))
def test_fuzz_cut_and_mutated_fixtures(i, frac, junk):
    name, data = FIXTURES[i]
    cut = int(len(data) * frac)
    _run(data[:cut], name)
    _run(data[:cut] + junk + data[cut + len(junk):], name)


CALLED = []


def _record(*a):
    CALLED.append(a)


class _Callme:
    def __reduce__(self):
        return (_record, ("ran",))


def test_a_reduce_to_any_function_is_never_called():
    blob = pickle.dumps({"version": "2.10", "entries": [{"record_id": 1}, _Callme()]}, protocol=2)
    for data in (blob, blob[:-5]):  # whole, and torn (the replay path)
        obj, notes = fr.load_pickle(data)
        assert not CALLED and any("refused" in n for n in notes)
