"""A generated store with K ops per communicator per step, for the comm check's many-ops cost (bench/checks_scale.py).

bench/scale_gen.py writes one TP and one DP all-reduce per rank and step, a shape where the slow-communicator,
self-delay and early-finisher signatures cannot fill a window; this writes the same job through the same writer
(``scale_gen.generate``, its ``_block`` replaced) with K TP all-reduces through the compute and K DP bucket
all-reduces after it, and a slow link from half-way: the TP and DP groups of rank 9 move their data 0.6 ms and 2 ms
slower per op (the comm check names rank 9). The straggler of scale_gen's job is kept.

    bench/scale_gen_ops.py /tmp/s12-comm/r1024-s1000-k8 1024 1000 8
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import scale_gen as g  # noqa: E402

K = 8  # ops per communicator per step (the command line sets it)


def block(job, rng, s0, s1, tp_id, dp_id):
    R, n = job.ranks, s1 - s0
    steps = np.arange(s0, s1)
    shape = (n, job.dp, job.pp, job.tp)
    compute = 800.0 * rng.lognormal(0.0, 0.01, size=shape)
    slow = np.zeros(R, bool); slow[job.straggler] = True
    late = (steps >= job.start)[:, None] & slow[None, :]
    compute = np.where(late.reshape(shape), compute * job.factor, compute)
    data_ms = 2.0 + rng.exponential(0.5, size=shape)
    t_start = g.T0 + steps * job.step_s
    flat = lambda a: np.ascontiguousarray(np.broadcast_to(a, shape)).reshape(n * R)
    rank = np.tile(np.arange(R), n); step = np.repeat(steps, R)
    ts = np.repeat(t_start, R)
    co = np.zeros(2 * K * n * R, g.COLL.dtype)

    def fill(part, seq, group: bytes, nbytes: int, arr, done, ids) -> None:
        """One all-reduce of every rank-step: its rows of ``co`` (a strided view) from its arrivals and ends (ms)."""
        part["rank"], part["step"], part["seq"] = rank, step, seq
        part["op"], part["group"], part["nbytes"] = b"all_reduce", group, nbytes
        a, d = flat(arr), flat(done)
        part["t_arrive"], part["t_done"], part["duration_ms"] = ts + a / 1000.0, ts + d / 1000.0, d - a
        part["comm_id"] = np.tile(ids, n)

    # K TP all-reduces through the forward/backward (each after 1/K of the compute), then K DP bucket all-reduces
    # a slow link on rank SLOW from half-way: the TP and DP groups it is in move their data slower
    SLOW = 9
    on = (steps >= job.steps // 2)[:, None, None, None]
    sl = np.zeros(R, bool); sl[SLOW] = True; sl = sl.reshape(shape[1:])
    link_tp = on & sl.any(axis=2, keepdims=True)[None]  # (n, dp, pp, 1) broadcast
    link_tp = np.broadcast_to(link_tp, shape)
    link_dp = np.broadcast_to(on & sl.any(axis=0, keepdims=True)[None], shape)
    prev_done = np.zeros(shape)
    first_dp_arr = None
    for i in range(K):
        arr = np.maximum(data_ms + compute * (i + 1) / K, prev_done)
        x = 0.4 + rng.exponential(0.05, size=shape[:3] + (1,))
        x = x + 0.6 * link_tp[..., :1]  # the slow link's TP group
        done = arr.max(axis=3, keepdims=True) + x
        done = np.broadcast_to(done, shape)
        fill(co[i::2 * K], step * K + i, b"tp", 8 << 20, arr, done, tp_id)
        prev_done = done
    tp_done = prev_done
    for i in range(K):
        arr = prev_done + rng.exponential(0.1, size=shape)
        if first_dp_arr is None:
            first_dp_arr = arr
        x = 3.0 + rng.exponential(0.3, size=(n, 1) + shape[2:])
        x = x + 2.0 * link_dp[:, :1]  # the slow link's DP group
        done = np.broadcast_to(arr.max(axis=1, keepdims=True) + x, shape)
        fill(co[K + i::2 * K], step * K + i, b"dp", 128 << 20, arr, done, dp_id)
        prev_done = done
    dp_done = prev_done
    step_ms = dp_done + 5.0
    st = g.step_rows(job, R, steps, ts, flat(step_ms), flat(compute), flat(data_ms),
                     flat((tp_done - data_ms - compute) + (dp_done - first_dp_arr)),
                     ts + flat(first_dp_arr) / 1000.0, flat(first_dp_arr.max(axis=1, keepdims=True) - first_dp_arr), rng)
    return st, co

if __name__ == "__main__":
    out, R, S, K = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    g._block = block
    print(g.generate(g.Job(ranks=R, steps=S), out))
