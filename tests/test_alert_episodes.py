"""One alert per finding episode (issue 16, item 2): a condition that persists across many analysis rounds is announced
once, and again only when its severity rises; not again when its evidence moves, when it flickers (absent a round or
two while the run moves on, then back), nor after a head restart (the book carries on from the stored findings)."""

from __future__ import annotations

from agent_helpers import TOKEN
from head.analysis import resolve_analyzers
from head.service import Head
from ranksight import schema, wire

RUN = "r"
STEPS_PER_ROUND = 10


def _step(rank: int, s: int, t_end: float) -> schema.StepRecord:
    return schema.StepRecord(run_id=RUN, rank=rank, step=s, node=rank // 2, host=f"h{rank // 2}", world_size=4,
                             t_start=t_end - 0.5, t_end=t_end, step_ms=500.0, compute_ms=400.0, comm_ms=90.0,
                             sync_wait_ms=5.0)


class Script:
    """The analyzer of these tests: round k's findings from ``plan(k, last_step)``."""

    def __init__(self, plan):
        self.plan, self.round, self.last_step = plan, 0, 0

    def __call__(self, data):
        self.round += 1
        self.last_step = int(data.steps["step"].max())
        return self.plan(self.round, self.last_step)


def _head(store, analyzer) -> tuple[Head, list[schema.Finding]]:
    h = Head(store, TOKEN, analyzer=analyzer)
    alerts: list[schema.Finding] = []
    h.analysis.finding_listeners.append(alerts.extend)
    return h, alerts


def _feed(h: Head, first: int, n: int) -> None:
    rs, live = h.store.run(RUN), h.live.run(RUN)
    for s in range(first, first + n):
        for rank in range(4):
            live.add("steps", rs.add("steps", [_step(rank, s, 1_800_000_000.0 + s * 0.5)]), now=1_800_000_000.0 + s * 0.5)


def straggler(round_: int, last: int, severity: str = "warning", start: int | None = None) -> schema.Finding:
    # the evidence moves every round; the onset is refined back and forth
    return schema.Finding(analyzer="stragglers", kind="straggler", severity=severity, ranks=[3], nodes=[1],
                          step_start=12 + round_ % 2 if start is None else start, step_end=last,
                          evidence={"ratio": 1.4 + 0.01 * round_, "peers_wait_ms": 90 + round_}, confidence=0.9,
                          summary=f"rank 3 is {1.4 + 0.01 * round_:.2f}x slower")


def skew(round_: int) -> schema.Finding:
    return schema.Finding(analyzer="hang", kind="clock_skew", severity="warning", ranks=[2, 3], nodes=[1],
                          evidence={"skew_s": -120.0 - 0.1 * round_}, summary="node 1's clock is 120 s behind")


def plan(k: int, last: int) -> list[schema.Finding]:
    out = []
    if k not in (5, 6):  # the straggler flickers: absent two rounds, then back with a later onset
        sev = "critical" if k in (9, 11, 12) else "warning"
        out.append(straggler(k, last, sev, start=last - 5 if k == 7 else None))
    if k not in (3, 4):
        out.append(skew(k))
    return out


def test_a_persistent_flickering_escalating_condition_is_one_alert_per_episode_and_escalation(tmp_path):
    h, alerts = _head(tmp_path / "store", Script(plan))
    try:
        for k in range(12):
            _feed(h, 1 + k * STEPS_PER_ROUND, STEPS_PER_ROUND)
            h.analysis.analyze_once(RUN)
        kinds = [(a.kind, a.severity) for a in alerts]
        assert kinds == [("straggler", "warning"), ("clock_skew", "warning"), ("straggler", "critical")], kinds
        assert alerts[0].id == alerts[2].id  # the escalation is of the same episode
        book = h.analysis.findings[RUN].current()
        assert sorted(f.kind for f in book) == ["clock_skew", "straggler"]
    finally:
        h.close()


def test_a_restarted_head_does_not_announce_the_open_episodes_again(tmp_path):
    h, alerts = _head(tmp_path / "store", Script(lambda k, last: [straggler(k, last, "critical"), skew(k)]))
    try:
        for k in range(3):
            _feed(h, 1 + k * STEPS_PER_ROUND, STEPS_PER_ROUND)
            h.analysis.analyze_once(RUN)
        assert sorted(a.kind for a in alerts) == ["clock_skew", "straggler"]
    finally:
        h.close()  # flushes the findings table
    # a restarted head on the same store, the same conditions still there: nothing to announce again
    def after_restart(k: int, last: int) -> list[schema.Finding]:
        out = [straggler(20 + k, last, "critical"), skew(20 + k)]
        if k >= 3:  # a condition that is really new
            out.append(schema.Finding(analyzer="stragglers", kind="straggler", severity="warning", ranks=[1], nodes=[0],
                                      step_start=last - 2, step_end=last, summary="rank 1 slow"))
        return out

    script = Script(after_restart)
    h, alerts = _head(tmp_path / "store", script)
    try:
        for k in range(4):
            _feed(h, 200 + k * STEPS_PER_ROUND, STEPS_PER_ROUND)
            h.analysis.analyze_once(RUN)
        # only the condition that is really new (rank 1, from the third round on) is announced
        assert [(a.kind, a.ranks) for a in alerts] == [("straggler", [1])]
        ids = {f.id for f in h.analysis.findings[RUN].current()}
        assert len(ids) == 3  # the two restored episodes kept their ids
    finally:
        h.close()


def test_a_clock_skewed_node_over_many_real_rounds_is_one_alert(tmp_path):
    """The real analyzers, node 1's clock 120 s behind the head's, 15 rounds: one clock_skew alert, no hang."""
    h, alerts = _head(tmp_path / "store", resolve_analyzers())
    t0 = 1_800_000_000.0
    clock = {"now": t0}
    h.analysis.clock = lambda: clock["now"]
    try:
        rs, live = h.store.run(RUN), h.live.run(RUN)
        for k in range(15):
            for s in range(1 + k * 4, 1 + (k + 1) * 4):
                head_now = t0 + s * 0.5
                for node in range(2):
                    node_now = head_now + (-120.0 if node == 1 else 0.0)
                    for rank in (2 * node, 2 * node + 1):
                        live.add("steps", rs.add("steps", [_step(rank, s, node_now)]), now=head_now + 0.3)
                    live.heartbeat(wire.Heartbeat(node=node, host=f"h{node}", t=node_now), now=head_now + 0.3)
                clock["now"] = head_now + 0.5
            h.analysis.analyze_once(RUN)
        assert [(a.kind, a.nodes) for a in alerts if a.kind in ("clock_skew", "hang")] == [("clock_skew", [1])]
        assert len({a.id for a in alerts}) == len(alerts)  # each alert its own episode
    finally:
        h.close()
