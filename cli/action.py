"""``ranksight action``: ask the head to act on a run's node (checkpoint, profile, evict), as the TUI's action key
does, from a script or a shell. An evict passes the head's evict-policy limits (already evicted, cooldown, the
eviction budget, the last node of the job) unless ``--force`` is given with a ``--reason``: the override is stored
with who asked and why in the run's actions table."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from cli.head_options import DEFAULT_HEAD, HeadToken, HeadUrl, TlsCa, TlsClientCert, TlsClientKey

EXIT_ACCEPTED = 0  # the head accepted the action (its status says whether it reached the agent yet)
EXIT_REFUSED = 3  # the head refused it: the policy's limits (409) or a bad request (400)
EXIT_UNREACHABLE = 4  # no answer from the head, or an error it could not serve (401/403/5xx)

action_command = typer.Typer(add_completion=False, help="Ask the head to checkpoint, profile or evict a node of a run.")


@action_command.command(help="Ask the head to act on a node of a run. Exit codes: 0 accepted; 3 refused (the evict "
                             "policy's limits, with the reason; or a bad request); 4 the head could not be reached or "
                             "failed.")
def action(
    run_id: str = typer.Argument(..., help="The run id."),
    what: str = typer.Argument(..., help="checkpoint | profile | evict"),
    node: Optional[int] = typer.Option(None, "--node", help="The node to act on (evict: required)."),
    steps: Optional[int] = typer.Option(None, "--steps", help="profile: how many steps to capture."),
    reason: str = typer.Option("", "--reason", help="Why: stored with the action (required with --force)."),
    force: bool = typer.Option(False, "--force", help="evict: go past the policy's limits (audited: who and why)."),
    by: str = typer.Option("", "--by", envvar="USER", help="Who asks, for the audit (default $USER)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Record what would be done; send nothing to the job."),
    as_json: bool = typer.Option(False, "--json", help="Print the action (or the refusal) as one JSON object."),
    head: HeadUrl = DEFAULT_HEAD,
    token: HeadToken = "",
    tls_ca: TlsCa = "",
    tls_client_cert: TlsClientCert = "",
    tls_client_key: TlsClientKey = "",
) -> None:
    import msgspec

    from ranksight.tls import ClientTls, TlsConfigError
    from tui.client import ClientError, HeadClient, HeadError

    if what not in ("checkpoint", "profile", "evict"):
        raise typer.BadParameter(f"{what!r}: one of checkpoint, profile, evict")
    if force and not reason.strip():
        raise typer.BadParameter("--force needs a --reason: it is stored with the override")
    try:
        client = HeadClient(head, token=token or None, tls=ClientTls.from_options(tls_ca, tls_client_cert,
                                                                                  tls_client_key))
    except TlsConfigError as e:
        raise typer.BadParameter(str(e)) from None

    def say(obj: dict, text: str, code: int) -> None:
        if as_json:
            sys.stdout.write(json.dumps(obj) + "\n")
        else:
            (sys.stdout if code == EXIT_ACCEPTED else sys.stderr).write(text + "\n")
        raise typer.Exit(code)

    try:
        a = client.request_action(run_id, what, node=node, steps=steps, reason=reason, dry_run=dry_run, force=force,
                                  by=by)
    except HeadError as e:
        code = EXIT_REFUSED if e.status in (400, 404, 409) else EXIT_UNREACHABLE
        say({"accepted": False, "status": e.status, "error": e.message},
            f"refused ({e.status}): {e.message}" + ("\n(to go past the policy's limits: --force --reason '...')"
                                                   if e.status == 409 and not force else ""), code)
    except ClientError as e:
        say({"accepted": False, "status": None, "error": str(e)}, f"error: {e}", EXIT_UNREACHABLE)
    d = msgspec.to_builtins(a)
    where = f"node {a.node}" if a.node is not None else "the job"
    say({"accepted": True, "action": d},
        f"{a.action} {where}: {a.status}" + (" (forced)" if getattr(a, "force", False) else "") + f" (id {a.id})",
        EXIT_ACCEPTED)
