"""Findings pushed to a real Alertmanager (``/api/v2/alerts``): one alert per episode with its labels and
annotations, silenced by a silence on run_id, resolved when the episode closes."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from datetime import datetime, timedelta, timezone

import pytest

from agent_helpers import TOKEN, wait_for
from conftest import free_port
from head.alertmanager import alert_of, bounded_list
from head.service import Head
from ranksight import schema


def _step(rank: int, s: int, step_ms: float) -> schema.StepRecord:
    return schema.StepRecord(run_id="r1", rank=rank, step=s, node=rank // 2, host=f"n{rank // 2}", world_size=4,
                             t_start=100.0 + s, t_end=100.0 + s + step_ms / 1000, step_ms=step_ms)


def _slow_steps(data):
    """A straggler finding per round while any step in the window was slow; its steps end at the last slow one."""
    st = data.steps
    slow = st[st["step_ms"] > 150]
    if not len(slow):
        return []
    return [schema.Finding(analyzer="test", kind="straggler", severity="warning",
                           ranks=sorted(int(r) for r in slow["rank"].unique()), nodes=[1],
                           step_start=int(slow["step"].min()), step_end=int(slow["step"].max()),
                           summary="rank 3 is slow", recommendation="look at rank 3's GPU")]


def test_alert_labels_are_bounded():
    f = schema.Finding(analyzer="a", kind="hang", severity="critical", ranks=list(range(100)), nodes=[3, 1, 3],
                       run_id="r", id="e1", t=0.0)
    a = alert_of(f, ends_at=60.0)
    assert a["labels"]["ranks"] == "0,1,2,3,4,5,6,7,+92" and a["labels"]["nodes"] == "1,3"
    assert a["labels"]["alertname"] == "ranksight_hang" and a["endsAt"] == "1970-01-01T00:01:00Z"
    assert bounded_list([]) == ""


def _am(url: str, path: str, body=None):
    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read() or b"null")


@pytest.mark.skipif(not shutil.which("prometheus-alertmanager"), reason="needs prometheus-alertmanager (make debs)")
def test_findings_reach_alertmanager_are_silenced_and_resolve(tmp_path):
    port = free_port()
    (tmp_path / "am.yml").write_text('route: {receiver: "null", group_wait: 0s}\nreceivers: [{name: "null"}]\n')
    am = subprocess.Popen(["prometheus-alertmanager", f"--config.file={tmp_path / 'am.yml'}",
                           f"--storage.path={tmp_path / 'am-data'}", f"--web.listen-address=127.0.0.1:{port}",
                           "--cluster.listen-address=", "--log.level=warn"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    am_url = f"http://127.0.0.1:{port}"
    h = Head(tmp_path / "store", TOKEN, analyzer=_slow_steps, analyzer_interval=0)
    try:
        wait_for(lambda: _am(am_url, "/api/v2/status"), 30, 0.3, "Alertmanager up")
        pusher = h.push_to_alertmanager(am_url, interval=0.5)
        h.start_background()
        rs, live = h.store.run("r1"), h.live.run("r1")
        live.add("steps", rs.add("steps", [_step(r, s, 300.0 if r == 3 else 100.0) for s in range(5) for r in range(4)]))
        assert [f.kind for f in h.analysis.analyze_once("r1")] == ["straggler"]
        alerts = wait_for(lambda: _am(am_url, "/api/v2/alerts"), 15, 0.2, "the finding in Alertmanager")
        assert len(alerts) == 1
        a = alerts[0]
        ep = h.analysis.findings["r1"].current()[0]
        assert a["labels"] == {"alertname": "ranksight_straggler", "run_id": "r1", "severity": "warning",
                               "kind": "straggler", "analyzer": "test", "episode": ep.id, "nodes": "1", "ranks": "3"}
        assert a["annotations"] == {"summary": "rank 3 is slow", "recommendation": "look at rank 3's GPU"}
        assert a["status"]["state"] == "active"
        # re-sent while open: still one alert (same labels), still firing after several rounds
        time.sleep(1.5)
        assert len(_am(am_url, "/api/v2/alerts")) == 1 and pusher.errors == 0 and pusher.sent >= 2

        now = datetime.now(timezone.utc)
        _am(am_url, "/api/v2/silences", {"matchers": [{"name": "run_id", "value": "r1", "isRegex": False}],
                                         "startsAt": now.isoformat(), "endsAt": (now + timedelta(hours=1)).isoformat(),
                                         "createdBy": "test", "comment": "run r1 under maintenance"})
        wait_for(lambda: [x for x in _am(am_url, "/api/v2/alerts") if x["status"]["state"] == "suppressed"
                          and x["status"]["silencedBy"]], 15, 0.2, "the alert silenced")
        assert _am(am_url, "/api/v2/alerts?silenced=false") == []

        # the episode closes (no slow step in the last 6 steps): sent with endsAt, Alertmanager resolves it
        live.add("steps", rs.add("steps", [_step(r, s, 100.0) for s in range(5, 15) for r in range(4)]))
        h.analysis.analyze_once("r1")
        assert h.analysis.findings["r1"].current()[0].status == "closed"
        pusher.notify([])
        wait_for(lambda: _am(am_url, "/api/v2/alerts") == [], 15, 0.2, "the alert resolved")
    finally:
        h.close()
        am.terminate()
        am.wait(timeout=10)


def test_a_bad_alertmanager_url_is_refused():
    from head.alertmanager import AlertmanagerPusher

    with pytest.raises(ValueError, match="alertmanager-url"):
        AlertmanagerPusher("localhost:9093", analysis=None)
