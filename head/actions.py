"""The head's actions on running jobs: checkpoint, profile, evict.

An action is requested through the API (a person, the TUI) or by the evict policy
(``head.policy_runner``), sent to the node agent that can carry it out (agent ``POST /control``), and
acknowledged by the trainer through the agent (a control ack in the logs path). Each status change
is appended to the run's ``actions`` table: the audit trail, read back after a head restart.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import ssl
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

import msgspec

from analyzers.policy import EvictPolicy, PolicyConfig
from head.live import AgentLive, RunLive
from head.runs import LiveRuns
from head.store import Store
from ranksight import schema
from ranksight.schema import MAX_PROFILE_STEPS
from ranksight.tables import read_table

log = logging.getLogger("ranksight.head")

ACTIONS = ("checkpoint", "profile", "evict")


class ActionRefused(Exception):
    """An evict the policy's limits forbid, asked without ``force`` (the API answers 409 with ``reason``)."""

    def __init__(self, reason: str, action: schema.Action):
        super().__init__(reason)
        self.reason = reason
        self.action = action  # the refusal as recorded in the audit trail


class ActionsBook:
    """Every run's actions, latest status per id."""

    def __init__(self, store: Store, live: LiveRuns, token: str, tls: ssl.SSLContext | None = None):
        self.store = store
        self.live = live
        self.token = token  # sent to the agents' endpoints (/control, /ops)
        # For agents whose control URL is https: verifies them (and presents the head's client certificate under
        # mutual TLS); None: the system's CAs. Plain http URLs do not use it.
        self.tls = tls
        self.by_run: dict[str, dict[str, schema.Action]] = {}
        # the evict policy's limits, which a person's evict passes too (head.policy_runner sets the head's own)
        self.policy_config = PolicyConfig()

    def of_run(self, run_id: str) -> dict[str, schema.Action]:
        """The run's actions by id, read from its ``actions`` table on first use."""
        acts = self.by_run.get(run_id)
        if acts is None:
            acts = {}
            try:
                df = read_table(self.store.root, run_id, "actions")
                # The latest status of each action wins: a final one (applied/refused/failed) over
                # "requested" whatever the clocks say (an ack carries the trainer's time).
                rows = df.to_dict("records") if len(df) else []
                rows.sort(key=lambda r: (r["status"] != "requested", r["t"]))
                for row in rows:
                    ranks = row.get("ranks")
                    row["ranks"] = [int(r) for r in ranks] if ranks is not None else []
                    # a missing value takes the field's default (a column added since the row was stored: force)
                    row = {k: v for k, v in row.items() if v is not None and not (isinstance(v, float) and v != v)}
                    acts[row["id"]] = msgspec.convert({**row, "run_id": run_id}, schema.Action, strict=False)
            except Exception as e:
                log.warning("head: could not load stored actions of %s: %s", run_id, e)
            self.by_run[run_id] = acts
        return acts

    def current(self, run_id: str) -> list[dict[str, Any]]:
        """The latest state of each of the run's actions, oldest first (``GET /api/runs/<id>/actions``)."""
        return [schema.to_dict(a) for a in sorted(self.of_run(run_id).values(), key=lambda a: a.t)]

    def record(self, a: schema.Action) -> None:
        """Record an action's new state (kept as its latest, appended to the ``actions`` table); nothing is sent."""
        self.of_run(a.run_id)[a.id] = a
        self.store.run(a.run_id).add("actions", [a])

    def apply_acks(self, run_id: str, acks: list[schema.ControlAck]) -> None:
        """The trainer's acknowledgements: each action's status and applied step follow them."""
        acts = self.of_run(run_id)
        for ack in acks:
            prev = acts.get(ack.id)
            if prev is None:
                prev = schema.Action(run_id=run_id, id=ack.id, t=ack.t, action=ack.action if ack.action in ACTIONS
                                     else "checkpoint", requested_by="unknown")
            if prev.status == ack.status and prev.applied_step == ack.applied_step:
                continue
            upd = msgspec.structs.replace(prev, status=ack.status, applied_step=ack.applied_step, t=ack.t)
            self.record(upd)
            log.info("head: action %s (%s) %s at step %s", ack.id, ack.action, ack.status, ack.applied_step)

    def request(self, run_id: str, req: dict[str, Any], requested_by: str = "api") -> schema.Action:
        """Create an action from a request body (``POST /api/runs/<id>/actions``), record it, and forward it to the
        node agent that can carry it out (not with ``dry_run``). ValueError for a bad request.

        An evict a person asks for passes the evict policy's limits (``evict_limit``) unless the request says
        ``"force": true`` with a ``reason``: refused, it is recorded as such and ``ActionRefused`` raised; forced,
        it is recorded with ``force`` set, the reason and who asked. The policy's own requests (``requested_by``
        "policy") were checked by the policy itself."""
        action, node, steps, ranks, action_id, reason, kind, dry_run, force, by = _validated(req)
        if by:
            requested_by = f"{requested_by} ({by})"
        a = schema.Action(run_id=run_id, id=action_id or uuid.uuid4().hex[:12], t=time.time(), action=action,
                          node=node, ranks=ranks, steps=steps, reason=reason, finding_kind=kind, dry_run=dry_run,
                          requested_by=requested_by, force=force)
        if action == "evict" and requested_by != "policy":
            limit = self.evict_limit(run_id, node, a.t, dry_run=dry_run)
            if limit is not None and not force:
                refused = msgspec.structs.replace(a, status="refused", reason=f"{limit} [not forced] {reason}".strip())
                self.record(refused)
                log.warning("head: refused a manual evict of node %s on run %s: %s", node, run_id, limit)
                raise ActionRefused(limit, refused)
            if limit is not None:
                a = msgspec.structs.replace(a, reason=f"{reason} [forced past: {limit}]")
                log.warning("head: manual evict of node %s on run %s FORCED by %s past the limits (%s): %s", node,
                            run_id, requested_by, limit, reason)
        if not a.dry_run:
            a = self._send(a)
        self.record(a)
        return a

    def evict_limit(self, run_id: str, node: int, now: float, dry_run: bool = False) -> str | None:
        """Why evicting ``node`` now breaks the evict policy's limits (``policy_config``) given the run's recorded
        actions and current placement; None when it does not. The evictions that count are the ones that were
        sent (not dry-run ones). A dry-run request is not refused for want of a placement: it asks nothing of the
        job."""
        live = self.live.run(run_id)
        node_ranks: dict[int, list[int]] = {}
        for p in (live.manifest.ranks if live.manifest is not None else []):
            node_ranks.setdefault(p.node, []).append(p.rank)
        policy = EvictPolicy(run_id, node_ranks, dataclasses.replace(self.policy_config, dry_run=False))
        policy.restore(self.of_run(run_id).values())
        if dry_run and not node_ranks:
            return f"node {node} was already evicted" if node in policy.evicted else None
        return policy.manual_limit(node, now)

    def open_agent(self, url: str, path: str, *, data: bytes | None = None, timeout: float):
        """A request to an agent's endpoint (``url`` as its heartbeat gave it, ``path`` with its query) with the
        head's token and TLS options: POST of JSON ``data``, else GET. ``urllib.request.urlopen``'s response, to be
        used in a ``with``; its errors as urlopen raises them."""
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(url.rstrip("/") + path, data=data, headers=headers,
                                     method="POST" if data is not None else "GET")
        return urllib.request.urlopen(req, timeout=timeout, context=self.tls)

    def _send(self, a: schema.Action) -> schema.Action:
        """POST the action's ``ControlRequest`` to the chosen agent; the action as it stands after (``failed`` with
        the reason when no agent could take it)."""
        agent = _agent_for(self.live.run(a.run_id), a)
        if agent is None:
            return msgspec.structs.replace(a, status="failed", reason=(a.reason + " [no live agent for this run]").strip())
        creq = schema.ControlRequest(id=a.id, action=a.action, t=a.t, steps=a.steps, node=a.node, reason=a.reason)
        try:
            with self.open_agent(agent.url, "/control", data=schema.encode(creq), timeout=5) as resp:
                resp.read()
        except (urllib.error.URLError, OSError) as e:
            a = msgspec.structs.replace(a, status="failed",
                                        reason=(a.reason + f" [agent {agent.node} unreachable: {e}]").strip())
        return a


MAX_INT = 2**31 - 1  # nodes and ranks: what every table and the trainer's int64 broadcast hold with room
ACTION_ID_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_TEXT = 2000


def _int_in(req: dict, key: str, lo: int, hi: int, default):
    v = req.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"{key} must be an integer in [{lo}, {hi}], not {v!r}")
    return v


def _validated(req: dict[str, Any]) -> tuple:
    """The request's fields, each checked at the boundary (type, range, length), so that every action the API
    accepts can be stored in the audit table and carried out: ValueError (400) otherwise."""
    action = req.get("action")
    if action not in ACTIONS:
        raise ValueError("action must be one of checkpoint, profile, evict")
    node = _int_in(req, "node", 0, MAX_INT, None)
    if action == "evict" and node is None:
        raise ValueError("evict needs a node")
    steps = _int_in(req, "steps", 1 if action == "profile" else 0, MAX_PROFILE_STEPS, 5 if action == "profile" else 0)
    ranks = req.get("ranks") or []
    if not isinstance(ranks, list) or len(ranks) > 65536 or not all(
            isinstance(r, int) and not isinstance(r, bool) and 0 <= r <= MAX_INT for r in ranks):
        raise ValueError(f"ranks must be a list of integers in [0, {MAX_INT}]")
    action_id = req.get("id")
    if action_id is not None and (not isinstance(action_id, str) or not ACTION_ID_RE.fullmatch(action_id)):
        raise ValueError("id must be 1-64 letters, digits, '_', '-' or '.'")
    texts = []
    for key in ("reason", "finding_kind"):
        v = req.get(key) or ""
        if not isinstance(v, str) or len(v) > MAX_TEXT:
            raise ValueError(f"{key} must be a string of at most {MAX_TEXT} characters")
        texts.append(v)
    dry_run = req.get("dry_run", False)
    if not isinstance(dry_run, bool):
        raise ValueError("dry_run must be true or false")
    force = req.get("force", False)
    if not isinstance(force, bool):
        raise ValueError("force must be true or false")
    if force and (action != "evict" or not texts[0].strip()):
        raise ValueError("force is for an evict, with a reason that says why the limits do not apply")
    by = req.get("by") or ""
    if not isinstance(by, str) or (by and not ACTION_ID_RE.fullmatch(by)):
        raise ValueError("by (who asks) must be 1-64 letters, digits, '_', '-' or '.'")
    return action, node, steps, ranks, action_id, texts[0], texts[1], dry_run, force, by


def _agent_for(live: RunLive, a: schema.Action) -> AgentLive | None:
    """The agent to send ``a`` to (rank 0's trainer acts on every request); None when no agent of the run has
    told the head its control URL."""
    with live.lock:
        agents = {n: ag for n, ag in live.agents.items() if ag.url}
        if not agents:
            return None
        if a.node is not None and a.action == "evict":
            # The eviction is carried out by rank 0's trainer, but the request names the node;
            # any agent of the run writes into the shared control directory. Prefer the named node's.
            return agents.get(a.node) or agents[min(agents)]
        rank0_node = None
        if live.manifest is not None:
            for p in live.manifest.ranks:
                if p.rank == 0:
                    rank0_node = p.node
        if rank0_node is None:
            rank0_node = live.rank_node(0)
        return agents.get(rank0_node) or agents[min(agents)]
