"""The live analysis round at scale: the window cut without a sort, the columnar frames, the rank-scaled window."""

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from analyzers.loader import RunData
from head.analysis import MIN_ANALYZE_WINDOW, ROUND_STEP_ROWS, round_window
from head.live import RunLive
from head.live_frames import analysis_frame, window_chunks, window_rows
from ranksight import schema
from ranksight.tables import SPECS


def _chunks(seed: int, n_chunks: int = 12, ranks: int = 9) -> list[pa.Table]:
    """Batches as a live window holds them: ranks interleaved, some ranks silent for a while (a rank that stopped
    early keeps old rows), repeated steps (a restart), rows of a rank out of order within a batch."""
    rng = np.random.default_rng(seed)
    out, step = [], np.zeros(ranks, np.int64)
    for c in range(n_chunks):
        n = int(rng.integers(0, 40))
        rank = rng.integers(-1, ranks, n)  # a negative rank too: kept in the window, cut like the others
        if c > n_chunks // 2:
            rank = rank[rank != 3]  # rank 3 went silent half way
        s = np.empty(len(rank), np.int64)
        for i, r in enumerate(rank):
            step[r] += 1 if rng.random() > 0.1 else -3  # now and then a restart re-runs steps
            s[i] = max(step[r], 0)
        out.append(pa.table({"rank": pa.array(rank, pa.int64()), "step": pa.array(s, pa.int64()),
                             "row": pa.array(np.arange(len(rank)) + 1000 * c)}))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k,steps_k", [(1, None), (5, None), (7, 3), (20, 6), (1000, None), (4, 50)])
def test_window_chunks_keeps_the_rows_window_rows_keeps(seed, k, steps_k):
    chunks = _chunks(seed)
    want = window_rows(pa.concat_tables(chunks), k, steps_k)
    got = window_chunks(chunks, k, steps_k)
    got_rows = pa.concat_tables(got).column("row").to_pylist() if got else []
    assert got_rows == want.column("row").to_pylist()  # the same rows, in arrival order


def test_window_chunks_of_ranks_far_apart_keeps_the_same_rows():
    chunks = [pa.table({"rank": pa.array([0, 1 << 40, 5, 1 << 40], pa.int64()), "step": pa.array([1, 1, 2, 2]),
                        "row": pa.array([0, 1, 2, 3])}),
              pa.table({"rank": pa.array([1 << 40, 0], pa.int64()), "step": pa.array([3, 3]), "row": pa.array([4, 5])})]
    got = pa.concat_tables(window_chunks(chunks, 1)).column("row").to_pylist()
    assert got == window_rows(pa.concat_tables(chunks), 1).column("row").to_pylist() == [2, 4, 5]


def test_window_chunks_drops_whole_batches_older_than_every_ranks_window():
    chunks = [pa.table({"rank": pa.array([0, 1] * 4, pa.int64()), "step": pa.array(np.repeat(np.arange(4), 2) + 4 * c)})
              for c in range(10)]
    got = window_chunks(chunks, 8)
    assert len(got) == 2 and got[0] is chunks[-2] and got[1] is chunks[-1]  # kept whole, not copied
    assert window_chunks([], 8) == [] and window_chunks([chunks[0].slice(0, 0)], 8) == []


def _step(rank, s, t0=1000.0, **kw):
    t_end = t0 + s * 0.2 + 0.17
    return schema.StepRecord(run_id="r1", rank=rank, step=s, node=rank // 2, host=f"n{rank // 2}", world_size=4,
                             dp_rank=rank, t_start=t_end - 0.17, t_end=t_end, step_ms=170.0, compute_ms=100.0 + rank,
                             comm_ms=65.0, sync_arrival=t_end - 0.07, sync_wait_ms=5.0 * rank, tokens=1000, **kw)


def _coll(rank, s, comm_id=None, members=None, done=True, seq=None):
    t = 1000.0 + s * 0.2
    return schema.CollectiveRecord(run_id="r1", rank=rank, step=s, seq=2 * s if seq is None else seq, op="all_reduce",
                                   group="dp", group_ranks=members or [], comm_id=comm_id, nbytes=1 << 20,
                                   t_arrive=t, t_done=t + 0.01 if done else None, duration_ms=None)


def _normalized(table: str, chunks, k, steps_k, comms) -> pd.DataFrame:
    """The row-wise way: the window's rows as a DataFrame, through RunData.normalize."""
    t = window_rows(pa.concat_tables(chunks), k, steps_k)
    df = t.to_pandas()
    data = RunData(run_id="r1", communicators=comms, **{table: df})
    return getattr(data, table)


def _same_frame(got: pd.DataFrame, want: pd.DataFrame, keys: list[str]) -> None:
    got = got.sort_values(keys).reset_index(drop=True)
    want = want.sort_values(keys).reset_index(drop=True)
    assert len(got) == len(want)
    for c in got.columns:
        if c in ("group_ranks",):
            assert [list(a) for a in got[c]] == [list(b) for b in want[c]]
            continue
        a, b = got[c], want[c]
        if isinstance(a.dtype, pd.CategoricalDtype) or a.dtype == object or str(a.dtype) in ("str", "string"):
            assert a.astype(object).where(a.notna(), None).tolist() == b.astype(object).where(b.notna(), None).tolist(), c
        elif a.dtype == np.float32:  # the columnar reader may narrow a column (analyzers/columnar.py): float32's precision
            np.testing.assert_allclose(a.to_numpy(dtype=float), b.to_numpy(dtype=float), rtol=1e-6, err_msg=c)
        else:
            np.testing.assert_array_equal(a.to_numpy(dtype=float), b.to_numpy(dtype=float), err_msg=c)


def test_analysis_frames_equal_what_normalize_gives():
    comms = pd.DataFrame([{"run_id": "r1", "comm_id": "c-dp", "group": "dp", "ranks": [0, 1, 2, 3], "rank": 0}])
    steps = [SPECS["steps"].to_table("r1", [_step(r, s) for r in range(4) for s in range(b, b + 5)]) for b in (0, 5, 10)]
    steps.append(SPECS["steps"].to_table("r1", [_step(1, 12, attempt=1, t0=1100.0)]))  # a restart re-runs step 12
    colls = [SPECS["collectives"].to_table("r1", [_coll(r, s, comm_id="c-dp") for r in range(4) for s in range(b, b + 5)])
             for b in (0, 5, 10)]
    colls.append(SPECS["collectives"].to_table("r1", [_coll(2, 14, members=[0, 2])]))  # an older writer's own list
    colls.append(SPECS["collectives"].to_table("r1", [_coll(3, 14, comm_id="c-dp", done=False, seq=28),
                                                      _coll(3, 14, comm_id="c-dp", seq=28)]))  # arrival, then done
    for k, steps_k in ((8, None), (100, None), (40, 6)):
        got = analysis_frame("steps", steps, k)
        _same_frame(got[[c for c in got.columns]], _normalized("steps", steps, k, None, comms)[list(got.columns)],
                    ["rank", "step"])
        got = analysis_frame("collectives", colls, k, steps_k, comms)
        want = _normalized("collectives", colls, k, steps_k, comms)
        _same_frame(got, want[list(got.columns)], ["rank", "step", "seq"])


def test_analysis_frame_leaves_a_window_without_the_readers_columns_to_the_row_wise_way():
    t = SPECS["steps"].to_table("r1", [_step(0, 1)]).drop_columns(["device_ms"])
    assert analysis_frame("steps", [t], 8) is None
    live = RunLive("r1", window=16)
    live._steps.append(t)  # as a batch of an older writer would sit in the window
    live._steps_rows = 1
    assert live.run_data().steps["step"].tolist() == [1]


def test_run_data_marks_the_columnar_tables_prepared():
    live = RunLive("r1", window=16)
    live.add("steps", [_step(r, s) for s in range(3) for r in range(4)])
    data = live.run_data()
    assert {"steps"} <= data.prepared and "collectives" not in data.prepared  # no collectives: normalize's empty frame
    assert data.steps.groupby("rank")["step"].count().tolist() == [3, 3, 3, 3]


def test_round_window_shrinks_with_the_rank_count_only_at_scale():
    assert round_window(256, 4) == 256 and round_window(256, 4096) == 256  # every recorded run, and up to 4,096
    assert round_window(256, 8192) == 128 and round_window(256, 16384) == MIN_ANALYZE_WINDOW == 64
    assert round_window(256, 1 << 20) == MIN_ANALYZE_WINDOW  # never fewer
    assert round_window(32, 16384) == 32  # never more than asked
    assert round_window(None, 16384) is None and round_window(256, 0) == 256 and round_window(256, 16384, 0) == 256
    assert ROUND_STEP_ROWS // 16384 == 64


def test_a_round_at_scale_hands_the_analyzers_the_rank_scaled_window(tmp_path):
    from head.service import Head
    from agent_helpers import TOKEN

    seen = []
    h = Head(tmp_path / "store", TOKEN, analyzer=lambda d: seen.append(d.steps.groupby("rank")["step"].count()) or [],
             window=256, analyze_window=200)
    try:
        live = h.live.run("r1")
        live.add("steps", [_step(r, s) for s in range(210) for r in range(4)])
        h.analysis.analyze_once("r1")
        h.analysis.round_rows = 4 * 20  # as if 4 ranks were thousands: 20 steps each, but not below the minimum
        h.analysis.analyze_once("r1")
    finally:
        h.close()
    assert seen[0].tolist() == [200] * 4 and seen[1].tolist() == [MIN_ANALYZE_WINDOW] * 4
