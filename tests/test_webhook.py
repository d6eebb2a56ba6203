"""Signed webhooks: the signature scheme, the background sender (retries, bounds, counters), the reference receiver."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import pytest
from werkzeug import Request, Response

from conftest import free_port
from dashboards.webhook import WebhookSender, WebhookTarget, alertmanager_payload, alertname_for
from dashboards.webhook_receiver import WebhookReceiver
from dashboards.webhook_signature import (HDR_DELIVERY, HDR_EVENT, HDR_SIGNATURE, HDR_TIMESTAMP, SignatureError,
                                          compute, sign, verify, verify_headers)
from ranksight.schema import Finding

REPO = Path(__file__).resolve().parent.parent
SECRET = "whsec-test-0123456789"


def _finding(**kw) -> Finding:
    base = dict(analyzer="straggler", kind="straggler", severity="warning", ranks=[3], nodes=[1], step_start=120,
                step_end=180, evidence={"compute_ratio": 1.31, "median_compute_ms": 40.0},
                recommendation="check GPU 3 on node 1", summary="rank 3 computes 1.31x the median", run_id="run-a",
                t=1_700_000_000.0, simulated=True)
    base.update(kw)
    return Finding(**base)


# --------------------------------------------------------------------------------------------
# the scheme
# --------------------------------------------------------------------------------------------

def test_sign_and_verify_roundtrip():
    body = b'{"a": 1}'
    h = sign(SECRET, body, now=1000)
    assert h[HDR_TIMESTAMP] == "1000"
    assert h[HDR_SIGNATURE] == "sha256=" + compute(SECRET, "1000", body)
    # the documented construction, independently: HMAC-SHA256(secret, ts + "." + body)
    import hashlib
    import hmac

    assert h[HDR_SIGNATURE] == "sha256=" + hmac.new(SECRET.encode(), b"1000." + body, hashlib.sha256).hexdigest()
    assert verify(SECRET, body, h[HDR_TIMESTAMP], h[HDR_SIGNATURE], now=1010) == 1000
    assert verify_headers(SECRET, body, {k.lower(): v for k, v in h.items()}, now=1010) == 1000


@pytest.mark.parametrize("case, match", [
    ("tampered body", "does not match"),
    ("wrong secret", "does not match"),
    ("stale", "tolerance"),
    ("future", "tolerance"),
    ("timestamp changed", "does not match"),
    ("no timestamp", "missing X-Ranksight-Timestamp"),
    ("no signature", "missing X-Ranksight-Signature"),
    ("bad timestamp", "integer Unix seconds"),
    ("other scheme", "no sha256"),
    ("truncated hex", "does not match"),
])
def test_verify_rejects(case, match):
    body = b'{"finding": "x"}'
    h = sign(SECRET, body, now=5000)
    ts, sig, secret, now = h[HDR_TIMESTAMP], h[HDR_SIGNATURE], SECRET, 5000.0
    if case == "tampered body":
        body = body.replace(b"x", b"y")
    elif case == "wrong secret":
        secret = "another-secret"
    elif case == "stale":
        now = 5000 + 301
    elif case == "future":
        now = 5000 - 301
    elif case == "timestamp changed":
        ts = "5001"
    elif case == "no timestamp":
        ts = None
    elif case == "no signature":
        sig = ""
    elif case == "bad timestamp":
        ts = "5000.5"
    elif case == "other scheme":
        sig = sig.replace("sha256=", "sha1=")
    elif case == "truncated hex":
        sig = sig[:-2]
    with pytest.raises(SignatureError, match=match):
        verify(secret, body, ts, sig, now=now)


def test_secret_rotation():
    body = b"{}"
    h = sign(["new", "old"], body, now=100)
    assert h[HDR_SIGNATURE].count("sha256=") == 2
    assert verify("old", body, h[HDR_TIMESTAMP], h[HDR_SIGNATURE], now=100) == 100
    assert verify(["new"], body, h[HDR_TIMESTAMP], h[HDR_SIGNATURE], now=100) == 100
    h1 = sign("old", body, now=100)
    assert verify(["new", "old"], body, h1[HDR_TIMESTAMP], h1[HDR_SIGNATURE], now=100) == 100
    with pytest.raises(SignatureError):
        verify(["x", "y"], body, h1[HDR_TIMESTAMP], h1[HDR_SIGNATURE], now=100)
    with pytest.raises(ValueError, match="empty"):
        sign("", body)


# --------------------------------------------------------------------------------------------
# sender -> reference receiver (in process)
# --------------------------------------------------------------------------------------------

@pytest.fixture
def receiver():
    srv = WebhookReceiver(0, SECRET, bearer_token="am-token", echo=False)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def test_sender_delivers_signed_finding(receiver):
    f = _finding()
    sender = WebhookSender([WebhookTarget(url=receiver.url + "/hook", secret=SECRET)])
    try:
        t0 = time.monotonic()
        assert sender.send_finding(f) == 1
        assert time.monotonic() - t0 < 0.5  # queued, not sent inline
        assert sender.flush(10)
    finally:
        sender.close()
    assert len(receiver.deliveries) == 1
    d = receiver.deliveries[0]
    assert d["auth"] == "signature" and d["event"] == "finding" and d["path"] == "/hook" and d["delivery"]
    assert msgspec.convert(d["payload"], Finding) == f
    st = sender.stats()
    assert (st["queued"], st["delivered"], st["failed"], st["retried"], st["pending"]) == (1, 1, 0, 0, 0)
    assert st["per_target"][receiver.url + "/hook"]["delivered"] == 1


def test_sender_alertmanager_format_and_severity_filter(receiver):
    sender = WebhookSender([WebhookTarget(url=receiver.url + "/am", secret=SECRET, format="alertmanager",
                                          min_severity="warning")], external_url="http://head:4318")
    try:
        n = sender.send_findings([_finding(), _finding(severity="info", kind="mfu_drop"),
                                  _finding(severity="critical", kind="gpu_health", ranks=[0, 1], nodes=[0],
                                           simulated=False)])
        assert n == 2  # the info finding is below this target's floor
        assert sender.flush(10)
    finally:
        sender.close()
    payloads = [d["payload"] for d in receiver.deliveries]
    assert len(payloads) == 2 and all(p["version"] == "4" and p["status"] == "firing" for p in payloads)
    by_name = {p["alerts"][0]["labels"]["alertname"]: p for p in payloads}
    s = by_name["RanksightFindingStraggler"]["alerts"][0]
    assert s["labels"] == {"alertname": "RanksightFindingStraggler", "severity": "warning", "run_id": "run-a",
                           "kind": "straggler", "analyzer": "straggler", "source": "ranksight-head",
                           "simulated": "true", "rank": "3", "node": "1"}
    assert s["annotations"]["summary"] == "[SIMULATED] rank 3 computes 1.31x the median"
    assert json.loads(s["annotations"]["evidence"]) == {"compute_ratio": 1.31, "median_compute_ms": 40.0}
    assert s["annotations"]["steps"] == "120-180"
    assert s["startsAt"].startswith("2023-11-14T22:13:20") and s["endsAt"] == "0001-01-01T00:00:00Z"
    assert s["generatorURL"] == "http://head:4318"
    g = by_name["RanksightFindingGpuHealth"]
    assert g["alerts"][0]["labels"]["rank"] == "0,1" and g["alerts"][0]["labels"]["simulated"] == "false"
    assert g["groupLabels"] == {"alertname": "RanksightFindingGpuHealth", "run_id": "run-a"}
    assert all(d["event"] == "alertmanager" for d in receiver.deliveries)


def test_alertmanager_payload_common_labels():
    p = alertmanager_payload([_finding(ranks=[1]), _finding(ranks=[2])])
    assert len(p["alerts"]) == 2
    assert "rank" not in p["commonLabels"] and p["commonLabels"]["kind"] == "straggler"
    assert p["alerts"][0]["fingerprint"] != p["alerts"][1]["fingerprint"]
    assert alertname_for("gpu_health") == "RanksightFindingGpuHealth"
    with pytest.raises(ValueError):
        alertmanager_payload([])


def test_sender_retries_5xx_then_succeeds(httpserver):
    seen = []

    def handler(status):
        def h(req: Request):
            seen.append((dict(req.headers), req.get_data()))
            return Response("{}", status=status)
        return h

    httpserver.expect_ordered_request("/hook", method="POST").respond_with_handler(handler(503))
    httpserver.expect_ordered_request("/hook", method="POST").respond_with_handler(handler(200))
    sender = WebhookSender([WebhookTarget(url=httpserver.url_for("/hook"), secret=SECRET)], backoff_s=0.05)
    try:
        sender.send_finding(_finding())
        assert sender.flush(10)
    finally:
        sender.close()
    httpserver.check_assertions()
    st = sender.stats()
    assert (st["delivered"], st["retried"], st["failed"]) == (1, 1, 0)
    assert len(seen) == 2
    (h1, b1), (h2, b2) = seen
    assert b1 == b2 and h1[HDR_DELIVERY] == h2[HDR_DELIVERY] and h1[HDR_EVENT] == "finding"
    for h, b in seen:  # every attempt is signed over its own timestamp
        verify_headers(SECRET, b, h)
    assert h1["Content-Type"] == "application/json"


def test_sender_does_not_retry_4xx(httpserver):
    httpserver.expect_request("/hook", method="POST").respond_with_data("bad signature", status=401)
    sender = WebhookSender([WebhookTarget(url=httpserver.url_for("/hook"), secret=SECRET)], backoff_s=0.05)
    try:
        sender.send_finding(_finding())
        assert sender.flush(10)
    finally:
        sender.close()
    st = sender.stats()
    assert (st["delivered"], st["retried"], st["failed"]) == (0, 0, 1)
    assert st["last_error"][httpserver.url_for("/hook")] == "HTTP 401"
    assert len(httpserver.log) == 1


def test_sender_gives_up_after_max_attempts_and_never_blocks():
    url = f"http://127.0.0.1:{free_port()}/hook"  # nothing listens there
    sender = WebhookSender([WebhookTarget(url=url, secret=SECRET, timeout_s=1)], max_attempts=3, backoff_s=0.05,
                           backoff_max_s=0.1)
    try:
        t0 = time.monotonic()
        for _ in range(5):
            sender.send_finding(_finding())
        assert time.monotonic() - t0 < 0.5
        assert sender.flush(15)
    finally:
        sender.close(timeout=1)
    st = sender.stats()
    assert (st["delivered"], st["failed"], st["retried"]) == (0, 5, 10)
    assert "Connection refused" in st["last_error"][url] or "URLError" in st["last_error"][url]


def test_sender_queue_is_bounded_and_close_is_bounded():
    url = f"http://127.0.0.1:{free_port()}/hook"
    sender = WebhookSender([WebhookTarget(url=url, secret=SECRET, timeout_s=1)], queue_size=2, max_attempts=10,
                           backoff_s=20, backoff_max_s=30)
    for _ in range(5):
        sender.send_finding(_finding())
    st = sender.stats()
    assert (st["queued"], st["dropped"]) == (2, 3)
    t0 = time.monotonic()
    sender.close(timeout=0.3)  # two deliveries are waiting 20 s for a retry: they are abandoned, not awaited
    assert time.monotonic() - t0 < 5
    assert sender.stats()["abandoned"] == 2
    with pytest.raises(RuntimeError, match="closed"):
        sender.send_finding(_finding())


def test_sender_configuration_errors():
    with pytest.raises(ValueError, match="secret"):
        WebhookSender([WebhookTarget(url="http://x/h", secret="")])
    with pytest.raises(ValueError, match="http"):
        WebhookSender([WebhookTarget(url="ftp://x/h", secret="s")])
    with pytest.raises(ValueError, match="format"):
        WebhookSender([WebhookTarget(url="http://x/h", secret="s", format="slack")])
    with pytest.raises(ValueError, match="min_severity"):
        WebhookSender([WebhookTarget(url="http://x/h", secret="s", min_severity="loud")])
    with pytest.raises(ValueError, match="at least one"):
        WebhookSender([])
    assert WebhookSender.from_env({}) is None
    with pytest.raises(ValueError, match="secret"):
        WebhookSender.from_env({"RANKSIGHT_WEBHOOK_URLS": "http://a/h"})
    s = WebhookSender.from_env({"RANKSIGHT_WEBHOOK_URLS": "http://a/h, http://b/h", "RANKSIGHT_WEBHOOK_SECRET": "s",
                                "RANKSIGHT_WEBHOOK_FORMAT": "alertmanager", "RANKSIGHT_WEBHOOK_MIN_SEVERITY": "critical"})
    try:
        assert [(t.url, t.format, t.min_severity) for t in s.targets] == [
            ("http://a/h", "alertmanager", "critical"), ("http://b/h", "alertmanager", "critical")]
        with pytest.raises(TypeError):
            s.send_findings([{"kind": "straggler"}])
    finally:
        s.close(timeout=0.1)


# --------------------------------------------------------------------------------------------
# the receiver refuses what it must
# --------------------------------------------------------------------------------------------

def _post(url: str, body: bytes, headers: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_receiver_accepts_valid_and_rejects_tampered_wrong_secret_stale(receiver):
    body = json.dumps({"hello": "world"}).encode()
    ok = {**sign(SECRET, body), HDR_DELIVERY: "d-1"}
    assert _post(receiver.url + "/h", body, ok)[0] == 200
    assert _post(receiver.url + "/h", body.replace(b"world", b"WORLD"), {**ok, HDR_DELIVERY: "d-2"})[0] == 401
    assert _post(receiver.url + "/h", body, {**sign("wrong", body), HDR_DELIVERY: "d-3"})[0] == 401
    stale = {**sign(SECRET, body, now=time.time() - 3600), HDR_DELIVERY: "d-4"}
    status, ans = _post(receiver.url + "/h", body, stale)
    assert status == 401 and "tolerance" in ans["message"]
    assert _post(receiver.url + "/h", body, {})[0] == 401  # unsigned, no bearer
    assert _post(receiver.url + "/h", body, {"Authorization": "Bearer nope"})[0] == 401
    # a replay of the accepted request is answered 200 but not processed again
    status, ans = _post(receiver.url + "/h", body, ok)
    assert status == 200 and "duplicate" in ans["message"]
    assert receiver.duplicates == 1
    garbage = b"not json"
    assert _post(receiver.url + "/h", garbage, {**sign(SECRET, garbage), HDR_DELIVERY: "d-5"})[0] == 400
    assert [d["payload"] for d in receiver.deliveries] == [{"hello": "world"}]
    assert [s for s, _ in receiver.rejected] == [401, 401, 401, 401, 401, 400]
    # Alertmanager's way in: the Bearer token
    assert _post(receiver.url + "/am", b'{"version": "4"}', {"Authorization": "Bearer am-token"})[0] == 200
    assert receiver.deliveries[-1]["auth"] == "bearer" and receiver.deliveries[-1]["event"] == "alertmanager"


def test_receiver_needs_some_credential():
    with pytest.raises(ValueError, match="secret"):
        WebhookReceiver(0, "", bearer_token="")


def test_cli_receiver_and_send(tmp_path):
    port = free_port()
    out = tmp_path / "deliveries.jsonl"
    env = dict(os.environ, PYTHONPATH=str(REPO), RANKSIGHT_WEBHOOK_SECRET=SECRET)
    p = subprocess.Popen([sys.executable, "-m", "cli.main", "dashboards", "webhook-receiver", "--port", str(port),
                          "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                         env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline and p.poll() is None, "receiver did not start"
                time.sleep(0.1)
        r = subprocess.run([sys.executable, "-m", "cli.main", "dashboards", "webhook-send", "--url",
                            f"http://127.0.0.1:{port}/hook"], capture_output=True, text=True, cwd=REPO, env=env,
                           timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "delivered 1/1" in r.stdout
        rec = json.loads(out.read_text().splitlines()[0])
        assert rec["auth"] == "signature" and rec["payload"]["summary"] == "ranksight test webhook: ignore"
        # wrong secret: refused, and the sender says so with a non-zero exit
        r = subprocess.run([sys.executable, "-m", "cli.main", "dashboards", "webhook-send", "--url",
                            f"http://127.0.0.1:{port}/hook", "--secret", "wrong"], capture_output=True, text=True,
                           cwd=REPO, env=env, timeout=60)
        assert r.returncode == 1 and "HTTP 401" in r.stdout
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        _, err = p.communicate(timeout=10)
    assert "listening on http://127.0.0.1:" in err and "refused POST /hook" in err
    # no arguments that make sense: a clear error, not a traceback
    from typer.testing import CliRunner

    from cli.main import main

    r = CliRunner().invoke(main, ["dashboards", "webhook-receiver"], env={"RANKSIGHT_WEBHOOK_SECRET": ""})
    assert r.exit_code == 2 and "--secret" in r.output


def test_head_findings_through_sender(receiver, tmp_path):
    """The wiring the head uses: new findings from LiveAnalysis.analyze_once go to WebhookSender.send_findings."""
    from head.service import Head

    produced = [_finding(run_id="", t=0.0), _finding(kind="hang", severity="critical", ranks=[2], summary="rank 2 hung", run_id="")]
    head = Head(tmp_path / "store", "tok", analyzer=lambda data: list(produced))
    sender = WebhookSender.from_env({"RANKSIGHT_WEBHOOK_URLS": receiver.url + "/hook",
                                     "RANKSIGHT_WEBHOOK_SECRET": SECRET})
    try:
        new = head.analysis.analyze_once("run-h")
        assert len(new) == 2
        assert sender.send_findings(new) == 2
        assert head.analysis.analyze_once("run-h") == []  # the head deduplicates: nothing is sent twice
        assert sender.flush(10)
    finally:
        sender.close()
        head.close()
    got = sorted((msgspec.convert(d["payload"], Finding) for d in receiver.deliveries), key=lambda f: f.kind)
    assert [f.kind for f in got] == ["hang", "straggler"]
    assert all(f.run_id == "run-h" and f.t > 0 for f in got)  # filled in by the head


def test_sender_does_not_follow_redirects(httpserver):
    httpserver.expect_request("/hook", method="POST").respond_with_data("", status=302,
                                                                       headers={"Location": "/elsewhere"})
    sender = WebhookSender([WebhookTarget(url=httpserver.url_for("/hook"), secret=SECRET)], backoff_s=0.05)
    try:
        sender.send_finding(_finding())
        assert sender.flush(10)
    finally:
        sender.close()
    st = sender.stats()
    assert (st["delivered"], st["failed"]) == (0, 1) and st["last_error"][httpserver.url_for("/hook")] == "HTTP 302"
    assert [r.path for r, _ in httpserver.log] == ["/hook"]
