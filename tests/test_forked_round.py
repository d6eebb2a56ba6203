"""A live round's analyzers in a child forked from the head (head/forked_round.py): the same findings as in the
analysis thread, a child that dies or hangs is a lost round (a gap) and not a crash, and the switch between them."""

import os
import signal
import time

import pytest

from agent_helpers import TOKEN
from head.forked_round import RoundLost, forked_analyzer
from head.service import Head, resolve_analyzers, round_in_child
from ranksight import schema


def _step(rank, s, t0, compute=100.0, comm=65.0):
    t_end = t0 + s * 0.2 + 0.17
    return schema.StepRecord(
        run_id="r1", rank=rank, step=s, node=rank // 2, host=f"n{rank // 2}", world_size=4, dp_rank=rank,
        t_start=t_end - 0.17, t_end=t_end, step_ms=170.0, compute_ms=compute, comm_ms=comm, forward_ms=compute / 3,
        backward_ms=2 * compute / 3, sync_arrival=t_end - 0.17 + compute / 1000, sync_wait_ms=comm, tokens=1000)


def _rows(s0, s1, t0, onset=20):
    """Rank 2 computes 1.6x longer from ``onset``; the others wait for it."""
    return [_step(r, s, t0, compute=160.0 if r == 2 and s >= onset else 100.0,
                  comm=5.0 if r == 2 and s >= onset else (65.0 if s >= onset else 5.0))
            for s in range(s0, s1) for r in range(4)]


def _feed(h, s0, s1, t0):
    h.live.run("r1").add("steps", h.store.run("r1").add("steps", _rows(s0, s1, t0)))


def _episodes(h):
    return sorted((f.analyzer, f.kind, f.severity, tuple(f.ranks), f.step_start, f.status, f.summary)
                  for f in h.analysis.findings["r1"].current())


def test_a_forked_round_books_the_findings_an_in_thread_round_books(tmp_path):
    heads = {how: Head(tmp_path / how, TOKEN, analyze_in=how) for how in ("thread", "child")}
    try:
        assert not heads["thread"].rounds_forked and heads["child"].rounds_forked
        t0 = time.time() - 100
        for h in heads.values():  # one clock for both: the hang check judges silence against it
            h.analysis.clock = lambda: t0 + 100
        for s0 in range(0, 96, 24):
            for h in heads.values():
                _feed(h, s0, s0 + 24, t0)
                h.analysis.analyze_once("r1")
            assert _episodes(heads["child"]) == _episodes(heads["thread"])
        got = _episodes(heads["child"])
        assert any(kind == "straggler" and ranks == (2,) for _, kind, _, ranks, *_ in got), got
        assert heads["child"].stats["analysis_lost"] == 0
        # the child's CPU is the head's too: counted to its own part
        assert heads["child"].cpu.seconds().get("analyze-child", 0.0) > 0
        assert "analyze-child" not in heads["thread"].cpu.seconds()
    finally:
        for h in heads.values():
            h.close()


def test_a_child_that_dies_is_a_lost_round_and_the_episodes_stay(tmp_path):
    fn = resolve_analyzers()
    kill = tmp_path / "kill"

    def analyzer(data):
        if kill.exists():  # in the child: die as the kernel's OOM killer would end it
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(data)

    h = Head(tmp_path / "store", TOKEN, analyzer=analyzer, analyze_in="child")
    try:
        t0 = time.time() - 100
        _feed(h, 0, 48, t0)
        h.analysis.analyze_once("r1")
        before = _episodes(h)
        assert any(kind == "straggler" for _, kind, *_ in before)
        kill.touch()
        _feed(h, 48, 72, t0)
        assert h.analysis.analyze_once("r1") == []  # no crash: a gap
        assert h.stats["analysis_lost"] == 1 and h.stats["analyzer_errors"] == 0
        assert _episodes(h) == before  # an empty answer would have closed them; a lost round leaves them
        kill.unlink()
        h.analysis.analyze_once("r1")  # the next round runs again
        assert h.stats["analysis_lost"] == 1
        assert any(kind == "straggler" and status == "open" for _, kind, _, _, _, status, _ in _episodes(h))
    finally:
        h.close()


def test_a_child_that_hangs_is_killed_and_its_round_lost():
    cpu = []
    slow = forked_analyzer(lambda data: time.sleep(600), timeout_s=1.0, on_child_cpu=cpu.append)
    t0 = time.monotonic()
    with pytest.raises(RoundLost, match="ran past"):
        slow(None)
    assert time.monotonic() - t0 < 30 and len(cpu) == 1  # killed and reaped, not waited for


def test_an_analyzer_error_in_the_child_is_an_analyzer_error(tmp_path):
    def analyzer(data):
        raise ValueError("broken check")

    with pytest.raises(RuntimeError, match="broken check"):
        forked_analyzer(analyzer)(None)
    h = Head(tmp_path / "store", TOKEN, analyzer=analyzer, analyze_in="child")
    try:
        _feed(h, 0, 24, time.time() - 100)
        assert h.analysis.analyze_once("r1") == []
        assert h.stats["analyzer_errors"] == 1 and h.stats["analysis_lost"] == 0
    finally:
        h.close()


def test_the_switch_says_where_a_round_runs(tmp_path):
    pids = []

    def analyzer(data):
        pids.append(os.getpid())  # in a child this list is the child's copy: the head's stays empty
        return []

    for how, forked in (("thread", False), ("child", True), ("auto", False)):  # auto: a given hook stays in-thread
        pids.clear()
        h = Head(tmp_path / how, TOKEN, analyzer=analyzer, analyze_in=how)
        try:
            assert h.rounds_forked is forked
            _feed(h, 0, 8, time.time() - 100)
            h.analysis.analyze_once("r1")
            assert pids == ([] if forked else [os.getpid()])
        finally:
            h.close()
    assert round_in_child("auto", default_analyzers=True) is hasattr(os, "fork")
    assert round_in_child("thread", default_analyzers=True) is False
    with pytest.raises(ValueError, match="analyze_in"):
        round_in_child("elsewhere", default_analyzers=True)


def test_a_forked_round_in_a_head_holding_thousands_of_descriptors(tmp_path):
    """A head with 2,048 agents' connections open has descriptors past select()'s 1,024: the round's pipe is one."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1400
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip("the open-files hard limit is below 1,400")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    held = []
    try:
        while len(held) < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        cpu = []
        assert forked_analyzer(lambda data: [data * 2], on_child_cpu=cpu.append)(21) == [42]
        assert len(cpu) == 1
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_auto_forks_only_a_large_round(monkeypatch):
    """``--analyze-in auto``: a small job's round stays in the thread (no second busy process beside its ranks); a
    round of ``FORK_MIN_ROWS`` rows or more goes to a child. ``child`` forks whatever the size."""
    import types

    from head import forked_round

    forks = []
    real_fork = os.fork
    monkeypatch.setattr(forked_round.os, "fork", lambda: forks.append(1) or real_fork())
    small = types.SimpleNamespace(steps=range(1_000), collectives=range(2_000))
    large = types.SimpleNamespace(steps=range(40_000), collectives=range(60_000))
    auto = forked_round.forked_analyzer(lambda d: [forked_round.round_rows(d)], min_rows=forked_round.FORK_MIN_ROWS)
    assert auto(small) == [3_000] and forks == []
    assert auto(large) == [100_000] and forks == [1]
    always = forked_round.forked_analyzer(lambda d: [forked_round.round_rows(d)])
    assert always(small) == [3_000] and forks == [1, 1]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_the_child_holds_none_of_the_heads_sockets():
    """A child that outlived a dead head must not keep its port bound or its clients' connections open: the child
    closes its copies of the sockets, and the head's own stay open (closing a copy sends nothing)."""
    import socket
    import stat

    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    served, _ = listener.accept()
    try:
        def sockets_in_child(_data):
            out = []
            for name in os.listdir("/proc/self/fd"):
                try:
                    if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                        out.append(int(name))
                except OSError:
                    pass
            return out

        assert forked_analyzer(sockets_in_child)(None) == []
        served.sendall(b"still open")  # the head's connection survived the child's close
        assert client.recv(16) == b"still open"
        assert listener.fileno() >= 0 and not listener._closed  # type: ignore[attr-defined]
    finally:
        for s in (client, served, listener):
            s.close()
