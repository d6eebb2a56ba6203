"""``make demo``: a user's day with ranksight, on this CPU.

1. ``ranksight launch``: a two-node run (one torchrun per simulated node, 2 ranks each)
   with a head and one node agent per node, and a straggler injected on one rank;
   live progress and the head's live findings on the terminal.
2. ``diagnose <run-id>``: the post-mortem report of that run, read from the run store.
3. A check that the report named the injected culprit, and nothing else, as a straggler, and
   what the head's checkpoint-and-evict policy decided (dry-run by default).

Every step is the command a user would type; the demo only strings them together.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.rule import Rule

console = Console()

CULPRIT_RANK = 3
ONSET_STEP = 12
STEPS = 40


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    console.print(f"[dim]$ {' '.join(cmd)}[/]")
    return subprocess.run(cmd, **kw)


def show_policy_actions(run_dir: Path) -> None:
    """What the head's evict policy decided while the run trained (dry-run by default: nothing was sent)."""
    import pandas as pd

    table = run_dir / "actions"
    if not table.is_dir():
        console.print("The head's evict policy decided nothing during this run.")
        return
    acts = pd.read_parquet(table)
    acts = acts[acts["requested_by"] == "policy"]
    if acts.empty:
        console.print("The head's evict policy decided nothing during this run.")
    for a in acts.itertuples():
        mode = "dry run: not sent" if a.dry_run else a.status
        console.print(f"Head policy: {a.action} node {a.node} ({mode}) — {a.reason}")


def main() -> int:
    store = Path("runs")
    run_id = time.strftime("demo-%Y%m%d-%H%M%S")
    ranksight = [sys.executable, "-m", "ranksight.cli"]
    fault = f"slow_rank:rank={CULPRIT_RANK},factor=1.6,start={ONSET_STEP}"

    console.print(Rule("ranksight demo"))
    console.print(
        "A 4-rank data-parallel GPT run on two simulated nodes (gloo on this CPU), watched by a head and\n"
        f"two node agents. Rank {CULPRIT_RANK} is made 1.6x slower from step {ONSET_STEP} on: in synchronous training\n"
        "every rank's step time then grows, and ranksight must say which rank is the culprit.\n"
        "GPU telemetry on this machine is SIMULATED (no GPU), and says so everywhere."
    )
    console.print(Rule("1. train, with agents and a head"))
    launch = run([*ranksight, "launch", "--nnodes", "2", "--nproc-per-node", "2", "--steps", str(STEPS),
                  "--run-id", run_id, "--store", str(store), "--inject", fault, "--timeout", "900",
                  "--", "--d-model", "128", "--n-layers", "4", "--batch-size", "16", "--quiet"])
    if launch.returncode != 0:
        console.print(f"[red]the training run failed (exit {launch.returncode}); logs are in {store / run_id / 'logs'}[/]")
        return 1

    console.print(Rule(f"2. diagnose {run_id}"))
    run([sys.executable, "-m", "analyzers.diagnose", run_id, "--store", str(store)])
    report = run([sys.executable, "-m", "analyzers.diagnose", run_id, "--store", str(store), "--json"],
                 capture_output=True, text=True)
    try:
        verdict = json.loads(report.stdout)
    except json.JSONDecodeError:
        console.print(f"[red]diagnose --json did not print JSON:[/] {report.stderr.strip()}")
        return 1

    console.print(Rule("3. did ranksight find the injected straggler?"))
    stragglers = [f for f in verdict["findings"] if f["kind"] == "straggler" and f["severity"] != "info"]
    named = sorted({r for f in stragglers for r in f["ranks"]})
    if named == [CULPRIT_RANK]:
        f = stragglers[0]
        console.print(f"[green]yes[/]: rank {CULPRIT_RANK} (node {', '.join(map(str, f['nodes']))}) named as the straggler since step "
                      f"{f['step_start']} (injected at step {ONSET_STEP}); its peers, which show the same long "
                      f"step times, were not blamed.\n  {f['summary']}")
        ok = True
    else:
        console.print(f"[red]no[/]: straggler findings name ranks {named or 'none'}, expected [{CULPRIT_RANK}] "
                      "(this 2-core machine may be too loaded for a clean signal; see bench/RESULTS.md).")
        ok = False
    show_policy_actions(store / run_id)
    console.print(f"\nThe run's files: {store / run_id}  (tables: pandas.read_parquet('{store / run_id}/steps'))\n"
                  f"More: diagnose {run_id} --store {store} --html report.html   |   ranksight runs --store {store}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
