"""nccl_tests: formulas, checks, the health-check verdict, the CLI, and real gloo runs.

One test launches the real thing, ``torchrun -m nccl_tests`` with 4 ranks; the other process tests
fork small worlds from a forkserver that imported torch once (so they skip the per-rank start-up that
dominates on 2 cores) and run the same entry point with the environment torchrun would set.
Every process has a generous timeout and is killed in ``finally``. No assertion depends on timing.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import free_port
from nccl_tests import data, formulas, output
from nccl_tests.cli import parse_args
from nccl_tests.health_report import analyze

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run"]

# ---------------------------------------------------------------------------
# formulas (pure)
# ---------------------------------------------------------------------------

EXPECTED_FACTOR = {
    "all_reduce": lambda n: Fraction(2 * (n - 1), n),
    "all_gather": lambda n: Fraction(n - 1, n),
    "reduce_scatter": lambda n: Fraction(n - 1, n),
    "alltoall": lambda n: Fraction(n - 1, n),
    "broadcast": lambda n: Fraction(1),
    "reduce": lambda n: Fraction(1),
    "sendrecv": lambda n: Fraction(1),
}


@pytest.mark.parametrize("op", sorted(EXPECTED_FACTOR))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16, 64])
def test_busbw_factor_matches_nccl_tests(op, n):
    want = EXPECTED_FACTOR[op](n)
    assert formulas.busbw_factor_exact(op, n) == want
    assert formulas.busbw_factor(f"{op}_perf", n) == pytest.approx(float(want), rel=1e-15)
    nbytes, secs = 123_456_789, 0.0123
    alg = formulas.algbw(nbytes, secs)
    assert alg == pytest.approx(nbytes / secs / 1e9)
    assert formulas.busbw(op, n, nbytes, secs) == pytest.approx(alg * float(want))


def test_named_factor_values():
    assert formulas.busbw_factor("all_reduce", 4) == 1.5
    assert formulas.busbw_factor("all_reduce", 8) == 1.75
    assert formulas.busbw_factor("all_gather", 4) == 0.75
    assert formulas.busbw_factor("reduce_scatter", 2) == 0.5
    assert formulas.busbw_factor("alltoall", 8) == 0.875
    assert formulas.busbw_factor("broadcast", 8) == 1.0
    assert formulas.busbw_factor("all_reduce", 1) == 0.0


def test_whole_buffer_bytes_for_gather_and_scatter():
    # all_gather / reduce_scatter: S = count per rank x type size x n
    n, per_rank, tsize = 4, 1000, 4
    count = formulas.element_count("all_gather", per_rank * n * tsize, tsize, n)
    assert count == per_rank * n
    assert formulas.row_bytes(count, tsize) == per_rank * tsize * n
    # counts are rounded down to whole per-rank chunks
    assert formulas.element_count("reduce_scatter", 100, 4, 3) == 24
    assert formulas.element_count("all_reduce", 100, 4, 3) == 25
    assert formulas.element_count("all_gather", 8, 4, 4) == 0


@pytest.mark.parametrize("text,value", [("8", 8), ("1K", 1024), ("64k", 65536), ("1M", 1 << 20), ("2G", 2 << 30), ("128MB", 128 << 20)])
def test_parse_size(text, value):
    assert formulas.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "-1", "1.5", "1X", "M"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        formulas.parse_size(text)


def test_size_sequence():
    assert formulas.size_sequence(8, 1 << 20, 2)[:3] == [8, 16, 32]
    assert formulas.size_sequence(8, 1 << 20, 2)[-1] == 1 << 20
    assert len(formulas.size_sequence(8, 1 << 20, 2)) == 18
    assert formulas.size_sequence(8, 100, 4) == [8, 32]
    assert formulas.size_sequence(0, 30, 2, step_bytes=10) == [0, 10, 20, 30]
    with pytest.raises(ValueError):
        formulas.size_sequence(1024, 8, 2)


def test_aggregate_modes():
    t = [3.0, 1.0, 2.0]
    assert [formulas.aggregate(t, m) for m in range(4)] == [3.0, 2.0, 1.0, 3.0]


# ---------------------------------------------------------------------------
# expected values and the comparison (pure torch, no processes)
# ---------------------------------------------------------------------------


def test_expected_all_reduce_is_the_sum_of_rank_inputs():
    n, count = 4, 37
    ins = [data.make_input("all_reduce", "sum", "float", r, n, count, "cpu") for r in range(n)]
    want = data.expected("all_reduce", "sum", "float", 0, n, count, 0)
    assert torch.equal(want, sum(ins))
    assert data.count_wrong(sum(ins), want, "float", n) == 0


def test_expected_prod_is_exact_two():
    for n in (1, 3, 8):
        want = data.expected("all_reduce", "prod", "int8", 0, n, 50, 0)
        assert torch.all(want == 2)


def test_expected_alltoall_and_gather_layout():
    n, count = 3, 12
    sends = [data.make_input("alltoall", "sum", "int32", r, n, count, "cpu") for r in range(n)]
    for me in range(n):
        got = torch.cat([sends[j][me * 4:(me + 1) * 4] for j in range(n)])
        assert torch.equal(got, data.expected("alltoall", "sum", "int32", me, n, count, 0))
    gathered = torch.cat([data.make_input("all_gather", "sum", "int32", r, n, count, "cpu") for r in range(n)])
    assert torch.equal(gathered, data.expected("all_gather", "sum", "int32", 2, n, count, 0))
    assert data.expected("reduce", "sum", "float", 1, n, count, root=0) is None


@pytest.mark.parametrize("type_name", ["int8", "uint8", "int32", "half", "bfloat16", "float", "double"])
def test_count_wrong_detects_corruption(type_name):
    want = data.expected("all_reduce", "sum", type_name, 0, 4, 64, 0)
    got = want.clone()
    assert data.count_wrong(got, want, type_name, 4) == 0
    data.corrupt_(got)
    assert data.count_wrong(got, want, type_name, 4) == 1
    got[5] = got[5] + 3
    assert data.count_wrong(got, want, type_name, 4) == 2


# ---------------------------------------------------------------------------
# health-check verdict (pure)
# ---------------------------------------------------------------------------


def _matrix(n, bw=10.0, slow_rank=None, slow_bw=1.0):
    return {(i, j): (slow_bw if slow_rank in (i, j) else bw) for i in range(n) for j in range(i + 1, n)}


def test_health_names_slow_rank():
    rep = analyze(_matrix(4, slow_rank=2), ["n0"] * 4, 0.5)
    assert not rep.ok
    assert [e.ranks for e in rep.ranks if e.flagged] == [[2]]
    slow_links = [e for e in rep.links if e.flagged]
    assert {tuple(e.ranks) for e in slow_links} == {(0, 2), (1, 2), (2, 3)}
    assert all(e.explained_by == "rank 2" for e in slow_links)


def test_health_all_equal_is_ok():
    rep = analyze(_matrix(8), ["a"] * 4 + ["b"] * 4, 0.5)
    assert rep.ok and rep.flagged() == []


def test_health_names_slow_inter_node_link_and_node():
    nodes = ["a", "a", "b", "b", "c", "c"]
    bw = {(i, j): (1.0 if {nodes[i], nodes[j]} == {"a", "c"} else 10.0) for i in range(6) for j in range(i + 1, 6)}
    rep = analyze(bw, nodes, 0.5)
    assert [e.name for e in rep.node_links if e.flagged] == ["a<->c"]
    assert not [e for e in rep.ranks if e.flagged]
    # a node whose intra-node group is slow
    rep = analyze(_matrix(6), nodes, 0.5, group_bw={"a": 5.0, "b": 5.0, "c": 1.0})
    assert [e.nodes for e in rep.node_groups if e.flagged] == [["c"]]


def test_health_threshold_is_respected():
    rep = analyze(_matrix(4, slow_rank=0, slow_bw=6.0), ["n"] * 4, 0.5)
    assert rep.ok  # 0.6 x: above 0.5
    rep = analyze(_matrix(4, slow_rank=0, slow_bw=6.0), ["n"] * 4, 0.9)
    assert not rep.ok


# ---------------------------------------------------------------------------
# report text
# ---------------------------------------------------------------------------


def test_row_format_and_parse_round_trip():
    r = output.Row("all_reduce", 1 << 20, 1 << 18, "float", "sum", -1,
                   output.Result(123.4, 8.5, 12.75, 0), output.Result(12345.6, 0.08, 0.12, 3))
    parsed = output.parse_table(output.format_row(r))
    assert parsed == [{"size": 1 << 20, "count": 1 << 18, "type": "float", "redop": "sum", "root": -1,
                       "out_of_place": {"time_us": 123.4, "algbw": 8.5, "busbw": 12.75, "wrong": 0},
                       "in_place": {"time_us": 12346.0, "algbw": 0.08, "busbw": 0.12, "wrong": 3}}]
    foot = output.footer([r], True)
    assert foot[0] == "# Out of bounds values : 3 FAILED"
    assert foot[1].startswith("# Avg bus bandwidth    : ")
    assert float(foot[1].split(":")[1]) == pytest.approx((12.75 + 0.12) / 2)
    header = output.table_header()
    assert "out-of-place" in header[0] and "in-place" in header[0]
    assert header[1].split() == ["#", "size", "count", "type", "redop", "root"] + ["time", "algbw", "busbw", "#wrong"] * 2


# ---------------------------------------------------------------------------
# CLI flags
# ---------------------------------------------------------------------------


def test_cli_parses_nccl_tests_flags():
    a = parse_args(["all_reduce_perf", "-b", "8", "-e", "1M", "-f", "2", "-n", "5", "-w", "2", "-c", "0", "-d", "bf16", "-o", "max"])
    assert (a.op, a.minbytes, a.maxbytes, a.iters, a.warmup_iters, a.check, a.dtype, a.redop) == (
        "all_reduce", 8, 1 << 20, 5, 2, 0, "bfloat16", "max")
    assert a.sizes[0] == 8 and a.sizes[-1] == 1 << 20
    assert parse_args(["broadcast", "-r", "1"]).root == 1
    h = parse_args(["--check"])
    assert h.health and h.op == "sendrecv"


@pytest.mark.parametrize("argv,msg", [
    (["bogus_perf"], "unknown operation"),
    ([], "name an operation"),
    (["all_reduce_perf", "-b", "1X"], "invalid size"),
    (["all_reduce_perf", "-d", "float7"], "unknown data type"),
    (["all_reduce_perf", "-o", "xor"], "unknown reduction"),
    (["all_reduce_perf", "-o", "avg", "-d", "int32"], "floating-point"),
    (["all_reduce_perf", "-b", "1M", "-e", "8"], "larger than maximum"),
    (["all_reduce_perf", "-t", "2"], "threads per process"),
    (["all_reduce_perf", "--store", "/tmp/x"], "--store and --run-id"),
    (["all_reduce_perf", "--bogus"], "unrecognized arguments"),
    (["all_gather_perf", "--check"], "--check runs the pairwise"),
])
def test_cli_bad_flags_are_clear_errors(argv, msg, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert msg in capsys.readouterr().err


def test_module_entry_point_rejects_bad_flag():
    p = subprocess.run([PY, "-m", "nccl_tests", "all_reduce_perf", "-n", "zero"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "iterations (-n) must be an integer" in p.stderr


def test_ranksight_cli_dispatches_to_the_same_parser():
    p = subprocess.run([PY, "-m", "cli.main", "nccl-tests", "nope"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "ranksight nccl-tests: error: argument op: unknown operation 'nope'" in p.stderr
    h = subprocess.run([PY, "-m", "cli.main", "nccl-tests", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert h.returncode == 0 and "--check" in h.stdout and "-b MINBYTES" in h.stdout


# ---------------------------------------------------------------------------
# real runs (gloo)
# ---------------------------------------------------------------------------


def _torchrun(nproc: int, args: list[str], env_extra: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("NCCL_TESTS_CORRUPT_RANK", None)
    env.pop("NCCL_TESTS_DELAY_RANK", None)
    env.update(env_extra or {})
    cmd = TORCHRUN + ["--nnodes", "1", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "nccl_tests"] + args
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


@pytest.mark.distributed
def test_all_reduce_perf_4_ranks_table_json_and_store(tmp_path):
    js = tmp_path / "ar.json"
    p = _torchrun(4, ["all_reduce_perf", "-b", "8", "-e", "256K", "-f", "8", "-n", "3", "--json", str(js),
                      "--store", str(tmp_path / "store"), "--run-id", "base1"])
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    # header: nccl-tests style lines and one rank line per rank
    assert "# nThread 1 nProcs 4" in out and "backend gloo" in out
    assert sum(1 for line in out.splitlines() if line.startswith("#  Rank ")) == 4
    assert "#       size         count      type   redop    root     time   algbw   busbw  #wrong" in out
    rows = output.parse_table(out)
    sizes = [8, 64, 512, 4096, 32768, 262144]
    assert [r["size"] for r in rows] == sizes
    for r in rows:
        assert r["count"] == r["size"] // 4 and r["type"] == "float" and r["redop"] == "sum" and r["root"] == -1
        for res in (r["out_of_place"], r["in_place"]):
            assert res["wrong"] == 0 and res["time_us"] > 0
            # printed with 2 decimals: busbw = 1.5 x algbw within the rounding of both
            assert abs(res["busbw"] - 1.5 * res["algbw"]) <= 0.005 * 2.5 + 1e-9
    assert "# Out of bounds values : 0 OK" in out
    assert "# Avg bus bandwidth    : " in out
    # full precision: busbw / algbw == 2(n-1)/n on every row
    doc = json.loads(js.read_text())
    assert doc["nranks"] == 4 and doc["backend"] == "gloo" and len(doc["results"]) == len(sizes)
    for r in doc["results"]:
        for k in ("out_of_place", "in_place"):
            res = r[k]
            assert res["algbw"] > 0
            assert res["busbw"] / res["algbw"] == pytest.approx(2 * 3 / 4, rel=1e-12)
            assert res["algbw"] == pytest.approx(r["size"] / (res["time_us"] * 1e-6) / 1e9, rel=1e-9)
            assert res["time_us"] == pytest.approx(max(res["per_rank_us"]), rel=1e-12)  # max across ranks
    # the run store baseline
    df = pd.read_parquet(tmp_path / "store" / "base1" / "nccl_tests" / "perf")
    assert len(df) == 2 * len(sizes)
    assert set(df.columns) >= {"op", "size", "count", "dtype", "in_place", "time_us", "algbw", "busbw", "wrong",
                               "nranks", "backend", "hosts", "nodes", "t"}
    assert (df["op"] == "all_reduce").all() and (df["nranks"] == 4).all() and (df["backend"] == "gloo").all()
    assert sorted(df["in_place"].unique().tolist()) == [False, True]
    assert ((df["busbw"] / df["algbw"]) - 1.5).abs().max() < 1e-12
    assert (df["wrong"] == 0).all()
    assert all(len(h) == 4 for h in df["hosts"])


_CTX = None


def _ctx():
    """A forkserver: ranks fork from a clean single-threaded server that has imported torch once,
    so they start fast and never inherit threads (or held locks) of the pytest process."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "pandas", "nccl_tests.cli", "nccl_tests.perf", "nccl_tests.health"])
    return _CTX


def _cli_rank(rank: int, n: int, port: int, outdir: str, argv: list[str], env_extra: dict) -> None:
    """One rank of a forked world running the real entry point (cli.main), with the environment
    torchrun would give it. cli.main leaves through runtime.finish (os._exit with its status)."""
    code = 3
    try:
        for k in ("NCCL_TESTS_CORRUPT_RANK", "NCCL_TESTS_DELAY_RANK", "NCCL_TESTS_DELAY_US", "RANKSIGHT_NODE", "GROUP_RANK"):
            os.environ.pop(k, None)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env_extra)
        sys.stdout = open(os.path.join(outdir, f"out-{rank}.txt"), "w")
        sys.stderr = open(os.path.join(outdir, f"err-{rank}.txt"), "w")
        torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1: no intra-op pool competing for 2 cores
        from nccl_tests.cli import main

        main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _fork_cli(n: int, argv: list[str], outdir: Path, env_extra: dict | None = None) -> tuple[list[int], str]:
    """Run ``python -m nccl_tests <argv>`` as an n-rank world of processes forked from the
    forkserver (torch already imported there); returns (exit codes, rank 0's stdout)."""
    ctx = _ctx()
    port = free_port()
    procs = [ctx.Process(target=_cli_rank, args=(r, n, port, str(outdir), argv, env_extra or {})) for r in range(n)]
    try:
        for pr in procs:
            pr.start()
        for pr in procs:
            pr.join(timeout=240)
        codes = [pr.exitcode for pr in procs]
    finally:
        for pr in procs:
            if pr.is_alive():
                os.kill(pr.pid, signal.SIGKILL)
                pr.join()
    return codes, (outdir / "out-0.txt").read_text()


@pytest.mark.distributed
def test_corrupted_result_is_counted_and_fails(tmp_path):
    codes, out = _fork_cli(4, ["all_reduce_perf", "-b", "64", "-e", "4K", "-f", "8", "-n", "2"], tmp_path,
                           {"NCCL_TESTS_CORRUPT_RANK": "3"})
    assert codes == [1, 1, 1, 1], (codes, out)
    rows = output.parse_table(out)
    assert len(rows) == 3
    for r in rows:  # one element of rank 3's result, in each placement
        assert r["out_of_place"]["wrong"] == 1 and r["in_place"]["wrong"] == 1
    assert "# Out of bounds values : 6 FAILED" in out
    assert "SELF-TEST: NCCL_TESTS_CORRUPT_RANK=3" in out


@pytest.mark.distributed
def test_health_check_names_delayed_rank(tmp_path):
    store = tmp_path / "store"
    codes, out = _fork_cli(4, ["--check", "--check-bytes", "256K", "-n", "5", "--store", str(store), "--run-id", "pre"],
                           tmp_path, {"NCCL_TESTS_DELAY_RANK": "2", "NCCL_TESTS_DELAY_US": "30000"})
    assert codes == [1, 1, 1, 1], (codes, out)
    assert "# Health check: FAILED - slow rank(s): 2 (host" in out
    assert "! rank 2" in out
    for r in (0, 1, 3):
        assert f"! rank {r} " not in out
    ents = pd.read_parquet(store / "pre" / "nccl_tests" / "health_entities")
    flagged_ranks = ents[(ents["kind"] == "rank") & ents["flagged"]]
    assert [list(x) for x in flagged_ranks["ranks"]] == [[2]]
    pairs = pd.read_parquet(store / "pre" / "nccl_tests" / "health_pairs")
    assert len(pairs) == 6
    slow = pairs[pairs["flagged"]]
    assert set(zip(slow["rank_a"], slow["rank_b"])) <= {(0, 2), (1, 2), (2, 3)}


@pytest.mark.distributed
def test_health_check_passes_without_delay(tmp_path):
    codes, out = _fork_cli(4, ["--check", "--check-bytes", "256K", "-n", "20"], tmp_path)
    assert codes == [0, 0, 0, 0], (codes, out)
    assert "# Health check: OK" in out
    assert "# Pairwise sendrecv bandwidth" in out


# ---------------------------------------------------------------------------
# every op, checked, in one forked 3-rank world (no torchrun: forked from the forkserver)
# ---------------------------------------------------------------------------

ALL_OPS = ["all_reduce", "all_gather", "reduce_scatter", "alltoall", "broadcast", "reduce", "sendrecv"]


def _world_main(rank: int, n: int, port: int, outdir: str, corrupt: bool) -> None:
    code = 3
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if corrupt:
            os.environ["NCCL_TESTS_CORRUPT_RANK"] = "1"
        else:
            os.environ.pop("NCCL_TESTS_CORRUPT_RANK", None)
        os.environ.pop("NCCL_TESTS_DELAY_RANK", None)
        sys.stdout = open(os.path.join(outdir, f"stdout-{rank}.txt"), "w")
        from nccl_tests import perf, runtime

        me, backend = runtime.init("gloo", 120)
        codes = []
        for op in ALL_OPS:
            for dtype, redop in (("float", "sum"), ("int8", "max"), ("bfloat16", "avg")):
                if dtype != "float" and not formulas.OPS[op].reduces:
                    continue
                args = parse_args([op, "-b", "8", "-e", "3K", "-f", "6", "-n", "1", "-w", "0", "-r", "1", "-d", dtype, "-o", redop,
                                   "--json", os.path.join(outdir, f"{op}-{dtype}-{redop}.json"), "--no-progress"])
                codes.append(perf.run(args, me, backend))
        code = 0 if not any(codes) else 1
    except BaseException:
        import traceback

        traceback.print_exc(file=sys.stderr)
    finally:
        try:
            sys.stdout.flush()
        except Exception:
            pass
        from nccl_tests import runtime as rt

        rt.finish(code)


def _fork_world(n: int, tmp_path: Path, corrupt: bool) -> list[int]:
    ctx = _ctx()
    port = free_port()
    procs = [ctx.Process(target=_world_main, args=(r, n, port, str(tmp_path), corrupt)) for r in range(n)]
    try:
        for pr in procs:
            pr.start()
        for pr in procs:
            pr.join(timeout=240)
        return [pr.exitcode for pr in procs]
    finally:
        for pr in procs:
            if pr.is_alive():
                os.kill(pr.pid, signal.SIGKILL)
                pr.join()


@pytest.mark.distributed
@pytest.mark.parametrize("corrupt", [False, True], ids=["clean", "corrupt-rank-1"])
def test_every_op_is_checked(tmp_path, corrupt):
    codes = _fork_world(3, tmp_path, corrupt)
    files = sorted(tmp_path.glob("*.json"))
    assert len(files) == 7 + 2 * 3, (codes, [p.read_text() for p in tmp_path.glob("stdout-*")])
    for f in files:
        doc = json.loads(f.read_text())
        n = doc["nranks"]
        assert n == 3 and doc["results"]
        for r in doc["results"]:
            for k in ("out_of_place", "in_place"):
                res = r[k]
                assert res["busbw"] == pytest.approx(res["algbw"] * formulas.busbw_factor(doc["op"], n), rel=1e-12)
                # rank 1's result is corrupted (reduce: rank 1 is the root, so it is checked there too)
                assert res["wrong"] == (1 if corrupt else 0), (f.name, r)
    if corrupt:
        assert all(c == 1 for c in codes), codes
    else:
        assert codes == [0, 0, 0]


def test_pair_time_quantile():
    from nccl_tests.health import quantile

    assert quantile([5.0, 1.0, 3.0], 0.5) == 3.0
    assert quantile([4.0, 1.0, 2.0, 3.0], 0.5) == 2.5
    assert quantile([10.0, 1.0, 2.0, 3.0, 4.0], 0.0) == 1.0
    assert quantile(list(range(11)), 0.2) == pytest.approx(2.0)
