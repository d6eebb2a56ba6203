"""The ``ranksight`` command: one entry point, one subcommand per surface.

Subcommands are imported only when used, so ``ranksight --help`` and light
commands (``runs``, ``nccl-log``) never pay for importing torch. Each entry
names ``module:attribute`` where the attribute is a ``typer.Typer`` app (with
one command) or a ``click.Command``; the module owns its options.
"""

from __future__ import annotations

import importlib

import click
import typer

from ranksight import __version__

# name -> (target, one-line help). Keep the help here so --help stays import-free.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("trainer.cli:train_command", "Run the trainer on this rank (started by torchrun)."),
    "launch": ("trainer.launch:launch_command", "Start a local multi-node run on this host and wait for it."),
    "nccl-tests": ("nccl_tests.cli:nccl_tests_command", "Collective benchmarks (nccl-tests output) and the pre-flight health check."),
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        target, help_text = COMMANDS[name]
        module_name, _, attr = target.partition(":")
        module = importlib.import_module(module_name)
        obj = getattr(module, attr)
        cmd = typer.main.get_command(obj) if isinstance(obj, typer.Typer) else obj
        cmd.name = name
        if not cmd.help:
            cmd.help = help_text
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Listing must not import every subcommand: use the help kept in COMMANDS.
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ranksight")
def main() -> None:
    """ranksight: which rank, which node, since which step, and why."""


if __name__ == "__main__":
    main()
