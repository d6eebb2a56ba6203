"""The import layering of docs/architecture.md, checked: no upward import, no cycle, no private name borrowed.

The packages follow the processes and the data path. What each may import (besides itself and third-party
libraries) is declared here once; docs/architecture.md draws the same picture. Every import counts, also the
ones inside functions (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> the project packages it may import. Read bottom-up: ranksight is what every process shares; the
# readers, the trainer, the benchmarks, the analyzers and the surfaces stand on it; the two long-running
# processes on those; the application on everything.
ALLOWED: dict[str, set[str]] = {
    "ranksight": set(),
    "probes": {"ranksight"},
    "trainer": {"ranksight"},
    "nccl_tests": {"ranksight"},
    "analyzers": {"ranksight"},
    "dashboards": {"ranksight"},
    "tui": {"ranksight"},
    "node": {"ranksight", "probes"},
    "head": {"ranksight", "analyzers", "dashboards"},
    "logs": {"ranksight", "probes", "analyzers", "nccl_tests"},
    "traces": {"ranksight", "probes", "analyzers"},
    "cli": {"ranksight", "probes", "trainer", "nccl_tests", "analyzers", "dashboards", "tui", "node", "head", "logs",
            "traces"},
}
PACKAGES = sorted(ALLOWED)
# Not packages of the product, but they must not borrow private names either.
CONSUMERS = ("tests", "bench", "examples")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(folders) -> dict[str, Path]:
    out = {}
    for folder in folders:
        for p in sorted((ROOT / folder).rglob("*.py")):
            if "fixtures" not in p.parts and "__pycache__" not in p.parts:
                out[_module_name(p)] = p
    return out


PRODUCT = _modules(PACKAGES)
EVERYTHING = {**PRODUCT, **_modules(CONSUMERS)}


def _imports(module: str, path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, imported names) of every import statement in the file, relative ones resolved."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target, [a.name for a in node.names]))
    return out


def _project_module(name: str) -> str | None:
    """The longest known product module that ``name`` is or lies inside (None for third-party and stdlib)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in PRODUCT:
            return candidate
    return None


def _top(module: str) -> str:
    return module.split(".")[0]


def test_every_package_is_declared():
    found = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert found == set(PACKAGES), "a new top-level package: declare what it may import in ALLOWED (and the docs)"


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_go_down_the_layers(package):
    wrong = []
    for module, path in PRODUCT.items():
        if _top(module) != package:
            continue
        for line, target, names in _imports(module, path):
            for name in [target] + [f"{target}.{n}" for n in names]:
                hit = _project_module(name)
                if hit is not None and _top(hit) != package and _top(hit) not in ALLOWED[package]:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {hit}")
    assert not wrong, f"{package} may import only {sorted(ALLOWED[package]) or 'nothing of the project'}:\n" + \
        "\n".join(sorted(set(wrong)))


def test_allowed_layers_have_no_cycle():
    seen: dict[str, int] = {}

    def visit(pkg: str, path: list[str]) -> None:
        assert seen.get(pkg) != 1, f"cycle in ALLOWED: {' -> '.join(path + [pkg])}"
        if seen.get(pkg) == 2:
            return
        seen[pkg] = 1
        for dep in ALLOWED[pkg]:
            visit(dep, path + [pkg])
        seen[pkg] = 2

    for pkg in PACKAGES:
        visit(pkg, [])


def test_no_module_import_cycle():
    """Between modules too (inside a package): an import graph without cycles can be read from the bottom up."""
    edges: dict[str, set[str]] = {m: set() for m in PRODUCT}
    for module, path in PRODUCT.items():
        for _line, target, names in _imports(module, path):
            for name in [target] + [f"{target}.{n}" for n in names]:
                hit = _project_module(name)
                if hit is not None and hit != module and not module.startswith(hit + "."):
                    edges[module].add(hit)  # (a package's own __init__ runs first anyway: not an edge back)
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                cycles.append(" -> ".join(stack[stack.index(n):] + [m, n]) if n in stack else f"{m} -> {n}")
            elif n not in state:
                visit(n, stack + [m])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_private_name_is_imported_from_another_package():
    """A name other packages (tests and benchmarks included) need is public; ``_x`` stays inside its package."""
    wrong = []
    for module, path in EVERYTHING.items():
        for line, target, names in _imports(module, path):
            hit = _project_module(target)
            if hit is None or _top(hit) == _top(module):
                continue
            private = [p for p in target.split(".") if p.startswith("_") and not p.startswith("__")]
            private += [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                wrong.append(f"{path.relative_to(ROOT)}:{line} from {target} imports {', '.join(private)}")
    assert not wrong, "private names used outside their package:\n" + "\n".join(wrong)


# Inside analyzers, the flight-recorder analyzer's stages: a module may import its own stage or an earlier one.
# Shared statistics first; then loader -> builder -> checks; then what uses findings (run_all, policy, scoring,
# the report); the diagnose CLI last.
ANALYZER_STAGES = [
    ("analyzers.stats", "analyzers.cpus", "analyzers.persistence", "analyzers.changepoint", "analyzers.evidence", "analyzers.trace_windows"),
    ("analyzers.loader", "analyzers.columnar", "analyzers.row_order", "analyzers.footer_stats", "analyzers.collectives",
     "analyzers.column_sinks"),
    ("analyzers.builder", "analyzers.step_view", "analyzers.matrices"),
    ("analyzers.checks",),
    ("analyzers", "analyzers.policy", "analyzers.score", "analyzers.report"),
    ("analyzers.diagnose",),
]


def _analyzer_stage(module: str) -> int:
    best = None
    for i, names in enumerate(ANALYZER_STAGES):
        for n in names:
            if (module == n or module.startswith(n + ".")) and (best is None or len(n) > len(best[1])):
                best = (i, n)
    assert best is not None, f"{module}: put it in a stage of ANALYZER_STAGES"
    return best[0]


def test_analyzers_go_loader_builder_checks():
    wrong = []
    for module, path in PRODUCT.items():
        if _top(module) != "analyzers":
            continue
        own = _analyzer_stage(module)
        for line, target, names in _imports(module, path):
            for name in [target] + [f"{target}.{n}" for n in names]:
                hit = _project_module(name)
                if hit is not None and _top(hit) == "analyzers" and hit != module and _analyzer_stage(hit) > own:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} ({ANALYZER_STAGES[own][0]} stage) imports {hit}")
    assert not wrong, "loader -> builder -> checks -> report: an import goes back up:\n" + "\n".join(sorted(set(wrong)))
