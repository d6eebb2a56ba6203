"""The head's own /metrics: findings open, ingest counters, lag, runs by state, analysis round time; token required;
scraped by a real Prometheus with the documented ``authorization`` scrape config."""

from __future__ import annotations

import shutil
import time

import pytest
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.sdk._logs.export import LogRecordExportResult
from opentelemetry.sdk.resources import Resource

from agent_helpers import TOKEN, Procs, Prometheus, http_status, serving, wait_for
from conftest import free_port
from head.service import Head
from ranksight import schema, wire


def _steps(rank: int, n: int, t_end: float, step_ms: float = 100.0):
    return [schema.StepRecord(run_id="runA", rank=rank, step=s, node=rank // 2, host=f"n{rank // 2}", world_size=4,
                              t_start=t_end - 1 - (n - s) * 0.1, t_end=t_end - (n - 1 - s) * 0.1, step_ms=step_ms,
                              compute_ms=step_ms - 10, comm_ms=10.0) for s in range(n)]


def _export(url: str, recs, rank: int) -> None:
    body = wire.join_array([schema.encode(r) for r in recs])
    rec = [wire.make_log_record("runA", "step", body, rank=rank, count=len(recs), resource=Resource.create({}))]
    exp = OTLPLogExporter(endpoint=url + "/v1/logs", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
    assert exp.export(rec) == LogRecordExportResult.SUCCESS


def _slow_rank_analyzer(data):
    st = data.steps
    slow = sorted(int(r) for r in st[st["step_ms"] > 150]["rank"].unique())
    return [schema.Finding(analyzer="test", kind="straggler", severity="warning", ranks=slow, summary="slow")] \
        if slow else []


@pytest.fixture
def head(tmp_path):
    h = Head(tmp_path / "store", TOKEN, analyzer=_slow_rank_analyzer, flush_interval=0.2, analyzer_interval=0)
    with serving(h, poll=0.1, background=True):
        yield h


def _sample(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name + str(sorted(s.labels.items())) == name or (s.name == name and not s.labels):
                return s.value
    raise KeyError(name)


def test_head_metrics_need_the_token_and_measure_what_the_head_holds(head):
    import urllib.request

    assert http_status(head.url + "/metrics", None, {}, method="GET") == 401
    assert http_status(head.url + "/metrics", None, {"Authorization": "Bearer wrong"}, method="GET") == 403
    now = time.time()
    for r in range(4):  # rank 3 slow; the newest step of every rank ended 2 s before it was sent
        _export(head.url, _steps(r, 20, now - 2.0, 300.0 if r == 3 else 100.0), r)
    _export(head.url, _steps(0, 5, now - 2.0), 0)  # a resend: 5 duplicates
    head.analysis.analyze_if_due("runA")
    req = urllib.request.Request(head.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    text = urllib.request.urlopen(req, timeout=5).read().decode()
    assert _sample(text, "ranksight_head_ingest_records_total[('result', 'new')]") == 80
    assert _sample(text, "ranksight_head_ingest_records_total[('result', 'duplicate')]") == 5
    assert _sample(text, "ranksight_head_ingest_batches_total[('signal', 'logs')]") == 5
    assert _sample(text, "ranksight_head_findings_open[('kind', 'straggler'), ('run_id', 'runA'), "
                         "('severity', 'warning')]") == 1
    assert _sample(text, "ranksight_head_runs[('state', 'running')]") == 1
    lag = _sample(text, "ranksight_head_ingest_lag_seconds[('run_id', 'runA')]")
    assert 2.0 <= lag < 60, lag
    assert _sample(text, "ranksight_head_analysis_round_seconds_count") == 1
    assert _sample(text, "ranksight_head_analysis_rounds_total") == 1


@pytest.mark.skipif(not shutil.which("prometheus"), reason="needs prometheus (make debs)")
def test_a_real_prometheus_scrapes_the_head_with_its_token(head, tmp_path):
    _export(head.url, _steps(3, 10, time.time(), 300.0), 3)
    head.analysis.analyze_if_due("runA")
    token_file = tmp_path / "head.token"
    token_file.write_text(TOKEN)
    procs = Procs(tmp_path / "logs")
    prom = Prometheus(tmp_path / "prom", [], procs, free_port())
    target = head.url.split("//", 1)[1]
    # the scrape config docs/dashboards-alerts.md gives for the head (YAML is a superset of JSON)
    (prom.dir / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: ranksight-head\n"
        f"    authorization: {{type: Bearer, credentials_file: {token_file}}}\n"
        f"    static_configs: [{{targets: [\"{target}\"]}}]\n")
    try:
        prom.start()
        prom.wait_up(1, timeout=40)
        got = wait_for(lambda: prom.query('ranksight_head_findings_open{run_id="runA",kind="straggler"}'), 20, 0.5,
                       "the head's findings in Prometheus")
        assert float(got[0]["value"][1]) == 1 and got[0]["metric"]["severity"] == "warning"
        assert float(prom.query('ranksight_head_ingest_records_total{result="new"}')[0]["value"][1]) == 10
        assert prom.query("ranksight_head_analysis_round_seconds_bucket")
        assert prom.query('ranksight_head_runs{state="running"} == 1')
    finally:
        procs.stop_all()


def test_head_cpu_by_part_counts_the_handlers_and_the_flusher(head):
    """ranksight_head_cpu_seconds_total{part}: the request handlers' CPU goes to http (it grows with requests served
    on a kept-alive connection, whose thread is still live), and the parts never claim more than the process used."""
    import http.client
    import urllib.parse
    import urllib.request

    def cpu() -> dict[str, float]:
        req = urllib.request.Request(head.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        text = urllib.request.urlopen(req, timeout=5).read().decode()
        from prometheus_client.parser import text_string_to_metric_families

        return {s.labels["part"]: s.value for fam in text_string_to_metric_families(text)
                for s in fam.samples if s.name == "ranksight_head_cpu_seconds_total"}

    before = cpu()
    assert {"http", "flush", "other"} <= set(before)
    u = urllib.parse.urlsplit(head.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)  # one live handler thread for all of them
    t0 = time.process_time()
    while time.process_time() - t0 < 0.6:  # enough client CPU that the server side spends ticks too
        conn.request("GET", "/api/runs", headers={"Authorization": f"Bearer {TOKEN}"})
        assert conn.getresponse().read()
    during = cpu()  # the connection's handler is still running: counted live from /proc
    conn.close()
    assert during["http"] > before["http"]
    total = time.process_time()  # the test and the head share this process
    assert sum(during.values()) <= total + 0.05
