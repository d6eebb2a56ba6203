"""Spools of collective records for the drill-down tests (``GET /ops``, ``ranksight ops``), and an agent endpoint
served on a free 127.0.0.1 port."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from agent_helpers import TOKEN
from ranksight import schema
from ranksight.layout import RunDir
from ranksight.spool import SpoolWriter

TP = schema.communicator_id("tp", [0, 1])
DP = schema.communicator_id("dp", [0, 2])


def step_ops(run_id: str, rank: int, step: int, *, tp_ops: int = 4, dp_ops: int = 2, attempt: int = 0,
             t0: float = 1.7e9, node: int = 0) -> list:
    """A rank's records of one step: ``tp_ops`` all-reduces on TP, ``dp_ops`` reduce-scatters on DP (durations
    1, 2, 3 ... ms within each kind), then its step record."""
    recs: list = []
    t = t0 + step
    seq = step * (tp_ops + dp_ops)
    for i in range(tp_ops):
        recs.append(schema.CollectiveRecord(run_id=run_id, rank=rank, step=step, seq=seq, op="all_reduce", group="tp",
                                            comm_id=TP, nbytes=1 << 20, t_arrive=t, t_done=t + (i + 1) / 1e3,
                                            duration_ms=float(i + 1), attempt=attempt))
        seq += 1
        t += 0.01
    for i in range(dp_ops):
        recs.append(schema.CollectiveRecord(run_id=run_id, rank=rank, step=step, seq=seq, op="reduce_scatter",
                                            group="dp", comm_id=DP, nbytes=4 << 20, t_arrive=t,
                                            t_done=t + (i + 1) / 1e3, duration_ms=float(i + 1), attempt=attempt))
        seq += 1
        t += 0.01
    recs.append(schema.StepRecord(run_id=run_id, rank=rank, step=step, node=node, host=f"node{node}", world_size=4,
                                  t_start=t0 + step, t_end=t, step_ms=(t - t0 - step) * 1e3, attempt=attempt))
    return recs


def write_steps(path: Path, run_id: str, rank: int, steps, garbage_after: dict[int, list[bytes]] | None = None,
                **kw) -> None:
    """Append ``steps``' records to the spool at ``path`` (as ``SpoolWriter`` does), with the lines of
    ``garbage_after[step]`` written raw after that step's collectives."""
    w = SpoolWriter(path)
    try:
        for s in steps:
            recs = step_ops(run_id, rank, s, **kw)
            for r in recs[:-1]:
                w.add(r)
            w.flush()
            for line in (garbage_after or {}).get(s, []):
                os.write(w.fd, line + b"\n")
            w.write_now(recs[-1])
    finally:
        os.close(w.fd)


@contextmanager
def agent_endpoint(store: Path, run_id: str, ranks: list[int], node: int = 0, token: str = TOKEN, tls=None):
    """A node agent's endpoint (``node.control.ControlServer``; HTTPS with a server ``tls`` context) for ``ranks``
    on 127.0.0.1; yields the server (``srv.url``)."""
    from node.control import ControlServer
    from node.prom import AgentMetrics
    from ranksight.http_server import serve_in_thread, shutdown_server

    srv = ControlServer(("127.0.0.1", 0), rd=RunDir(store, run_id), node=node, token=token, metrics=AgentMetrics(),
                        local_ranks=lambda: list(ranks), tls=tls)
    serve_in_thread(srv, "test-agent-http")
    try:
        yield srv
    finally:
        shutdown_server(srv)
        srv.server_close()
