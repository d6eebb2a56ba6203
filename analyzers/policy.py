"""The evict policy: findings in, alerts and actions out. Pure logic; the head carries the actions out.

Each analysis round the head calls :meth:`EvictPolicy.observe` with that round's findings:

- **Alerts always**: every finding at or above ``alert_min_severity`` is alerted once when it first
  appears (and again when its severity rises, or after it went away and came back).
- **Checkpoint-and-evict** only for a finding of an evictable kind that names exactly one known node
  (not every node), with enough confidence, that was present in ``confirm_rounds`` consecutive
  rounds; and only within limits: never below ``min_world_size`` ranks or ``min_nodes`` nodes (at
  least 1: a job is never left without a node), a ``cooldown_s`` between evictions, at most
  ``max_evictions`` per run, never the same node twice. A single-node job is never asked to evict:
  there is nothing to go on with (its findings recommend a restart instead).
- **Dry-run** (the default, as NVRx ships its STOP verdicts in log mode): the action is produced and
  audited with ``dry_run=True`` and the head does not send it.
- **Audit trail**: every decision, including refusals, is an :class:`~ranksight.schema.Action` with
  its reason and the finding kind, in :attr:`EvictPolicy.audit`.
- **State that survives the head**: the evictions (their count, the cooldown's start, the nodes gone) are the run's
  recorded actions; :meth:`EvictPolicy.restore` carries on from them after a head restart.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ranksight.schema import SEVERITY_ORDER, Action, Finding


@dataclass
class PolicyConfig:
    confirm_rounds: int = 3
    evict_kinds: tuple[str, ...] = ("straggler", "gpu_health", "comm_bottleneck", "hang")
    evict_min_severity: str = "warning"
    min_confidence: float = 0.7
    min_world_size: int = 1
    min_nodes: int = 1
    cooldown_s: float = 600.0
    max_evictions: int = 1
    dry_run: bool = True
    alert_min_severity: str = "warning"


@dataclass
class Decision:
    """What one round decided: alerts to send, actions to carry out (or log, in dry-run), new audit entries."""

    alerts: list[Finding] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)
    audit: list[Action] = field(default_factory=list)


def finding_key(f: Finding) -> tuple:
    return (f.kind, f.analyzer, tuple(sorted(f.ranks)), tuple(sorted(f.nodes)), (f.evidence or {}).get("cause", ""))


class EvictPolicy:
    def __init__(self, run_id: str, node_ranks: dict[int, list[int]], cfg: PolicyConfig | None = None):
        """``node_ranks``: the job's current placement (node -> its ranks)."""
        self.cfg = cfg or PolicyConfig()
        self.run_id = run_id
        self.node_ranks = {int(n): list(r) for n, r in node_ranks.items()}
        self.streak: dict[tuple, int] = {}
        self.alerted: dict[tuple, str] = {}
        self.refused: dict[tuple, str] = {}
        self.evicted: list[int] = []
        self.last_evict_t: float | None = None
        self.audit: list[Action] = []

    @property
    def world_size(self) -> int:
        return sum(len(r) for r in self.node_ranks.values())

    @property
    def n_nodes(self) -> int:
        """The job's nodes (ranks whose node is not known, -1, are on none)."""
        return len([n for n in self.node_ranks if n >= 0])

    def _target_node(self, f: Finding) -> int | None:
        """The one known node ``f`` names, where the job has another to go on with; else None (nothing to evict)."""
        if len(f.nodes) != 1 or self.n_nodes <= 1:
            return None
        node = int(f.nodes[0])
        return node if node >= 0 and node in self.node_ranks else None

    def _limit(self, node: int, now: float) -> str | None:
        c = self.cfg
        if len(self.evicted) >= c.max_evictions:
            return f"max evictions reached ({len(self.evicted)} of {c.max_evictions})"
        if self.last_evict_t is not None and now - self.last_evict_t < c.cooldown_s:
            return f"cooldown: last eviction {now - self.last_evict_t:.0f} s ago, cooldown {c.cooldown_s:.0f} s"
        left = self.world_size - len(self.node_ranks.get(node, []))
        if left < c.min_world_size:
            return f"would leave {left} ranks, below the minimum world size {c.min_world_size}"
        min_nodes = max(1, c.min_nodes)
        if self.n_nodes - 1 < min_nodes:
            return f"would leave {self.n_nodes - 1} node(s), below the minimum {min_nodes}"
        return None

    def _action(self, f: Finding, node: int, now: float, status: str, reason: str) -> Action:
        return Action(run_id=self.run_id, id=uuid.uuid4().hex[:12], t=now, action="evict", node=node,
                      ranks=sorted(self.node_ranks.get(node, f.ranks)), reason=reason, finding_kind=f.kind,
                      dry_run=self.cfg.dry_run, status=status, requested_by="policy")

    def observe(self, findings: list[Finding], now: float | None = None) -> Decision:
        now = time.time() if now is None else now
        c = self.cfg
        d = Decision()
        seen = set()
        for f in findings:
            key = finding_key(f)
            seen.add(key)
            self.streak[key] = self.streak.get(key, 0) + 1
            if SEVERITY_ORDER[f.severity] >= SEVERITY_ORDER[c.alert_min_severity]:
                prev = self.alerted.get(key)
                if prev is None or SEVERITY_ORDER[f.severity] > SEVERITY_ORDER[prev]:
                    d.alerts.append(f)
                self.alerted[key] = f.severity
        for key in list(self.streak):
            if key not in seen:  # the finding went away: its confirmation starts over
                self.streak.pop(key)
                self.alerted.pop(key, None)
                self.refused.pop(key, None)
        for f in sorted(findings, key=lambda f: -SEVERITY_ORDER[f.severity]):
            key = finding_key(f)
            if f.kind not in c.evict_kinds or SEVERITY_ORDER[f.severity] < SEVERITY_ORDER[c.evict_min_severity]:
                continue
            if f.confidence < c.min_confidence or self.streak[key] < c.confirm_rounds:
                continue
            node = self._target_node(f)
            if node is None or node in self.evicted:
                continue
            why = f"{f.kind} on node {node} confirmed {self.streak[key]} rounds: {f.summary}"
            limit = self._limit(node, now)
            if limit is not None:
                if self.refused.get(key) != limit.split(":")[0]:
                    a = self._action(f, node, now, "refused", f"{limit} ({why})")
                    d.audit.append(a)
                    self.audit.append(a)
                    self.refused[key] = limit.split(":")[0]
                continue
            a = self._action(f, node, now, "requested", f"checkpoint-and-evict: {why}" + (" [dry run]" if c.dry_run else ""))
            d.actions.append(a)
            d.audit.append(a)
            self.audit.append(a)
            self.evicted.append(node)
            self.last_evict_t = now
            if not c.dry_run:
                self.node_ranks.pop(node, None)
        return d

    def manual_limit(self, node: int, now: float | None = None) -> str | None:
        """Why an evict of ``node`` asked by a person (the API, the TUI) breaks the limits this policy keeps (node
        already evicted, cooldown, eviction budget, last node of the job), or None when it does not."""
        now = time.time() if now is None else now
        if node in self.evicted:
            return f"node {node} was already evicted"
        if self.n_nodes and node not in self.node_ranks:
            return f"node {node} is not in the job (its nodes: {sorted(n for n in self.node_ranks if n >= 0)})"
        if not self.n_nodes:
            return "the job's placement is not known yet (no manifest): cannot tell that a node would be left"
        return self._limit(node, now)

    def restore(self, actions) -> None:
        """Carry on from the run's recorded actions (a head restarted mid-run, an eviction a person asked for through
        the API): every eviction that was requested or applied, and not failed or refused, counts against
        ``max_evictions``, starts the cooldown from its time, and is never asked again; outside dry-run its node has
        left the job. Dry-run decisions count only in dry-run. An action already seen (same id) is skipped, so it can
        be called again with every round's actions."""
        seen = {a.id for a in self.audit}
        for a in sorted(actions, key=lambda a: a.t):
            if a.id in seen:
                continue
            if a.action != "evict" or a.node is None or a.status not in ("requested", "applied"):
                continue
            if a.dry_run and not self.cfg.dry_run:
                continue
            if a.node not in self.evicted:
                self.evicted.append(int(a.node))
            self.last_evict_t = a.t if self.last_evict_t is None else max(self.last_evict_t, a.t)
            if not a.dry_run:
                self.node_ranks.pop(int(a.node), None)
            self.audit.append(a)

    def record_result(self, action_id: str, status: str, applied_step: int | None = None) -> Action | None:
        """The head reports what became of an action (applied, failed); the audit entry is updated."""
        for a in self.audit:
            if a.id == action_id:
                a.status = status
                a.applied_step = applied_step
                return a
        return None
