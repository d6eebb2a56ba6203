"""The CLI's machine-readable face (docs/cli.md): every command that prints a result has --json, printing exactly one
JSON object on stdout with its documented keys, errors included; and the tables people read fit 80 columns without a
value cut. The command list comes from ``cli.main.COMMANDS``: a new command without a case here fails
``test_every_command_is_covered``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from typer.testing import CliRunner

from cli.main import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
NCCL_LOG = FIXTURES / "logs" / "nccl" / "v221_healthy.log"

# Commands that print no result to parse: a process that runs until stopped, or a full-screen view.
NO_RESULT = {
    "train": "a rank of a training job (torchrun starts it); its records go to the spool",
    "head": "a service that runs until stopped; its results are its HTTP API",
    "tui": "a full-screen terminal view",
}


def cli(*args: str, env: dict | None = None):
    """(exit code, stdout) of ``ranksight ARGS`` in this process (CliRunner: stdout and stderr apart)."""
    r = CliRunner().invoke(main, list(args), env=env)
    if r.exception and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r.exit_code, r.stdout


def cli_process(*args: str, timeout: float = 240):
    """(exit code, stdout) of ``python -m cli.main ARGS`` in a child (commands that end with os._exit or start jobs)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT, env=env)
    return r.returncode, r.stdout


def one_object(stdout: str) -> dict:
    """stdout holds one JSON object and nothing else."""
    doc = json.loads(stdout)
    assert isinstance(doc, dict), stdout[:200]
    return doc


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    s = tmp_path_factory.mktemp("store")
    (s / "run-20240501-120000-a-rather-long-run-name" / "spool").mkdir(parents=True)
    (s / "broken").mkdir()
    (s / "broken" / "run.json").write_text("{not json")
    return s


# name -> [(argv, expected exit codes, documented keys)], each a call whose stdout must be one JSON object.
def cases(store: Path, tmp: Path) -> dict[str, list[tuple[list[str], set[int], set[str]]]]:
    drain_store = tmp / "drain"
    (drain_store / "r1").mkdir(parents=True, exist_ok=True)
    return {
        "runs": [(["runs", "--store", str(store), "--json"], {0}, {"store", "runs"}),
                 (["runs", "--store", str(tmp / "none"), "--json"], {1}, {"store", "error", "runs"})],
        "compact": [(["compact", "--store", str(store), "--json"], {0}, {"store", "runs"}),
                    (["compact", "--store", str(tmp / "none"), "--json"], {1}, {"store", "error", "runs"})],
        "launch": [(["launch", "--inject", "no_such_fault:rank=0", "--json"], {2}, {"error", "exit_code", "run_id"}),
                   (["launch", "--nnodes", "1", "--nproc-per-node", "1", "--steps", "2", "--no-live", "--no-agents",
                     "--store", str(tmp / "launch"), "--run-id", "j1", "--json"], {0},
                    {"run_id", "run_dir", "finished", "exit_code", "error", "interrupted", "steps", "last_step",
                     "nodes", "findings", "findings_error", "agents"})],
        "nccl-tests": [(["nccl-tests", "all_reduce_perf", "-b", "8", "-e", "64", "-n", "2", "--no-progress", "--json"],
                        {0}, {"error", "tool", "op", "backend", "nranks", "results", "out_of_bounds_values",
                              "avg_bus_bandwidth"}),
                       (["nccl-tests", "--check", "--json"], {2}, {"error", "tool", "exit_code"})],
        "diagnose": [(["diagnose", "real-4rank-clean", "--store", str(FIXTURES / "runs"), "--json"], {0},
                      {"run_id", "verdict", "findings", "coverage", "exit_code", "worst_severity"}),
                     (["diagnose", "nope", "--store", str(store), "--json"], {40}, {"run_id", "error", "exit_code"})],
        "nccl-log": [(["nccl-log", str(NCCL_LOG), "--json"], {0},
                      {"error", "files", "file_errors", "ranks", "processes", "comms", "transports", "errors"}),
                     (["nccl-log", str(tmp / "none.log"), "--json"], {1}, {"error", "file_errors"})],
        "trace": [(["trace", str(FIXTURES / "traces" / "hand_cpu.json"), "--json"], {0, 20, 30},
                   {"verdict", "ranks", "findings", "notes", "errors"}),
                  (["trace", str(tmp / "none.json"), "--json"], {40}, {"verdict", "ranks", "errors"})],
        "logs": [(["logs", str(NCCL_LOG), "--json"], {0, 20, 30},
                  {"verdict", "exit_code", "inputs", "findings", "summaries", "errors"})],
        "agent": [(["agent", "--drain", "--json", "--head", "http://127.0.0.1:9", "--node", "0", "--store",
                    str(drain_store), "--run-id", "r1", "--token", "t", "--drain-timeout", "0.5"], {0},
                   {"error", "run_id", "node", "records_before", "delivered_records", "undelivered_records",
                    "outbox", "dropped_records", "rejected_records"})],
        "action": [(["action", "r1", "checkpoint", "--head", "http://127.0.0.1:9", "--token", "t", "--json"], {4},
                    {"accepted", "status", "error"})],
        "ops": [(["ops", "r1", "--rank", "0", "--steps", "0-5", "--head", "http://127.0.0.1:9", "--token", "t",
                  "--json"], {4}, {"error", "status"})],
        "dashboards": [(["dashboards", "build", "--out", str(tmp / "dash"), "--json"], {0},
                        {"ok", "error", "dir", "written"}),
                       (["dashboards", "lint", "--dir", str(tmp / "dash"), "--json"], {0},
                        {"ok", "error", "dashboards", "problems", "queries"}),
                       (["dashboards", "lint", "--dir", str(tmp / "none"), "--json"], {2}, {"ok", "error"}),
                       (["dashboards", "push", "--url", "http://127.0.0.1:9", "--dir", str(tmp / "dash"), "--json"],
                        {2}, {"ok", "error", "url", "folder", "pushed"}),
                       (["dashboards", "rules", "--no-check", "--json"], {0},
                        {"ok", "error", "rules_file", "written", "checks"})],
    }


IN_CHILD = {"launch", "nccl-tests"}  # they start processes / leave with os._exit: run as a user would


def test_every_command_is_covered(store, tmp_path):
    """A command added to ``ranksight`` needs a --json case here (or a reason it prints no result)."""
    missing = set(COMMANDS) - set(cases(store, tmp_path)) - set(NO_RESULT)
    assert not missing, f"commands without a --json case: {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(set(COMMANDS) - set(NO_RESULT)))
def test_json_is_one_object_with_documented_keys(name, store, tmp_path):
    for argv, codes, keys in cases(store, tmp_path)[name]:
        code, out = (cli_process if name in IN_CHILD else cli)(*argv)
        assert code in codes, (argv, code, out[:500])
        doc = one_object(out)
        assert keys <= set(doc), (argv, sorted(keys - set(doc)))
        if "error" in keys and code not in (0, 20, 30):
            assert doc["error"], (argv, doc)  # a failure under --json says why, in the object


def test_runs_missing_store_is_json_not_text(tmp_path):
    code, out = cli("runs", "--store", str(tmp_path / "nope"), "--json")
    assert code == 1
    doc = one_object(out)
    assert doc["runs"] == [] and "no store" in doc["error"]


def test_usage_error_under_json_is_json():
    code, out = cli("runs", "--no-such-option", "--json")
    doc = one_object(out)
    assert code == 2 and doc["usage_error"] is True and "--no-such-option" in doc["error"]
    code, out = cli("action", "r1", "explode", "--json")
    assert code == 2 and "explode" in one_object(out)["error"]
    code, out = cli("runs", "--no-such-option")  # without --json: click's text, not JSON, on stderr
    assert code == 2 and out == ""


# --- tables at 80 columns -------------------------------------------------------------------------------------------

def assert_fits(text: str, values: list[str], width: int = 80) -> None:
    lines = text.splitlines()
    assert all(cell_len(line.rstrip()) <= width for line in lines), max(lines, key=cell_len)
    assert "…" not in text
    for v in values:  # each value whole on one line
        assert any(v in line for line in lines), v


def test_plain_rich_table_cuts_values_at_80_columns():
    """Why fit_table exists: rich squeezes a wide table by cutting values (the old `runs` table did this)."""
    con = Console(width=80, file=StringIO(), record=True)
    t = Table()
    for c in ("run id", "started (UTC)", "layout", "world", "nodes", "steps recorded", "last step", "status"):
        t.add_column(c)
    t.add_row("run-20240501-120000-a-rather-long-run-name", "2024-05-01 12:00:00", "dp=2 tp=1 pp=1", "4", "2",
              "120 (spool)", "119", "finished")
    con.print(t)
    text = con.export_text()
    assert "…" in text or "run-20240501-120000-a-rather-long-run-name" not in text


def test_runs_table_fits_80_columns(store):
    code, out = cli("runs", "--store", str(store), env={"COLUMNS": "80"})
    assert code == 0
    assert_fits(out, ["run-20240501-120000-a-rather-long-run-name", "broken", "damaged", "0 (spool)"])
    assert "not shown at 80 columns:" in out  # the columns it left out are named


def test_runs_table_keeps_every_column_when_wide(store):
    code, out = cli("runs", "--store", str(store), env={"COLUMNS": "200"})
    assert code == 0 and "not shown" not in out and "layout" in out and "nodes" in out


def test_fit_table_drops_in_order_and_wraps_when_it_must():
    from ranksight.fit_table import Col, fit_table

    con = Console(width=80, file=StringIO(), record=True)
    cols = [Col("id"), Col("a"), Col("b"), Col("c")]
    row = ["x" * 20, "y" * 30, "z" * 30, "w" * 10]
    fitted = fit_table(con, cols, [row], ("c", "b"))
    assert fitted.dropped == ["c", "b"]
    con.print(fitted.table)
    assert_fits(con.export_text(), ["x" * 20, "y" * 30])
    con = Console(width=30, file=StringIO(), record=True)
    fitted = fit_table(con, cols, [row], ("c",))
    con.print(fitted.table)
    text = con.export_text()
    assert "…" not in text and text.count("y") == 30  # too wide even so: folded onto more lines, nothing lost


def test_nccl_log_tables_fit_80_columns():
    from probes.nccl_log.cli import render_tables
    from probes.nccl_log.summary import summarize

    s = summarize([str(NCCL_LOG), str(FIXTURES / "logs" / "nccl_tests" / "per_node" / "nodea.log")])
    con = Console(width=80, file=StringIO(), record=True)
    render_tables(s, con)
    text = con.export_text()
    hosts = sorted({p["host"] for p in s["processes"] if p["host"]})
    assert_fits(text, hosts + ["0-15", "NET/IB/0/GDRDMA"])


def test_launch_progress_table_fits_80_columns(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import msgspec

    from cli import launch
    from ranksight import schema
    from ranksight.layout import RunDir

    run = RunDir(tmp_path, "run-20240501-120000")
    run.spool_dir.mkdir(parents=True)
    for rank in range(4):
        rec = schema.StepRecord(run_id=run.run_id, rank=rank, node=rank // 2, host="host-a", world_size=4, step=1234,
                                t_start=0.0, t_end=1.0, step_ms=12345.0, compute_ms=10234.0, comm_ms=1111.0,
                                loss=2.345678, tokens=123456789)
        (run.spool_dir / f"rank-{rank}.jsonl").write_bytes(msgspec.json.encode(rec) + b"\n")
    cluster = SimpleNamespace(nodes=[])
    con = Console(width=80, file=StringIO(), record=True)
    monkeypatch.setattr(launch, "console", con)
    con.print(launch.progress_table(run, cluster, 100000))
    assert_fits(con.export_text(), ["1234/100000 (stale)", "12345", "2.3457"])
