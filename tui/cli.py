"""``ranksight tui``: the live terminal view of a run, talking to the head over HTTP."""

from __future__ import annotations

import typer

tui_command = typer.Typer(add_completion=False, help="Live terminal view of a run (talks to the head).")


@tui_command.command()
def tui(
    head: str = typer.Option("http://127.0.0.1:4318", "--head", envvar="RANKSIGHT_HEAD",
                             help="Base URL of the head's HTTP API."),
    token: str = typer.Option("", "--token", envvar="RANKSIGHT_TOKEN",
                              help="Bearer token the head requires (RANKSIGHT_TOKEN)."),
    run: str = typer.Option(None, "--run", help="Run id to open; without it the run picker opens."),
    interval: float = typer.Option(1.0, "--interval", min=0.1, help="Seconds between refreshes."),
    window: int = typer.Option(60, "--window", min=5, max=2000, help="Steps shown in the heat map and sparklines."),
    timeout: float = typer.Option(3.0, "--timeout", min=0.1, help="Seconds before a head request counts as failed."),
    tls_ca: str = typer.Option("", "--tls-ca", envvar="RANKSIGHT_TLS_CA",
                               help="CA (PEM) to verify an https head against (default: the system's CAs)."),
    tls_client_cert: str = typer.Option("", "--tls-client-cert", envvar="RANKSIGHT_TLS_CLIENT_CERT",
                                        help="Mutual TLS: the certificate to present to the head."),
    tls_client_key: str = typer.Option("", "--tls-client-key", envvar="RANKSIGHT_TLS_CLIENT_KEY",
                                       help="The private key of --tls-client-cert."),
) -> None:
    """Live terminal view of a run: ranks, compute heat map, trends, findings, actions."""
    from tui.app import RanksightApp
    from tui.client import HeadClient
    from ranksight.tls import ClientTls, TlsConfigError

    try:
        client = HeadClient(head, token=token, timeout=timeout,
                            tls=ClientTls.from_options(tls_ca, tls_client_cert, tls_client_key))
    except TlsConfigError as e:
        raise typer.BadParameter(str(e)) from None
    app = RanksightApp(client, run_id=run or None, interval=interval, window=window)
    app.run()
    raise typer.Exit(app.return_code or 0)
