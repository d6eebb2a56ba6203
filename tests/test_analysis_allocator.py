"""The allocator settings (ranksight/allocator.py). Live analysis keeps the memory a round frees for the next round
(keep_freed_memory): a second round of the same allocations reuses the pages instead of faulting them in again.
diagnose's comm check on a big run reuses freed pages while it runs, then puts back what the process had."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

ROUNDS = textwrap.dedent("""
    import resource, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    if sys.argv[2] == "keep":
        from head.analysis import keep_freed_memory
        assert keep_freed_memory()
    def one_round():
        arrays = [np.ones(1 << 20) for _ in range(16)]  # 16 arrays of 8 MiB, every page written
        del arrays
    faults = []
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        one_round()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(faults[1], faults[2])
""")


def _later_round_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", ROUNDS, str(ROOT), mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return max(int(x) for x in out.stdout.split())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_later_round_reuses_the_pages_an_earlier_one_freed():
    kept = _later_round_faults("keep")
    default = _later_round_faults("default")
    # 128 MiB written a round (32,768 pages): under the defaults a part is handed back at the heap's top and faulted
    # in again every round; kept, next to none
    assert default > 4_000
    assert kept < default / 8


def test_live_analysis_sets_it_and_a_head_without_analysis_does_not(monkeypatch):
    import head.analysis as analysis

    calls = []
    monkeypatch.setattr(analysis, "keep_freed_memory", lambda: calls.append(1) or True)
    analysis.LiveAnalysis(None, None, {}, analyzer=None)
    assert calls == []
    analysis.LiveAnalysis(None, None, {}, analyzer=lambda data: [])
    assert calls == [1]
    analysis.LiveAnalysis(None, None, {}, analyzer=lambda data: [], keep_freed=False)  # --return-freed-memory
    assert calls == [1]


def test_the_heads_switch_reaches_live_analysis(tmp_path, monkeypatch):
    import head.analysis as analysis
    from head.service import Head

    calls = []
    monkeypatch.setattr(analysis, "keep_freed_memory", lambda: calls.append(1) or True)
    Head(tmp_path / "a", "t", analyzer=lambda data: [], keep_freed_memory=False).close()
    assert calls == []
    Head(tmp_path / "b", "t", analyzer=lambda data: []).close()
    assert calls == [1]


class _FakeLibc:
    def __init__(self):
        self.calls = []

    def mallopt(self, param, value):
        self.calls.append(("mallopt", param, value))
        return 1

    def malloc_trim(self, pad):
        self.calls.append(("trim", pad))
        return 1


def test_reuse_freed_pages_sets_the_allocator_only_when_enabled_and_outermost(monkeypatch):
    """diagnose's comm check on a big run: large temporaries from the heap while it runs; afterwards glibc's usual
    settings and the free memory handed back (a process that did not ask to keep)."""
    from ranksight import allocator

    libc = _FakeLibc()
    calls = libc.calls
    monkeypatch.setattr(allocator, "_LIBC", libc)
    monkeypatch.setattr(allocator, "_KEPT", [False])
    with allocator.reuse_freed_pages(False):
        pass
    assert calls == []
    with allocator.reuse_freed_pages():
        with allocator.reuse_freed_pages():  # nested: the outer one's settings stand
            assert calls == [("mallopt", allocator.M_MMAP_THRESHOLD, allocator.LARGE),
                             ("mallopt", allocator.M_TRIM_THRESHOLD, allocator.LARGE)]
        assert len(calls) == 2
    assert calls[2:] == [("mallopt", allocator.M_MMAP_THRESHOLD, allocator.AFTER_MMAP),
                         ("mallopt", allocator.M_TRIM_THRESHOLD, allocator.AFTER_TRIM), ("trim", 0)]
    calls.clear()
    try:
        with allocator.reuse_freed_pages():
            raise ValueError
    except ValueError:
        pass
    assert calls[-1] == ("trim", 0) and allocator._DEPTH == [0]  # restored when the work raises


def test_a_big_check_in_a_head_that_keeps_freed_memory_leaves_the_heads_settings(monkeypatch):
    """A live round run in the head's own process (``--analyze-in thread``) on a big job: after the comm check the
    head's settings are back and nothing is trimmed, so the next round still reuses the pages."""
    from ranksight import allocator

    libc = _FakeLibc()
    monkeypatch.setattr(allocator, "_LIBC", libc)
    monkeypatch.setattr(allocator, "_KEPT", [False])
    assert allocator.keep_freed_memory()
    libc.calls.clear()
    with allocator.reuse_freed_pages():
        pass
    assert libc.calls == [("mallopt", allocator.M_MMAP_THRESHOLD, allocator.LARGE),
                          ("mallopt", allocator.M_TRIM_THRESHOLD, allocator.LARGE),
                          ("mallopt", allocator.M_MMAP_THRESHOLD, allocator.KEEP_MMAP_THRESHOLD),
                          ("mallopt", allocator.M_TRIM_THRESHOLD, allocator.KEEP_TRIM_THRESHOLD)]
