"""The tree has no unused import or variable, no redefinition and no undefined name (ruff, the rules in
pyproject.toml's [tool.ruff.lint]): mistakes a reader trips over, and an undefined name is a crash waiting on a
path no other test takes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_ruff_would_catch_an_undefined_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f():\n    return undefined_thing\n")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"),
                        str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "F821" in r.stdout and "F401" in r.stdout, r.stdout
