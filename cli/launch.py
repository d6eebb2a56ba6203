"""``ranksight launch``: a local multi-node training run on this host, watched live.

One torchrun per simulated node (see cli.local_cluster), each in a network
namespace of its own where that works (root; cli.netns), else all on 127.0.0.1,
with elastic c10d rendezvous so a node can leave (evict) and the job re-forms
without it. ``--inject`` is checked before anything starts. Options the launcher does not know are passed to the trainer as is
(``ranksight launch ... -- --d-model 128``).

By default it also runs the data path beside the job, as a user would on a
cluster: a head and one node agent per node (cli.datapath.DataPath, started as
commands), and shows the findings the head's live analyzers report.
"""

from __future__ import annotations

import json
import signal
import sys
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import msgspec
import typer
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ranksight import schema
from ranksight.layout import DEFAULT_STORE, RunDir
from ranksight.tls import client_tls_from_env
from cli.local_cluster import LocalCluster, use_netns
from cli.netns import NetnsError
from trainer.faults import FaultSpecError, apply_config_faults, parse_faults

console = Console(stderr=True)

launch_command = typer.Typer(add_completion=False, context_settings={"help_option_names": ["-h", "--help"]})


def default_run_id() -> str:
    return datetime.now(timezone.utc).strftime("run-%Y%m%d-%H%M%S")


def last_step_record(spool: Path, window: int = 16384) -> schema.StepRecord | None:
    """The newest complete step record of a spool file (reads only its tail)."""
    try:
        with open(spool, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - window))
            tail = f.read()
    except FileNotFoundError:
        return None
    for line in reversed(tail.split(b"\n")):
        if not line.strip():
            continue
        try:
            rec = schema.decode_spool_line(line)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue  # a partial first/last line of the window
        if isinstance(rec, schema.StepRecord):
            return rec
    return None


SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}


class FindingsFeed:
    """The head's live findings for this run, polled over its HTTP API (with the data path's token)."""

    def __init__(self, head_url: str, run_id: str, token: str, every_s: float = 2.0):
        self.url = f"{head_url}/api/runs/{run_id}/findings"
        self.token = token
        self.every_s = every_s
        self.findings: list[dict] = []
        self.error = ""
        self._last = 0.0

    def poll(self) -> list[dict]:
        """Fetch if due; return the findings not seen before (to log them as they appear)."""
        if time.monotonic() - self._last < self.every_s:
            return []
        self._last = time.monotonic()
        try:
            # An https head (--head-url): verified with RANKSIGHT_TLS_CA (+ client certificate), as the agents are.
            ctx = client_tls_from_env().context() if self.url.startswith("https://") else None
            req = urllib.request.Request(self.url, headers={"Authorization": f"Bearer {self.token}"})
            with urllib.request.urlopen(req, timeout=2, context=ctx) as r:
                body = json.loads(r.read())
        except (OSError, ValueError) as e:  # TlsConfigError is a ValueError
            self.error = f"head unreachable: {e}"
            return []
        self.error = ""
        items = body.get("findings", body) if isinstance(body, dict) else body
        items = [f for f in items if isinstance(f, dict)]
        new = items[len(self.findings):]
        self.findings = items
        return new

    def render(self, limit: int = 6) -> Text:
        text = Text()
        if self.error:
            text.append(self.error + "\n", style="red")
        if not self.findings:
            text.append("head: no findings yet", style="dim")
            return text
        text.append(f"head: {len(self.findings)} finding(s), newest last\n", style="bold")
        for f in self.findings[-limit:]:
            text.append(f"  [{f.get('severity', '?')}] ", style=SEVERITY_STYLE.get(f.get("severity"), ""))
            text.append(f"{f.get('summary') or f.get('kind')}")
            text.append(" (closed)\n" if f.get("status") == "closed" else "\n", style="dim")
        return text


# The live table's columns, the first to go when the terminal is narrow.
PROGRESS_DROP_ORDER = ("tokens/s", "compute ms", "node")


def progress_table(run: RunDir, cluster: LocalCluster, steps: int) -> Table:
    from ranksight.fit_table import Col, dropped_note, fit_table

    cols = [Col(c, "right") for c in ("rank", "node", "step", "loss", "step ms", "compute ms", "comm ms", "tokens/s")]
    rows = []
    spools = sorted(run.spool_dir.glob("rank-*.jsonl"), key=lambda p: int(p.stem.split("-")[1]))
    now = time.time()
    for spool in spools:
        rec = last_step_record(spool)
        if rec is None:
            continue
        stale = now - rec.t_end > 30
        loss = "nan/inf" if rec.loss_nonfinite else (f"{rec.loss:.4f}" if rec.loss is not None else "-")
        tps = rec.tokens / (rec.step_ms / 1000) if rec.step_ms > 0 else 0.0
        rows.append([
            str(rec.rank), str(rec.node), f"{rec.step}/{steps}" + (" (stale)" if stale else ""), loss,
            f"{rec.step_ms:.0f}", f"{rec.compute_ms:.0f}", f"{rec.comm_ms:.0f}", f"{tps:,.0f}",
        ])
    states = []
    for n in cluster.nodes:
        code = n.proc.poll()
        states.append(f"node{n.node}: " + ("evicted" if n.evicted else "running" if code is None else f"exit {code}"))
    fitted = fit_table(console, cols, rows, PROGRESS_DROP_ORDER,
                       title=f"run {run.run_id}: live progress (from the ranks' spool files)")
    fitted.table.caption = " | ".join(states) + ("\n" + dropped_note(fitted.dropped, console.width)
                                                 if fitted.dropped else "")
    return fitted.table


@launch_command.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(
    ctx: typer.Context,
    nnodes: int = typer.Option(2, help="Simulated nodes (one torchrun each)."),
    nproc_per_node: int = typer.Option(2, help="Ranks per node."),
    dp: int = typer.Option(0, help="Data-parallel degree (0: world / (tp*pp))."),
    tp: int = typer.Option(1, help="Tensor-parallel degree."),
    pp: int = typer.Option(1, help="Pipeline-parallel degree."),
    pp_schedule: str = typer.Option("1f1b", help="1f1b | gpipe | interleaved."),
    microbatches: int = typer.Option(0, help="Pipeline micro-batches (0: trainer default)."),
    precision: str = typer.Option("fp32", help="fp32 | bf16 | fp16."),
    steps: int = typer.Option(20, help="Training steps."),
    inject: list[str] = typer.Option([], help="Fault to inject, e.g. slow_rank:rank=3,factor=1.3,start=15 (repeatable)."),
    run_id: str = typer.Option("", help="Run id (default: run-<UTC time>)."),
    store: Path = typer.Option(DEFAULT_STORE, help="Run store directory; the run lives in <store>/<run-id>/."),
    min_nodes: int = typer.Option(1, help="Fewest nodes the elastic job may shrink to."),
    max_restarts: int = typer.Option(3, help="torchrun worker-group restarts allowed per node."),
    last_call_timeout: int = typer.Option(5, help="Seconds the rendezvous waits for late nodes."),
    timeout: float = typer.Option(0, help="Give up after this many seconds (0: no limit)."),
    live: bool = typer.Option(True, help="Show live progress on the terminal."),
    agents: bool = typer.Option(True, help="Run a head and one node agent per node beside the job."),
    head_url: str = typer.Option("", help="Ship to this running head instead of starting one."),
    evict: str = typer.Option("dry-run", help="The head's checkpoint-and-evict policy: off | dry-run (record what it "
                                              "would do) | on (evict a confirmed bad node; the run re-forms without it)."),
    analyze_interval: float = typer.Option(5.0, help="Seconds between the head's analysis rounds."),
    collectives: str = typer.Option("auto", help="What the agents ship of the collectives: per-op | per-step (one "
                                    "record per rank, step, kind and communicator; the raw ops stay in the spools "
                                    "for `ranksight ops`) | auto (per-step above 256 ranks)."),
    netns: Optional[bool] = typer.Option(None, "--netns/--no-netns",
                                         help="Each node in a network namespace of its own, joined by a bridge (a "
                                              "slow_link rate_mbit then limits that node's link). Default: when run as "
                                              "root and namespaces work here; else every node on 127.0.0.1."),
    as_json: bool = typer.Option(False, "--json", help="At the end print one JSON object on stdout: how each node "
                                                       "ended, the head's findings, what the agents left undelivered "
                                                       "(docs/cli.md). The live view stays on stderr."),
) -> None:
    """Start a local multi-node run on this host (one torchrun per node) and wait for it."""
    world = nnodes * nproc_per_node
    faults = validate_inject(inject, world, nnodes, pp, as_json=as_json)
    dp = dp or world // (tp * pp)
    if dp * tp * pp != world:
        raise typer.BadParameter(f"dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp} but nnodes*nproc_per_node = {world}")
    if not 1 <= min_nodes <= nnodes:
        raise typer.BadParameter(f"--min-nodes must be between 1 and --nnodes ({nnodes})")
    try:
        netns = use_netns(netns)
    except NetnsError as e:
        console.print(f"ranksight launch: error: --netns: {e}", markup=False, highlight=False)
        _json_error(as_json, f"--netns: {e}", 2)
        raise typer.Exit(2) from None
    if not netns and any(f.kind == "slow_link" and f.rate_mbit for f in faults):
        console.print("note: no network namespace per node, so slow_link's rate_mbit has no link of its own to limit: "
                      "the trainer delays each of the rank's operations by delay_ms instead", markup=False)
    run = RunDir(store, run_id or default_run_id())
    run.root.mkdir(parents=True, exist_ok=True)

    trainer_args = [
        "--run-id", run.run_id, "--store", str(store), "--dp", str(dp), "--tp", str(tp), "--pp", str(pp),
        "--pp-schedule", pp_schedule, "--precision", precision, "--steps", str(steps),
        "--min-nodes", str(min_nodes),
    ]
    if microbatches:
        trainer_args += ["--microbatches", str(microbatches)]
    for spec in inject:
        trainer_args += ["--inject", spec]
    trainer_args += list(ctx.args)

    cluster = LocalCluster(run_dir=run.root, nnodes=nnodes, nproc_per_node=nproc_per_node,
                           trainer_args=trainer_args, min_nodes=min_nodes, max_restarts=max_restarts,
                           last_call_timeout=last_call_timeout, netns=netns)
    console.print(f"[bold]ranksight launch[/]: run [cyan]{run.run_id}[/] in {run.root} — {nnodes} nodes × "
                  f"{nproc_per_node} ranks ({'a network namespace each' if netns else 'all on 127.0.0.1'}), "
                  f"dp={dp} tp={tp} pp={pp}, {precision}, {steps} steps"
                  + (f", inject {', '.join(inject)}" if inject else ""))
    data_path = None
    if agents:
        from cli.datapath import DataPath  # started as processes; imported only for their orchestration
        from head.policy_runner import MODES

        if evict not in MODES:
            raise typer.BadParameter(f"--evict must be one of {', '.join(MODES)}")
        if collectives not in ("auto", "per-op", "per-step"):
            raise typer.BadParameter("--collectives must be auto, per-op or per-step")
        data_path = DataPath(store, run.run_id, nnodes, head_url=head_url or None,
                             head_args=["--evict", evict, "--analyze-interval", str(analyze_interval),
                                        "--min-nodes", str(min_nodes)],
                             agent_args=["--collectives", collectives])
    summary: dict = {}
    rc = run_cluster(cluster, run, steps, timeout=timeout, live=live, data_path=data_path, summary=summary)
    if as_json:
        sys.stdout.write(json.dumps(summary, default=str) + "\n")
    raise typer.Exit(rc)


def _json_error(as_json: bool, message: str, code: int) -> None:
    """Under --json, a launch that ends before it starts says why in the one JSON object too."""
    if as_json:
        sys.stdout.write(json.dumps({"error": message, "exit_code": code, "run_id": None}) + "\n")


def validate_inject(inject: list[str], world: int, nnodes: int, pp: int, as_json: bool = False) -> list[schema.FaultSpec]:
    """The ``--inject`` specs, parsed as the trainer will parse them, with targets inside the job; a bad one ends the
    command here, before anything starts: one line on stderr, exit code 2 (a usage error)."""
    try:
        faults = parse_faults(inject)
        # the configuration faults' own checks (few_microbatches needs a pipeline), on a stand-in of the config
        apply_config_faults(SimpleNamespace(parallel=SimpleNamespace(pp=pp, microbatches=0)), faults)
        for text, f in zip(inject, faults):
            if f.rank is not None and not 0 <= f.rank < world:
                raise FaultSpecError(f"--inject {text!r}: rank={f.rank} is not a rank of this {world}-rank job")
            if f.node is not None and not 0 <= f.node < nnodes:
                raise FaultSpecError(f"--inject {text!r}: node={f.node} is not a node of this {nnodes}-node job")
    except FaultSpecError as e:
        console.print(f"ranksight launch: error: {e}", markup=False, highlight=False, soft_wrap=True)
        _json_error(as_json, str(e), 2)
        raise typer.Exit(2) from None
    return faults


def run_cluster(cluster: LocalCluster, run: RunDir, steps: int, timeout: float = 0, live: bool = True,
                data_path=None, summary: dict | None = None) -> int:
    """Start the cluster (and the data path), show progress until every non-evicted node has exited. ``summary``,
    when given, is filled with the end summary ``launch --json`` prints (its keys: docs/cli.md)."""
    start = time.monotonic()
    interrupted = False
    feed = None
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)

    def view_now():
        table = progress_table(run, cluster, steps)
        return Group(table, feed.render()) if feed else table

    try:
        if data_path is not None:
            data_path.start()
            feed = FindingsFeed(data_path.head_url, run.run_id, data_path.token)
            console.print(f"data path: head {data_path.head_url}, {cluster.nnodes} node agents "
                          f"(watch it live: RANKSIGHT_TOKEN=… ranksight tui --head {data_path.head_url} --run {run.run_id})")
        cluster.start()
        with Live(view_now(), console=console, refresh_per_second=2,
                  transient=False, auto_refresh=False) if live else _NoLive() as view:
            while not cluster.done:
                cluster.poll()
                if timeout and time.monotonic() - start > timeout:
                    console.print(f"[red]timeout after {timeout:.0f} s[/]: stopping the run")
                    interrupted = True
                    break
                if feed is not None:
                    for f in feed.poll():
                        if not live:  # with a live view the findings panel shows them
                            console.print(escape(f"[head] new finding [{f.get('severity')}]: "
                                                 f"{f.get('summary') or f.get('kind')}"))
                view.update(view_now(), refresh=True)
                time.sleep(0.5)
            cluster.poll()
            if feed is not None:
                feed._last = 0.0
                feed.poll()
            view.update(view_now(), refresh=True)
    except KeyboardInterrupt:
        interrupted = True
        console.print("[yellow]interrupted[/]: stopping every node")
    finally:
        cluster.stop()
        undelivered: dict[int, dict] = {}
        agent_reports: dict[int, dict] = {}
        if data_path is not None:
            # Agents first: each drains its spools and ships the last records before the head flushes.
            agent_reports = data_path.stop()
            undelivered = {n: r for n, r in agent_reports.items()
                           if r.get("missing") or r.get("undelivered_records") or r.get("dropped_records")
                           or r.get("rejected_records")}
        signal.signal(signal.SIGTERM, previous)
    for n, r in sorted(undelivered.items()):
        if r.get("missing"):
            console.print(f"[yellow]agent of node {n} left no exit report[/]: it may not have delivered its last "
                          f"records (see {run.root / 'logs' / f'agent-node{n}.log'})")
            continue
        if r.get("undelivered_records") or r.get("dropped_records"):
            console.print(f"[yellow]agent of node {n}: {r['undelivered_records']} record(s) not delivered[/] (in "
                          f"{r['outbox']}; deliver later with `ranksight agent --drain --store {run.store} --run-id "
                          f"{run.run_id} --node {n} --head URL`); {r['dropped_records']} dropped for good")
        if r.get("rejected_records"):
            console.print(f"[yellow]agent of node {n}: the head refused {r['rejected_records']} record(s)[/] (kept "
                          f"in {r.get('rejected_file')}, {r.get('rejected_not_kept', 0)} not kept): each with the "
                          f"head's reason")

    codes = cluster.exit_codes()
    evicted = cluster.evicted_nodes()
    failed = {n: c for n, c in codes.items() if n not in evicted and c != 0}
    for n, c in sorted(codes.items()):
        what = "evicted (left the job on request)" if n in evicted else f"exit code {c}"
        console.print(f"  node{n}: {what}; log {run.root / 'logs' / f'node-{n}.log'}")
    rc = 1 if interrupted or failed else 0
    if summary is not None:
        last = {}
        for spool in run.spool_dir.glob("rank-*.jsonl"):
            rec = last_step_record(spool)
            if rec is not None:
                last[rec.rank] = rec.step
        summary.update({
            "run_id": run.run_id, "run_dir": str(run.root), "finished": rc == 0, "exit_code": rc,
            "error": None if rc == 0 else ("interrupted" if interrupted else
                                            f"node(s) {', '.join(map(str, sorted(failed)))} failed"),
            "interrupted": interrupted, "steps": steps,
            "last_step": max(last.values()) if last else None,
            "nodes": [{"node": n, "exit_code": c, "evicted": n in evicted,
                       "log": str(run.root / "logs" / f"node-{n}.log")} for n, c in sorted(codes.items())],
            "findings": feed.findings if feed is not None else [],
            "findings_error": (feed.error or None) if feed is not None else None,
            "agents": [{"node": n, **r} for n, r in sorted(agent_reports.items())],
        })
    if rc:
        console.print(f"[red]run {run.run_id} did not finish cleanly[/]")
        return rc
    console.print(f"[green]run {run.run_id} finished[/]; its files are in {run.root}")
    return 0


def _raise_interrupt(*_args) -> None:
    # SIGTERM to the launcher stops the run the same way Ctrl-C does: every node is torn down.
    raise KeyboardInterrupt


class _NoLive:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, *_args, **_kwargs) -> None:
        pass
