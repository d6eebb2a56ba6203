"""`ranksight runs`: lists runs from run.json + the steps table (or the spools before any head stored them)."""

import json

from typer.testing import CliRunner

from head.store import Store
from agent_helpers import FakeRanks
from cli.main import main
from ranksight import schema
from ranksight.layout import atomic_write


def run_cli(*args):
    r = CliRunner().invoke(main, ["runs", *args])
    r.returncode = r.exit_code
    return r


def test_runs_lists_store_and_spool_runs(tmp_path):
    store = tmp_path / "runs"
    fr = FakeRanks(store, "alpha", {0: [0, 1]}, step_s=0.0, steps=5)
    fr._run()
    st = Store(store)
    recs = [schema.decode_spool_line(l) for p in sorted((store / "alpha" / "spool").glob("*.jsonl"))
            for l in p.read_bytes().splitlines()]
    st.run("alpha").add("steps", recs)
    st.close()
    man = (store / "alpha" / "run.json").read_bytes()
    atomic_write(store / "alpha" / "run.json", man.replace(b'"finished":null', b'"finished":123.0'))
    FakeRanks(store, "beta", {0: [0]}, step_s=0.0, steps=3)._run()  # spool only, no head yet
    (store / "gamma").mkdir()
    (store / "gamma" / "run.json").write_text("{broken")
    out = run_cli("--store", str(store), "--json")
    assert out.returncode == 0, out.output
    rows = {r["run_id"]: r for r in json.loads(out.stdout)["runs"]}
    assert (rows["alpha"]["steps_recorded"], rows["alpha"]["last_step"], rows["alpha"]["status"],
            rows["alpha"]["world_size"], rows["alpha"]["source"]) == (10, 4, "finished", 2, "store")
    assert (rows["beta"]["steps_recorded"], rows["beta"]["source"]) == (3, "spool")
    assert rows["gamma"]["status"] == "damaged"
    table = run_cli("--store", str(store))
    assert table.returncode == 0 and "alpha" in table.stdout and "finished" in table.stdout
    missing = run_cli("--store", str(tmp_path / "nope"))
    assert missing.returncode == 1 and "no store" in missing.output
