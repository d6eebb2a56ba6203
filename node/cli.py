"""``ranksight agent``: run the node agent for one node of one run."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import typer

agent_command = typer.Typer(add_completion=False, help="Run the node agent: tail spools, sample GPUs/host, ship OTLP, serve /metrics.")


@agent_command.command()
def agent(
    head: str = typer.Option(..., "--head", help="Head service base URL, e.g. http://127.0.0.1:4318"),
    node: int = typer.Option(..., "--node", help="This node's index (ranks whose placement says node == N are tailed)."),
    run_id: str = typer.Option("", "--run-id", help="Run id (with --store), or taken from --run-dir's name."),
    store: Path = typer.Option(Path("./runs"), "--store", help="Store/run root: the run directory is <store>/<run-id>."),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="The run directory itself (instead of --store + --run-id)."),
    token: str = typer.Option("", "--token", envvar="RANKSIGHT_TOKEN", help="Shared token (Bearer) for the head and /control."),
    gpu_interval: float = typer.Option(1.0, "--gpu-interval", help="Seconds between GPU/host samples."),
    ship_interval: float = typer.Option(1.0, "--ship-interval", help="Seconds between shipments to the head."),
    metrics_port: int | None = typer.Option(None, "--metrics-port", help="Port for Prometheus /metrics and POST /control (0 = any free port)."),
    bind: str = typer.Option("127.0.0.1", "--bind", help="Address for /metrics and /control."),
    advertise_url: str | None = typer.Option(None, "--advertise-url", help="URL the head uses to reach /control, "
                                             "e.g. https://node3.example:9401 (a name --tls-cert holds, or a proxy in "
                                             "front of the agent); default: from --bind (this machine's name for a "
                                             "wildcard bind) and --metrics-port."),
    tls_cert: Path | None = typer.Option(None, "--tls-cert", help="Serve /metrics and /control over HTTPS with this "
                                         "PEM certificate (chain)."),
    tls_key: Path | None = typer.Option(None, "--tls-key", help="The private key of --tls-cert (PEM)."),
    tls_client_ca: Path | None = typer.Option(None, "--tls-client-ca", help="Mutual TLS on /metrics and /control: "
                                              "require a client certificate issued by this CA (the head's, "
                                              "Prometheus')."),
    tls_ca: Path | None = typer.Option(None, "--tls-ca", envvar="RANKSIGHT_TLS_CA", help="CA (PEM) to verify an "
                                       "https --head against (default: the system's CAs)."),
    tls_client_cert: Path | None = typer.Option(None, "--tls-client-cert", envvar="RANKSIGHT_TLS_CLIENT_CERT",
                                                help="Mutual TLS: this agent's certificate for the head."),
    tls_client_key: Path | None = typer.Option(None, "--tls-client-key", envvar="RANKSIGHT_TLS_CLIENT_KEY",
                                               help="The private key of --tls-client-cert."),
    sim_gpu: str = typer.Option("auto", "--sim-gpu", help="auto: real GPUs if present, else the simulated ones; on: always simulated; off: real only."),
    dcgm_url: str | None = typer.Option(None, "--dcgm-url", help="Read GPU data from a dcgm-exporter /metrics URL instead of NVML."),
    host: str | None = typer.Option(None, "--host", help="Host name to report (default: this machine's)."),
    outbox_mb: int = typer.Option(256, "--outbox-mb", help="Disk buffer while the head is unreachable; oldest dropped (and counted) beyond it."),
    priority: str = typer.Option("", "--priority", envvar="RANKSIGHT_AGENT_PRIORITY", show_default=False,
                                 help="CPU/IO priority: low (the default: nice 19, gives way to the ranks and keeps up) | "
                                      "idle (SCHED_IDLE: only cores nothing else wants; lags on a busy node) | normal."),
    drain_timeout: float = typer.Option(15.0, "--drain-timeout", help="At stop: seconds to keep trying to deliver "
                                        "what the head has not acknowledged; the rest stays in the outbox and is "
                                        "named in <run>/agent/node-<N>.exit.json."),
    drain: bool = typer.Option(False, "--drain", help="Only deliver a stopped agent's leftover outbox (retrying for "
                                                      "--drain-timeout seconds), then exit: 0 when all of it was delivered."),
    as_json: bool = typer.Option(False, "--json", help="With --drain: print its report as one JSON object "
                                                       "(docs/cli.md); the log stays on stderr."),
    collectives: str = typer.Option("auto", "--collectives", help="per-op: ship every collective record; "
                                    "per-step: a rank's ops of one step, kind and communicator as one record (their "
                                    "means and total; every op stays in the spool on this node); auto: per-step in "
                                    "jobs of more than 256 ranks."),
    log_level: str = typer.Option("INFO", "--log-level"),
) -> None:
    """Run until SIGINT/SIGTERM; on exit, ship (or spool to disk) what was read, and report what could not be."""
    from node.agent import NodeAgent
    from ranksight.priority import AGENT_DEFAULT_PRIORITY, PRIORITIES, set_priority
    from ranksight.layout import RunDir
    from ranksight.tls import ClientTls, ServerTls, TlsConfigError, is_loopback

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if sim_gpu not in ("auto", "on", "off"):
        raise typer.BadParameter("--sim-gpu must be auto, on or off")
    priority = priority or AGENT_DEFAULT_PRIORITY
    if priority not in PRIORITIES:
        raise typer.BadParameter(f"--priority must be one of {', '.join(PRIORITIES)}")
    if collectives not in ("auto", "per-op", "per-step"):
        raise typer.BadParameter("--collectives must be auto, per-op or per-step")
    if as_json and not drain:
        raise typer.BadParameter("--json goes with --drain (a running agent reports on /metrics and its log)")
    if not token:
        raise typer.BadParameter("a token is required: --token or RANKSIGHT_TOKEN (the head prints one)")
    try:
        server_tls = ServerTls.from_options(tls_cert, tls_key, tls_client_ca)
        tls_server = server_tls.context() if server_tls else None
        tls_client = ClientTls.from_options(tls_ca, tls_client_cert, tls_client_key)
        tls_client.context()  # a client certificate that does not load is said now, not at the first export
    except TlsConfigError as e:
        raise typer.BadParameter(str(e)) from None
    import urllib.parse

    head_host = urllib.parse.urlsplit(head if "://" in head else "http://" + head).hostname or ""
    if not head.startswith("https://") and not is_loopback(head_host):
        print(f"ranksight agent: WARNING: shipping to {head} without TLS: the token travels in cleartext "
              f"(an https head URL and --tls-ca fix that)", file=sys.stderr, flush=True)
    if advertise_url and not advertise_url.startswith(("http://", "https://")):
        raise typer.BadParameter("--advertise-url must start with http:// or https://")
    if metrics_port is not None and tls_server is None and not is_loopback(bind):
        print(f"ranksight agent: WARNING: /control on {bind} without TLS: the head's token reaches it in cleartext "
              f"(--tls-cert/--tls-key fix that)", file=sys.stderr, flush=True)
    if run_dir is not None:
        rd = RunDir(run_dir.parent, run_id or run_dir.name)
        if rd.root.resolve() != run_dir.resolve():
            raise typer.BadParameter("--run-dir's name must be the run id (or omit --run-id)")
    elif run_id:
        rd = RunDir(store, run_id)
    else:
        raise typer.BadParameter("give --run-dir, or --store and --run-id")
    if drain:
        a = NodeAgent(rd, node, head, token, host=host, outbox_bytes=outbox_mb * 1024 * 1024, otlp_metrics=False,
                      tls_client=tls_client)
        before = a.outbox.records()
        report = a.drain(drain_timeout)
        a.shipper.close()
        if as_json:
            import msgspec

            left = report.undelivered_records
            doc = {"error": f"{left} record(s) not delivered" if left else None, "run_id": rd.run_id,
                   "records_before": before,
                   "delivered_records": before - report.undelivered_records, **msgspec.to_builtins(report)}
            print(json.dumps(doc), flush=True)
            raise typer.Exit(0 if report.undelivered_records == 0 else 1)
        print(f"ranksight agent --drain: node {node} run {rd.run_id}: delivered {before - report.undelivered_records} "
              f"of {before} record(s); {report.undelivered_records} left in {report.outbox}", flush=True)
        raise typer.Exit(0 if report.undelivered_records == 0 else 1)
    # Before any thread starts: Linux scheduling policy is per thread, and threads inherit it.
    set_priority(priority, who="ranksight agent")
    a = NodeAgent(rd, node, head, token, gpu_interval=gpu_interval, ship_interval=ship_interval,
                  metrics_port=metrics_port, bind=bind, sim_gpu=sim_gpu, dcgm_url=dcgm_url, host=host,
                  outbox_bytes=outbox_mb * 1024 * 1024, drain_timeout_s=drain_timeout, tls_client=tls_client,
                  tls_server=tls_server, advertise_url=advertise_url, collectives=collectives)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"ranksight agent: node {node} run {rd.run_id} pid {os.getpid()} priority {priority}", flush=True)
    a.run(stop)
    print("ranksight agent: stopped", flush=True)
