"""completion_leads and last_arriver_ops in numpy give what the per-communicator pandas code gave (kept here as
the reference): the same rows, in the same order, the same floats, on a window with a slow link, a dropped op,
drifted sequence numbers and ties in arrival."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analyzers.checks.links import SYMMETRIC_OPS, completion_leads, last_arriver_ops
from analyzers.collectives import member_counts
from analyzers.stats import leave_one_out_median


def _reference_filter(co, first_step, tol_of):
    co = co[co["t_done"].notna() & co["duration_ms"].notna() & co["op"].astype(str).str.lower().isin(SYMMETRIC_OPS)]
    if first_step is not None:
        co = co[co["step"] >= first_step]
    g = co.groupby(["gkey", "seq"])
    size = member_counts(co["group_ranks"])
    spread = (g["t_done"].transform("max") - g["t_done"].transform("min")) * 1000.0
    return co[(g["rank"].transform("size") == size) & (size >= 2) & (spread <= tol_of(g))]


def reference_leads(co, first_step, tol=10.0):
    ok = _reference_filter(co, first_step, lambda g: np.maximum(tol, g["duration_ms"].transform("max")))
    parts = []
    for _, sub in ok.groupby("gkey"):
        done = sub.pivot_table(index="rank", columns="seq", values="t_done", aggfunc="first")
        lead = ((leave_one_out_median(done) - done) * 1000.0).stack().rename("lead_ms").reset_index()
        parts.append(sub[["gkey", "seq", "rank", "step", "duration_ms"]].merge(lead, on=["rank", "seq"]))
    return pd.concat(parts, ignore_index=True)[["gkey", "seq", "rank", "step", "lead_ms", "duration_ms"]]


def reference_last(co, first_step, tol=10.0):
    ok = _reference_filter(co, first_step, lambda g: tol)
    last = ok.loc[ok.groupby(["gkey", "seq"])["t_arrive"].idxmax()]
    return last[["gkey", "seq", "rank", "step", "duration_ms", "group", "group_ranks"]].reset_index(drop=True)


def window(seed=0, ranks=16, steps=40, extra_kinds=True):
    rng = np.random.default_rng(seed)
    rows = []
    groups = {"tp": [list(range(i, i + 4)) for i in range(0, ranks, 4)],
              "dp": [list(range(i, ranks, 4)) for i in range(4)]}
    for s in range(steps):
        base = 1.7e9 + s * 0.1
        for name, gs in groups.items():
            for m in gs:
                key = f"{name}[{','.join(map(str, m))}]"
                arrive = {r: base + rng.uniform(0, 0.01) for r in m}
                arrive[m[0]] = arrive[m[-1]]  # a tie in arrival
                last = max(arrive.values())
                for r in m:
                    if name == "dp" and r == 5 and s == 7:
                        continue  # an op one member never recorded: dropped
                    extra = 0.004 if (r == 6 and s >= 20) else 0.0  # rank 6's link is slow: it finishes first
                    seq = 2 * s + (name == "dp") + (1 if (r == 9 and name == "tp" and s >= 30) else 0)
                    done = last + 0.002 + rng.uniform(0, 0.0005) - extra
                    rows.append(dict(rank=r, step=s, seq=seq, op="all_reduce" if s % 9 else "ALLREDUCE", group=name,
                                     gkey=key, group_ranks=np.array(m), t_arrive=arrive[r], t_done=done,
                                     duration_ms=(done - arrive[r]) * 1000.0))
    if extra_kinds:  # a communicator whose only op is rooted (left out) sorts between the kept ones
        for r in (0, 4):
            rows.append(dict(rank=r, step=3, seq=0, op="broadcast", group="pp", gkey="pp[0,4]", group_ranks=np.array([0, 4]),
                             t_arrive=1.7e9, t_done=1.7e9 + 0.001, duration_ms=1.0))
    return pd.DataFrame(rows).sample(frac=1.0, random_state=seed).reset_index(drop=True)


@pytest.mark.parametrize("block_cells", [None, 7])
def test_completion_leads_same_as_per_communicator_pivots(block_cells, monkeypatch):
    if block_cells:  # the members' times a few instances at a time
        from analyzers.checks import completion_leads as leads_module
        monkeypatch.setattr(leads_module, "LEAD_BLOCK_CELLS", block_cells)
    for seed in range(3):
        co = window(seed)
        for first in (None, 5):
            got = completion_leads(co, first)
            want = reference_leads(co, first)
            assert len(got) and got["lead_ms"].abs().max() > 0
            pd.testing.assert_frame_equal(got[want.columns].astype({"gkey": object}), want.astype({"gkey": object}),
                                          check_dtype=False)


def test_last_arriver_ops_same_as_groupby_idxmax():
    for seed in range(3):
        co = window(seed)
        got, want = last_arriver_ops(co, 3), reference_last(co, 3)
        assert len(got)
        assert (got["ops"] == 1).all()  # unfolded records: one op each
        pd.testing.assert_frame_equal(got.drop(columns=["group_ranks", "ops", "gcode", "row"]), want.drop(columns="group_ranks"),
                                      check_dtype=False)


def test_last_arriver_ops_leave_out_a_record_before_the_first_step_of_a_complete_op():
    """A stray record of an op (the same communicator and seq) in a step before the first one judged: left out, the
    op keeps its members' records and stays complete; the stray's later arrival must not make it the last arriver."""
    from analyzers.checks import op_instances

    co = window(0)
    op = co[(co["step"] == 10) & (co["gkey"] == co.loc[co["step"] == 10, "gkey"].iloc[0])]
    stray = op.iloc[[0]].assign(step=1, t_arrive=op["t_arrive"].max() + 1.0)
    with_stray = pd.concat([co, stray], ignore_index=True)
    for data in (co, with_stray):
        op_instances.release_op_instances()
        got, want = last_arriver_ops(data, 3), reference_last(data, 3)
        pd.testing.assert_frame_equal(got.drop(columns=["group_ranks", "ops", "gcode", "row"]),
                                      want.drop(columns="group_ranks"), check_dtype=False)
    op_instances.release_op_instances()


def test_last_arriver_ops_by_chunks_of_records_are_the_whole_ones(monkeypatch):
    from analyzers.checks import op_instances

    for seed in range(3):
        co = window(seed)
        whole = last_arriver_ops(co, 3)
        op_instances.release_op_instances()
        monkeypatch.setattr(op_instances, "RECORD_CHUNK", 5)
        got = last_arriver_ops(co, 3)
        op_instances.release_op_instances()
        monkeypatch.undo()
        assert len(co) > 5 * 4 and len(got)
        pd.testing.assert_frame_equal(got, whole)


def test_completion_leads_of_every_record_read_through_every_row():
    """Every record of one kind of op, all timed: the positions are an ``EveryRow``, not an arange; the leads' rows
    and their lookup by position are the arange's."""
    from analyzers.checks import completion_leads as leads_module, op_instances

    co = window(1, extra_kinds=False)
    co = co[co["op"].isin(op_instances.SYMMETRIC_OPS) & co["t_done"].notna() & co["duration_ms"].notna()]
    co = co.reset_index(drop=True)
    op_instances.release_op_instances()
    leads = leads_module.CompletionLeads(co, None)
    assert isinstance(leads._arrays["rows"], op_instances.EveryRow) and not leads.empty
    arange = leads_module.CompletionLeads(co, None)
    arange._arrays = dict(arange._arrays, rows=np.arange(len(co), dtype=np.int32))
    probe = np.r_[np.arange(-2, len(co) + 3), np.random.default_rng(0).integers(0, len(co), 50)]
    np.testing.assert_array_equal(leads.at_rows(probe), arange.at_rows(probe))
    sel = leads.positions()[::3]
    pd.testing.assert_frame_equal(leads.frame(sel), arange.frame(sel))
    op_instances.release_op_instances()


def test_stable_order_is_lexsort():
    from analyzers.collectives import stable_order
    rng = np.random.default_rng(3)
    for n, hi in ((0, 1), (500, 4), (5000, 70_000), (5000, 2**40)):
        a, b = rng.integers(0, hi, n), rng.integers(0, 3, n).astype(np.int32)
        assert (stable_order(a) == np.argsort(a, kind="stable")).all()
        assert (stable_order(b, a) == np.lexsort((a, b))).all()
    neg = np.array([3, -1, 2, -1])
    assert (stable_order(neg) == np.argsort(neg, kind="stable")).all()  # falls back to lexsort


def test_windowed_medians_in_slices_of_whole_rows_are_the_same():
    from analyzers.checks import links
    from analyzers.stats import windowed_medians
    rng = np.random.default_rng(4)
    n = 20_000
    lab, st, v, w = rng.integers(0, 300, n) * 7, rng.integers(0, 120, n), rng.random(n), rng.integers(1, 3, n)
    index = sorted(set(lab.tolist()), reverse=True)[:250]  # some labels left out, rows in descending order
    steps = list(range(5, 120))
    old = links.CHUNK_ROWS
    try:
        links.CHUNK_ROWS = 700  # many slices
        for window, min_ops, weights in ((3, 4, None), (1, 1, None), (3, 4, w)):
            want = windowed_medians(lab, st, v, index, steps, window, min_ops, weights=weights)
            got = links._label_windowed_medians(lab, st, v, index, steps, window, min_ops, weights)
            assert want.notna().to_numpy().sum() > 1000
            pd.testing.assert_frame_equal(got, want)
    finally:
        links.CHUNK_ROWS = old


def test_sorted_members_of_shared_and_separate_lists():
    from analyzers.checks.links import sorted_members
    shared = np.array([5, 1, 3])
    rows = [shared] * 3000 + [np.array([2, 0])] + [np.array([9, 8])] * 2  # shared objects; distinct equal arrays
    got = sorted_members(pd.Series(rows, dtype=object))
    assert got[:3000] == [(1, 3, 5)] * 3000 and got[3000:] == [(0, 2), (8, 9), (8, 9)]
    separate = [np.array([i % 7, 100 - i % 7]) for i in range(5000)]  # all distinct objects: by bytes
    assert sorted_members(pd.Series(separate, dtype=object)) == [tuple(sorted((i % 7, 100 - i % 7))) for i in range(5000)]


def test_symmetric_instances_derived_from_every_non_p2p_one_are_the_same():
    """The symmetric instances derived from the non-p2p ones (a mask over their records, no copies) give their
    callers what the symmetric ones built from the records give: the same complete records, in the same order, with
    the same per-record values and per-instance figures; and the same last arrivers and completion leads."""
    from analyzers.checks import op_instances
    _OpInstances = op_instances._OpInstances
    for seed in range(2):
        co = window(seed)
        co.loc[co.sample(frac=0.05, random_state=seed).index, "duration_ms"] = np.nan  # records without a duration
        co.loc[co["step"] == 11, "op"] = "broadcast"  # a rooted op: not symmetric, but not p2p either
        for first in (None, 5):
            want = _OpInstances(co, first, "symmetric")
            got = _OpInstances(co, None, "not_p2p").symmetric_from(first)
            assert list(got.gkeys) == list(want.gkeys)
            for longest in (False, True):
                ok_g, ok_w = got.complete(10.0, longest=longest), want.complete(10.0, longest=longest)
                assert len(ok_g) == len(ok_w) > 100
                for name in ("rows", "gcode", "seq", "rank", "step", "t_done", "dur", "t_arrive", "weight", "size"):
                    np.testing.assert_array_equal(getattr(got, name)[ok_g], getattr(want, name)[ok_w], err_msg=name)
                ig, iw = got.inst[ok_g], want.inst[ok_w]
                np.testing.assert_array_equal(np.unique(ig, return_inverse=True)[1], np.unique(iw, return_inverse=True)[1])
                for name in ("inst_size", "inst_count", "inst_spread_ms", "inst_dur_max"):
                    np.testing.assert_array_equal(getattr(got, name)[ig], getattr(want, name)[iw], err_msg=name)
            # through the round's cache: the wait grid first (every non-p2p op), then the symmetric ones derived
            op_instances.release_op_instances()
            want_last, want_leads = last_arriver_ops(co, first), completion_leads(co, first)
            op_instances.release_op_instances()
            op_instances.collective_wait_ms(co)
            got_last, got_leads = last_arriver_ops(co, first), completion_leads(co, first)
            op_instances.release_op_instances()
            pd.testing.assert_frame_equal(got_last, want_last)
            pd.testing.assert_frame_equal(got_leads, want_leads)


def test_completion_leads_for_a_subset_are_those_of_the_whole():
    """``CompletionLeads`` works out the leads of the records asked for (their ops' members only): the same floats
    as ``completion_leads`` of every record, looked up by position, by rank and by row of ``co``."""
    from analyzers.checks.completion_leads import CompletionLeads
    from analyzers.checks.op_instances import release_op_instances
    for seed in (0, 1):
        co = window(seed)
        release_op_instances()
        whole = completion_leads(co, 2)
        release_op_instances()
        leads = CompletionLeads(co, 2)
        by_row = pd.Series(whole["lead_ms"].to_numpy(), index=whole["row"].to_numpy())
        rng = np.random.default_rng(seed)
        sel = np.sort(rng.choice(leads.positions(), 37, replace=False))
        frame = leads.frame(sel)
        assert frame["lead_ms"].tolist() == by_row.loc[frame["row"]].tolist()
        assert leads.lead_ms(sel).tolist() == frame["lead_ms"].tolist()
        for r in (0, 6, 9):
            mine = leads.of_rank(r)
            assert (mine["rank"] == r).all() and len(mine) == int((whole["rank"] == r).sum())
            assert mine["lead_ms"].tolist() == by_row.loc[mine["row"]].tolist()
        rows = np.r_[whole["row"].to_numpy()[:50], len(co) + 5, -1]  # two rows that are no complete record
        got = leads.at_rows(rows)
        assert got[:50].tolist() == whole["lead_ms"].to_numpy()[:50].tolist() and np.isnan(got[50:]).all()
        # a rooted op's record (the broadcast, not symmetric) has no lead
        rooted = np.flatnonzero(co["op"].to_numpy() == "broadcast")
        assert np.isnan(leads.at_rows(rooted)).all()
