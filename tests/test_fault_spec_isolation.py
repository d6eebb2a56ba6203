"""Measured, never booked: no signal, record or analyzer reads the fault spec.

Only the trainer's fault code (and the trainer wiring that hands ``--inject`` to it), the schema that defines the
spec, and the scoring and reporting code (the injected-vs-found table, the benchmarks, the demo's check) may touch
it. Everything that produces or judges a signal — the instrumentation, the node agent, the probes, the head, the
analyzers' loader, builder and checks, the dashboards, the TUI — must not. The check reads the code (AST), so a
comment or a docstring that mentions a fault is fine; a read is not.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Who may touch the fault spec, and why.
ALLOWED = {
    "trainer/faults.py": "the faults themselves",
    "trainer/netfault.py": "slow_link's rate limit on a node's interface",
    "trainer/train.py": "parses --inject, hands the specs to FaultState and the trainer's manifest",
    "trainer/config.py": "the --inject option",
    "trainer/cli.py": "the --inject option",
    "ranksight/schema.py": "defines FaultSpec and Manifest.faults",
    "analyzers/score.py": "scoring",
    "analyzers/report/model.py": "the injected-vs-found table",
    "analyzers/report/render_text.py": "the injected-vs-found table",
    "analyzers/report/render_html.py": "the injected-vs-found table",
    "analyzers/report/render_json.py": "the injected-vs-found table",
    "cli/launch.py": "validates --inject and passes it to the trainer",
    "cli/demo.py": "checks the demo found what it injected",
}
CHECKED = ("ranksight", "node", "probes", "head", "analyzers", "dashboards", "tui", "trainer", "cli", "nccl_tests")
NAMES = {"FaultSpec", "FaultState", "parse_fault", "parse_faults", "FaultSpecError"}
EVENTS = {"fault_start", "fault_end", "hang_entered", "simulated_fault"}


def fault_reads(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in NAMES:
            out.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in ("faults", "inject"):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno} reads .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in EVENTS:
            out.append(f"{path.relative_to(ROOT)}:{node.lineno} matches the {node.value!r} record")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            mod = node.module if isinstance(node, ast.ImportFrom) else None
            names = [a.name for a in node.names]
            if mod in ("trainer.faults", "trainer.netfault") or any(n.startswith("trainer.faults") for n in names):
                out.append(f"{path.relative_to(ROOT)}:{node.lineno} imports the fault code")
    return out


def test_no_signal_record_or_analyzer_reads_the_fault_spec():
    offenders = []
    for pkg in CHECKED:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in ALLOWED:
                continue
            offenders += fault_reads(path)
    assert not offenders, "the fault spec is read outside the fault and scoring code:\n" + "\n".join(offenders)


def test_the_check_sees_a_read(tmp_path):
    """The AST check is not blind: a check that looks at the manifest's faults, or matches the fault_start event,
    is caught."""
    bad = ROOT / "analyzers" / "checks" / "_probe_for_test.py"
    bad.write_text("def analyze(frame):\n    return [f for f in frame.data.manifest.faults if f.kind == 'slow_rank']\n"
                   "def other(ev):\n    return ev[ev.event == 'fault_start']\n")
    try:
        found = fault_reads(bad)
    finally:
        bad.unlink()
    assert any(".faults" in f for f in found) and any("fault_start" in f for f in found)


def test_allowed_files_exist():
    """A renamed module must not silently widen what the check lets through."""
    missing = [p for p in ALLOWED if not (ROOT / p).exists()]
    assert not missing, missing
