"""Carries out the evict policy on the head: findings in, checkpoint-and-evict actions out.

The decision logic is ``analyzers.policy.EvictPolicy`` (pure, tested on its own); this
module only feeds it each analysis round's findings (it is one of the head's round hooks,
``head.analysis.LiveAnalysis.round_hooks``) and sends what it decides through the head's
``head.actions.ActionsBook``, the same way a person's request from the TUI or the API travels:
head -> node agent -> control file -> the trainer acts at a step boundary.

Modes: ``off``; ``dry-run`` (the default: decisions are recorded as actions with
``dry_run=True`` and never sent, the way NVRx ships its STOP verdicts in log mode);
``on`` (sent). Refusals (minimum nodes, cooldown, ...) are recorded too: the actions
table is the audit trail.
"""

from __future__ import annotations

import logging
from typing import Any

from analyzers.policy import EvictPolicy, PolicyConfig
from head.actions import ActionsBook
from ranksight import schema

log = logging.getLogger("ranksight.head.policy")

MODES = ("off", "dry-run", "on")


class PolicyRunner:
    """A round hook: each round's findings into the run's ``EvictPolicy``; its actions recorded or sent."""

    def __init__(self, actions: ActionsBook, mode: str = "dry-run", cfg: PolicyConfig | None = None):
        if mode not in MODES:
            raise ValueError(f"evict mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.actions = actions
        self.mode = mode
        self.cfg = cfg or PolicyConfig()
        self.cfg.dry_run = mode != "on"
        actions.policy_config = self.cfg  # manual evictions through the API pass the same limits
        self.policies: dict[str, EvictPolicy] = {}
        self._placed_from: dict[str, schema.Manifest | None] = {}  # the manifest each policy's placement came from

    def _policy(self, run_id: str, manifest: schema.Manifest | None) -> EvictPolicy | None:
        """The run's policy, with the job's current placement: the manifest's, followed as it changes (a manifest
        rank 0 rewrote with every rank's placement, a job re-formed without a node)."""
        node_ranks: dict[int, list[int]] = {}
        for p in (manifest.ranks if manifest is not None else []):
            node_ranks.setdefault(p.node, []).append(p.rank)
        policy = self.policies.get(run_id)
        if policy is None:
            if not node_ranks:
                return None  # no placement yet: nothing can be evicted safely
            policy = self.policies[run_id] = EvictPolicy(run_id, node_ranks, self.cfg)
        elif node_ranks and manifest is not self._placed_from.get(run_id):
            policy.node_ranks = {n: list(r) for n, r in node_ranks.items()
                                 if n not in policy.evicted or self.cfg.dry_run}
        # the run's stored actions: a head restarted mid-run carries on from them (limits, cooldown, nodes gone), and
        # evictions a person asked for through the API count against the same limits
        policy.restore(self.actions.of_run(run_id).values())
        self._placed_from[run_id] = manifest
        return policy

    def __call__(self, run_id: str, findings: list[schema.Finding], manifest: schema.Manifest | None) -> list[Any]:
        """One analysis round. Returns the actions recorded or sent this round."""
        if self.mode == "off":
            return []
        policy = self._policy(run_id, manifest)
        if policy is None:
            return []
        decision = policy.observe(findings)
        done = []
        for a in decision.audit:
            if a.status == "refused":
                log.warning("policy refused to evict node %s: %s", a.node, a.reason)
                self.actions.record(a)
                done.append(a)
        for a in decision.actions:
            if a.dry_run:
                log.warning("policy (dry run) would checkpoint and evict node %s: %s", a.node, a.reason)
                self.actions.record(a)
                done.append(a)
            else:
                log.warning("policy: checkpoint and evict node %s: %s", a.node, a.reason)
                sent = self.actions.request(run_id, {
                    "id": a.id, "action": "evict", "node": a.node, "ranks": a.ranks, "reason": a.reason,
                    "finding_kind": a.finding_kind, "dry_run": False}, requested_by="policy")
                done.append(sent)
        return done
