"""``ranksight head``: run the head service (OTLP receiver, run store, analyzers loop, HTTP API)."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
import threading
from pathlib import Path

import typer

head_command = typer.Typer(add_completion=False, help="Run the head service: OTLP receiver, run store, live analysis, HTTP API.")


@head_command.command()
def head(
    store: Path = typer.Option(Path("./runs"), "--store", help="Run store directory (Parquet per run-id)."),
    port: int = typer.Option(4318, "--port", help="Port for OTLP/HTTP (/v1/logs, /v1/metrics) and the JSON API (/api/...)."),
    token: str = typer.Option("", "--token", envvar="RANKSIGHT_TOKEN",
                              help="Shared token agents and API clients must send (Bearer). Generated if absent and "
                                   "written to <store>/.head-token (mode 0600), never printed."),
    public_read: bool = typer.Option(False, "--public-read", help="Serve the GET API but the drill-down (/ops) without the token (only behind a "
                                                                   "proxy that authenticates)."),
    bind: str = typer.Option("127.0.0.1", "--bind", help="Address to listen on. Anything but loopback exposes the API, "
                                                           "and needs TLS (--tls-cert/--tls-key) or --insecure-bind."),
    tls_cert: Path | None = typer.Option(None, "--tls-cert", help="Serve HTTPS with this PEM certificate (chain)."),
    tls_key: Path | None = typer.Option(None, "--tls-key", help="The private key of --tls-cert (PEM)."),
    tls_client_ca: Path | None = typer.Option(None, "--tls-client-ca", help="Mutual TLS: require a client "
                                              "certificate issued by this CA (PEM) from agents and API clients."),
    tls_ca: Path | None = typer.Option(None, "--tls-ca", envvar="RANKSIGHT_TLS_CA", help="CA (PEM) to verify agents' "
                                       "https control endpoints against (default: the system's CAs)."),
    tls_client_cert: Path | None = typer.Option(None, "--tls-client-cert", envvar="RANKSIGHT_TLS_CLIENT_CERT",
                                                help="Mutual TLS: the head's certificate for agents' control endpoints."),
    tls_client_key: Path | None = typer.Option(None, "--tls-client-key", envvar="RANKSIGHT_TLS_CLIENT_KEY",
                                               help="The private key of --tls-client-cert."),
    insecure_bind: bool = typer.Option(False, "--insecure-bind", help="Allow a non-loopback --bind without TLS (only "
                                       "behind a TLS-terminating proxy or on a network you trust: the token and "
                                       "all run data then travel in cleartext)."),
    flush_interval: float = typer.Option(1.0, "--flush-interval", help="Seconds between Parquet flushes."),
    analyze_interval: float = typer.Option(5.0, "--analyze-interval", help="Seconds between analyzer passes over the live window; 0 turns live analysis off."),
    window: int = typer.Option(512, "--window", help="Steps per rank kept in memory for the API (and the analyzers, up to --analyze-window)."),
    analyze_window: int = typer.Option(256, "--analyze-window", min=1,
                                       help="Steps per rank each live analysis round looks at (its cost grows with it); at most --window."),
    analyze_in: str = typer.Option("auto", "--analyze-in",
                                   help="Where a live round's analyzers run: child (a process forked from the head "
                                        "each round, on another core: ingest keeps its own), thread (the head's "
                                        "analysis thread, sharing the interpreter with ingest), auto (child where "
                                        "the system can fork and the round holds 100,000 step and collective rows "
                                        "or more; smaller rounds stay in the thread)."),
    compact_to: str = typer.Option("", "--compact-to", envvar="RANKSIGHT_COMPACT_TO",
                                   help="Put the compacted hour partitions here instead of --store: a directory or an "
                                        "object-storage URI (s3://bucket/prefix?region=..., gs://...; credentials from "
                                        "the environment). The write-ahead log and fresh parts stay in --store."),
    fsync: bool = typer.Option(False, "--fsync/--no-fsync", help="fsync the write-ahead log before acknowledging (survives power loss, slower)."),
    log_level: str = typer.Option("INFO", "--log-level"),
    alertmanager_url: str = typer.Option("", "--alertmanager-url", envvar="RANKSIGHT_ALERTMANAGER_URL",
                                         help="Push findings to this Alertmanager (POST /api/v2/alerts): one alert per "
                                              "finding episode, re-sent while open, resolved when it closes."),
    alertmanager_interval: float = typer.Option(60.0, "--alertmanager-interval", min=1.0,
                                                help="Seconds between re-sends of the open findings to Alertmanager."),
    evict: str = typer.Option("dry-run", "--evict", help="Checkpoint-and-evict policy: off | dry-run (record what it would do) | on."),
    min_nodes: int = typer.Option(1, "--min-nodes", help="The policy never evicts below this many nodes."),
    confirm_rounds: int = typer.Option(3, "--confirm-rounds", help="Analysis rounds a finding must persist before an eviction."),
    evict_cooldown: float = typer.Option(600.0, "--evict-cooldown", help="Seconds between two evictions."),
    park_connections: bool = typer.Option(True, "--park-connections/--thread-per-connection",
                                          help="Agents' keep-alive connections wait in one epoll between requests and "
                                               "a few threads serve the requests (plain HTTP on Linux), or a thread "
                                               "per connection (as under TLS)."),
    keep_freed_memory: bool = typer.Option(True, "--keep-freed-memory/--return-freed-memory",
                                           help="The C allocator (glibc) keeps what a live round frees, up to 1 GiB, "
                                                "for the next round instead of handing it back to the system and "
                                                "faulting it in again (faster rounds at scale, resident memory at its "
                                                "high-water mark); --return-freed-memory keeps glibc's defaults (a "
                                                "head sharing a node's memory with training)."),
    priority: str = typer.Option("normal", "--priority", envvar="RANKSIGHT_HEAD_PRIORITY",
                                 help="CPU/IO priority: normal (the head has a node of its own) | low (nice 19) | idle "
                                      "(SCHED_IDLE: for a head that must share the training cores)."),
) -> None:
    """Run the head service until SIGINT/SIGTERM, then flush everything to Parquet."""
    from head.api import make_server
    from head.service import Head, tune_gc
    from ranksight.http_server import serve_in_thread, shutdown_server
    from ranksight.priority import PRIORITIES, set_priority
    from ranksight.tls import ClientTls, ServerTls, TlsConfigError, is_loopback

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        server_tls = ServerTls.from_options(tls_cert, tls_key, tls_client_ca)
        tls_context = server_tls.context() if server_tls else None
        agent_tls = ClientTls.from_options(tls_ca, tls_client_cert, tls_client_key).context()
    except TlsConfigError as e:
        raise typer.BadParameter(str(e)) from None
    if server_tls is None and not insecure_bind and not is_loopback(bind):
        raise typer.BadParameter(
            f"refusing to listen on {bind} without TLS: agents' and clients' bearer token and all run data would "
            f"cross the network in cleartext. Give --tls-cert and --tls-key (docs/security.md), or --insecure-bind "
            f"if a TLS-terminating proxy or a network you trust stands in front of the head.", param_hint="--bind")
    if server_tls is None and not is_loopback(bind):
        print(f"ranksight head: WARNING: --insecure-bind: listening on {bind} without TLS; the token travels in "
              f"cleartext", file=sys.stderr, flush=True)
    if priority not in PRIORITIES:
        raise typer.BadParameter(f"--priority must be one of {', '.join(PRIORITIES)}")
    set_priority(priority, who="ranksight head")  # before the head's threads start: they inherit it
    if not token:
        token = secrets.token_urlsafe(24)
        token_file = store / ".head-token"
        store.mkdir(parents=True, exist_ok=True)
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        os.chmod(token_file, 0o600)  # an existing file keeps its old mode through O_CREAT
        print(f"ranksight head: generated a token in {token_file} (mode 0600): give it to agents and clients as "
              f"RANKSIGHT_TOKEN", flush=True)
    tune_gc()
    from head.policy_runner import MODES, PolicyRunner
    from analyzers.policy import PolicyConfig

    if evict not in MODES:
        raise typer.BadParameter(f"--evict must be one of {', '.join(MODES)}")
    from head.service import ANALYZE_IN
    if analyze_in not in ANALYZE_IN:
        raise typer.BadParameter(f"--analyze-in must be one of {', '.join(ANALYZE_IN)}, not {analyze_in!r}")
    if compact_to:
        from ranksight.store_layout import StoreLocationError, open_location

        try:
            open_location(compact_to)
        except StoreLocationError as e:
            raise typer.BadParameter(f"--compact-to: {e}") from None
    from head.store.store_lock import StoreBusy, StoreLock

    try:  # one head per store (two would interleave their write-ahead logs); held until this process ends
        store_lock = StoreLock(store, "ranksight head")
    except StoreBusy as e:
        raise typer.BadParameter(f"{e}: one head per store", param_hint="--store") from None
    h = Head(store, token, window=window, flush_interval=flush_interval, analyzer_interval=analyze_interval, fsync=fsync,
             analyze_window=analyze_window, public_read=public_read, agent_tls=agent_tls,
             compact_to=compact_to or None, analyze_in=analyze_in, keep_freed_memory=keep_freed_memory)
    h.analysis.round_hooks.append(PolicyRunner(h.actions, evict, PolicyConfig(
        min_nodes=min_nodes, confirm_rounds=confirm_rounds, cooldown_s=evict_cooldown)))
    try:
        srv = make_server(h, bind, port, tls=tls_context, park=park_connections)
    except OSError as e:
        h.close()
        raise typer.BadParameter(f"cannot listen on {bind}:{port}: {e}") from None
    sender = None
    try:
        from dashboards.webhook import WebhookSender

        sender = WebhookSender.from_env()  # RANKSIGHT_WEBHOOK_URLS / _SECRET / _FORMAT / _MIN_SEVERITY
    except ImportError:
        pass
    except ValueError as e:
        h.close()
        srv.server_close()
        raise typer.BadParameter(f"webhook configuration: {e}") from None
    if sender is not None:
        h.analysis.finding_listeners.append(sender.send_findings)
        print(f"ranksight head: findings go to {len(sender.targets)} webhook target(s)", flush=True)
    if alertmanager_url:
        try:
            h.push_to_alertmanager(alertmanager_url, alertmanager_interval)
        except ValueError as e:
            h.close()
            srv.server_close()
            raise typer.BadParameter(str(e)) from None
        print(f"ranksight head: findings go to Alertmanager {alertmanager_url}", flush=True)
    h.start_background()
    stop = threading.Event()

    def _stop(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    serve_in_thread(srv, "head-http")
    tls_note = "" if server_tls is None else (" tls=mutual (client certificates required)" if server_tls.client_ca
                                              else " tls=on")
    print(f"ranksight head: listening on {srv.scheme}://{srv.server_address[0]}:{srv.server_address[1]} "
          f"store={os.path.abspath(store)} pid={os.getpid()} priority={priority}{tls_note}", flush=True)
    stop.wait()
    shutdown_server(srv)
    srv.server_close()
    h.close()
    if sender is not None:
        sender.close()
    store_lock.release()
    print("ranksight head: stopped, store flushed", flush=True)
