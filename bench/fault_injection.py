"""Fault injection on the real data path (issue 16, "Must show"): for every record the head acknowledged, exactly once
in the store; no false hang; no eviction of a healthy node; poison records read past and counted.

    .venv/bin/python bench/fault_injection.py                       # every scenario (about 10-15 min on 2 cores)
    .venv/bin/python bench/fault_injection.py --only head_kill9_mid --only poison_utf8 --steps 30

Each scenario is one real 2-node x 2-rank CPU training run (torchrun per node, c10d rendezvous; bench/fault_rig.py)
with a head and one agent per node, in a temporary directory of its own, and one fault:

- ``agent_kill9_mid``: node 1's agent is killed with SIGKILL mid-run and started again 3 s later;
- ``head_kill9_mid``: the head is killed with SIGKILL mid-run and started again on the same store 4 s later;
- ``kill9_at_end``: every agent and the head are killed with SIGKILL as the last step is written, then started again;
- ``head_down_at_end``: the head stops before training ends; the agents stop (SIGTERM, 3 s drain timeout) with their
  outboxes undelivered; the head comes back and ``ranksight agent --drain`` delivers what each agent left;
- ``disk_full``: the head's store is on a small tmpfs (``mount -t tmpfs``), filled to the last byte mid-run; the head
  is killed with SIGKILL while the disk is full, the space is freed, the head starts again on the same store;
- ``clock_skew_+120`` / ``clock_skew_-120``: node 1's agent and training ranks run with their wall clock 120 s ahead
  of / behind the head's (an LD_PRELOAD shim, bench/clock_skew.c, built here with gcc);
- ``poison_utf8``, ``poison_negative``, ``poison_trace``, ``poison_foreign_run``: mid-run, a line with invalid UTF-8,
  a step record with negative tokens and FLOPs (the key of a step already written), a profiler trace with an
  overlong UTF-8 sequence, a step record of another run are added to rank 0's files.

Counted per scenario: records the head acknowledged (keys of the records in every request it answered 200, seen by
a pass-through proxy in front of it) against the head's Parquet store (read with ranksight.tables): missing and
stored more than once; the ranks' step records (spool files) against the stored steps; hang findings of the head's
live analysis (every episode it stored, and its API) and of the post-mortem analyzers over the stored run (what
``diagnose`` runs); evict actions (the policy runs in dry-run: a decision to evict is recorded all the same); the
poison records and where each was counted. The table goes to stdout, the rows to bench/results/fault_injection.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fault_rig import ROOT, Rig, log_count  # noqa: E402

from analyzers import run_all  # noqa: E402
from analyzers.loader import load_run  # noqa: E402
from ranksight import schema  # noqa: E402
from ranksight.tables import KEYS  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "fault_injection.json"
TABLES = [t for t, k in KEYS.items() if k and t != "actions"]  # the record tables the agents ship


# ---------------------------------------------------------------------------
# scenarios: each drives one Rig from start to a clean stop and returns notes for its row
# ---------------------------------------------------------------------------

def start_all(rig: Rig, agent_env: dict | None = None, train_env: dict | None = None, drain_timeout: float = 15.0):
    rig.start_head()
    for n in (0, 1):
        rig.start_agent(n, env=agent_env if n == 1 else None, drain_timeout=drain_timeout)
    rig.start_training(train_env)


def stop_all(rig: Rig) -> dict:
    reports = rig.stop_agents()
    rig.kill_head(signal.SIGTERM)
    rig.say("agents and head stopped (SIGTERM)")
    undelivered = sum(r.get("undelivered_records", 0) for r in reports.values())
    return {"exit_undelivered": undelivered, "exit_reports_missing": sum(1 for r in reports.values() if r.get("missing"))}


def s_agent_kill9_mid(rig: Rig) -> dict:
    start_all(rig)
    rig.wait_step(rig.steps // 3)
    rig.kill_agent(1)
    rig.say(f"agent 1 kill -9 at step {rig.last_step()}")
    time.sleep(3)
    rig.start_agent(1)
    rig.wait_training()
    return stop_all(rig)


def s_head_kill9_mid(rig: Rig) -> dict:
    start_all(rig)
    rig.wait_step(rig.steps // 3)
    rig.read_head()
    rig.kill_head()
    rig.say(f"head kill -9 at step {rig.last_step()}")
    time.sleep(4)
    rig.start_head()
    rig.wait_training()
    return stop_all(rig)


def s_kill9_at_end(rig: Rig) -> dict:
    start_all(rig)
    rig.wait_step(rig.steps)
    rig.read_head()
    for n in (0, 1):
        rig.kill_agent(n)
    rig.kill_head()
    rig.say(f"agents and head kill -9 at step {rig.last_step()}")
    rig.wait_training()
    rig.start_head()
    for n in (0, 1):
        rig.start_agent(n)
    time.sleep(8)  # restarted agents resume from their saved positions
    return stop_all(rig)


def s_head_down_at_end(rig: Rig) -> dict:
    start_all(rig, drain_timeout=3.0)
    rig.wait_step(rig.steps * 2 // 3)
    rig.kill_head(signal.SIGTERM)
    rig.say(f"head stopped at step {rig.last_step()}")
    rig.wait_training()
    reports = rig.stop_agents()
    left = sum(r.get("undelivered_records", 0) for r in reports.values())
    rig.say(f"agents stopped: {left} record(s) undelivered per their exit reports")
    rig.start_head()
    codes = {n: rig.drain_agent(n) for n in (0, 1)}
    rig.say(f"`ranksight agent --drain` exit codes {codes}")
    time.sleep(3)
    rig.kill_head(signal.SIGTERM)
    return {"exit_undelivered": left, "drain_codes": codes}


def mount_tmpfs(path: Path, size: str) -> str | None:
    """Mount a tmpfs of ``size`` at ``path``; None, or why it could not be."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr.strip() or f"mount exited {r.returncode}")


def fill(path: Path) -> int:
    """Write ``path`` until the file system is full; bytes written."""
    n = 0
    chunk = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                n += f.write(chunk)
            except OSError:
                small = b"\0" * 4096
                try:
                    while True:
                        n += f.write(small)
                except OSError:
                    return n


def s_disk_full(rig: Rig) -> dict:
    start_all(rig)
    rig.wait_step(rig.steps // 3)
    filler = rig.head_store / "filler"
    size = fill(filler)
    rig.say(f"head's tmpfs filled at step {rig.last_step()} ({size >> 20} MiB)")
    time.sleep(6)  # the head must refuse (503) what it cannot store
    before = rig.proxy.statuses.get("/v1/logs 503", 0)
    rig.kill_head()
    rig.say(f"head kill -9 while the disk is full ({before} request(s) answered 503 so far)")
    filler.unlink()
    rig.start_head()
    rig.say("space freed, head started again on the same store")
    rig.wait_training()
    out = stop_all(rig)
    out["wal_full"] = log_count(rig.logs, "head", "WalFull") + log_count(rig.logs, "head", "No space left")
    return out


def build_skew_shim(tmp: Path) -> Path:
    so = tmp / "clock_skew.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(so), str(ROOT / "bench" / "clock_skew.c"), "-ldl"],
                   check=True, capture_output=True)
    return so


def skew_scenario(skew_s: float):
    def run(rig: Rig) -> dict:
        so = build_skew_shim(rig.tmp)
        base = {"LD_PRELOAD": str(so), "RSFI_SKEW_S": str(skew_s)}
        start_all(rig, agent_env=base, train_env={**base, "RSFI_SKEW_NODE": "1"})
        rig.wait_training()
        time.sleep(3)
        rig.read_head()
        out = stop_all(rig)
        out["skew_s_ranks"] = ranks_skew(rig)
        return out
    return run


def ranks_skew(rig: Rig) -> float | None:
    """Node 1's ranks' clock minus node 0's, measured: the median difference of their step end times (the ranks
    of a step end within milliseconds of each other, at the all-reduce)."""
    import statistics

    st = rig.stored("steps")
    if st.empty:
        return None
    by = st.groupby(["step", "node"])["t_end"].median().unstack()
    if 0 not in by or 1 not in by:
        return None
    return round(float(statistics.median((by[1] - by[0]).dropna())), 1)


def spool_line(rig: Rig, rank: int, step: int) -> schema.StepRecord:
    from ranksight.spool import read_spool

    for r in read_spool(rig.rd.spool_dir / f"rank-{rank}.jsonl").records:
        if isinstance(r, schema.StepRecord) and r.step == step:
            return r
    raise LookupError(f"rank {rank} has no step {step}")


def append(rig: Rig, rank: int, line: bytes) -> None:
    # one write() with O_APPEND, as the rank's own writer: the line lands whole between two of its records
    with open(rig.rd.spool_dir / f"rank-{rank}.jsonl", "ab", buffering=0) as f:
        f.write(line)


def poison_scenario(kind: str):
    def run(rig: Rig) -> dict:
        start_all(rig)
        rig.wait_step(max(3, rig.steps // 3))
        rank = 0
        if kind == "utf8":
            append(rig, rank, b'{"kind":"event","run_id":"' + rig.run_id.encode() + b'\xff\xfe","rank":0,"step":1,'
                              b'"t":1.0,"event":"x"}\n')
        elif kind == "negative":
            rec = msgspec.structs.replace(spool_line(rig, rank, 2), tokens=-5, flops=-1.0)
            append(rig, rank, schema.encode(rec) + b"\n")
        elif kind == "foreign_run":
            rec = msgspec.structs.replace(spool_line(rig, rank, 2), run_id="another-run")
            append(rig, rank, schema.encode(rec) + b"\n")
        elif kind == "trace":
            rig.rd.traces_dir.mkdir(parents=True, exist_ok=True)
            p = rig.rd.traces_dir / f"rank-{rank}.json"
            p.write_bytes(b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a\xc0\xafb", "ts": 1, "dur": 2, '
                          b'"pid": 1, "tid": 1}]}')
        rig.say(f"poison ({kind}) into rank {rank}'s files at step {rig.last_step()}")
        rig.wait_training()
        time.sleep(3)
        rig.read_head()
        out = stop_all(rig)
        out["poison"] = kind
        return out
    return run


SCENARIOS = {
    "agent_kill9_mid": s_agent_kill9_mid,
    "head_kill9_mid": s_head_kill9_mid,
    "kill9_at_end": s_kill9_at_end,
    "head_down_at_end": s_head_down_at_end,
    "disk_full": s_disk_full,
    "clock_skew_+120": skew_scenario(120.0),
    "clock_skew_-120": skew_scenario(-120.0),
    "poison_utf8": poison_scenario("utf8"),
    "poison_negative": poison_scenario("negative"),
    "poison_trace": poison_scenario("trace"),
    "poison_foreign_run": poison_scenario("foreign_run"),
}


# ---------------------------------------------------------------------------
# counting
# ---------------------------------------------------------------------------

def count(rig: Rig, notes: dict) -> dict:
    """The row of one finished scenario, from the proxy's record of acknowledgements, the spools and the store."""
    acked_unique = acked_missing = stored_dup = resent = 0
    per_table = {}
    for table in TABLES:
        acked = rig.proxy.acked.get(table, {})
        stored = rig.stored_keys(table)
        miss = sum(1 for k in acked if k not in stored)
        dup = sum(c - 1 for c in stored.values() if c > 1)
        acked_unique += len(acked)
        acked_missing += miss
        stored_dup += dup
        resent += sum(c - 1 for c in acked.values() if c > 1)
        if acked or stored:
            per_table[table] = {"acked": len(acked), "stored": len(stored), "missing": miss, "dup": dup}
    written = rig.written_steps()
    stored_steps = rig.stored_keys("steps")
    findings = rig.stored("findings")
    live_hang_ids = set(findings.loc[findings["kind"] == "hang", "id"]) if not findings.empty else set()
    live_hang_ids |= {i for i, f in rig.live_findings.items() if f.get("kind") == "hang"}
    skew_ids = set(findings.loc[findings["kind"] == "clock_skew", "id"]) if not findings.empty else set()
    try:
        post = run_all(load_run(rig.head_store, rig.run_id, source="store"))
        post_hang = [f.summary for f in post if f.kind == "hang"]
    except Exception as e:  # noqa: BLE001 - a store the analyzers cannot read is itself a result
        post_hang = [f"analyzers failed: {type(e).__name__}: {e}"]
    actions = rig.stored("actions")
    evicts = actions[actions["action"] == "evict"] if not actions.empty else actions
    events = rig.stored("events")
    gaps = int((events["event"] == "spool_gap").sum()) if not events.empty else 0
    stats = {k: sum(s.get(k, 0) for s in rig.head_stats.values()) for k in ("rejected", "records_new", "duplicates")}
    row = {
        "acked": acked_unique, "acked_missing": acked_missing, "stored_dup": stored_dup, "acked_again": resent,
        "steps_written": len(written), "steps_stored": len(stored_steps),
        "steps_missing": len(written - set(stored_steps)), "steps_dup": sum(c - 1 for c in stored_steps.values() if c > 1),
        "hang_live": len(live_hang_ids), "hang_diagnose": len(post_hang), "hang_summaries": post_hang[:3],
        "evictions": int(evicts["id"].nunique()) if not evicts.empty else 0,
        "evict_reasons": sorted(set(evicts["reason"])) if not evicts.empty else [],
        "clock_skew_findings": len(skew_ids), "spool_gaps": gaps, "head_rejected": stats["rejected"],
        "http_503": rig.proxy.statuses.get("/v1/logs 503", 0), "per_table": per_table, **notes,
    }
    if notes.get("poison") == "trace":
        row["traces_set_aside"] = log_count(rig.logs, "agent-node", "not summarized")
    if notes.get("poison") == "negative":
        st = rig.stored("steps")
        row["stored_negative_tokens"] = int((st["tokens"] < 0).sum()) if not st.empty else 0
    if notes.get("poison") == "foreign_run":
        row["foreign_run_stored"] = (rig.head_store / "another-run").exists()
    return row


def poison_counted(row: dict) -> str:
    kind = row.get("poison")
    if kind == "utf8":
        return f"{row['spool_gaps']} spool_gap event"
    if kind == "negative":
        return f"duplicate key dropped; {row['stored_negative_tokens']} negative rows stored"
    if kind == "trace":
        return f"{row['traces_set_aside']} trace set aside (agent log)"
    if kind == "foreign_run":
        return f"{row['head_rejected']} refused by the head" + (" (but stored!)" if row["foreign_run_stored"] else "")
    return "-"


def fault_seen(row: dict) -> str:
    """What shows that the fault took effect (and what the data path did about it)."""
    out = []
    if row.get("acked_again"):
        out.append(f"{row['acked_again']} record key(s) acknowledged twice, stored once")
    if row.get("http_503"):
        out.append(f"{row['http_503']} requests answered 503")
    if row.get("wal_full"):
        out.append(f"{row['wal_full']} disk-full errors in the head's log, head kill -9 while full")
    if row.get("exit_undelivered"):
        out.append(f"{row['exit_undelivered']} undelivered at agent stop, then `--drain` exit codes "
                   f"{sorted(row.get('drain_codes', {}).values())}" if "drain_codes" in row else
                   f"{row['exit_undelivered']} undelivered at agent stop")
    if row.get("exit_reports_missing"):
        out.append(f"{row['exit_reports_missing']} agent(s) without exit report")
    if row.get("skew_s_ranks") is not None:
        out.append(f"node 1's ranks {row['skew_s_ranks']:+.0f} s (measured), {row['clock_skew_findings']} clock_skew finding")
    if row.get("evict_reasons"):
        out.append("evict: " + "; ".join(row["evict_reasons"]))
    if "kill -9" in " ".join(row.get("timeline", [])) and not out:
        out.append(next(e for e in row["timeline"] if "kill -9" in e))
    return "; ".join(out) or "-"


def run_scenario(name: str, steps: int, keep: bool = False) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"rsfi-{name.replace('+', 'p')}-"))
    head_store = None
    mounted = False
    if name == "disk_full":
        head_store = tmp / "head-tmpfs"
        why = mount_tmpfs(head_store, "48m")
        if why:
            shutil.rmtree(tmp, ignore_errors=True)
            return {"scenario": name, "skipped": f"cannot mount a tmpfs for the head's store: {why}"}
        mounted = True
    t0 = time.monotonic()
    rig = Rig(tmp, f"fi-{name.replace('+', 'p')}", steps, head_store=head_store)
    try:
        notes = SCENARIOS[name](rig)
        row = {"scenario": name, **count(rig, notes)}
    except Exception as e:  # noqa: BLE001 - one broken scenario is reported, the others still run
        row = {"scenario": name, "error": f"{type(e).__name__}: {e}"}
    finally:
        rig.close()
        if mounted:
            subprocess.run(["umount", "-l", str(head_store)], capture_output=True)
    row["wall_s"] = round(time.monotonic() - t0, 1)
    row["timeline"] = rig.events
    row["ok"] = ok(row)
    if keep:
        row["dir"] = str(tmp)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return row


def ok(row: dict) -> bool:
    if "error" in row or "skipped" in row:
        return False
    return (row["acked_missing"] == 0 and row["stored_dup"] == 0 and row["steps_missing"] == 0
            and row["hang_live"] == 0 and row["hang_diagnose"] == 0 and row["evictions"] == 0)


def table(rows: list[dict]) -> str:
    head = ("| scenario | acked | acked missing | stored twice | steps written / stored | hang (live / diagnose) "
            "| evictions | poison counted | the fault, seen | wall s |\n|---|---|---|---|---|---|---|---|---|---|")
    out = [head]
    for r in rows:
        if "skipped" in r or "error" in r:
            out.append(f"| {r['scenario']} | {r.get('skipped') or 'ERROR ' + r['error']} | | | | | | | | {r.get('wall_s', '')} |")
            continue
        out.append(f"| {r['scenario']} | {r['acked']} | {r['acked_missing']} | {r['stored_dup']} | "
                   f"{r['steps_written']} / {r['steps_stored']} | {r['hang_live']} / {r['hang_diagnose']} | "
                   f"{r['evictions']} | {poison_counted(r)} | {fault_seen(r)} | {r['wall_s']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=list(SCENARIOS), help="run this scenario (repeatable)")
    ap.add_argument("--steps", type=int, default=50, help="training steps per run")
    ap.add_argument("--results", default=str(RESULTS), help="JSON file for the rows ('' for none)")
    ap.add_argument("--keep", action="store_true", help="keep each scenario's directory (logs, stores)")
    args = ap.parse_args(argv)
    rows = []
    for name in args.only or list(SCENARIOS):
        row = run_scenario(name, args.steps, keep=args.keep)
        rows.append(row)
        print(f"{name}: {'ok' if row['ok'] else 'NOT OK'} in {row['wall_s']} s "
              f"{json.dumps({k: v for k, v in row.items() if k not in ('timeline', 'per_table')})}", flush=True)
    print()
    print(table(rows))
    if args.results:
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        Path(args.results).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["ok"] or "skipped" in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
