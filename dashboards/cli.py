"""``ranksight dashboards``: build/push Grafana dashboards, install alert rules, receive/send signed webhooks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import typer

RULES_DIR = Path(__file__).resolve().parent / "rules"
RULES_FILE = RULES_DIR / "ranksight.rules.yml"
RULES_TEST_FILE = RULES_DIR / "ranksight.rules_test.yml"
ALERTMANAGER_EXAMPLE = Path(__file__).resolve().parent / "alertmanager.yml"
# The shipped rules' runbook_url is docs/runbooks.md#<anchor>, relative to the repository root:
# usable without configuration; --runbook-base URL points the links at a published copy instead.
RUNBOOK_DEFAULT_BASE = "docs/runbooks.md"
RUNBOOKS_FILE = Path(__file__).resolve().parent.parent / RUNBOOK_DEFAULT_BASE

dashboards_command = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                                 help="Build Grafana dashboards and push them to a Grafana; alert rules; signed webhooks.")


JSON_HELP = "Print one JSON object (the result, or {\"error\": ...}) instead of text."


def _fail(msg: str, as_json: bool = False, **partial) -> None:
    """Exit 2 with the error: a line on stderr, and under --json also the object on stdout (with what was done)."""
    typer.echo(f"error: {msg}", err=True)
    if as_json:
        typer.echo(json.dumps({"ok": False, "error": msg, **partial}))
    raise typer.Exit(2)


@dashboards_command.command("build")
def build_cmd(out: Path = typer.Option(None, "--out", help="Directory for <uid>.json (default: dashboards/json)."),
              as_json: bool = typer.Option(False, "--json", help=JSON_HELP)) -> None:
    """Generate the dashboards (grafana-foundation-sdk), lint them, write <uid>.json files."""
    from dashboards.build import JSON_DIR, write_all
    from dashboards.lint import LintError

    out_dir = out or JSON_DIR
    try:
        paths = write_all(out_dir)
    except LintError as e:
        _fail(f"dashboard lint failed, nothing written: {e}", as_json, dir=str(out_dir), written=[])
    except OSError as e:
        _fail(f"cannot write dashboards: {e}", as_json, dir=str(out_dir), written=[])
    if as_json:
        typer.echo(json.dumps({"ok": True, "error": None, "dir": str(out_dir), "written": [str(p) for p in paths]}))
        return
    for p in paths:
        typer.echo(str(p))


@dashboards_command.command("push")
def push_cmd(
    url: str = typer.Option(..., "--url", help="Grafana base URL, e.g. http://grafana:3000"),
    token: str = typer.Option("", "--token", envvar="GRAFANA_TOKEN", help="Grafana service-account token (Bearer)."),
    folder: str = typer.Option("ranksight", "--folder", help="Folder title (created if missing)."),
    folder_uid: str = typer.Option("ranksight", "--folder-uid", help="Folder uid."),
    src: Path = typer.Option(None, "--dir", help="Dashboards to push (default: dashboards/json, written by `build`)."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Create or overwrite the dashboards in a Grafana folder."""
    from dashboards.build import JSON_DIR, load_dir
    from dashboards.lint import lint_dashboard
    from dashboards.provision import ProvisionError, push

    where = {"url": url, "folder": folder, "folder_uid": folder_uid, "pushed": []}
    try:
        models = load_dir(src or JSON_DIR)
    except (OSError, ValueError) as e:
        _fail(str(e), as_json, **where)
    for uid, m in models.items():
        problems = lint_dashboard(m)
        if problems:
            _fail(f"{uid} fails lint, not pushed: {'; '.join(problems)}", as_json, **where)
    try:
        answers = push(url, token, models, folder_title=folder, folder_uid=folder_uid)
    except ProvisionError as e:
        _fail(str(e), as_json, **where)
    if as_json:
        # Grafana's own answer per dashboard: uid, status, version, url (the token is never in it)
        typer.echo(json.dumps({"ok": True, "error": None, **where, "pushed": [
            {k: a.get(k) for k in ("uid", "status", "version", "url")} for a in answers]}))
        return
    for a in answers:
        typer.echo(f"{a.get('status', 'ok')}: {a.get('uid', '?')} version {a.get('version', '?')} {a.get('url', '')}")


@dashboards_command.command("lint")
def lint_cmd(
    src: Path = typer.Option(None, "--dir", help="Dashboards to check (default: dashboards/json)."),
    prometheus: str = typer.Option(None, "--prometheus",
                                   help="Also evaluate every panel query on this Prometheus (e.g. http://prom:9090)."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Check dashboard JSON (refIds, datasource uids, units, grid, variables); optionally run each query on a Prometheus."""
    from dashboards.build import JSON_DIR, load_dir
    from dashboards.lint import PromQLError, check_promql, lint_dashboard, panel_queries, promql_for_prometheus

    def say(line: str) -> None:
        if not as_json:
            typer.echo(line)

    result = {"dashboards": 0, "prometheus": prometheus, "problems": [], "queries": []}
    try:
        models = load_dir(src or JSON_DIR)
    except (OSError, ValueError) as e:
        _fail(str(e), as_json, **result)
    result["dashboards"] = len(models)
    bad = 0
    for uid, m in models.items():
        for p in lint_dashboard(m):
            say(f"{uid}: {p}")
            result["problems"].append({"uid": uid, "problem": p})
            bad += 1
        if prometheus:
            for title, ref, expr in panel_queries(m):
                q = {"uid": uid, "panel": title, "ref": ref, "status": "ok", "error": None}
                result["queries"].append(q)
                try:
                    data = check_promql(prometheus, promql_for_prometheus(expr))
                except PromQLError as e:
                    say(f"{uid}: {title} / {ref}: {e}")
                    q.update(status="error", error=str(e))
                    result["problems"].append({"uid": uid, "problem": f"{title} / {ref}: {e}"})
                    bad += 1
                    continue
                except OSError as e:
                    _fail(f"cannot reach Prometheus at {prometheus}: {e}", as_json, **result)
                if not data.get("result"):
                    q["status"] = "no data"
                    say(f"{uid}: {title} / {ref}: ok, no data (yet)")
    if bad:
        _fail(f"{bad} problem(s)", as_json, **result)
    if as_json:
        typer.echo(json.dumps({"ok": True, "error": None, **result}))
        return
    typer.echo(f"ok: {len(models)} dashboard(s)" + (f", queries evaluated on {prometheus}" if prometheus else ""))


def render_rules(runbook_base: str | None) -> str:
    """The rules file; with ``runbook_base`` every ``runbook_url`` is ``<runbook_base>#<anchor>``."""
    text = RULES_FILE.read_text()
    if runbook_base:
        if not runbook_base.startswith(("http://", "https://")):
            raise ValueError(f"--runbook-base must be an http(s) URL, got {runbook_base!r}")
        text = text.replace(f"runbook_url: '{RUNBOOK_DEFAULT_BASE}#", f"runbook_url: '{runbook_base.rstrip('/')}#")
    return text


@dashboards_command.command("rules")
def rules_cmd(
    out: Path = typer.Option(None, "--out", help="Directory to write ranksight.rules.yml into (for Prometheus' rule_files)."),
    runbook_base: str = typer.Option(None, "--runbook-base",
                                     help="URL of your published copy of docs/runbooks.md: runbook_url becomes URL#<alert>. "
                                          "Default: docs/runbooks.md#<alert>, relative to the ranksight repository."),
    check: bool = typer.Option(True, "--check/--no-check", help="Run promtool check rules and the rule unit tests."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Install (or just check) the Prometheus alert rules."""
    result = {"rules_file": None, "written": False, "checks": []}
    try:
        text = render_rules(runbook_base)
    except ValueError as e:
        _fail(str(e), as_json, **result)
    target = RULES_FILE
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        target = out / RULES_FILE.name
        target.write_text(text)
        result["written"] = True
    result["rules_file"] = str(target)
    if not as_json:
        typer.echo(f"wrote {target}" if out is not None else str(RULES_FILE))
    if check:
        promtool = shutil.which("promtool")
        if promtool is None:
            _fail("promtool not found (apt-get install prometheus); use --no-check to skip the checks", as_json,
                  **result)
        for args in ([promtool, "check", "rules", str(target)], [promtool, "test", "rules", str(RULES_TEST_FILE)]):
            r = subprocess.run(args, capture_output=True, text=True, cwd=RULES_DIR)
            output = (r.stdout + r.stderr).strip()
            result["checks"].append({"check": " ".join(args[1:3]), "ok": r.returncode == 0, "output": output})
            if not as_json:
                typer.echo(output)
            if r.returncode != 0:
                _fail(f"{' '.join(args[1:3])} failed", as_json, **result)
    if as_json:
        typer.echo(json.dumps({"ok": True, "error": None, **result}))


@dashboards_command.command("webhook-receiver")
def receiver_cmd(
    port: int = typer.Option(9095, "--port", help="Port on 127.0.0.1."),
    secret: str = typer.Option("", "--secret", envvar="RANKSIGHT_WEBHOOK_SECRET", help="HMAC secret of signed ranksight webhooks."),
    bearer_token: str = typer.Option("", "--bearer-token", envvar="RANKSIGHT_WEBHOOK_BEARER",
                                     help="Also accept Alertmanager deliveries with this Bearer token."),
    tolerance: float = typer.Option(300.0, "--tolerance", help="Largest accepted clock difference of a signed request (s)."),
    out: Path = typer.Option(None, "--out", help="Append each accepted delivery as a JSON line to this file."),
) -> None:
    """Reference receiver: verify signed webhooks (and Alertmanager's), print each delivery as JSON."""
    from dashboards.webhook_receiver import serve

    if not secret and not bearer_token:
        _fail("give --secret (or RANKSIGHT_WEBHOOK_SECRET) and/or --bearer-token")
    if tolerance <= 0:
        _fail("--tolerance must be positive")
    try:
        serve(port, secret, bearer_token=bearer_token, tolerance=tolerance, out_path=str(out) if out else None)
    except OSError as e:
        _fail(f"cannot listen on 127.0.0.1:{port}: {e}")


@dashboards_command.command("webhook-send")
def send_cmd(
    url: list[str] = typer.Option(..., "--url", help="Receiver URL (repeatable)."),
    secret: str = typer.Option("", "--secret", envvar="RANKSIGHT_WEBHOOK_SECRET", help="HMAC secret."),
    fmt: str = typer.Option("finding", "--format", help="finding | alertmanager"),
    timeout: float = typer.Option(20.0, "--timeout", help="Seconds to wait for delivery (retries included)."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Send one signed test finding, to check a receiver end to end."""
    from dashboards.webhook import WebhookSender
    from ranksight.schema import Finding

    try:
        sender = WebhookSender.from_urls(url, secret, fmt=fmt, min_severity="info", backoff_s=0.5, max_attempts=4)
    except ValueError as e:
        _fail(str(e), as_json, urls=len(url), delivered=0)
    f = Finding(analyzer="webhook-send", kind="straggler", severity="info", ranks=[0], nodes=[0], summary=
                "ranksight test webhook: ignore", evidence={"test": True}, run_id="webhook-test", t=time.time())
    sender.send_finding(f)
    sender.close(timeout=timeout)
    st = sender.stats()
    if as_json:
        ok = st["delivered"] == len(url)
        typer.echo(json.dumps({"ok": ok, "error": None if ok else "not every receiver got the finding", "urls": len(url),
                               **{k: st[k] for k in ("delivered", "failed", "abandoned", "last_error")}}, default=str))
        raise typer.Exit(0 if ok else 1)
    typer.echo(f"delivered {st['delivered']}/{len(url)}; failed {st['failed']}; abandoned {st['abandoned']}"
               + (f"; last errors {st['last_error']}" if st["last_error"] else ""))
    if st["delivered"] != len(url):
        raise typer.Exit(1)


if __name__ == "__main__":
    dashboards_command(sys.argv[1:])
