"""The node agent's per-cycle shortcuts keep its behaviour: the state file, the OTel resource, the exporter's
environment settings, the outbox listing and the Prometheus series."""

import node.state as state_mod
from ranksight import wire
from node.agent import NodeAgent
from node.otlp_session import env_once_session
from node.state import load_state
from node.outbox import Item
from agent_helpers import TOKEN
from ranksight import schema
from ranksight.layout import RunDir
from test_agent_node import write_steps


def test_state_is_written_when_it_changes_only(tmp_path, monkeypatch):
    rd = RunDir(tmp_path, "r1")
    writes = []
    real = state_mod.atomic_write
    monkeypatch.setattr(state_mod, "atomic_write", lambda p, d, durable=True: (writes.append(durable), real(p, d, durable)))
    a = NodeAgent(rd, 0, "http://127.0.0.1:9", TOKEN, otlp_metrics=False)
    a.state_file.save()
    a.state_file.save()
    assert writes == [False]  # once, and without an fsync (see StateFile.save)
    write_steps(rd, 0, 0, range(3))
    a.spool.collect()
    assert a.spool.commit(acknowledged=True)
    a.state_file.save()
    assert len(writes) == 2 and load_state(rd.agent_state(0), 0).positions[0].offset > 0


def test_resource_is_built_once_per_attribute_set(tmp_path):
    a = NodeAgent(RunDir(tmp_path, "r1"), 0, "http://127.0.0.1:9", TOKEN, otlp_metrics=False)
    r1 = a.shipper.resource()
    assert a.shipper.resource() is r1
    a.shipper.agent_url = "http://127.0.0.1:9401"  # the metrics URL became known: the resource says so
    r2 = a.shipper.resource()
    assert r2 is not r1 and r2.attributes[wire.R_AGENT_URL] == "http://127.0.0.1:9401"
    assert a.shipper.resource() is r2


def test_exporter_session_reads_the_environment_once_per_url(monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.example:3128")
    monkeypatch.setenv("NO_PROXY", "localhost")
    s = env_once_session()
    got = s.merge_environment_settings("http://head:4318/v1/logs", {}, None, None, None)
    assert got["proxies"].get("http") == "http://proxy.example:3128"
    got["proxies"]["http"] = "changed by a caller"
    again = s.merge_environment_settings("http://head:4318/v1/logs", {}, None, None, None)
    assert again["proxies"].get("http") == "http://proxy.example:3128" and len(s._env_cache) == 1
    assert s.merge_environment_settings("http://localhost:4318/v1/logs", {}, None, None, None)["proxies"].get("http") is None


def test_outbox_listing_follows_its_own_changes(tmp_path):
    a = NodeAgent(RunDir(tmp_path, "r1"), 0, "http://127.0.0.1:9", TOKEN, otlp_metrics=False)
    ob = a.outbox
    assert len(ob) == 0 and ob.records() == 0
    p1 = ob.append([Item(kind="step", body=b"[]", count=3)])
    ob.append([Item(kind="step", body=b"[]", count=4)])
    assert len(ob) == 2 and ob.records() == 7 and ob.oldest() == p1
    ob.remove(p1)
    assert len(ob) == 1 and ob.records() == 4


def test_prometheus_series_are_created_on_first_use(tmp_path):
    from prometheus_client.exposition import generate_latest

    a = NodeAgent(RunDir(tmp_path, "r1"), 0, "http://127.0.0.1:9", TOKEN, otlp_metrics=False)
    rec = schema.StepRecord(run_id="r1", rank=1, step=3, node=0, host="h", world_size=2, t_start=1.0, t_end=1.2,
                            step_ms=200.0, tokens=10, loss=2.0)
    a.metrics.observe_steps([rec])
    a.metrics.observe_steps([schema.StepRecord(run_id="r1", rank=1, step=4, node=0, host="h", world_size=2, t_start=1.2,
                                               t_end=1.4, step_ms=200.0, tokens=10, loss=1.5, overflow=True)])
    text = generate_latest(a.metrics.registry).decode()
    lab, node_lab = 'node="0",rank="1",run_id="r1"', 'node="0",run_id="r1"'
    assert f"ranksight_steps_total{{{node_lab}}} 2.0" in text and f"ranksight_tokens_total{{{node_lab}}} 20.0" in text
    assert f"ranksight_loss{{{node_lab}}} 1.5" in text and f"ranksight_last_step{{{lab}}} 4.0" in text
    assert f"ranksight_overflow_steps_total{{{node_lab}}} 1.0" in text
    assert "ranksight_loss_scale{" not in text and "ranksight_grad_norm{" not in text  # never reported: no series
