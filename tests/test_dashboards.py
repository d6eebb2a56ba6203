"""Dashboards: build, project lint, foundation-sdk round trip, CLI build, push via grafana-client."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import Dashboard as DashboardModel
from werkzeug import Request, Response

from dashboards.build import JSON_DIR, build_all, load_dir, to_dict, write_all
from dashboards.lint import lint_dashboard, panel_queries, promql_for_prometheus, variables_in
from dashboards.provision import ProvisionError, push

REPO = Path(__file__).resolve().parent.parent
TOKEN = "glsa_test_token_123"


@pytest.fixture(scope="module")
def models():
    return build_all()


@pytest.fixture(scope="module")
def job(models):
    return models["ranksight-job"]


def _panel(model, title):
    return next(p for p in model["panels"] if p.get("title") == title)


def test_built_dashboards_pass_lint(models):
    assert models, "no dashboards built"
    for uid, m in models.items():
        assert lint_dashboard(m) == [], uid


def test_round_trip_through_foundation_sdk(models):
    register_default_plugins()
    for uid, m in models.items():
        parsed = DashboardModel.from_json(copy.deepcopy(m))
        again = to_dict(parsed)
        assert again["uid"] == uid
        assert len(again["panels"]) == len(m["panels"])
        for a, b in zip(again["panels"], m["panels"]):
            assert a["type"] == b["type"] and a.get("title") == b.get("title") and a["gridPos"] == b["gridPos"]
            assert [t.get("expr") for t in a.get("targets") or []] == [t.get("expr") for t in b.get("targets") or []]
            assert [t.get("refId") for t in a.get("targets") or []] == [t.get("refId") for t in b.get("targets") or []]
        assert [v["name"] for v in again["templating"]["list"]] == [v["name"] for v in m["templating"]["list"]]


def test_job_dashboard_content(job):
    titles = {p["title"] for p in job["panels"]}
    for needed in ("Step time p50 / p95 per node", "Tokens/s", "Loss per node", "Last step per rank",
                   "Compute vs communication per rank", "GPU utilization", "SM clock", "GPU temperature", "GPU power",
                   "SM clock ÷ the model's highest (1 h)", "GPU utilization per rank", "XID errors", "Records shipped to the head", "Agent lag",
                   "Disk outbox", "Dropped records and failed exports", "About simulated GPU data"):
        assert needed in titles, needed
    variables = {v["name"]: v for v in job["templating"]["list"]}
    assert {"datasource", "run", "node", "rank", "host", "simulated"} <= set(variables)
    assert variables["datasource"]["type"] == "datasource"
    step = _panel(job, "Step time p50 / p95 per node")
    exprs = [t["expr"] for t in step["targets"]]
    assert exprs[0].startswith("histogram_quantile(0.5, ") and exprs[1].startswith("histogram_quantile(0.95, ")
    # the histogram is per node (bounded series): no rank label to select on
    assert all("ranksight_step_duration_seconds_bucket" in e and 'node=~"$node"' in e and "rank=" not in e for e in exprs)
    # GPU series put on ranks by the agent's join series, never by a copy of dcgm-exporter's gauges
    joined = _panel(job, "GPU utilization per rank")["targets"][0]["expr"]
    assert "DCGM_FI_DEV_GPU_UTIL" in joined and "on (UUID)" in joined and "ranksight_rank_gpu_info" in joined
    # Every GPU panel uses dcgm-exporter names, filters on $simulated and shows it in the legend.
    for p in job["panels"]:
        for t in p.get("targets") or []:
            if "DCGM_FI_" in t["expr"] and p["title"] != "GPUs reporting, by source":
                assert 'simulated=~"$simulated"' in t["expr"], (p["title"], t["expr"])
                assert "simulated={{simulated}}" in t["legendFormat"], p["title"]
    note = _panel(job, "About simulated GPU data")
    assert note["type"] == "text" and 'simulated="true"' in note["options"]["content"]
    assert {t["expr"].split("{")[0] for t in _panel(job, "GPU utilization")["targets"]} == {"DCGM_FI_DEV_GPU_UTIL"}


def _clean_dash():
    return {"uid": "u", "title": "t", "templating": {"list": [{"name": "datasource", "type": "datasource"},
                                                              {"name": "rank", "type": "query"}]},
            "panels": [{"type": "timeseries", "title": "a", "gridPos": {"x": 0, "y": 0, "w": 12, "h": 8},
                        "fieldConfig": {"defaults": {"unit": "s"}},
                        "targets": [{"refId": "A", "expr": 'up{rank=~"$rank"}[$__rate_interval]',
                                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}]}]}


@pytest.mark.parametrize("mutate, problem", [
    (lambda d: d["panels"][0]["targets"][0].update(refId=""), "empty refId"),
    (lambda d: d["panels"][0]["targets"].append(dict(d["panels"][0]["targets"][0])), "duplicate refId 'A'"),
    (lambda d: d["panels"][0]["targets"][0].pop("datasource"), "no datasource uid"),
    (lambda d: d["panels"][0]["targets"][0].update(datasource={"uid": "${nope}"}), "names no datasource variable"),
    (lambda d: d["panels"][0]["fieldConfig"]["defaults"].pop("unit"), "no unit"),
    (lambda d: d["panels"].append({**copy.deepcopy(d["panels"][0]), "title": "b",
                                   "gridPos": {"x": 6, "y": 4, "w": 12, "h": 8}}), "overlaps panel 0"),
    (lambda d: d["panels"][0].update(gridPos={"x": 20, "y": 0, "w": 12, "h": 8}), "outside the 24-column grid"),
    (lambda d: d["panels"][0].update(gridPos={"x": 0, "y": 0, "w": "12", "h": 8}), "integer x, y, w, h"),
    (lambda d: d["panels"][0]["targets"][0].update(expr='up{node=~"$node"}'), "$node is neither"),
    (lambda d: d["panels"][0]["targets"][0].update(expr=" "), "empty expr"),
    (lambda d: d["panels"][0].update(targets=[]), "no queries"),
    (lambda d: d["panels"].append({**copy.deepcopy(d["panels"][0]), "gridPos": {"x": 12, "y": 0, "w": 12, "h": 8}}),
     "used 2 times"),
])
def test_lint_catches(mutate, problem):
    d = _clean_dash()
    assert lint_dashboard(d) == []
    mutate(d)
    problems = lint_dashboard(d)
    assert any(problem in p for p in problems), problems


def test_macros_and_variables_are_replaced():
    q = promql_for_prometheus('rate(x{rank=~"$rank", run_id=~"${run}"}[$__rate_interval]) / $__range_s',
                              values={"run": "r1"})
    assert q == 'rate(x{rank=~".*", run_id=~"r1"}[10s]) / 60'
    assert variables_in('a{b="$x"}[$__interval] ${y:regex}') == {"x", "__interval", "y"}


def test_every_query_uses_only_known_variables(job):
    known = {v["name"] for v in job["templating"]["list"]} | {"__rate_interval", "__interval", "__range"}
    for title, ref, expr in panel_queries(job):
        assert variables_in(expr) <= known, (title, ref)


def test_write_all_and_cli_build(tmp_path):
    paths = write_all(tmp_path / "a")
    assert [p.name for p in paths] == ["ranksight-job.json"]
    assert load_dir(tmp_path / "a") == build_all()
    out = tmp_path / "cli"
    r = subprocess.run([sys.executable, "-m", "cli.main", "dashboards", "build", "--out", str(out)],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "ranksight-job.json").read_text()) == build_all()["ranksight-job"]


def test_committed_json_is_current():
    """dashboards/json is what `ranksight dashboards build` writes from the code (rebuild after a change)."""
    assert load_dir(JSON_DIR) == build_all()


def test_load_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="dashboards build"):
        load_dir(tmp_path / "missing")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_dir(tmp_path)
    (tmp_path / "x.json").write_text('{"title": "no uid"}')
    with pytest.raises(ValueError, match="no uid"):
        load_dir(tmp_path)


# --------------------------------------------------------------------------------------------
# push: grafana-client against a pytest-httpserver stub of Grafana's HTTP API
# --------------------------------------------------------------------------------------------

def _bearer_ok(req: Request) -> bool:
    return req.headers.get("Authorization") == f"Bearer {TOKEN}"


def test_push_creates_folder_and_overwrites_dashboards(httpserver, models):
    posted: list[dict] = []

    def folder_get(req: Request):
        assert _bearer_ok(req)
        return Response(json.dumps({"message": "folder not found"}), status=404, content_type="application/json")

    def folder_post(req: Request):
        assert _bearer_ok(req)
        body = req.get_json()
        assert body == {"title": "ML training", "uid": "ml-train"}
        return Response(json.dumps({"uid": "ml-train", "title": "ML training", "id": 7}), content_type="application/json")

    def dash_post(req: Request):
        assert _bearer_ok(req)
        body = req.get_json()
        posted.append(body)
        uid = body["dashboard"]["uid"]
        return Response(json.dumps({"status": "success", "uid": uid, "version": 3, "url": f"/d/{uid}/x", "id": 1}),
                        content_type="application/json")

    httpserver.expect_ordered_request("/api/folders/ml-train", method="GET").respond_with_handler(folder_get)
    httpserver.expect_ordered_request("/api/folders", method="POST").respond_with_handler(folder_post)
    httpserver.expect_ordered_request("/api/dashboards/db", method="POST").respond_with_handler(dash_post)
    with_id = {uid: {**m, "id": 99} for uid, m in models.items()}
    answers = push(httpserver.url_for("/"), TOKEN, with_id, folder_title="ML training", folder_uid="ml-train")
    httpserver.check_assertions()
    assert [a["uid"] for a in answers] == list(models)
    assert len(posted) == len(models) == 1
    body = posted[0]
    assert body["folderUid"] == "ml-train" and body["overwrite"] is True and body["message"]
    assert "id" not in body["dashboard"]
    assert body["dashboard"] == {k: v for k, v in models["ranksight-job"].items() if k != "id"}


def test_push_reuses_existing_folder_and_reports_refusal(httpserver, models):
    httpserver.expect_request("/api/folders/ranksight", method="GET").respond_with_json({"uid": "ranksight", "id": 1})
    httpserver.expect_request("/api/dashboards/db", method="POST").respond_with_json(
        {"message": "Access denied to save dashboard"}, status=403)
    with pytest.raises(ProvisionError, match="refused"):
        push(httpserver.url_for("/"), TOKEN, models)
    assert not any(r.path == "/api/folders" and r.method == "POST" for r, _ in httpserver.log)


def test_push_input_errors(models):
    with pytest.raises(ProvisionError, match="http"):
        push("grafana:3000", TOKEN, models)
    with pytest.raises(ProvisionError, match="token"):
        push("http://127.0.0.1:1", "", models)
    with pytest.raises(ProvisionError, match="no dashboards"):
        push("http://127.0.0.1:1", TOKEN, {})
    with pytest.raises(ProvisionError, match="cannot reach|refused"):
        push("http://127.0.0.1:1", TOKEN, models, timeout=2)


def test_cli_push(httpserver, tmp_path):
    write_all(tmp_path)
    httpserver.expect_request("/api/folders/ranksight", method="GET").respond_with_json({"uid": "ranksight"})
    httpserver.expect_request("/api/dashboards/db", method="POST",
                              headers={"Authorization": f"Bearer {TOKEN}"}).respond_with_json(
        {"status": "success", "uid": "ranksight-job", "version": 1, "url": "/d/ranksight-job/x"})
    r = subprocess.run([sys.executable, "-m", "cli.main", "dashboards", "push", "--url", httpserver.url_for("/"),
                        "--token", TOKEN, "--dir", str(tmp_path)], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "success: ranksight-job version 1" in r.stdout
    from typer.testing import CliRunner

    from cli.main import main

    r = CliRunner().invoke(main, ["dashboards", "push", "--url", httpserver.url_for("/"), "--token", TOKEN,
                                  "--dir", str(tmp_path / "empty")])
    assert r.exit_code == 2 and "dashboards build" in r.output
    r = CliRunner().invoke(main, ["dashboards", "push", "--url", "grafana:3000", "--token", TOKEN, "--dir", str(tmp_path)])
    assert r.exit_code == 2 and "must start with http" in r.output


def test_cli_lint(tmp_path):
    from typer.testing import CliRunner

    from cli.main import main

    write_all(tmp_path)
    r = CliRunner().invoke(main, ["dashboards", "lint", "--dir", str(tmp_path)])
    assert r.exit_code == 0 and "ok: 1 dashboard(s)" in r.output, r.output
    m = json.loads((tmp_path / "ranksight-job.json").read_text())
    m["panels"][1]["targets"][1]["refId"] = "A"
    (tmp_path / "ranksight-job.json").write_text(json.dumps(m))
    r = CliRunner().invoke(main, ["dashboards", "lint", "--dir", str(tmp_path)])
    assert r.exit_code == 2 and "duplicate refId 'A'" in r.output and "1 problem(s)" in r.output
