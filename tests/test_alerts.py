"""Alert rules and Alertmanager config, offline: promtool check/test rules, amtool check-config and routing."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dashboards.cli import (ALERTMANAGER_EXAMPLE, RULES_FILE, RULES_TEST_FILE, RUNBOOK_DEFAULT_BASE, RUNBOOKS_FILE,
                            render_rules)

REPO = Path(__file__).resolve().parent.parent
ALERTS = ("RanksightStragglingRank", "RanksightRankStalled", "RanksightGpuXid", "RanksightGpuClockThrottled",
          "RanksightAgentDown", "RanksightAgentDroppingRecords", "RanksightAgentLagHigh")

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (make debs)")
needs_amtool = pytest.mark.skipif(shutil.which("amtool") is None, reason="needs amtool (make debs)")


def _run(args, cwd=None):
    return subprocess.run(args, capture_output=True, text=True, cwd=cwd, timeout=60)


@needs_promtool
def test_promtool_check_rules():
    r = _run(["promtool", "check", "rules", str(RULES_FILE)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in r.stdout


@needs_promtool
def test_promtool_rule_unit_tests():
    r = _run(["promtool", "test", "rules", RULES_TEST_FILE.name], cwd=RULES_FILE.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_alert_has_a_unit_test_and_runbook_annotations():
    rules = RULES_FILE.read_text()
    tests = RULES_TEST_FILE.read_text()
    names = re.findall(r"^\s+- alert: (\w+)$", rules, flags=re.M)
    assert sorted(names) == sorted(ALERTS)
    for name in ALERTS:
        assert re.search(rf"alertname: {name}\n\s+exp_alerts:\n\s+- exp_labels", tests), f"no firing test for {name}"
        block = rules.split(f"- alert: {name}\n", 1)[1].split("- alert:", 1)[0]
        for key in ("summary:", "description: |-", "runbook_url:", "severity:"):
            assert key in block, (name, key)
        assert f"#{name.lower()}'" in block, name
    docs = RUNBOOKS_FILE.read_text()
    for name in ALERTS:
        assert f"\n## {name}\n" in docs, f"docs/runbooks.md has no runbook section for {name}"
        section = docs.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
        for part in ("*What it means.*", "*Confirm with `ranksight diagnose`.*", "*What to do.*", "ranksight diagnose <run>"):
            assert part in section, (name, part)


def _anchors(markdown: str) -> set[str]:
    """GitHub-style heading anchors: lower case, punctuation dropped, spaces to dashes."""
    heads = re.findall(r"^#{1,6} (.+)$", markdown, flags=re.M)
    return {re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_default_runbook_urls_resolve_to_the_runbooks_in_the_repository():
    """Without --runbook-base every runbook_url is docs/runbooks.md#<anchor>: the file exists, the anchor too."""
    urls = re.findall(r"runbook_url: '([^']*)'", render_rules(None))
    assert len(urls) == len(ALERTS)
    anchors = _anchors(RUNBOOKS_FILE.read_text())
    for url in urls:
        path, _, anchor = url.partition("#")
        assert path == RUNBOOK_DEFAULT_BASE and (REPO / path).resolve() == RUNBOOKS_FILE
        assert anchor in anchors, url
    # the promtool unit tests expect the same links
    assert set(re.findall(r"runbook_url: '([^']*)'", RULES_TEST_FILE.read_text())) <= set(urls)
    assert "ranksight.invalid" not in RULES_FILE.read_text()


@needs_promtool
def test_rule_unit_tests_fail_on_a_wrong_expectation(tmp_path):
    """The promtool tests are not vacuous: a changed expected value or a weakened rule fails them."""
    shutil.copy(RULES_FILE, tmp_path / RULES_FILE.name)
    (tmp_path / RULES_TEST_FILE.name).write_text(
        RULES_TEST_FILE.read_text().replace("compute 1.30x the job median", "compute 1.31x the job median"))
    r = _run(["promtool", "test", "rules", RULES_TEST_FILE.name], cwd=tmp_path)
    assert r.returncode != 0 and "RanksightStragglingRank" in r.stdout + r.stderr
    # A rule that forgot the "changed to non-zero" guard would alert on an agent restart (XID gauge back to 0).
    shutil.copy(RULES_TEST_FILE, tmp_path / RULES_TEST_FILE.name)
    (tmp_path / RULES_FILE.name).write_text(
        RULES_FILE.read_text().replace(" and DCGM_FI_DEV_XID_ERRORS > 0)", ")"))
    r = _run(["promtool", "test", "rules", RULES_TEST_FILE.name], cwd=tmp_path)
    assert r.returncode != 0 and 'gpu="2"' in r.stdout + r.stderr
    # Without "unless ... ranksight_run_finished == 1" a finished run's agents would page: the stall and
    # straggler tests of the finished runs ("done", "r3") fail.
    (tmp_path / RULES_FILE.name).write_text(
        RULES_FILE.read_text().replace("unless on (run_id) (ranksight_run_finished == 1)", ""))
    r = _run(["promtool", "test", "rules", RULES_TEST_FILE.name], cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and 'run_id="done"' in out and 'run_id="r3"' in out


@needs_promtool
def test_rules_cli_writes_with_runbook_base_and_checks(tmp_path):
    r = _run([sys.executable, "-m", "cli.main", "dashboards", "rules", "--out", str(tmp_path),
              "--runbook-base", "https://wiki.example.com/ranksight/alerts"], cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    text = (tmp_path / "ranksight.rules.yml").read_text()
    assert f"runbook_url: '{RUNBOOK_DEFAULT_BASE}#" not in text
    assert "runbook_url: 'https://wiki.example.com/ranksight/alerts#ranksightgpuxid'" in text
    assert len(re.findall(r"runbook_url: 'https://wiki\.example\.com/ranksight/alerts#\w+'", text)) == len(ALERTS)
    assert "docs/runbooks.md" in text  # the header comment still says where the runbooks live
    assert "SUCCESS" in r.stdout
    with pytest.raises(ValueError, match="http"):
        render_rules("wiki/alerts")
    r = _run([sys.executable, "-m", "cli.main", "dashboards", "rules", "--runbook-base", "ftp://x"], cwd=REPO)
    assert r.returncode == 2 and "http(s) URL" in r.stderr


@needs_amtool
def test_amtool_check_config():
    r = _run(["amtool", "check-config", str(ALERTMANAGER_EXAMPLE)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout and "3 receivers" in r.stdout


@needs_amtool
@pytest.mark.parametrize("labels, receiver", [
    (["severity=critical", "alertname=RanksightGpuXid"], "ranksight-critical"),
    (["severity=critical", "alertname=RanksightRankStalled", "run_id=r1"], "ranksight-critical"),
    (["severity=warning", "alertname=RanksightStragglingRank"], "ranksight-warning"),
    (["severity=info", "alertname=Something"], "ranksight-default"),
    (["alertname=NoSeverity"], "ranksight-default"),
])
def test_alertmanager_routes_by_severity(labels, receiver):
    r = _run(["amtool", "config", "routes", "test", f"--config.file={ALERTMANAGER_EXAMPLE}", *labels])
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == receiver


def test_rule_severities_route_somewhere_specific():
    rules = RULES_FILE.read_text()
    sev = dict(re.findall(r"- alert: (\w+)\n(?:.*\n)*?\s+severity: (\w+)", rules))
    assert sev == {"RanksightStragglingRank": "warning", "RanksightRankStalled": "critical",
                   "RanksightGpuXid": "critical", "RanksightGpuClockThrottled": "warning",
                   "RanksightAgentDown": "warning",
                   "RanksightAgentDroppingRecords": "warning", "RanksightAgentLagHigh": "warning"}


def test_agent_exports_run_finished_from_the_manifest(tmp_path):
    """ranksight_run_finished{run_id}: 0 while the manifest has no `finished`, 1 once it has (what the rules use)."""
    import time

    from prometheus_client import generate_latest

    from node.agent import NodeAgent
    from ranksight import schema
    from ranksight.layout import RunDir
    from cli.local_cluster import free_port

    rd = RunDir(tmp_path / "store", "r-fin")
    rd.manifest.parent.mkdir(parents=True, exist_ok=True)

    def finished_value(agent) -> str:
        agent.spool.discover(force=True)
        lines = [ln for ln in generate_latest(agent.metrics.registry).decode().splitlines()
                 if ln.startswith("ranksight_run_finished{")]
        assert len(lines) == 1 and 'run_id="r-fin"' in lines[0], lines
        return lines[0].rsplit(" ", 1)[1]

    a = NodeAgent(rd, 0, f"http://127.0.0.1:{free_port()}", "t", sim_gpu="off", otlp_metrics=False)
    assert finished_value(a) == "0.0"  # no manifest yet
    m = schema.Manifest(run_id="r-fin", created=time.time(), start_time=time.time())
    rd.manifest.write_bytes(schema.encode(m))
    assert finished_value(a) == "0.0"
    m.finished = time.time()
    rd.manifest.write_bytes(schema.encode(m))
    assert finished_value(a) == "1.0"


# The fields dcgm-exporter collects out of the box: the uncommented lines of etc/default-counters.csv in
# github.com/NVIDIA/dcgm-exporter (read at commit d5e5f510a1b6, May 2026). Copied as names only. Not in it:
# DCGM_FI_DEV_CLOCK_THROTTLE_REASONS / DCGM_FI_DEV_CLOCKS_EVENT_REASONS, DCGM_FI_DEV_MAX_SM_CLOCK, the ECC
# counters, the *_VIOLATION counters, DCGM_EXP_XID_ERRORS_COUNT.
DCGM_EXPORTER_DEFAULT_FIELDS = frozenset("""
DCGM_FI_DEV_SM_CLOCK DCGM_FI_DEV_MEM_CLOCK DCGM_FI_DEV_MEMORY_TEMP DCGM_FI_DEV_GPU_TEMP DCGM_FI_DEV_POWER_USAGE
DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION DCGM_FI_DEV_PCIE_REPLAY_COUNTER DCGM_FI_DEV_GPU_UTIL DCGM_FI_DEV_MEM_COPY_UTIL
DCGM_FI_DEV_ENC_UTIL DCGM_FI_DEV_DEC_UTIL DCGM_FI_DEV_XID_ERRORS DCGM_FI_DEV_FB_FREE DCGM_FI_DEV_FB_USED
DCGM_FI_DEV_FB_RESERVED DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL DCGM_FI_DEV_VGPU_LICENSE_STATUS
DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS DCGM_FI_DEV_ROW_REMAP_FAILURE
DCGM_FI_DRIVER_VERSION DCGM_FI_PROF_GR_ENGINE_ACTIVE DCGM_FI_PROF_PIPE_TENSOR_ACTIVE DCGM_FI_PROF_DRAM_ACTIVE
DCGM_FI_PROF_PCIE_TX_BYTES DCGM_FI_PROF_PCIE_RX_BYTES
""".split())


def test_rules_and_dashboards_use_only_dcgm_exporter_default_fields():
    """A stock dcgm-exporter must feed every GPU rule and panel: a rule on an opt-in field never fires."""
    from dashboards.build import build_all
    from dashboards.lint import panel_queries

    rule_lines = [ln for ln in RULES_FILE.read_text().splitlines() if not ln.lstrip().startswith("#")]  # not comments
    used = {"rules": set(re.findall(r"DCGM_(?:FI|EXP)_\w+", "\n".join(rule_lines)))}
    used["dashboards"] = {f for model in build_all().values() for _, _, expr in panel_queries(model)
                          for f in re.findall(r"DCGM_(?:FI|EXP)_\w+", expr)}
    for where, fields in used.items():
        assert fields and fields <= DCGM_EXPORTER_DEFAULT_FIELDS, (where, sorted(fields - DCGM_EXPORTER_DEFAULT_FIELDS))
    assert "DCGM_FI_DEV_SM_CLOCK" in used["rules"]  # the throttle rule rests on a default field
