"""One head per store (head/store/store_lock.py): a second head, or ``ranksight compact`` on a store a head holds,
is refused with the holder named; the lock goes with the process that holds it, and a live round's forked child
does not keep it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import main as ranksight_main
from head.forked_round import forked_analyzer
from head.store.store_lock import StoreBusy, StoreLock

ROOT = Path(__file__).resolve().parents[1]


def test_a_second_holder_is_refused_with_the_first_named(tmp_path):
    first = StoreLock(tmp_path, "ranksight head")
    with pytest.raises(StoreBusy, match=f"ranksight head pid {os.getpid()}"):
        StoreLock(tmp_path, "ranksight head")
    first.release()
    again = StoreLock(tmp_path, "ranksight compact")  # released: free again
    again.release()


def test_compact_refuses_a_store_a_head_holds(tmp_path):
    (tmp_path / "r1").mkdir()
    held = StoreLock(tmp_path, "ranksight head")
    try:
        r = CliRunner().invoke(ranksight_main, ["compact", "--store", str(tmp_path), "--json"])
        assert r.exit_code == 1, r.output
        out = json.loads(r.output)
        assert "in use by ranksight head" in out["error"] and out["runs"] == []
    finally:
        held.release()
    r = CliRunner().invoke(ranksight_main, ["compact", "--store", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output


def test_the_lock_goes_with_a_killed_holder(tmp_path):
    """A crashed head leaves no stale lock: the kernel drops it with the process."""
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from head.store.store_lock import StoreLock
        lock = StoreLock({str(tmp_path)!r}, "ranksight head")
        print("held", flush=True)
        time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(StoreBusy):
            StoreLock(tmp_path, "ranksight head")
    finally:
        p.kill()
        p.wait(timeout=30)
    StoreLock(tmp_path, "ranksight head").release()


def test_a_forked_rounds_child_does_not_keep_the_store_locked(tmp_path):
    lock = StoreLock(tmp_path, "ranksight head")
    fd = lock.fd

    def child_has_the_lock_fd(_data):
        try:
            os.fstat(fd)
            return True
        except OSError:
            return False

    try:
        assert forked_analyzer(child_has_the_lock_fd)(None) is False
        os.fstat(fd)  # the head's own stays open, and the lock held
        with pytest.raises(StoreBusy):
            StoreLock(tmp_path, "ranksight head")
    finally:
        lock.release()


def test_a_second_head_process_is_refused(tmp_path):
    """The real command: a second ``ranksight head`` on the same store exits with a usage error naming the first."""
    store = tmp_path / "store"
    held = StoreLock(store, "ranksight head")
    try:
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "cli.main", "head", "--store", str(store), "--port", "0",
                            "--token", "t"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert p.returncode == 2, (p.stdout, p.stderr)
        assert "in use by ranksight head" in p.stderr and "one head per store" in p.stderr
        assert time.monotonic() - t0 < 120
    finally:
        held.release()
