"""A person's evict (``POST /api/runs/<id>/actions``) passes the evict policy's limits (issue 16, item 2): refused with a
409 and the reason when the node was already evicted, in the cooldown, past the eviction budget, or the last node of
the job; ``"force": true`` with a reason overrides, audited in the actions table (``force``, who, why). The limits
hold across a head restart, and the policy counts a person's evictions against its own."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agent_helpers import TOKEN
from analyzers.policy import PolicyConfig
from head.api import make_server
from head.policy_runner import PolicyRunner
from head.service import Head
from ranksight import schema
from ranksight.tables import read_table

RUN = "man"


def _manifest(nodes: int) -> schema.Manifest:
    return schema.Manifest(run_id=RUN, created=0.0, start_time=0.0, nodes=nodes, ranks=[
        schema.RankPlacement(rank=r, node=r // 2, host=f"h{r // 2}", local_rank=r % 2, pp_stage=0, dp_rank=r, tp_rank=0)
        for r in range(2 * nodes)])


def post(url: str, body: dict) -> tuple[int, dict]:
    """POST a JSON body with the token; (status, JSON answer) for errors too."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


class Served:
    """A head with its HTTP server; actions are not sent to agents (``sent`` lists what would have been)."""

    def __init__(self, store, nodes: int = 2, cfg: PolicyConfig | None = None, mode: str = "on", analyzer=None):
        self.head = Head(store, TOKEN, analyzer=analyzer)
        self.runner = PolicyRunner(self.head.actions, mode, cfg or PolicyConfig())
        self.head.analysis.round_hooks.append(self.runner)
        if nodes:
            self.head.live.run(RUN).manifest = _manifest(nodes)
        self.sent: list[schema.Action] = []
        self.head.actions._send = lambda a: (self.sent.append(a), a)[1]  # type: ignore[method-assign]
        self.srv = make_server(self.head, "127.0.0.1", 0)
        threading.Thread(target=self.srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}/api/runs/{RUN}/actions"

    def post(self, **body):
        return post(self.url, body)

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()
        self.head.close()


def test_a_second_eviction_is_refused_unless_forced_and_the_force_is_audited(tmp_path):
    s = Served(tmp_path / "store")
    try:
        st, a = s.post(action="evict", node=1, reason="slow")
        assert st == 202 and a["status"] == "requested" and not a["force"]
        st, err = s.post(action="evict", node=1, reason="again")
        assert st == 409 and "node 1 was already evicted" in err["error"] and "force" in err["error"]
        st, err = s.post(action="evict", node=0)  # the budget (one per run) is spent; it is also the last node
        assert st == 409 and "max evictions reached (1 of 1)" in err["error"]
        st, err = s.post(action="evict", node=0, force=True)  # forced without saying why
        assert st == 400 and "reason" in err["error"]
        st, err = s.post(action="checkpoint", force=True, reason="x")  # force is for evicts only
        assert st == 400
        st, a = s.post(action="evict", node=0, force=True, reason="node 0's GPUs are failing; the job is checkpointed",
                       by="alice")
        assert st == 202 and a["force"] is True and a["requested_by"].endswith("(alice)")
        assert "[forced past: max evictions reached" in a["reason"] and "GPUs are failing" in a["reason"]
        assert [x.node for x in s.sent] == [1, 0]  # the refused ones were never sent
        s.head.store.flush_all()
        stored = read_table(s.head.store.root, RUN, "actions")
        rows = sorted(zip(stored["node"], stored["status"], stored["force"]), key=str)
        assert rows == sorted([(1, "requested", False), (1, "refused", False), (0, "refused", False),
                               (0, "requested", True)], key=str)
    finally:
        s.close()
    s = Served(tmp_path / "store")  # a restarted head: the limits come from the stored actions
    try:
        st, err = s.post(action="evict", node=1)
        assert st == 409 and "already evicted" in err["error"] and s.sent == []
    finally:
        s.close()


def test_the_cooldown_and_the_last_node_hold_for_a_person_too(tmp_path):
    s = Served(tmp_path / "store", nodes=3, cfg=PolicyConfig(max_evictions=5, cooldown_s=600.0))
    try:
        assert s.post(action="evict", node=2)[0] == 202
        st, err = s.post(action="evict", node=1)
        assert st == 409 and err["error"].startswith("evict refused: cooldown: last eviction")
        st, err = s.post(action="evict", node=7)
        assert st == 409 and "node 7 is not in the job" in err["error"]
    finally:
        s.close()
    s = Served(tmp_path / "store2", nodes=1, cfg=PolicyConfig(max_evictions=5, cooldown_s=0.0))
    try:
        st, err = s.post(action="evict", node=0)
        assert st == 409 and "would leave 0 ranks" in err["error"]  # the last node of the job
    finally:
        s.close()
    s = Served(tmp_path / "store3", nodes=0)  # no manifest yet: the head cannot tell that a node would be left
    try:
        st, err = s.post(action="evict", node=1)
        assert st == 409 and "placement is not known" in err["error"]
        assert s.post(action="evict", node=1, dry_run=True)[0] in (200, 202)  # asks nothing of the job
    finally:
        s.close()


def test_the_policy_counts_a_persons_eviction(tmp_path):
    def straggler_on_node1(_data):
        return [schema.Finding(analyzer="stragglers", kind="straggler", severity="warning", ranks=[3], nodes=[1],
                               step_start=12, confidence=0.9, summary="rank 3 (node 1) is the straggler")]

    cfg = PolicyConfig(confirm_rounds=2, max_evictions=2, cooldown_s=600.0)
    s = Served(tmp_path / "store", nodes=3, cfg=cfg, analyzer=straggler_on_node1)
    try:
        assert s.post(action="evict", node=2, reason="by hand")[0] == 202
        for _ in range(4):
            s.head.analysis.analyze_once(RUN)
        # the policy would evict node 1 now, but a person evicted node 2 a moment ago: its cooldown holds
        assert [x.node for x in s.sent] == [2]
        refused = [a for a in s.head.actions.current(RUN) if a["status"] == "refused"]
        assert refused and refused[0]["requested_by"] == "policy" and refused[0]["reason"].startswith("cooldown")
    finally:
        s.close()


def test_actions_stored_before_the_force_field_still_read(tmp_path):
    """An actions part file written before ``force`` existed reads back with its default, and keeps counting."""
    store = tmp_path / "store"
    d = store / RUN / "actions"
    d.mkdir(parents=True)
    pq.write_table(pa.table({"run_id": [RUN], "id": ["old1"], "t": [1.0], "action": ["evict"], "node": [1],
                             "ranks": [[2, 3]], "steps": [0], "reason": ["x"], "finding_kind": [""], "dry_run": [False],
                             "status": ["applied"], "applied_step": [5], "requested_by": ["policy"]}),
                   d / "part-000000.parquet")
    s = Served(store)
    try:
        (old,) = s.head.actions.of_run(RUN).values()
        assert old.force is False and old.applied_step == 5
        st, err = s.post(action="evict", node=1)
        assert st == 409 and "already evicted" in err["error"]
    finally:
        s.close()


@pytest.mark.parametrize("body", [{"action": "evict", "node": 1, "force": "yes", "reason": "r"},
                                  {"action": "evict", "node": 1, "force": True, "reason": "   "},
                                  {"action": "evict", "node": 1, "by": "a b/c"}])
def test_bad_force_fields_are_a_400(tmp_path, body):
    s = Served(tmp_path / "store")
    try:
        st, _ = post(s.url, body)
        assert st == 400 and s.sent == []
    finally:
        s.close()

