"""``ranksight ops RUN --rank R --steps A-B``: a rank's raw collective records, drilled down from what the head
stores. Above 256 ranks the agents ship a step's ops of one kind on one communicator as one folded record (their
means); the records of every op stay in the rank's spool on its node. The head forwards this query to the agent of
the rank's node (``GET /api/runs/<id>/ops``, ``head/ops_proxy.py``) and this prints the answer: an 80-column table,
or the answer as one JSON object with ``--json``.

The table's ``vs mean`` column is the op's duration less the mean duration of its fold group (the rank's ops of that
step, kind and communicator listed here): what the folded record the head holds says for all of them. Times are
milliseconds after the first listed op's arrival (``t0``, printed above the table).
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone

import typer

from cli.head_options import DEFAULT_HEAD, HeadToken, HeadUrl, TlsCa, TlsClientCert, TlsClientKey

EXIT_OK = 0
EXIT_REFUSED = 3  # the head (or the agent) refused the query: a bad range (400), an unknown rank or run (404)
EXIT_UNREACHABLE = 4  # no answer from the head, its token refused, or the agent unreachable (502)

ops_command = typer.Typer(add_completion=False, help="A rank's raw collective records over a step range, from its "
                                                     "node's spool (through the head).")


@ops_command.command(help="Print a rank's raw collective records over a step range (at most 1,000 steps), read "
                          "from the spool on its node through the head. Exit codes: 0 shown; 3 refused (a bad range, "
                          "an unknown rank or run); 4 the head or the node's agent could not be reached.")
def ops(
    run_id: str = typer.Argument(..., help="The run id."),
    rank: int = typer.Option(..., "--rank", help="The rank."),
    steps: str = typer.Option(..., "--steps", help="A-B (inclusive), or one step A."),
    comm: str = typer.Option("", "--comm", help="Only this communicator: its id, or a group name (tp, dp, ...)."),
    op: str = typer.Option("", "--op", help="Only this op kind (all_reduce, reduce_scatter, ...)."),
    limit: int = typer.Option(10_000, "--limit", help="At most this many records (the answer says when cut)."),
    as_json: bool = typer.Option(False, "--json", help="Print the answer as one JSON object."),
    head: HeadUrl = DEFAULT_HEAD,
    token: HeadToken = "",
    tls_ca: TlsCa = "",
    tls_client_cert: TlsClientCert = "",
    tls_client_key: TlsClientKey = "",
    timeout: float = typer.Option(90.0, "--timeout", help="Seconds to wait for the answer (a node's first query "
                                                          "indexes the rank's spool)."),
) -> None:
    from ranksight.ops_query import decode_answer, parse_ops_query
    from ranksight.tls import ClientTls, TlsConfigError
    from tui.client import ClientError, HeadClient, HeadError

    params = {"rank": str(rank), "steps": steps, "limit": str(limit), "comm": comm, "op": op}
    try:
        q = parse_ops_query(params)  # the head's own check, here first: a usage error costs no request
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    try:
        client = HeadClient(head, token=token, timeout=timeout,
                            tls=ClientTls.from_options(tls_ca, tls_client_cert, tls_client_key)
                            if head.startswith("https://") else None)
    except TlsConfigError as e:
        raise typer.BadParameter(str(e)) from None

    def fail(status: int | None, msg: str, code: int) -> None:
        if as_json:
            sys.stdout.write(json.dumps({"error": msg, "status": status}) + "\n")
        else:
            sys.stderr.write((f"refused ({status}): " if status else "error: ") + msg + "\n")
        raise typer.Exit(code)

    try:
        body = client.ops(run_id, q.params())
    except HeadError as e:
        fail(e.status, e.message, EXIT_REFUSED if e.status in (400, 404) else EXIT_UNREACHABLE)
    except ClientError as e:
        fail(None, str(e), EXIT_UNREACHABLE)
    try:
        answer = decode_answer(body)
    except ValueError as e:
        fail(None, f"{client.base_url}: {e}", EXIT_UNREACHABLE)
    if as_json:
        sys.stdout.buffer.write(body + b"\n")
        sys.stdout.flush()
        return
    sys.stdout.write("\n".join(ops_table(answer)) + "\n")


def _bytes(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _fold_key(r) -> tuple:
    """What an agent folds into one record (``ranksight.collective_fold``): a rank's ops of one attempt's step, of
    one kind, on one communicator."""
    return r.attempt, r.step, r.op, r.comm_id or r.group


def ops_table(answer) -> list[str]:
    """The answer as lines of at most 80 columns: a header, one row per op, what was cut or lost, the communicators."""
    ops = answer.ops
    steps = (f"step {answer.step_from}" if answer.step_from == answer.step_to
             else f"steps {answer.step_from}-{answer.step_to}")
    head = f"run {answer.run_id}  rank {answer.rank} (node {answer.node})  {steps}"
    if answer.comm:
        head += f"  comm {answer.comm}"
    if answer.op:
        head += f"  op {answer.op}"
    lines = [head[:80]]
    if not ops:
        lines.append("no collective records in this range")
    else:
        t0 = min(r.t_arrive for r in ops)
        lines.append(f"{len(ops)} op(s); times in ms after t0 = "
                     f"{datetime.fromtimestamp(t0, timezone.utc).strftime('%Y-%m-%d %H:%M:%S.%f')} UTC")
        attempts = sorted({r.attempt for r in ops})
        if len(attempts) > 1:  # a restarted job ran these steps again: each attempt's rows, in the file's order
            lines.append(f"steps run more than once: attempts {', '.join(map(str, attempts))}, in the file's order")
        # the mean duration of each fold group: the rank's ops of one step, kind and communicator
        groups: dict[tuple, list[float]] = {}
        for r in ops:
            if r.duration_ms is not None:
                groups.setdefault(_fold_key(r), []).append(r.duration_ms)
        means = {k: sum(v) / len(v) for k, v in groups.items()}
        lines.append(f"{'step':>6} {'seq':>6} {'op':<10} {'comm':<8} {'nbytes':>7} {'arrive':>10} {'done':>10} "
                     f"{'dur':>8} {'vs mean':>7}")
        for r in ops:
            done = f"{(r.t_done - t0) * 1e3:10.3f}" if r.t_done is not None else f"{'-':>10}"
            dur = f"{r.duration_ms:8.3f}" if r.duration_ms is not None else f"{'-':>8}"
            mean = means.get(_fold_key(r))
            vs = f"{r.duration_ms - mean:+7.2f}" if mean is not None and r.duration_ms is not None else f"{'-':>7}"
            lines.append(f"{r.step:>6} {r.seq:>6} {r.op[:10]:<10} {r.group[:8]:<8} {_bytes(r.nbytes):>7} "
                         f"{(r.t_arrive - t0) * 1e3:10.3f} {done} {dur} {vs}")
    if answer.truncated:
        lines.append(f"cut at {answer.limit} records: ask for fewer steps, a --comm or an --op")
    if answer.damaged_lines:
        lines.append(f"{answer.damaged_lines} damaged spool line(s) in or next to this range (records lost there):")
        for g in answer.gaps[:5]:
            lines.append(f"  {g.lines} line(s), {g.nbytes} bytes at offset {g.offset}, after step {g.after_step}")
    comms = sorted({(r.group, r.comm_id) for r in ops if r.comm_id})
    for g, c in comms:
        lines.append(f"communicator {g}: {c}")
    return [ln if len(ln) <= 80 else ln[:79] + "…" for ln in lines]
