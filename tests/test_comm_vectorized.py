"""The comm check's numpy paths give what the pandas code they replaced gave (kept here as the reference): the bus
bandwidth rows per op instance (``_busbw_rows``) and the collective wait grid (``collective_wait_ms``), on records
with several communicators and message sizes, folded records, a missing member list, an op one member never
recorded, mixed-case op names and a categorical / string column mix."""

from __future__ import annotations

import numpy as np
import pandas as pd

from analyzers.checks import busbw, comm, completion_leads
from analyzers.checks.comm import BUSBW_FACTOR, CommConfig, busbw_gbs
from analyzers.checks.links import P2P_OPS
from analyzers.collectives import member_counts, op_counts


def reference_busbw_rows(co: pd.DataFrame, base: pd.DataFrame, cfg: CommConfig) -> pd.DataFrame:
    """The loop over op instances that ``_busbw`` ran before (main at 1aea11b)."""
    co = co[co["duration_ms"].notna() & (co["nbytes"] > 0)]
    co = co.assign(per_op_bytes=co["nbytes"] / op_counts(co), ops=op_counts(co))
    g = co.groupby(["gkey", "group", "seq", "op"]).agg(dur=("duration_ms", "min"), nbytes=("per_op_bytes", "max"),
                                                       n=("rank", "nunique"), step=("step", "min"), ops=("ops", "max"))
    g = g.reset_index()
    gsize = co.groupby(["gkey", "seq"])["group_ranks"].first()
    rows = []
    for _, row in g.iterrows():
        members = gsize.get((row["gkey"], row["seq"]))
        n = len(members) if isinstance(members, (list, np.ndarray)) and len(members) else int(row["n"])
        bw = busbw_gbs(str(row["op"]), float(row["nbytes"]), float(row["dur"]), n)
        if bw is None:
            continue
        op = str(row["op"]).lower().replace("nccl:", "")
        b = base[base["op"].str.replace("_", "") == op.replace("_", "")]
        if b.empty:
            continue
        idx = (np.log(b["size_bytes"].clip(lower=1)) - np.log(max(row["nbytes"], 1))).abs().idxmin()
        ref = b.loc[idx]
        if max(ref["size_bytes"], row["nbytes"]) / max(min(ref["size_bytes"], row["nbytes"]), 1) > cfg.size_match:
            continue
        rows.append(dict(group=row["group"], op=op, step=int(row["step"]), nbytes=float(row["nbytes"]), busbw=bw,
                         ops=int(row["ops"]), baseline=float(ref["busbw"]), baseline_size=float(ref["size_bytes"])))
    return pd.DataFrame(rows)


def reference_collective_wait_ms(co: pd.DataFrame) -> pd.DataFrame:
    """``collective_wait_ms`` as it was (groupby-transform and pivot_table)."""
    co = co[co["t_done"].notna() & ~co["op"].isin(P2P_OPS)]
    g = co.groupby(["gkey", "seq"])
    size = member_counts(co["group_ranks"])
    spread = (g["t_done"].transform("max") - g["t_done"].transform("min")) * 1000.0
    ok = (g["rank"].transform("size") == size) & (size >= 2) & (spread <= CommConfig.match_tol_ms)
    co = co[ok]
    late = (co.groupby(["gkey", "seq"])["t_arrive"].transform("max") - co["t_arrive"]) * 1000.0
    late = late * op_counts(co)
    return co.assign(late=late).pivot_table(index="rank", columns="step", values="late", aggfunc="sum")


def records(seed: int = 0, steps: int = 12, categorical: bool = False) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    groups = {"tp": [list(range(i, i + 4)) for i in range(0, 16, 4)], "dp": [list(range(i, 16, 4)) for i in range(4)]}
    rows = []
    for s in range(steps):
        for name, gs in groups.items():
            for gi, m in enumerate(gs):
                for k in range(3 if name == "tp" else 1):
                    seq = s * 3 + k
                    op = ["all_reduce", "ALL_GATHER", "nccl:reduce_scatter", "broadcast"][(s + k + gi) % 4]
                    nbytes = float([1 << 20, 1 << 26, 3 << 24][(k + gi) % 3])
                    t0 = 1.7e9 + s + k * 0.01
                    for r in m:
                        if name == "dp" and r == 5 and s == 7:
                            continue  # an op one member never recorded
                        folded = 2 if (name == "tp" and r % 3 == 0) else 1
                        arrive = t0 + rng.uniform(0, 0.004)
                        dur = rng.uniform(1.0, 9.0) if not (s == 3 and r == 2) else np.nan
                        rows.append(dict(rank=r, step=s, seq=seq, op=op, group=name,
                                         gkey=f"{name}[{','.join(map(str, m))}]",
                                         group_ranks=np.array(m) if not (name == "dp" and gi == 1) else np.array([], dtype=np.int64),
                                         nbytes=nbytes * folded, ops=folded, t_arrive=arrive,
                                         t_done=np.nan if (s == steps - 1 and r == 0) else arrive + 0.01,
                                         duration_ms=dur))
    co = pd.DataFrame(rows).sample(frac=1.0, random_state=seed).reset_index(drop=True)
    if categorical:
        co = co.astype({"op": "category", "group": "category", "gkey": "category"})
    return co


BASE = pd.DataFrame({"op": ["all_reduce", "allgather", "reduce_scatter", "all_reduce"],
                     "size_bytes": [1 << 20, 1 << 26, 1 << 26, 1 << 27], "busbw": [3.0, 40.0, 35.0, 80.0],
                     "nranks": [4, 4, 4, 4]})


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    df = df.astype({"group": object, "op": object})
    return df.sort_values(list(df.columns)).reset_index(drop=True)


def test_busbw_rows_same_as_the_loop_over_instances():
    cfg = CommConfig()
    for seed in range(3):
        for categorical in (False, True):
            co = records(seed, categorical=categorical)
            got, want = busbw.busbw_rows(co, BASE, cfg), reference_busbw_rows(co, BASE, cfg)
            assert len(want) > 20 and set(want["op"]) == {"all_reduce", "all_gather", "reduce_scatter"}
            pd.testing.assert_frame_equal(_sorted(got)[list(want.columns)], _sorted(want), check_dtype=False,
                                          check_exact=True)


def test_busbw_rows_none_without_a_matching_baseline():
    co = records(0)
    assert busbw.busbw_rows(co, BASE.assign(size_bytes=BASE["size_bytes"] * 1000), CommConfig()) is None
    assert all(op in BUSBW_FACTOR for op in ("all_reduce", "all_gather", "reduce_scatter"))


def test_collective_wait_ms_same_as_pivot_table():
    for seed in range(3):
        for categorical in (False, True):
            co = records(seed, categorical=categorical)
            got, want = comm.collective_wait_ms(co), reference_collective_wait_ms(co)
            assert want.shape[0] == 16 and np.nanmax(want.to_numpy()) > 0
            pd.testing.assert_frame_equal(got, want, check_dtype=False, check_names=False, check_exact=False,
                                          rtol=1e-12, atol=1e-9)


def test_name_starts_with_as_astype_str():
    from analyzers.collectives import name_starts_with
    names = ["pp:0>1", "dp", None, "pp:x", "tp"]
    for s in (pd.Series(names), pd.Series(names, dtype="category"), pd.Series(names, dtype=object),
              pd.Series(["pp:0>1", 3, np.nan], dtype=object)):
        for prefix in ("pp:", ("dp", "tp")):
            assert name_starts_with(s, prefix).tolist() == s.astype(str).str.startswith(prefix).fillna(False).tolist()


def test_rank_positions_by_mask_then_by_sort():
    rng = np.random.default_rng(5)
    rank = rng.integers(3, 60, 5000).astype(np.int32)
    positions = completion_leads.RankPositions(rank)
    for r in list(range(0, 64)) + [5, 40]:  # more ranks than FEW: the later ones from the sorted rows
        np.testing.assert_array_equal(positions.of(r), np.flatnonzero(rank == r))
    assert positions.order is not None


def test_collective_wait_ms_of_a_few_ranks_is_their_rows_of_the_whole():
    """The waits of a few ranks, from the records of their own ops only: the same floats as their rows of every
    rank's grid (a step none of their ops has is a missing column, which the check reads as no wait)."""
    from analyzers.checks.op_instances import collective_wait_ms_of, release_op_instances
    for seed in range(3):
        for categorical in (False, True):
            co = records(seed, categorical=categorical)
            release_op_instances()
            whole = comm.collective_wait_ms(co)
            for ranks in ({3}, {0, 5, 11}, {15, 99}):
                got = collective_wait_ms_of(co, ranks)
                assert list(got.index) == sorted(r for r in ranks if r in whole.index)
                want = whole.loc[got.index]
                pd.testing.assert_frame_equal(got.reindex(columns=want.columns), want, check_exact=True)
                assert set(got.columns) <= set(want.columns)
            assert collective_wait_ms_of(co, {99}).empty
