"""``ranksight action``: a person's evict from the shell passes the head's policy limits, and ``--force --reason``
goes past them, audited (issue 16: manual evictions pass the same limits unless forced with an audited --force)."""

from __future__ import annotations

import json
import threading

from typer.testing import CliRunner

from agent_helpers import TOKEN
from analyzers.policy import PolicyConfig
from cli.main import main as ranksight_main
from head.api import make_server
from head.policy_runner import PolicyRunner
from head.service import Head
from ranksight import schema

RUN = "cli-act"


def _head(store):
    head = Head(store, TOKEN)
    head.analysis.round_hooks.append(PolicyRunner(head.actions, "on", PolicyConfig()))
    head.live.run(RUN).manifest = schema.Manifest(run_id=RUN, created=0.0, start_time=0.0, nodes=3, ranks=[
        schema.RankPlacement(rank=r, node=r // 2, host=f"h{r // 2}", local_rank=r % 2, pp_stage=0, dp_rank=r,
                             tp_rank=0) for r in range(6)])
    head.actions._send = lambda a: a  # no agent to reach: the action stays as the head recorded it
    srv = make_server(head, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    return head, srv, f"http://127.0.0.1:{srv.server_address[1]}"


def run(url, *args, token=TOKEN):
    r = CliRunner().invoke(ranksight_main, ["action", RUN, *args, "--head", url, "--token", token])
    return r.exit_code, r.output


def test_a_second_evict_is_refused_with_the_reason_and_force_goes_past_it_audited(tmp_path):
    head, srv, url = _head(tmp_path / "store")
    try:
        code, out = run(url, "evict", "--node", "1", "--reason", "slow GPU", "--json")
        first = json.loads(out)
        assert code == 0 and first["accepted"] and first["action"]["node"] == 1, out
        code, out = run(url, "evict", "--node", "1", "--reason", "again")
        assert code == 3 and "refused (409)" in out and "already evicted" in out and "--force" in out, out
        code, out = run(url, "evict", "--node", "2", "--force")  # --force without a reason: a usage error
        assert code == 2
        code, out = run(url, "evict", "--node", "1", "--force", "--reason", "operator: reboot", "--by", "alice",
                        "--json")
        forced = json.loads(out)["action"]
        assert code == 0 and forced["force"] is True and "operator: reboot" in forced["reason"], out
        assert "alice" in forced["requested_by"]
        stored = head.actions.of_run(RUN)
        assert sum(1 for a in stored.values() if a.force) == 1
        code, out = run(url, "evict", "--node", "1", token="wrong")
        assert code == 4 and "403" in out
        code, out = run(url, "reboot")
        assert code == 2
    finally:
        srv.shutdown()
        head.close()


def test_an_unreachable_head_is_exit_4(tmp_path):
    code, out = run("http://127.0.0.1:9", "checkpoint", "--node", "0")
    assert code == 4 and "error" in out
