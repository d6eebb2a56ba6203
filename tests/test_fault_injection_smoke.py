"""bench/fault_injection.py keeps working: its two cheapest scenarios, short, through the script's own functions (real
torchruns, a head, two agents, the acknowledgement-recording proxy). The full suite is the benchmark itself."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import fault_injection  # noqa: E402

STEPS = 12


def test_poison_utf8_and_agent_kill9_keep_every_acknowledged_record_once():
    rows = {name: fault_injection.run_scenario(name, STEPS) for name in ("poison_utf8", "agent_kill9_mid")}
    for name, row in rows.items():
        assert "error" not in row, (name, row.get("error"))
        # every record the head acknowledged is in the store exactly once; every step the ranks wrote is stored
        assert row["acked"] > 0 and row["per_table"]["steps"]["acked"] == 4 * STEPS, (name, row["per_table"])
        assert row["acked_missing"] == 0 and row["stored_dup"] == 0, (name, row["per_table"])
        assert row["steps_written"] == row["steps_stored"] == 4 * STEPS and row["steps_missing"] == 0, name
        assert row["hang_live"] == 0 and row["hang_diagnose"] == 0, (name, row["hang_summaries"])
        assert row["ok"], name
    assert rows["poison_utf8"]["spool_gaps"] == 1  # the bad line is a counted gap, and the data after it still flows
    assert any("kill -9" in e for e in rows["agent_kill9_mid"]["timeline"])
    table = fault_injection.table(list(rows.values()))
    assert len(table.splitlines()) == 4 and "| poison_utf8 | " in table and "1 spool_gap event" in table
