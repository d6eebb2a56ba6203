"""The ``ranksight`` command: one entry point, one subcommand per surface.

Subcommands are imported only when used, so ``ranksight --help`` and light
commands (``runs``, ``nccl-log``) never pay for importing torch. Each entry
names ``module:attribute`` where the attribute is a ``typer.Typer`` app with a
single command; the module owns its options.
"""

from __future__ import annotations

import importlib
import json

import typer
import typer.core

from ranksight import __version__

# name -> (target, one-line help). Keep the help here so --help stays import-free.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("trainer.cli:train_command", "Run the trainer on this rank (started by torchrun)."),
    "launch": ("cli.launch:launch_command", "Start a local multi-node run on this host and wait for it."),
    "nccl-tests": ("nccl_tests.cli:nccl_tests_command", "Collective benchmarks (nccl-tests output) and the pre-flight health check."),
    "diagnose": ("cli.diagnose:diagnose_command", "Post-mortem report of a run."),
    "nccl-log": ("probes.nccl_log.cli:nccl_log_command", "Summarize NCCL_DEBUG=INFO logs a user already has."),
    "trace": ("traces.cli:trace_command", "Analyse profiler traces of one or many ranks (HTA's analyses, and who is slow)."),
    "logs": ("logs.cli:logs_command", "Diagnose the logs you already have (NCCL, watchdog, Flight Recorder, Xid, ...)."),
    "agent": ("node.cli:agent_command", "Run the node agent: tail spools, sample GPUs/host, ship OTLP, serve /metrics."),
    "head": ("head.cli:head_command", "Run the head service: OTLP receiver, run store, live analysis, HTTP API."),
    "runs": ("cli.runs:runs_command", "List the runs in a store."),
    "compact": ("cli.compact:compact_command", "Compact a stored run's partitions again, sorted (no head needed)."),
    "action": ("cli.action:action_command", "Ask the head to checkpoint, profile or evict a node of a run."),
    "ops": ("cli.ops:ops_command", "A rank's raw collective records over a step range, from its node (via the head)."),
    "dashboards": ("dashboards.cli:dashboards_command", "Build Grafana dashboards and push them to a Grafana."),
    "tui": ("tui.cli:tui_command", "Live terminal view of a run (talks to the head)."),
}


class LazyGroup(typer.core.TyperGroup):
    """A command group whose subcommands are imported on first use."""

    def list_commands(self, ctx) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx, name: str):
        if name not in COMMANDS:
            return None
        target, help_text = COMMANDS[name]
        module_name, _, attr = target.partition(":")
        app = getattr(importlib.import_module(module_name), attr)
        cmd = typer.main.get_command(app)
        cmd.name = name
        cmd.help = cmd.help or help_text
        return cmd

    def parse_args(self, ctx, args):
        ctx.meta["ranksight.json"] = "--json" in args  # seen before the subcommand parses (and may refuse) them
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        # Under --json a usage error (a bad option, a missing argument, a BadParameter raised by a command) is one
        # JSON object on stdout too, so a script that parses the output never gets text instead; exit code 2 as
        # click gives it.
        try:
            return super().invoke(ctx)
        except typer.TyperException as e:
            # typer vendors click and exports no UsageError: a usage error is the click exception that exits 2
            if getattr(e, "exit_code", None) != 2 or not ctx.meta.get("ranksight.json"):
                raise
            e.show()  # the usual text, on stderr, for a person reading along
            typer.echo(json.dumps({"error": e.format_message(), "usage_error": True, "exit_code": e.exit_code}))
            raise typer.Exit(e.exit_code) from None

    def format_commands(self, ctx, formatter) -> None:
        # Listing must not import every subcommand: use the help kept in COMMANDS.
        with formatter.section("Commands"):
            formatter.write_dl([(name, COMMANDS[name][1]) for name in self.list_commands(ctx)])


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"ranksight {__version__}")
        raise typer.Exit()


# rich_markup_mode=None: plain help for the group, so that listing commands imports none of them.
main = typer.Typer(cls=LazyGroup, rich_markup_mode=None, add_completion=False,
                   context_settings={"help_option_names": ["-h", "--help"]})


@main.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="Show the version and exit.")) -> None:
    """ranksight: which rank, which node, since which step, and why."""


if __name__ == "__main__":
    main()
