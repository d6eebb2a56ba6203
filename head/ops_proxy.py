"""``GET /api/runs/<id>/ops?rank=R&steps=A-B[&comm=ID][&op=KIND][&limit=N]``: the raw collective records of one
rank, from the node that holds its spool.

The head stores what the agents ship (folded per step above 256 ranks); the records of every op stay on the nodes.
This finds the node of rank R in the run's live window (its step records, else the manifest's placement, else the
ranks an agent's heartbeat lists), and forwards the query to that node's agent (``GET /ops`` on the endpoint whose
URL the agent's heartbeat gave) with the token and TLS options the head uses for ``/control``
(``head.actions.ActionsBook.open_agent``). The agent's answer (``ranksight.ops_query.OpsAnswer``) is passed on as it came.

Errors say what is wrong: a bad query 400 (checked here before anything is sent), a rank no node of the run is
known to hold 404, no agent URL or an agent that cannot be reached or fails 502 with the reason.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import urllib.error
import urllib.parse

from head.receiver import HttpError
from ranksight.ops_query import parse_ops_query

log = logging.getLogger("ranksight.head")

AGENT_TIMEOUT_S = 60.0  # a rank's first query indexes its whole spool before it reads


def node_of_rank(live, rank: int) -> int | None:
    """The node of ``rank`` in a run's live window: from its step records, else the manifest, else the agents'
    heartbeats (the ranks each agent tails)."""
    n = live.rank_node(rank)
    if n is not None:
        return n
    with live.lock:
        for p in (live.manifest.ranks if live.manifest is not None else []):
            if p.rank == rank:
                return p.node
        for a in live.agents.values():
            if a.heartbeat is not None and rank in a.heartbeat.ranks:
                return a.node
    return None


def forward_ops(head, run_id: str, query: dict[str, str]) -> bytes:
    """The agent's answer (JSON bytes) to the drill-down ``query`` on ``run_id``; HttpError otherwise."""
    try:
        q = parse_ops_query(query)
    except ValueError as e:
        raise HttpError(400, str(e)) from None
    live = head.live.run(run_id)
    node = node_of_rank(live, q.rank)
    if node is None:
        raise HttpError(404, f"rank {q.rank} is not known in run {run_id}'s live window (no step record, placement "
                             f"or agent names it)")
    with live.lock:
        agent = live.agents.get(node)
        url = agent.url if agent is not None else ""
    if not url:
        raise HttpError(502, f"rank {q.rank} is on node {node}, whose agent has not told the head its URL (it runs "
                             f"without --metrics-port, or has not reached the head yet)")
    try:
        with head.actions.open_agent(url, "/ops?" + urllib.parse.urlencode(q.params()), timeout=AGENT_TIMEOUT_S) as r:
            return r.read()
    except urllib.error.HTTPError as e:
        reason = _error_text(e)
        if e.code in (400, 404):  # the agent's own answer: a range it refuses, a rank that is not there
            raise HttpError(e.code, f"agent of node {node}: {reason}") from None
        if e.code in (401, 403):
            raise HttpError(502, f"the agent of node {node} refused the head's token ({e.code}): the agent and the "
                                 f"head must share one --token") from None
        raise HttpError(502, f"the agent of node {node} failed ({e.code}): {reason}") from None
    except urllib.error.URLError as e:
        raise HttpError(502, f"the agent of node {node} at {url} is unreachable: {e.reason}") from None
    except (socket.timeout, TimeoutError):
        raise HttpError(502, f"the agent of node {node} at {url} did not answer in {AGENT_TIMEOUT_S:g} s") from None
    except (OSError, ValueError, http.client.HTTPException) as e:  # a reset, a malformed status line
        raise HttpError(502, f"the agent of node {node} at {url}: {type(e).__name__}: {e}") from None


def _error_text(e: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(e.read() or b"{}").get("error") or e.reason)
    except (ValueError, AttributeError, OSError):
        return str(e.reason)
