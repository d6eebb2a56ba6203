"""The checks run in forked processes (``run_all(jobs=N)``, ``diagnose --jobs N``): the findings, errors and coverage
of a serial round, in the same order; a check that raises or a child that dies changes nothing of that."""

from __future__ import annotations

import os

import pytest
from analyzer_fixtures import Spec, build

import analyzers
from analyzers import forked
from analyzers.checks import CHECKS

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")


def _run(data, jobs):
    errors, coverage = [], []
    found = analyzers.run_all(data, errors=errors, coverage=coverage, jobs=jobs)
    return ([(f.analyzer, f.kind, f.severity, f.ranks, f.step_start, f.step_end, f.summary, f.evidence, f.t)
             for f in found], [e.splitlines()[0] for e in errors], [(c.check, c.status, c.reason) for c in coverage])


def _straggler_run():
    return build(Spec(world=8, steps=40, nodes=2, compute_factor=lambda r, s: 1.4 if r == 5 and s >= 15 else 1.0))


def test_forked_round_equals_serial(monkeypatch):
    data = _straggler_run()
    data.now = 1_700_000_500.0  # findings' t: the same in both rounds
    serial = _run(data, 1)
    assert any(f[1] == "straggler" and f[3] == [5] for f in serial[0])
    given = []
    real_give = forked._Worker.give
    monkeypatch.setattr(forked._Worker, "give", lambda w, name: given.append((w.pid, name)) or real_give(w, name))
    assert _run(data, 3) == serial
    assert sorted(n for _, n in given) == sorted(CHECKS)  # every check, each once
    assert given[0][1] == "comm"  # the longest first
    assert len({pid for pid, _ in given}) == 3 and all(pid != os.getpid() for pid, _ in given)  # in 3 children


def test_forked_check_error_and_dead_child(monkeypatch):
    data = _straggler_run()
    data.now = 1_700_000_500.0
    parent = os.getpid()
    real_fp16, real_mfu = CHECKS["fp16"].analyze, CHECKS["mfu"].analyze

    def broken(frame, cfg=None):
        raise RuntimeError("boom")

    def dies_in_child(frame, cfg=None):
        if os.getpid() != parent:
            os._exit(9)  # killed without an answer (as by the OOM killer)
        return real_mfu(frame, cfg)

    monkeypatch.setattr(CHECKS["fp16"], "analyze", broken)
    serial = _run(data, 1)
    monkeypatch.setattr(CHECKS["mfu"], "analyze", dies_in_child)
    got = _run(data, 2)
    assert got == serial
    assert got[1] == ["fp16: RuntimeError: boom"]
    assert ("fp16", "error", "the check failed: RuntimeError: boom") in got[2]
    monkeypatch.setattr(CHECKS["fp16"], "analyze", real_fp16)


def test_default_jobs_small_run_in_process():
    data = _straggler_run()
    assert forked.default_jobs(data, 10) == 1  # a fork per check costs more than it saves on a small run
    assert forked.schedule(["fp16", "stragglers", "comm", "zzz"]) == ["comm", "stragglers", "fp16", "zzz"]


@pytest.mark.parametrize("load, cpus, want", [(0.2, 2, 2), (1.0, 2, 2), (1.4, 2, 2), (1.6, 2, 1), (2.5, 2, 1),
                                              (9.0, 2, 1), (3.0, 16, 14), (3.6, 16, 13), (0.0, 1, 1)])
def test_idle_cpus_rounds_to_the_nearest_cpu(monkeypatch, load, cpus, want):
    # this process's own load (1.0) aside, a CPU idle more than half the time counts: truncating made it 1 job on a
    # 2-core box as soon as the load average passed 1.0
    monkeypatch.setattr(forked, "available_cpus", lambda: cpus)
    monkeypatch.setattr(forked.os, "getloadavg", lambda: (load, load, load))
    assert forked.idle_cpus() == want
