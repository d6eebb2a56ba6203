"""nccl-tests reader: the 2020, 2023 and 2025+ output formats (per-iteration and timestamp columns, launcher
prefixes), and each conclusion with the numbers the fixtures were built with
(tests/make_nccl_tests_fixtures.py)."""

from __future__ import annotations

import os

from hypothesis import given, strategies as st

from logs import analyze
from logs.inputs import InputFile
from logs.readers import nccl_tests as nt
from fuzz_settings import fuzz_settings

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "logs", "nccl_tests")


def _report(*names):
    r = analyze([os.path.join(FIX, n) for n in names])
    assert not r.errors, r.errors
    return r


def _read(name):
    with open(os.path.join(FIX, name), "rb") as f:
        return nt.read(InputFile(name, f.read()))


def test_new_format_every_row_and_the_header():
    res = _read("new_h100_healthy.log")
    (run,) = res.events
    assert run["version"] == "2.19.6" and run["program"] == "all_reduce_perf"
    assert run["config"]["ngpus"] == 8 and run["config"]["max_bytes"] == 8 << 30 and run["config"]["iters"] == 20
    assert len(run["devices"]) == 8 and run["devices"][3] == {
        "rank": 3, "group": 0, "pid": 4003, "host": "gpu-node-01", "device": 3, "bus": "0000:1b:00",
        "gpu": "NVIDIA H100 80GB HBM3", "line": 9}
    assert len(run["rows"]) == 16 and run["rows"][0]["size"] == 8 and run["rows"][0]["redop"] == "sum"
    last = run["rows"][-1]
    assert last["root"] == -1 and last["out_of_place"]["busbw"] == 372.18 and last["in_place"]["busbw"] == 379.78
    assert last["out_of_place"]["time_us"] == 40389.6 and last["in_place"]["wrong"] == 0
    assert run["avg_busbw"] == 136.773 and run["oob"] == 0
    assert res.summary == {"runs": 1}


def test_healthy_run_is_one_info_finding_with_peak_latency_and_expectation():
    r = _report("new_h100_healthy.log")
    (f,) = r.findings
    assert f.severity == "info" and f.kind == "benchmark" and f.ranks == list(range(8))
    ev = f.evidence
    assert ev["peak_busbw_gbps"] == 379.78 and ev["peak_at_bytes"] == 8 << 30 and ev["peak_placement"] == "in_place"
    assert ev["small_message_bytes"] == 8 and ev["small_message_time_us"] == 23.4
    assert ev["link_gbps_per_direction"] == 450.0 and ev["expected_min_busbw_gbps"] == 225.0
    assert "NVLink 4" in ev["expectation_source"] and f.gpus == ["NVIDIA H100 80GB HBM3"]
    assert "peak busbw 379.78 GB/s at 8 GiB (expected >= 225 GB/s), 23.4 us at 8 B" in f.summary


def test_per_iteration_columns_timestamps_and_srun_prefix():
    (run,) = _read("new_periter_ts.log").events
    assert run["stream"] == "task:0" and len(run["rows"]) == 3
    row = run["rows"][2]
    assert row["out_of_place"]["i_p99_us"] == 6699.84 and row["in_place"]["busbw"] == 49.06
    r = _report("new_periter_ts.log")
    assert r.findings[0].evidence["link"].startswith("PCIe Gen5") and r.findings[0].severity == "info"


def test_wrong_elements_are_critical_with_mpi_tag_prefix():
    r = _report("mid_mpi_wrong.log")
    crit = [f for f in r.findings if f.severity == "critical"]
    assert len(crit) == 1
    ev = crit[0].evidence
    assert ev["out_of_bounds"] == 12
    assert ev["wrong"] == [{"size": 64 << 20, "placement": "in_place", "wrong": 12,
                            "line": os.path.join(FIX, "mid_mpi_wrong.log") + ":26"}]
    info = next(f for f in r.findings if f.severity == "info")
    assert info.hosts == ["node0", "node1"] and info.evidence["ranks"] == 16 and info.evidence["peak_busbw_gbps"] == 183.53


def test_old_format_slow_nvlink_is_a_warning_against_the_expectation():
    (run,) = _read("old_a100_slow.log").events
    assert run["rows"][0]["redop"] is None and run["rows"][0]["root"] is None
    assert run["devices"][0]["group"] is None and run["devices"][0]["bus"] == "0x07"
    r = _report("old_a100_slow.log")
    (f,) = r.findings
    assert f.severity == "warning" and f.evidence["peak_busbw_gbps"] == 22.09
    assert f.evidence["expected_min_busbw_gbps"] == 150.0 and "NVLink 3" in f.summary


def test_each_node_ran_its_own_test_across_files():
    r = _report("per_node")
    (w,) = [f for f in r.findings if f.severity == "warning"]
    assert "did not span nodes" in w.summary and w.hosts == ["node-a", "node-b"]
    assert w.evidence["nnodes_reported"] == [[1], [1]] and w.evidence["ranks_per_run"] == [8, 8]


def test_each_node_ran_its_own_test_interleaved_in_one_file():
    r = _report("interleaved_srun.log")
    (w,) = [f for f in r.findings if f.severity == "warning"]
    assert w.hosts == ["gpu-07", "gpu-08"] and w.evidence["streams"] == ["task:0", "task:1"]
    assert len([f for f in r.findings if f.severity == "info"]) == 2


def test_cut_short_run_with_ansi_and_progress_bar():
    r = _report("cut_short.log")
    assert any("without a footer" in n for n in r.inputs[0].notes)
    (f,) = r.findings
    assert f.evidence["busbw_by_size"] == {"1048576": 50.41, "67108864": 222.01}  # the torn third row is dropped


def test_parse_row_shapes():
    assert nt.parse_row("sum  -1  10.0  1.0  1.5  0  9.0  1.1  1.6  N/A")["in_place"]["wrong"] is None
    assert nt.parse_row("10.0  1.0  1.5  0e+00  9.0  1.1  1.6  0e+00")["root"] is None
    assert nt.parse_row("sum  -1  x  y  z") is None


FILES = []
for root, _, files in os.walk(FIX):
    for name in sorted(files):
        if name.endswith(".log"):
            with open(os.path.join(root, name), "rb") as fh:
                FILES.append(fh.read())


def _run(data: bytes):
    if nt.sniff(data):
        res = nt.read(InputFile("x.log", data))
        if res is not None:
            nt.conclude([res])
            nt.summarize([res])


@fuzz_settings(150)
@given(st.binary(max_size=3000))
def test_fuzz_random_bytes(data):
    _run(data)
    _run(b"# Avg bus bandwidth : 1\n" + data)


@fuzz_settings(150)
@given(st.integers(0, len(FILES) - 1), st.floats(0, 1), st.floats(0, 1), st.binary(max_size=30))
def test_fuzz_cut_and_mutated_fixtures(i, a, b, junk):
    data = FILES[i]
    lo, hi = sorted((int(len(data) * a), int(len(data) * b)))
    _run(data[lo:hi])
    _run(data[:lo] + junk + data[lo:])
