"""examples/otel-collector/config.yaml (docs/otel-collector.md): it parses, names the components the docs promise
and nothing that would rewrite ranksight's records; and, where a Collector binary is at hand, its exporter block
carries ranksight records to a real head over TLS with the bearer token, in protobuf and in JSON.

The Collector is found through RANKSIGHT_OTELCOL, then ``otelcol-contrib`` / ``otelcol`` on PATH; without one the
live test is skipped (none of the project's machines has one; the docs say what was run).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from agent_helpers import serving
from head.service import Head
from ranksight import schema, wire
from ranksight.tables import read_table
from ranksight.tls import ServerTls

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "otel-collector" / "config.yaml"
DOC = ROOT / "docs" / "otel-collector.md"
EXPORTER = "otlphttp/ranksight"
# Processors that may sit in the pipelines: neither touches a log record's attributes or body.
HARMLESS = {"memory_limiter", "batch"}


def load() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def test_the_example_parses_and_names_the_components_and_the_head():
    cfg = load()
    http = cfg["receivers"]["otlp"]["protocols"]["http"]
    assert http["endpoint"].startswith("127.0.0.1:")  # defaults bind loopback
    assert "batch" in cfg["processors"]
    exp = cfg["exporters"][EXPORTER]
    assert exp["endpoint"].startswith("https://") and not exp["endpoint"].rstrip("/").endswith(("/v1/logs", "/logs"))
    assert exp["encoding"] == "proto" and exp["compression"] in ("zstd", "gzip", "deflate")
    assert exp["headers"]["Authorization"] == "Bearer ${env:RANKSIGHT_TOKEN}"  # the token from the environment
    assert exp["tls"]["ca_file"] and not exp["tls"].get("insecure") and not exp["tls"].get("insecure_skip_verify")
    assert exp["retry_on_failure"]["enabled"] and exp["sending_queue"]["enabled"]
    pipes = cfg["service"]["pipelines"]
    assert set(pipes) == {"logs", "metrics"}
    for name, p in pipes.items():
        assert p["receivers"] == ["otlp"] and p["exporters"] == [EXPORTER], name
        assert "batch" in p["processors"] and set(p["processors"]) <= HARMLESS, name
        assert set(p["processors"]) <= set(cfg["processors"])
    # the bounds the example's batches must respect, as the head has them
    from head import receiver as rx

    assert rx.MAX_BODY_BYTES == 32 * 1024 * 1024 and rx.MAX_JSON_BYTES == 32 * 1024 * 1024
    assert cfg["processors"]["batch"]["send_batch_max_size"] <= 4096


def test_the_docs_name_what_the_example_uses_and_say_what_was_run():
    text = DOC.read_text()
    for word in ("otelcol-contrib", "otlp", "batch", "otlphttp", "encoding: json", "Authorization", "ca_file",
                 "ranksight.run_id", "ranksight.kind", "groupbyattrs", "transform", "partial success"):
        assert word in text, word
    assert "was not run" in text  # plainly: the full example has not met a real otlp receiver here
    assert "examples/otel-collector/config.yaml" in (ROOT / "README.md").read_text()


# -- a real Collector, where one is installed -------------------------------------------------------------------

def collector_binary() -> str | None:
    for c in (os.environ.get("RANKSIGHT_OTELCOL"), shutil.which("otelcol-contrib"), shutil.which("otelcol")):
        if c and os.access(c, os.X_OK):
            return c
    return None


def components(binary: str) -> dict:
    out = subprocess.run([binary, "components"], capture_output=True, text=True, timeout=60).stdout
    doc = yaml.safe_load(out) or {}
    return {kind: {c["name"] for c in doc.get(kind) or []} for kind in ("receivers", "processors", "exporters")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tls_head(tmp_path):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(tmp_path / "server.pem")
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    h = Head(tmp_path / "store", "collector-token", analyzer=None, flush_interval=0.2)
    tls = ServerTls.from_options(tmp_path / "server.pem", tmp_path / "server.pem").context()
    h.ca = tmp_path / "ca.pem"
    with serving(h, poll=0.1, background=True, tls=tls):
        yield h


def step_batches(run_id: str, ranks: int, n: int) -> list[bytes]:
    return [wire.join_array([schema.encode(schema.StepRecord(
        run_id=run_id, rank=r, step=s, node=0, host="h", world_size=ranks, t_start=float(s), t_end=s + 0.1,
        step_ms=100.0)) for s in range(n)]) for r in range(ranks)]


def collector_config(head, encoding: str, have: dict, tmp: Path, run_id: str) -> tuple[dict, int | None]:
    """The example with its exporter pointed at the test's head. With an ``otlp`` receiver the example's own pipeline
    runs (agents' exporter in); a Collector build without one (the one this was run with) gets a ``filelog``
    receiver feeding the same exporter: each line a ranksight JSON batch, the two attributes the head needs added."""
    cfg = load()
    exp = cfg["exporters"][EXPORTER]
    exp["endpoint"], exp["encoding"], exp["tls"] = head.url, encoding, {"ca_file": str(head.ca)}
    exp["sending_queue"].pop("storage", None)
    cfg["service"]["telemetry"] = {"metrics": {"level": "none"}}  # no :8888 listener beside other tests
    cfg["processors"]["batch"]["timeout"] = "200ms"
    if "otlp" in have["receivers"]:
        port = free_port()
        cfg["receivers"]["otlp"]["protocols"]["http"]["endpoint"] = f"127.0.0.1:{port}"
        return cfg, port
    (tmp / "batches.log").write_bytes(b"\n".join(step_batches(run_id, 2, 20)) + b"\n")
    cfg["receivers"] = {"filelog": {"include": [str(tmp / "batches.log")], "start_at": "beginning",
                                    "include_file_name": False, "operators": [
                                        {"type": "add", "field": f'attributes["{wire.A_RUN}"]', "value": run_id},
                                        {"type": "add", "field": f'attributes["{wire.A_KIND}"]', "value": "step"}]}}
    procs = [p for p in cfg["service"]["pipelines"]["logs"]["processors"] if p in have["processors"]]
    cfg["service"]["pipelines"] = {"logs": {"receivers": ["filelog"], "processors": procs,
                                            "exporters": [EXPORTER]}}
    return cfg, None


def send_through_agent_exporter(port: int, run_id: str) -> None:
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
    from opentelemetry.sdk.resources import Resource

    exp = OTLPLogExporter(endpoint=f"http://127.0.0.1:{port}/v1/logs", timeout=10)
    res = Resource.create({wire.R_NODE: 0})
    recs = [wire.make_log_record(run_id, "step", body, rank=r, node=0, count=20, resource=res)
            for r, body in enumerate(step_batches(run_id, 2, 20))]
    deadline = time.time() + 30
    while exp.export(recs).name != "SUCCESS":  # the receiver may not listen yet
        assert time.time() < deadline, "the Collector's otlp receiver never accepted the batch"
        time.sleep(0.5)


@pytest.mark.parametrize("encoding", ["proto", "json"])
def test_a_real_collector_carries_records_to_the_head(tls_head, tmp_path, encoding, monkeypatch):
    from head import receiver

    seen: list[str] = []  # the Content-Encoding of each body the head decompressed
    orig = receiver.decompress

    def recording(body, enc, *a, **k):
        seen.append((enc or "identity").strip().lower())
        return orig(body, enc, *a, **k)

    monkeypatch.setattr(receiver, "decompress", recording)
    binary = collector_binary()
    if binary is None:
        pytest.skip("no OpenTelemetry Collector binary (RANKSIGHT_OTELCOL, otelcol-contrib or otelcol on PATH)")
    have = components(binary)
    if EXPORTER.split("/")[0] not in have["exporters"] or not {"otlp", "filelog"} & have["receivers"]:
        pytest.skip(f"this Collector build lacks the otlphttp exporter or a usable receiver: {have}")
    run_id = f"col-{encoding}"
    cfg, port = collector_config(tls_head, encoding, have, tmp_path, run_id)
    (tmp_path / "collector.yaml").write_text(yaml.safe_dump(cfg))
    log_path = tmp_path / "collector.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([binary, "--config", str(tmp_path / "collector.yaml")], stdout=log_file,
                                stderr=subprocess.STDOUT, env={**os.environ, "RANKSIGHT_TOKEN": "collector-token"})
        try:
            if port is not None:
                send_through_agent_exporter(port, run_id)
            deadline, n = time.time() + 60, 0
            while time.time() < deadline and n < 40:
                time.sleep(0.5)
                tls_head.store.flush_all()
                if (tls_head.store.root / run_id).is_dir():
                    n = len(read_table(tls_head.store.root, run_id, "steps"))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert n == 40, log_path.read_text()[-3000:]
    assert tls_head.stats["http_4xx"] == 0 and tls_head.stats["rejected"] == 0
    assert seen and set(seen) == {load()["exporters"][EXPORTER]["compression"]}, seen  # the example's, on the wire
    rows = read_table(tls_head.store.root, run_id, "steps")
    assert sorted(set(rows["rank"])) == [0, 1] and sorted(rows["step"].unique().tolist()) == list(range(20))
