"""diagnose: exit codes, the --json contract, the HTML page, load errors -> EXIT_LOAD_ERROR."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from analyzer_fixtures import build, write_run
from typer.testing import CliRunner

from cli.main import main as ranksight_main
from analyzers.report.model import EXIT_CRITICAL, EXIT_LOAD_ERROR, EXIT_WARNING
from ranksight.schema import SCHEMA_VERSION, FaultSpec, FINDING_KINDS

FINDING_KEYS = {"analyzer", "kind", "severity", "ranks", "nodes", "step_start", "step_end", "evidence", "recommendation",
                "confidence", "summary", "simulated", "hosts", "gpus", "inputs"}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("store")
    write_run(build(world=4, steps=30), d, "clean")
    write_run(build(world=4, nodes=2, steps=30, compute_factor=lambda r, s: 1.5 if (r == 1 and s >= 10) else 1.0,
                    faults=[FaultSpec(kind="slow_rank", rank=1, factor=1.5, start=10)]), d, "slow")
    write_run(build(world=4, steps=30, stop={3: 20}, finished=False,
                    faults=[FaultSpec(kind="hang", rank=3, start=20)]), d, "hung", truncate_last=True)
    write_run(build(world=4, steps=30), d, "future")
    m = json.loads((d / "future" / "run.json").read_text())
    m["schema_version"] = SCHEMA_VERSION + 1
    (d / "future" / "run.json").write_text(json.dumps(m))
    (d / "empty" / "spool").mkdir(parents=True)
    return d


def run(store, *args):
    r = CliRunner().invoke(ranksight_main, ["diagnose", *args, "--store", str(store)])
    return r.exit_code, r.output


def test_clean_run_exit_0(store):
    code, out = run(store, "clean")
    assert code == 0
    assert "HEALTHY" in out and "No findings" in out
    assert "compute time per rank" in out and "MFU" in out


def test_slow_rank_exits_warning_and_report(store):
    code, out = run(store, "slow")
    assert code == EXIT_WARNING
    assert "rank 1 (node 0) is the straggler since step 10" in out
    assert "injected faults" in out and "slow_rank" in out and "yes, 2 step(s) after onset" in out
    assert "What to do next" in out


def test_json_contract(store):
    code, out = run(store, "slow", "--json")
    assert code == EXIT_WARNING
    obj = json.loads(out)  # exactly one JSON object
    assert {"run_id", "verdict", "findings", "faults", "simulated"} <= set(obj)
    assert obj["run_id"] == "slow" and obj["verdict"].startswith("WARNING")
    assert isinstance(obj["simulated"], bool)
    for f in obj["findings"]:
        assert set(f) == FINDING_KEYS
        assert f["kind"] in FINDING_KINDS and f["severity"] in ("info", "warning", "critical")
    stragglers = [f for f in obj["findings"] if f["kind"] == "straggler"]
    assert [f["ranks"] for f in stragglers] == [[1]] and stragglers[0]["step_start"] == 10
    assert obj["faults"][0]["found"] and obj["faults"][0]["latency_steps"] == 2


def test_hang_exits_critical(store):
    code, out = run(store, "hung", "--json")
    assert code == EXIT_CRITICAL
    obj = json.loads(out)
    assert obj["truncated_lines"] == 1
    hangs = [f for f in obj["findings"] if f["kind"] == "hang"]
    assert hangs[0]["ranks"] == [3] and "never joined" in hangs[0]["summary"]


def test_since_until(store):
    code, out = run(store, "slow", "--json", "--until", "9")
    assert code == 0 and json.loads(out)["steps"] == [0, 9]
    code, out = run(store, "slow", "--json", "--since", "12")
    obj = json.loads(out)
    assert obj["steps"] == [12, 29]


@pytest.mark.parametrize("run_id,needle", [("nope", "unknown run id"), ("empty", "no step records"),
                                           ("future", "schema version")])
def test_load_errors_exit_load_error(store, run_id, needle):
    code, out = run(store, run_id)
    assert code == EXIT_LOAD_ERROR
    assert needle in out
    code, out = run(store, run_id, "--json")
    assert code == EXIT_LOAD_ERROR and needle in json.loads(out)["error"]


def test_html_is_self_contained(store, tmp_path):
    page = tmp_path / "r.html"
    code, _ = run(store, "slow", "--html", str(page))
    assert code == EXIT_WARNING
    text = page.read_text()
    assert text.startswith("<!doctype html>") and "<svg" in text and "rank 1 (node 0) is the straggler" in text
    for external in ("<script src", "<link ", "http://", "https://", "src=\"", "url("):
        assert external not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_console_script_entry_point(store):
    # the `diagnose` console script is cli.diagnose:main
    r = subprocess.run([sys.executable, "-c", "import sys; sys.argv=['diagnose','clean','--store',sys.argv[1],'--json'];"
                        "from cli.diagnose import main; main()", str(store)], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["verdict"].startswith("HEALTHY")


def test_an_eviction_and_the_restart_are_in_the_report(tmp_path):
    """A run whose node 1 was evicted by the head's policy at step 20 and that resumed on node 0: the verdict, the
    history table and --json say so; the header keeps the layout the run started with."""
    import pandas as pd

    from ranksight.schema import Action

    write_run(build(world=4, nodes=2, steps=30, compute_factor=lambda r, s: 1.5 if (r == 3 and s >= 10) else 1.0), tmp_path, "ev")
    m = json.loads((tmp_path / "ev" / "run.json").read_text())
    # the manifest as the trainer leaves it: the newest attempt's layout, the history in attempts
    m["layout"].update(dp=2, world=2)
    m["attempts"] = [dict(attempt=0, t=1.0, world_size=4, resumed_step=None, ended_step=20, evicted_node=1),
                     dict(attempt=1, t=2.0, world_size=2, resumed_step=20, ended_step=29)]
    (tmp_path / "ev" / "run.json").write_text(json.dumps(m))
    base = dict(run_id="ev", id="a1", t=5.0, action="evict", node=1, ranks=[3], reason="straggler on node 1 confirmed 3 rounds",
                finding_kind="straggler", requested_by="policy")
    rows = [Action(**base, status="requested"), Action(**base, status="applied", applied_step=20)]
    (tmp_path / "ev" / "actions").mkdir()
    pd.DataFrame([{f: getattr(a, f) for f in a.__struct_fields__} for a in rows]).to_parquet(tmp_path / "ev" / "actions" / "part-0.parquet")
    code, out = run(tmp_path, "ev")
    assert code == EXIT_WARNING
    assert "what happened to the job" in out and "evict node 1 (applied)" in out and "attempt 1: 2 ranks" in out
    assert "dp=4" in out  # the layout the run started with
    code, out = run(tmp_path, "ev", "--json")
    obj = json.loads(out)
    assert obj["verdict"].endswith("node 1 evicted at step 20 (policy), the run resumed from step 20 on 2 ranks and reached step 29")
    assert [(a["action"], a["status"], a["applied_step"]) for a in obj["history"]["actions"]] == [("evict", "applied", 20)]
    assert [a["world_size"] for a in obj["history"]["attempts"]] == [4, 2]


def test_logs_stored_with_a_run_are_read_by_diagnose(tmp_path):
    """Issue 13: `diagnose <run-id>` runs the `ranksight logs` readers over the logs stored with the run: a kernel log
    a user dropped into <run>/logs/ turns a healthy-looking run into a critical report naming the GPU; --no-logs
    leaves them out."""
    import shutil

    write_run(build(world=4, steps=30), tmp_path, "xid")
    logs = tmp_path / "xid" / "logs"
    logs.mkdir()
    shutil.copy(Path(__file__).parent / "fixtures" / "logs" / "kernel" / "dmesg_xid79_aer.log", logs / "node-1-dmesg.log")
    (logs / "node-0.log").write_text("W1124 12:00:00 torchrun: some launcher chatter\n" * 20)  # nothing of ours
    code, out = run(tmp_path, "xid", "--json")
    obj = json.loads(out)
    xid = [f for f in obj["findings"] if f["analyzer"] == "logs.kernel"]
    assert code == 30 and xid and xid[0]["severity"] == "critical" and "Xid 79" in xid[0]["summary"]
    assert xid[0]["inputs"] == [str(logs / "node-1-dmesg.log")] and xid[0]["gpus"]
    assert obj["findings"][0]["analyzer"] == "logs.kernel"  # the worst first
    code, out = run(tmp_path, "xid", "--json", "--no-logs")
    assert code == 0 and not [f for f in json.loads(out)["findings"] if f["analyzer"].startswith("logs.")]


def test_traces_stored_with_a_run_are_read_by_diagnose(tmp_path):
    """Issue 14: `diagnose <run-id>` runs `ranksight trace`'s checks over the run's stored profiler traces: GPU-like
    traces where rank 2's kernels run 1.4x longer name rank 2 from kernel time."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from kineto_synth import generate

    write_run(build(world=4, steps=30), tmp_path, "tr")
    generate(str(tmp_path / "tr" / "traces"), ranks=4, steps=6, kernels=40, slow_rank=2, slow_factor=1.4, seed=3)
    code, out = run(tmp_path, "tr", "--json")
    found = [f for f in json.loads(out)["findings"] if f["analyzer"] == "trace" and f["kind"] == "straggler"]
    assert found and found[0]["ranks"] == [2] and code >= 20, out[:2000]
