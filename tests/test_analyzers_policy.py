"""The evict policy: alerts always, evictions only confirmed and within limits, audited."""

from analyzers.policy import EvictPolicy, PolicyConfig
from ranksight.schema import Finding

NODES = {0: [0, 1], 1: [2, 3], 2: [4, 5]}


def straggler(node=1, severity="warning", conf=0.9):
    return Finding(analyzer="stragglers", kind="straggler", severity=severity, ranks=NODES[node], nodes=[node],
                   confidence=conf, summary=f"node {node} is slow", evidence={"cause": "x"})


def test_alert_once_and_evict_after_confirmation_window():
    p = EvictPolicy("r", NODES, PolicyConfig(confirm_rounds=3, dry_run=False, cooldown_s=0))
    d1 = p.observe([straggler()], now=100.0)
    assert len(d1.alerts) == 1 and d1.actions == []
    d2 = p.observe([straggler()], now=110.0)
    assert d2.alerts == [] and d2.actions == []
    d3 = p.observe([straggler()], now=120.0)
    assert len(d3.actions) == 1
    a = d3.actions[0]
    assert a.action == "evict" and a.node == 1 and a.ranks == [2, 3] and not a.dry_run
    assert a.finding_kind == "straggler" and "confirmed 3 rounds" in a.reason and a.status == "requested"
    assert p.audit == [a]
    assert p.world_size == 4  # node 1 left the job
    assert p.record_result(a.id, "applied", applied_step=42).applied_step == 42


def test_interrupted_streak_starts_over():
    p = EvictPolicy("r", NODES, PolicyConfig(confirm_rounds=2, dry_run=False))
    p.observe([straggler()], now=1.0)
    p.observe([], now=2.0)  # went away
    d = p.observe([straggler()], now=3.0)
    assert d.actions == [] and len(d.alerts) == 1  # new appearance alerts again, confirmation restarts
    assert len(p.observe([straggler()], now=4.0).actions) == 1


def test_dry_run_is_default_and_audited():
    p = EvictPolicy("r", NODES, PolicyConfig(confirm_rounds=1))
    (a,) = p.observe([straggler()], now=1.0).actions
    assert a.dry_run and "[dry run]" in a.reason
    assert p.world_size == 6  # nothing actually left


def test_limits_min_world_max_evictions_cooldown():
    # min world size: evicting node 1 would leave 4 < 5 ranks
    p = EvictPolicy("r", NODES, PolicyConfig(confirm_rounds=1, min_world_size=5, dry_run=False))
    d = p.observe([straggler()], now=1.0)
    assert d.actions == [] and d.audit[0].status == "refused" and "minimum world size" in d.audit[0].reason
    assert p.observe([straggler()], now=2.0).audit == []  # the same refusal is audited once

    # cooldown, then max evictions
    p = EvictPolicy("r", NODES, PolicyConfig(confirm_rounds=1, cooldown_s=100, max_evictions=2, dry_run=False))
    assert len(p.observe([straggler(1)], now=0.0).actions) == 1
    d = p.observe([straggler(2)], now=50.0)
    assert d.actions == [] and "cooldown" in d.audit[0].reason
    p2 = EvictPolicy("r", NODES, PolicyConfig(confirm_rounds=1, cooldown_s=0, max_evictions=1, dry_run=False))
    p2.observe([straggler(1)], now=0.0)
    d = p2.observe([straggler(2)], now=500.0)
    assert d.actions == [] and "max evictions" in d.audit[0].reason

    # min nodes
    p3 = EvictPolicy("r", {0: [0], 1: [1]}, PolicyConfig(confirm_rounds=1, min_nodes=2, dry_run=False))
    f = Finding(analyzer="gpu_health", kind="gpu_health", severity="critical", ranks=[1], nodes=[1], confidence=0.95)
    assert p3.observe([f], now=0.0).actions == []


def test_not_evictable_findings():
    p = EvictPolicy("r", NODES, PolicyConfig(confirm_rounds=1, dry_run=False))
    world = Finding(analyzer="fp16", kind="fp16_overflow", severity="critical", ranks=[0, 1, 2, 3, 4, 5], nodes=[0, 1, 2])
    info = Finding(analyzer="comm", kind="comm_bottleneck", severity="info", ranks=[2, 3], nodes=[1])
    unsure = straggler(conf=0.5)
    d = p.observe([world, info, unsure], now=0.0)
    assert d.actions == []
    assert [f.kind for f in d.alerts] == ["fp16_overflow", "straggler"]  # info is not alerted by default
