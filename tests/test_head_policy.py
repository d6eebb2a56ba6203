"""The head carries out the evict policy: persistent findings become (dry-run) evict actions."""

from __future__ import annotations

import pytest

from head.service import Head
from head.policy_runner import PolicyRunner
from analyzers.policy import PolicyConfig
from ranksight import schema

RUN = "pol"


def straggler_on_node1(_data) -> list[schema.Finding]:
    return [schema.Finding(analyzer="stragglers", kind="straggler", severity="warning", ranks=[3], nodes=[1],
                           step_start=12, evidence={"ratio": 1.5}, confidence=0.9,
                           summary="rank 3 (node 1) is the straggler since step 12")]


def make_head(tmp_path, mode: str, **cfg) -> Head:
    head = Head(tmp_path / "store", "tok", analyzer=straggler_on_node1)
    head.analysis.round_hooks.append(PolicyRunner(head.actions, mode, PolicyConfig(confirm_rounds=3, **cfg)))
    live = head.live.run(RUN)
    live.manifest = schema.Manifest(run_id=RUN, created=0.0, start_time=0.0, nodes=2, ranks=[
        schema.RankPlacement(rank=r, node=r // 2, host=f"h{r // 2}", local_rank=r % 2, pp_stage=0, dp_rank=r, tp_rank=0)
        for r in range(4)])
    return head


def test_dry_run_records_one_eviction_after_the_confirmation_window(tmp_path):
    head = make_head(tmp_path, "dry-run")
    try:
        for _ in range(2):
            head.analysis.analyze_once(RUN)
        assert head.actions.current(RUN) == []  # not confirmed yet
        head.analysis.analyze_once(RUN)
        head.analysis.analyze_once(RUN)  # the same node is never evicted twice
        acts = head.actions.current(RUN)
        assert len(acts) == 1
        a = acts[0]
        assert (a["action"], a["node"], a["ranks"], a["dry_run"], a["requested_by"]) == ("evict", 1, [2, 3], True, "policy")
        assert a["finding_kind"] == "straggler" and "confirmed 3 rounds" in a["reason"]
    finally:
        head.close()


def test_refusal_below_min_nodes_is_audited_and_nothing_is_sent(tmp_path):
    head = make_head(tmp_path, "on", min_nodes=2)
    sent = []
    head.actions.request = lambda *a, **k: sent.append((a, k))  # type: ignore[method-assign]
    try:
        for _ in range(4):
            head.analysis.analyze_once(RUN)
        acts = head.actions.current(RUN)
        assert sent == []
        assert [(a["status"], a["node"]) for a in acts] == [("refused", 1)]
        assert "below the minimum 2" in acts[0]["reason"]
    finally:
        head.close()


def test_enforcing_mode_sends_the_eviction_through_the_head(tmp_path):
    head = make_head(tmp_path, "on")
    sent = []
    head.actions.request = lambda run_id, req, requested_by: sent.append((run_id, req, requested_by))  # type: ignore[method-assign]
    try:
        for _ in range(3):
            head.analysis.analyze_once(RUN)
        assert len(sent) == 1
        run_id, req, by = sent[0]
        assert (run_id, req["action"], req["node"], req["dry_run"], by) == (RUN, "evict", 1, False, "policy")
    finally:
        head.close()


def test_unknown_mode_is_refused(tmp_path):
    head = Head(tmp_path / "s", "tok", analyzer=None)
    try:
        with pytest.raises(ValueError, match="evict mode"):
            PolicyRunner(head.actions, "maybe")
    finally:
        head.close()


def test_a_restarted_head_carries_on_from_the_stored_evictions(tmp_path):
    """The policy's state is the run's actions table: after a restart the same node is not evicted again, and the
    cooldown and the eviction count still hold (a head restarted ~100 s after an eviction once decided it again)."""
    head = make_head(tmp_path, "dry-run")
    try:
        for _ in range(3):
            head.analysis.analyze_once(RUN)
        assert [(a["node"], a["status"]) for a in head.actions.current(RUN)] == [(1, "requested")]
    finally:
        head.close()
    head = make_head(tmp_path, "dry-run")  # a new head on the same store
    try:
        for _ in range(5):
            head.analysis.analyze_once(RUN)
        acts = head.actions.current(RUN)
        assert [(a["node"], a["status"]) for a in acts] == [(1, "requested")], acts
        policy = head.analysis.round_hooks[-1].policies[RUN]
        assert policy.evicted == [1] and policy.last_evict_t is not None
    finally:
        head.close()
