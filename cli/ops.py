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


def ops_table(answer) -> list[str]:
    """The answer as lines of at most 80 columns: a header, one row per op, what was cut or lost, the communicators
    (the rows: ``tui.ops_model``, which the TUI's ops screen shows too)."""
    from tui.ops_model import fmt_bytes, ops_model

    m = ops_model(answer)
    lines = [m.title[:80]]
    if not m.rows:
        lines.append("no collective records in this range")
    else:
        lines.append(f"{len(m.rows)} op(s); times in ms after t0 = "
                     f"{datetime.fromtimestamp(m.t0, timezone.utc).strftime('%Y-%m-%d %H:%M:%S.%f')} UTC")
        if len(m.attempts) > 1:  # a restarted job ran these steps again: each attempt's rows, in the file's order
            lines.append(f"steps run more than once: attempts {', '.join(map(str, m.attempts))}, in the file's order")
        lines.append(f"{'step':>6} {'seq':>6} {'op':<10} {'comm':<8} {'nbytes':>7} {'arrive':>10} {'done':>10} "
                     f"{'dur':>8} {'vs mean':>7}")
        for r in m.rows:
            done = f"{r.done_ms:10.3f}" if r.done_ms is not None else f"{'-':>10}"
            dur = f"{r.dur_ms:8.3f}" if r.dur_ms is not None else f"{'-':>8}"
            vs = f"{r.vs_mean_ms:+7.2f}" if r.vs_mean_ms is not None else f"{'-':>7}"
            lines.append(f"{r.step:>6} {r.seq:>6} {r.op[:10]:<10} {r.group[:8]:<8} {fmt_bytes(r.nbytes):>7} "
                         f"{r.arrive_ms:10.3f} {done} {dur} {vs}")
    lines += m.notes
    for g, c in m.comms:
        lines.append(f"communicator {g}: {c}")
    return [ln if len(ln) <= 80 else ln[:79] + "…" for ln in lines]
