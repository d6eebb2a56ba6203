"""The comm check's shortcuts for 1,024 x 10,000 and 16,384 x 1,000 give what the general code gives: the instance
numbering by a table, gkey numbered from its categorical codes, the longest duration in float32, the leave-one-out
medians of an op's members without an argsort, every record's lead kept once most are asked for, full rank x step
grids placed by one scatter, and the early-finisher signature skipped where no (rank, communicator) can fill a
window (and run, and still firing, where one can)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import pandas as pd
from test_comm_vectorized import records
from test_links_vectorized import window
from test_slow_link_analysis import CROSS, warnings, with_egress_ops

from analyzer_fixtures import build
from analyzers import stats
from analyzers.matrices import RankStepCells, rank_step_matrix
from analyzers.checks import completion_leads, links, op_instances
from analyzers.checks.comm import CommConfig


def test_instance_numbers_by_table_are_those_of_the_hashed_keys():
    rng = np.random.default_rng(1)
    gcode = rng.integers(0, 7, 5000).astype(np.int32)
    seq = rng.integers(-3, 400, 5000).astype(np.int32)
    narrow, m = op_instances._instance_numbers(gcode, seq)
    wide, m2 = op_instances._instance_numbers(gcode, seq * 1000)  # too sparse for a table: hashed
    key = gcode.astype(np.int64) * 10_000 + seq
    want = np.unique(key, return_inverse=True)[1]
    assert m == m2 == len(np.unique(key))
    assert (narrow == want).all() and (wide == want).all()


def test_instance_numbers_of_a_gapless_span_are_the_keys_as_numbered_by_the_hash():
    # every (communicator, seq) of the span present (each communicator's sequence numbers without a gap, the
    # generated stores): the keys are their own numbers, as the running count and the hashed keys number them
    rng = np.random.default_rng(2)
    gcode = np.repeat(np.arange(5, dtype=np.int32), 300)
    seq = np.tile(np.arange(7, 307, dtype=np.int32), 5)
    order = rng.permutation(len(gcode))
    gcode, seq = np.r_[gcode[order], gcode[:40]], np.r_[seq[order], seq[:40]]  # some keys twice
    got, m = op_instances._instance_numbers(gcode, seq)
    hashed, m2 = op_instances._instance_numbers(gcode, seq * 1000)
    assert m == m2 == 5 * 300
    assert (got == hashed).all() and got.dtype == np.int32


def test_instances_communicators_from_the_table_are_those_of_their_records():
    rng = np.random.default_rng(5)
    for gapless in (True, False):
        gcode = np.repeat(np.arange(4, dtype=np.int32), 50)
        seq = np.tile(np.arange(-3, 47, dtype=np.int32), 4)
        if not gapless:  # some keys missing: numbered by the running count
            kept = rng.random(len(gcode)) < 0.7
            gcode, seq = gcode[kept], seq[kept]
        order = rng.permutation(len(gcode))
        inst, m, inst_gcode = op_instances._instances(gcode[order], seq[order])
        want = np.zeros(m, np.int64)
        want[inst] = gcode[order]
        assert inst_gcode is not None and (inst_gcode == want).all() and inst_gcode.dtype == np.int64
    assert op_instances._instances(gcode, seq * 100_000)[2] is None  # hashed: scattered by the caller


def test_gkey_numbered_from_categorical_codes_with_every_category_present():
    cats = ["tp[4,5]", "dp[0,2]", "tp[0,1]"]
    col = pd.Series(pd.Categorical(["tp[4,5]", "dp[0,2]", "tp[0,1]", "dp[0,2]"], categories=cats))
    codes, uniq = op_instances._factorize_sorted(col)
    want_codes, want_uniq = pd.factorize(col, sort=True)
    assert list(codes) == list(want_codes) and list(uniq) == list(np.asarray(want_uniq, dtype=object))


def test_float_values_are_the_column_own_array_or_a_float64_conversion():
    col = pd.Series([1.0, np.nan, 3.0])
    assert np.shares_memory(op_instances.float_values(col), col.to_numpy())
    for other in (pd.Series([1.0, None, 3.0], dtype="Float64"), pd.Series([1, 2, 3], dtype=np.int32),
                  pd.Series([1.0, np.nan], dtype=np.float32)):
        got = op_instances.float_values(other)
        np.testing.assert_array_equal(got, other.to_numpy(dtype=float, na_value=np.nan))
        assert got.dtype == np.float64


def test_counts_by_chunks_are_bincounts(monkeypatch):
    monkeypatch.setattr(op_instances, "RECORD_CHUNK", 7)
    codes = np.random.default_rng(4).integers(0, 9, 100).astype(np.int32)
    for n in (0, 5, 7, 100):
        got = op_instances.counts(codes[:n], 12)
        np.testing.assert_array_equal(got, np.bincount(codes[:n], minlength=12))
        assert got.dtype == np.int64


def test_every_row_indexes_and_searches_as_its_arange():
    rng = np.random.default_rng(6)
    for n in (0, 1, 9, 40):
        every, arange = op_instances.EveryRow(n), np.arange(n, dtype=np.int32)
        assert len(every) == n
        np.testing.assert_array_equal(np.asarray(every), arange)
        picks = [slice(None), slice(2, 7), slice(None, None, 3), rng.random(n) < 0.5, np.zeros(0, np.int64)]
        if n:
            picks += [rng.integers(0, n, 12), rng.integers(-n, n, 12).astype(np.int32), np.int64(n - 1)]
        for at in picks:
            got, want = every[at], arange[at]
            np.testing.assert_array_equal(got, want)
            assert np.asarray(got).dtype == want.dtype
        for bad in ([n], [-n - 1], np.ones(n + 1, bool)):
            with pytest.raises(IndexError):
                every[np.asarray(bad)]
        v = rng.integers(-3, n + 3, 20)
        for side in ("left", "right"):
            np.testing.assert_array_equal(every.searchsorted(v, side), arange.searchsorted(v, side))


def test_gkey_numbered_from_categorical_codes_as_factorize_sorts():
    cats = ["tp[4,5]", "dp[0,2]", "unused", "tp[0,1]", "dp[1,3]"]
    values = ["tp[4,5]", "dp[1,3]", None, "tp[0,1]", "dp[0,2]", "tp[4,5]"]
    col = pd.Series(pd.Categorical(values, categories=cats))
    codes, uniq = op_instances._factorize_sorted(col)
    want_codes, want_uniq = pd.factorize(col, sort=True)
    assert list(codes) == list(want_codes) and list(uniq) == list(np.asarray(want_uniq, dtype=object))


def test_longest_duration_in_float32_is_the_float64_one():
    co = records(2, categorical=True)
    co32 = co.astype({"duration_ms": np.float32})
    a = op_instances._OpInstances(co32, None, "not_p2p")
    b = op_instances._OpInstances(co32.astype({"duration_ms": np.float64}), None, "not_p2p")
    np.testing.assert_array_equal(a.inst_dur_max, b.inst_dur_max)
    assert a.inst_dur_max.dtype == np.float64


def _reference_row_loo_median(mat):
    """The argsort version it replaced: each cell's place in its sorted row, then the middle one or two others."""
    n, s = mat.shape
    order = np.argsort(mat, axis=1, kind="stable")
    srt = np.take_along_axis(mat, order, axis=1)
    pos = np.empty_like(order)
    np.put_along_axis(pos, order, np.broadcast_to(np.arange(s), (n, s)), axis=1)
    m = s - 1
    lo = np.where((m - 1) // 2 >= pos, (m - 1) // 2 + 1, (m - 1) // 2)
    hi = np.where(m // 2 >= pos, m // 2 + 1, m // 2)
    return (np.take_along_axis(srt, lo, axis=1) + np.take_along_axis(srt, hi, axis=1)) / 2.0


def test_leads_by_blocks_of_instances_are_the_whole_ones(monkeypatch):
    rng = np.random.default_rng(24)
    sizes = rng.integers(2, 6, 300)
    inst = np.repeat(np.arange(300), sizes).astype(np.int32)
    order = rng.permutation(len(inst))
    inst = inst[order]
    done = rng.choice([1.0, 1.001, 1.002, 1.0035], size=len(inst)) + rng.integers(0, 3, len(inst)) * 0.0001
    whole = completion_leads._leads_ms(inst, done, sizes)
    for cells in (1, 5, 64):
        monkeypatch.setattr(completion_leads, "LEAD_BLOCK_CELLS", cells)
        np.testing.assert_array_equal(completion_leads._leads_ms(inst, done, sizes), whole)
    want = (stats.group_loo_median(inst, done) - done) * 1000.0
    np.testing.assert_allclose(whole, want, rtol=0, atol=1e-6)


def test_row_loo_median_without_argsort_is_the_same_with_ties():
    rng = np.random.default_rng(3)
    for s in (2, 3, 4, 7, 8, 32):
        mat = rng.integers(0, 4, (400, s)).astype(float) * 0.25 + 1.7e9  # many ties
        np.testing.assert_array_equal(completion_leads._row_loo_median(mat), _reference_row_loo_median(mat))
        mat = rng.random((400, s))
        np.testing.assert_array_equal(completion_leads._row_loo_median(mat), _reference_row_loo_median(mat))


def test_leads_kept_once_are_those_worked_out_per_subset():
    co = window(seed=4)
    whole = completion_leads.CompletionLeads(co, 2)
    pos = whole.positions()
    few = pos[:10]
    got_few = whole.lead_ms(few)  # a few: their ops' only, nothing kept
    assert whole._lead is None
    got_all = whole.lead_ms(pos)  # most of them: every record's, kept
    assert whole._lead is not None
    np.testing.assert_array_equal(got_all[:10], got_few)
    np.testing.assert_array_equal(whole.lead_ms(few), got_few)
    fresh = completion_leads.CompletionLeads(co, 2)
    for chunk in np.array_split(pos, 7):
        np.testing.assert_array_equal(fresh.lead_ms(chunk[::2]), got_all[np.searchsorted(pos, chunk[::2])])
    op_instances.release_op_instances()


def test_full_grid_matrices_are_pivot_tables():
    rng = np.random.default_rng(5)
    rows = pd.DataFrame({"rank": np.repeat(np.arange(6), 9), "step": np.tile(np.arange(3, 12), 6),
                         "x": rng.random(54)}).sample(frac=1.0, random_state=1).reset_index(drop=True)
    cells = RankStepCells(rows["rank"].to_numpy(), rows["step"].to_numpy())
    assert len(cells.cell) == 54
    want = rows.pivot_table(index="rank", columns="step", values="x", aggfunc="last").sort_index(axis=1)
    pd.testing.assert_frame_equal(cells.matrix(rows["x"].to_numpy()), want, check_names=False)
    pd.testing.assert_frame_equal(rank_step_matrix(rows, "x"), want, check_names=False)
    dup = pd.concat([rows, rows.iloc[:5].assign(x=-1.0)], ignore_index=True)  # a cell with two rows: its last
    want = dup.pivot_table(index="rank", columns="step", values="x", aggfunc="last").sort_index(axis=1)
    pd.testing.assert_frame_equal(rank_step_matrix(dup, "x"), want, check_names=False)


def test_row_robust_sigmas_of_a_finite_matrix_as_with_gaps():
    rng = np.random.default_rng(6)
    v = rng.normal(size=(50, 31))
    got = stats.row_robust_sigmas(v)
    want = [stats.robust_sigma(row) for row in v]
    np.testing.assert_array_equal(got, want)
    v[3, 4] = np.nan
    np.testing.assert_array_equal(stats.row_robust_sigmas(v)[[0, 3]], [stats.robust_sigma(v[0]), stats.robust_sigma(v[3])])


def test_windowed_medians_of_a_categorical_column_as_of_its_strings():
    rng = np.random.default_rng(7)
    labels = pd.Series(rng.choice(["b", "a", "c"], 600)).astype(pd.CategoricalDtype(["c", "a", "b", "unused"]))
    step = rng.integers(0, 30, 600)
    vals = rng.random(600)
    index = ["a", "b", "zz"]
    got = stats.windowed_medians(labels, step, vals, index, list(range(30)), 3, 2)
    want = stats.windowed_medians(labels.astype(str).to_numpy(), step, vals, index, list(range(30)), 3, 2)
    pd.testing.assert_frame_equal(got, want)


def _leads(co, first_step=1):
    op_instances.release_op_instances()
    return completion_leads.CompletionLeads(co, first_step)


def test_window_can_fill_is_false_only_where_no_pair_can_fill_a_window():
    cfg = CommConfig()
    one = window(seed=0)  # one op per communicator and step, two communicators a rank: cells of two
    assert not links.window_can_fill(_leads(one), cfg.link_window, cfg.link_min_ops, cheaper_only=False)
    assert links.window_can_fill(_leads(one), cfg.link_window, 3, cheaper_only=False)  # 3 steps hold 3 ops
    # where pairing costs no more than the bound, it is not worked out (True), unless the records are in (step,
    # rank) order (the bound from neighbours: test_window_bound_from_records_in_order_is_the_counted_one)
    assert links.most_in_cell_in_order(*_cell_arrays(_leads(one))) is None
    assert links.window_can_fill(_leads(one), cfg.link_window, cfg.link_min_ops)
    # two ops of one communicator in a step: a cell of two that is one pair's
    tp = one[one["group"] == "tp"]
    twice = pd.concat([tp, tp.assign(seq=tp["seq"] + 1000)], ignore_index=True)
    assert links.window_can_fill(_leads(twice), cfg.link_window, cfg.link_min_ops, cheaper_only=False)
    # records that stand for two ops each
    assert links.window_can_fill(_leads(one.assign(ops=2)), cfg.link_window, cfg.link_min_ops, cheaper_only=False)
    # three records in a cell: bounded by the count
    dp = one[one["group"] == "dp"]
    three = pd.concat([one, dp.assign(seq=dp["seq"] + 1000, gkey=dp["gkey"].str.replace("dp", "ep"))], ignore_index=True)
    assert links.window_can_fill(_leads(three), cfg.link_window, cfg.link_min_ops, cheaper_only=False)
    op_instances.release_op_instances()


def test_early_finishers_skipped_only_where_they_cannot_fire(monkeypatch):
    # the bound worked out at any size: the slow egress with 8 ops a step is still found by its ranks finishing first
    real = links.window_can_fill
    calls = []

    def always(leads, window, min_ops, chunk=1 << 22, cheaper_only=True):
        calls.append(real(leads, window, min_ops, chunk, cheaper_only=False))
        return calls[-1]

    monkeypatch.setattr(links, "window_can_fill", always)

    def slow(r, s, members):
        return r in (2, 3) and s >= 10 and members in CROSS["dp"]

    fs = warnings(with_egress_ops(build(world=4, nodes=2, steps=26), CROSS, slow, 6.0))
    assert calls == [True]
    assert [(f.ranks, f.evidence["scope"], {r["method"] for r in f.evidence["ranks"]}) for f in fs] == \
        [([2, 3], "node", {"completion_lead"})]
    # one op per communicator and step (a rank of the window finishes first from step 20): the bound rules the
    # signature out, as its own gate does when it runs
    co = window(seed=1)
    leads = _leads(co)
    steps = list(range(1, 40))
    assert calls == [True] and not real(leads, 3, 4, cheaper_only=False)
    assert links.early_finishers(co, CommConfig(), steps, None, leads) == []
    monkeypatch.setattr(links, "window_can_fill", lambda *a, **k: True)
    assert links.early_finishers(co, CommConfig(), steps, None, leads) == []
    op_instances.release_op_instances()


def test_threshold_noise_worked_out_only_where_a_cell_passes_its_floor(monkeypatch):
    # the slow link by transfer ratio and the one by wait deficit are still found (their noise worked out), and a
    # clean run works out neither (the medians over every rank's row are the costly part at 16,384 ranks)
    from analyzers.builder import build_frame
    from analyzers.checks import comm, wait_deficit

    calls = []
    real = comm.temporal_sigma
    for module in (comm, wait_deficit):
        monkeypatch.setattr(module, "temporal_sigma", lambda m: calls.append(m.shape) or real(m))
    fs = comm.analyze(build_frame(build(link_delay_ms=lambda r, s: 40.0 if (r == 3 and s >= 8) else 0.0)))
    assert [(f.ranks, f.step_start) for f in fs if f.evidence.get("cause") == "slow_link"] == [([3], 8)]
    assert calls
    calls.clear()
    fs = comm.analyze(build_frame(build(send_delay_ms=lambda r, s: 60.0 if (r == 1 and s >= 8) else 0.0)))
    assert [(f.ranks, f.evidence["method"]) for f in fs if f.severity != "info"] == [([1], "wait_deficit")]
    assert calls
    calls.clear()
    assert [f for f in comm.analyze(build_frame(build())) if f.severity != "info"] == []
    assert calls == []


def test_gkey_numbered_when_every_category_is_present():
    col = pd.Series(pd.Categorical(["b", "a", "c", "a", None], categories=["c", "a", "b"]))
    codes, uniq = op_instances._factorize_sorted(col)
    want_codes, want_uniq = pd.factorize(col, sort=True)
    assert list(codes) == list(want_codes) and list(uniq) == list(np.asarray(want_uniq, dtype=object))


def test_op_weights_of_an_int32_column_without_a_copy_are_the_clipped_ones():
    co = pd.DataFrame({"ops": np.array([1, 3, 2, 1], np.int32)})
    rows = np.arange(4)
    assert op_instances._op_weights(co, rows) is co["ops"].to_numpy() or \
        np.shares_memory(op_instances._op_weights(co, rows), co["ops"].to_numpy())
    low = pd.DataFrame({"ops": np.array([0, 3, -1, 1], np.int32)})
    assert list(op_instances._op_weights(low, rows)) == [1, 3, 1, 1]
    assert list(op_instances._op_weights(co, np.array([1, 3]))) == [3, 1]


def _cell_arrays(leads):
    """The complete records' ranks, steps and communicators (what window_can_fill bounds)."""
    c = leads.complete
    return leads.rank[c], leads.step[c], leads.gcode[c]


def _in_step_rank_order(co):
    return co.sort_values(["step", "rank"], kind="stable", ignore_index=True)


def test_window_bound_from_records_in_order_is_the_counted_one():
    # a store compacted in key order holds its records by (step, rank): the bound read off neighbouring records is
    # the one the cell counts give (cheaper_only=False), for cells of two of different communicators, of one
    # communicator twice, of three, and of heavier records; and records out of that order are not read so
    cfg = CommConfig()
    one = window(seed=0)
    tp = one[one["group"] == "tp"]
    dp = one[one["group"] == "dp"]
    twice = pd.concat([tp, tp.assign(seq=tp["seq"] + 1000)], ignore_index=True)
    three = pd.concat([one, dp.assign(seq=dp["seq"] + 1000, gkey=dp["gkey"].str.replace("dp", "ep"))], ignore_index=True)
    cases = [(one, 1), (one.assign(ops=2), 1), (twice, 2), (three, 3), (tp, 1)]
    for co, most in cases:
        ordered = _in_step_rank_order(co)
        leads = _leads(ordered)
        assert links.most_in_cell_in_order(*_cell_arrays(leads)) == most
        for min_ops in (2, 3, 4, 7):
            counted = links.window_can_fill(_leads(co), cfg.link_window, min_ops, cheaper_only=False)
            assert links.window_can_fill(_leads(ordered), cfg.link_window, min_ops) == counted, (most, min_ops)
    assert not links.window_can_fill(_leads(_in_step_rank_order(one)), cfg.link_window, cfg.link_min_ops)
    shuffled = _in_step_rank_order(one).iloc[::-1].reset_index(drop=True)
    assert links.most_in_cell_in_order(*_cell_arrays(_leads(shuffled))) is None
    op_instances.release_op_instances()


def test_early_finishers_on_records_in_order_still_fire():
    # the slow egress with 8 ops a step, its records in (step, rank) order: the bound lets the signature run
    def slow(r, s, members):
        return r in (2, 3) and s >= 10 and members in CROSS["dp"]

    data = with_egress_ops(build(world=4, nodes=2, steps=26), CROSS, slow, 6.0)
    data.collectives = _in_step_rank_order(data.collectives)
    fs = warnings(data)
    assert [(f.ranks, f.evidence["scope"], {r["method"] for r in f.evidence["ranks"]}) for f in fs] == \
        [([2, 3], "node", {"completion_lead"})]


def test_leave_one_out_median_of_a_full_matrix_by_single_place_partitions_is_the_sorted_one(monkeypatch):
    # every row count's middle places (odd and even counts left), ties, and blocks of columns of every width
    rng = np.random.default_rng(11)
    for n in (2, 3, 4, 5, 8, 9, 64, 65):
        for v in (rng.normal(size=(n, 70)), rng.integers(0, 3, size=(n, 70)).astype(float)):
            want = stats._loo_median_block(v)
            np.testing.assert_array_equal(stats._loo_median_full(v), want)
            monkeypatch.setattr(stats, "LOO_FULL_BLOCK_CELLS", n * 5)  # 32-column blocks (the last one shorter)
            np.testing.assert_array_equal(stats._loo_median(v), want)
            monkeypatch.undo()
    with_gap = rng.normal(size=(6, 40))
    with_gap[2, 3] = np.nan  # a gap: the general path
    np.testing.assert_array_equal(stats._loo_median(with_gap), stats._loo_median_block(with_gap))


def test_transfer_ms_and_per_step_median_of_a_grid_are_pandas_ones():
    from analyzers.builder import StepView, grid_transfer_ms, transfer_ms

    rng = np.random.default_rng(12)
    for trial in range(60):
        nr, ns = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        dt = (np.float32, np.float64)[trial % 2]
        n = nr * ns
        st = pd.DataFrame({"rank": np.tile(np.arange(nr), ns).astype(np.int32),
                           "step": np.repeat(np.arange(ns) + 3, nr).astype(np.int32),
                           "sync_wait_ms": rng.choice([np.nan, 0.0, -0.0, 1.0, 2.5, np.inf], size=n).astype(dt),
                           "comm_ms": rng.choice([np.nan, 0.0, 1.0, 2.0, 5.0, -1.0], size=n).astype(dt),
                           "step_ms": rng.choice([np.nan, 1.0, 2.0, 4.5, 7.0], size=n).astype(dt)})
        want = transfer_ms(st)
        orig = st.copy()
        got = grid_transfer_ms(st, nr)
        pd.testing.assert_frame_equal(st, orig, check_exact=True)  # worked on a copy: the rows as they were
        pd.testing.assert_series_equal(got, want, check_exact=True)
        assert (np.signbit(got.to_numpy()) == np.signbit(want.to_numpy())).all()
        view = StepView(st)
        pd.testing.assert_series_equal(view.column("transfer_ms"), want, check_exact=True)
        pd.testing.assert_series_equal(view.per_step_median("step_ms"), st.groupby("step")["step_ms"].median(),
                                       check_index_type=False, check_exact=True)
    off_grid = st.iloc[::-1]  # not a grid: pandas' own
    pd.testing.assert_series_equal(StepView(off_grid).per_step_median("step_ms"),
                                   off_grid.groupby("step")["step_ms"].median(), check_exact=True)


def test_per_step_median_by_blocks_of_steps_is_pandas_one(monkeypatch):
    from analyzers import builder, step_view

    monkeypatch.setattr(step_view, "MEDIAN_BLOCK_STEPS", 3)
    rng = np.random.default_rng(14)
    for trial in range(20):
        nr, ns = int(rng.integers(1, 7)), int(rng.integers(1, 12))
        values = rng.choice([np.nan, 1.0, 2.0, 4.5, 7.0, 0.1], size=nr * ns).astype((np.float32, np.float64)[trial % 2])
        if trial % 3 == 0:
            values[: nr * 2] = np.nan  # whole steps without a value
        st = pd.DataFrame({"rank": np.tile(np.arange(nr), ns).astype(np.int32),
                           "step": np.repeat(np.arange(ns) + 3, nr).astype(np.int32), "step_ms": values})
        view = builder.StepView(st)
        assert view._grid is not None
        pd.testing.assert_series_equal(view.per_step_median("step_ms"), st.groupby("step")["step_ms"].median(),
                                       check_index_type=False, check_exact=True)


def test_compute_check_by_rows_is_the_one_of_whole_frames():
    rng = np.random.default_rng(13)
    comp = pd.DataFrame(rng.choice([0.0, 1.0, 2.0, 3.5, np.nan], size=(5, 12)), index=[0, 1, 2, 4, 7],
                        columns=range(10, 22))
    ref = pd.DataFrame(stats._loo_median(comp.to_numpy()), index=comp.index, columns=comp.columns)
    extra = pd.DataFrame(rng.normal(size=(5, 12)) * 10, index=comp.index, columns=comp.columns)
    asked = []
    lazy = links.ComputeCheck.of_matrix(comp, lambda: asked.append(1) or ref, extra)
    whole = links.ComputeCheck(comp / ref.replace(0, np.nan), comp - ref, extra)
    for r in (0, 1, 2, 4, 7, 99):
        for s0, s1 in ((10, 21), (12, 15), (30, 40)):
            np.testing.assert_equal(lazy.compute_ratio(r, s0, s1), whole.compute_ratio(r, s0, s1))
            assert lazy.slow_computer(r, s0, s1) == whole.slow_computer(r, s0, s1)
        got, want = lazy.ratio_row(r), (whole.comp_ratio.loc[r] if r in whole.comp_ratio.index else None)
        assert (got is None) == (want is None) and (got is None or got.equals(want))
    assert asked == [1]  # the reference built once, when first needed
    pd.testing.assert_frame_equal(lazy.comp_ratio, whole.comp_ratio, check_exact=True)


@pytest.mark.parametrize("gap", [False, True])
def test_row_reference_is_the_reference_row_and_the_compute_check_reads_it(gap):
    from analyzers.builder import StepView

    rng = np.random.default_rng(15)
    nr, ns = 7, 40
    st = pd.DataFrame({"rank": np.tile(np.arange(nr) * 2, ns).astype(np.int32),
                       "step": np.repeat(np.arange(ns) + 5, nr).astype(np.int32),
                       "compute_ms": rng.choice([1.0, 2.0, 2.5, 3.0, 0.0], size=nr * ns)})
    if gap:
        st.loc[3, "compute_ms"] = np.nan  # a gap: the reference matrix is built and read
    whole, rows = StepView(st), StepView(st)
    row_of = rows.row_reference("compute_ms")
    extra = pd.DataFrame(rng.normal(size=(nr, ns)) * 10, index=whole.matrix("compute_ms").index,
                         columns=whole.matrix("compute_ms").columns)
    for r in (0, 6, 12):
        pd.testing.assert_series_equal(row_of(r), whole.reference("compute_ms").loc[r], check_exact=True)
    assert ("compute_ms" in rows._references) == gap  # full matrix: no reference matrix built
    assert whole.row_reference("compute_ms")(4) is not None  # built already: its row
    by_rows = links.ComputeCheck.of_matrix(rows.matrix("compute_ms"), lambda: rows.reference("compute_ms"), extra,
                                           rows.row_reference("compute_ms"))
    by_ref = links.ComputeCheck.of_matrix(whole.matrix("compute_ms"), lambda: whole.reference("compute_ms"), extra)
    for r in (0, 2, 12):
        for s0, s1 in ((5, 44), (9, 20)):
            np.testing.assert_equal(by_rows.compute_ratio(r, s0, s1), by_ref.compute_ratio(r, s0, s1))
            assert by_rows.slow_computer(r, s0, s1) == by_ref.slow_computer(r, s0, s1)
        assert by_rows.ratio_row(r).equals(by_ref.ratio_row(r))


def test_median_rows_by_one_single_place_partition_is_numpys():
    # odd and even row lengths, ties, one column; and the robust sigmas that read it
    rng = np.random.default_rng(14)
    for shape in [(1, 1), (3, 1), (2, 2), (5, 7), (4, 8), (30, 100), (7, 101)]:
        for v in (rng.normal(size=shape), rng.integers(0, 3, size=shape).astype(float)):
            np.testing.assert_array_equal(stats.median_rows(v), np.median(v, axis=1))
            w = v.copy()
            np.testing.assert_array_equal(stats.median_rows(w, overwrite_input=True), np.median(v, axis=1))
            want = [stats.robust_sigma(row) for row in v]
            np.testing.assert_array_equal(stats.row_robust_sigmas(v), want)


def test_first_positions_chunk_by_chunk_are_the_scattered_ones(monkeypatch):
    rng = np.random.default_rng(15)
    monkeypatch.setattr(op_instances, "FIRST_CHUNK", 7)
    for n_codes, n in ((5, 100), (9, 40), (3, 0), (4, 5)):
        codes = rng.integers(0, n_codes, n).astype(np.int32)
        codes[codes == 2] = 1  # a code that never occurs: every chunk looked at
        want = np.full(n_codes, n, np.int64)
        np.minimum.at(want, codes, np.arange(n))
        np.testing.assert_array_equal(op_instances.first_positions(codes, n_codes), want)
        late = np.r_[np.zeros(30, np.int32), codes]  # code 0 first, the others later
        want_late = np.full(n_codes, len(late), np.int64)
        np.minimum.at(want_late, late, np.arange(len(late)))
        np.testing.assert_array_equal(op_instances.first_positions(late, n_codes), want_late)


def test_sorted_members_of_shared_lists_by_a_gather_are_the_tuples():
    shared = [np.array([3, 1, 2]), np.array([5, 4]), np.array([7])]
    rows = pd.Series([shared[i] for i in [0, 1, 0, 2, 1, 1, 0]] + [np.array([9, 8])], dtype=object)
    got = links.sorted_members(rows)
    want = [tuple(sorted(int(x) for x in m)) for m in rows]
    assert list(got) == want and all(type(t) is tuple for t in got)
    frame = pd.DataFrame({"suspects": got})
    assert frame["suspects"].iloc[0] == (1, 2, 3) and frame["suspects"].iloc[3] == (7,)


def test_windowed_medians_of_many_ops_per_step_by_a_slice_of_windows_are_the_windows_medians():
    # 4 values a step in 3-step windows (12 values: the sort path); consecutive output steps (a slice of the windows)
    # and scattered ones (a gather), against each window's own median and quantile
    rng = np.random.default_rng(16)
    labels = np.repeat(np.arange(5), 40 * 4)
    step = np.tile(np.repeat(np.arange(40), 4), 5)
    vals = rng.random(len(labels)).round(2)
    keep = rng.random(len(labels)) > 0.1  # some cells with fewer values
    labels, step, vals = labels[keep], step[keep], vals[keep]
    for steps in (list(range(2, 40)), [2, 5, 6, 9, 30, 39]):
        for q in (0.5, 0.25):
            got = stats.windowed_medians(labels, step, vals, list(range(5)), steps, 3, 4, q)
            want = stats._windowed_medians_by_label(labels, step, vals, list(range(5)), steps, 3, 4, q)
            pd.testing.assert_frame_equal(got, want, check_exact=True)


def test_per_step_means_of_a_grid_are_pandas_groupby_means():
    from analyzers.builder import StepView

    rng = np.random.default_rng(18)
    for nr, ns in ((1, 1), (3, 4), (9, 5), (130, 3), (300, 7)):  # segments past numpy's pairwise blocks
        st = pd.DataFrame({"rank": np.tile(np.arange(nr), ns).astype(np.int32),
                           "step": np.repeat(np.arange(ns) + 2, nr).astype(np.int32),
                           "a": rng.gamma(2.0, 3.0, nr * ns), "b": rng.gamma(2.0, 3.0, nr * ns).astype(np.float32)})
        cols = {"x": st["a"], "y": st["b"]}
        want = pd.DataFrame({"step": st["step"], **cols}).groupby("step").agg(x=("x", "mean"), y=("y", "mean"))
        pd.testing.assert_frame_equal(StepView(st).per_step_means(cols), want, check_exact=True)
        gap = st.assign(a=st["a"].where(st.index != 1))  # a NaN: pandas' own (compensated sums)
        cols = {"x": gap["a"], "y": gap["b"]}
        want = pd.DataFrame({"step": gap["step"], **cols}).groupby("step").agg(x=("x", "mean"), y=("y", "mean"))
        pd.testing.assert_frame_equal(StepView(gap).per_step_means(cols), want, check_exact=True)


def test_communicators_by_rank_from_distinct_pairs_are_the_groupby_sets():
    from analyzers.checks import comm

    _communicators_by_rank = comm._communicators_by_rank
    rng = np.random.default_rng(19)
    for names, dtype in itertools.product((["tp[0,1]", "tp[2,3]", "pp:0>1"], ["tp[0,1]", None]), ("category", object)):
        part = pd.DataFrame({"rank": rng.integers(0, 6, 500).astype(np.int32),
                             "gkey": pd.Series(rng.choice(names, 500), dtype=dtype)})
        want = part.groupby("rank")["gkey"].agg(lambda x: set(map(str, x))).to_dict()
        assert _communicators_by_rank(part) == want
    assert _communicators_by_rank(part.iloc[:0]) == {}


def test_unexplained_wait_in_place_is_pandas_arithmetic():
    from analyzers.checks import wait_deficit

    _unexplained_wait = wait_deficit.unexplained_wait
    rng = np.random.default_rng(20)
    idx, cols = pd.Index([0, 1, 3, 4], name="rank"), pd.Index(range(5, 35), name="step")

    def m(values, index=idx, columns=cols):
        return pd.DataFrame(rng.choice(values, size=(len(index), len(columns))), index=index, columns=columns)

    vals = [np.nan, -0.0, 0.0, 1.5, -2.0, 7.25, np.inf]
    times = [np.nan, 100.0, 100.001, 99.998, 100.0005]
    wait, wait_ref, arr, arr_ref = m(vals), m(vals), m(times), m(times)
    want_lag = (arr - arr_ref) * 1000.0
    want = (wait_ref - wait) - want_lag.clip(lower=0)
    got, lag = _unexplained_wait(wait, wait_ref, arr, arr_ref)
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    pd.testing.assert_frame_equal(lag, want_lag, check_exact=True)
    assert (np.signbit(got.to_numpy()) == np.signbit(want.to_numpy())).all()
    other = m(times, index=pd.Index([0, 1, 2, 3], name="rank"))  # other ranks: pandas' aligned arithmetic
    got2, _ = _unexplained_wait(wait, wait_ref, other, other)
    pd.testing.assert_frame_equal(got2, (wait_ref - wait) - ((other - other) * 1000.0).clip(lower=0), check_exact=True)


@pytest.mark.parametrize("block_cells", [None, 20])
def test_unexplained_wait_from_the_arrivals_column_statistics_is_the_reference_matrix_one(block_cells, monkeypatch):
    from analyzers.checks import wait_deficit

    if block_cells:
        monkeypatch.setattr(wait_deficit, "WAIT_BLOCK_CELLS", block_cells)  # a few columns a block
    rng = np.random.default_rng(21)
    for n_rows, n_cols in ((2, 1), (3, 70), (6, 5), (7, 100), (40, 33)):
        idx, cols = pd.Index(range(n_rows), name="rank"), pd.Index(range(3, 3 + n_cols), name="step")

        def m(values):
            return pd.DataFrame(rng.choice(values, size=(n_rows, n_cols)), index=idx, columns=cols)

        wait, wait_ref = m([np.nan, -0.0, 0.0, 1.5, -2.0, 7.25, np.inf]), m([np.nan, 0.0, 1.5, 3.0, 9.5])
        for arr in (m([100.0, 100.001, 99.998, 100.0005, 100.002]),
                    m([100.0, 100.001, np.nan, 99.998])):  # a gap: the reference matrix's path
            want, want_lag = wait_deficit.unexplained_wait(wait, wait_ref, arr, stats.leave_one_out_median(arr))
            got, lag_of = wait_deficit.unexplained_wait_rows(wait, wait_ref, arr, lambda: stats.leave_one_out_median(arr))
            pd.testing.assert_frame_equal(got, want, check_exact=True)
            assert (np.signbit(got.to_numpy()) == np.signbit(want.to_numpy())).all()
            for r in idx:
                pd.testing.assert_series_equal(lag_of(r), want_lag.loc[r], check_exact=True, check_names=False)


@pytest.mark.parametrize("block_cells", [None, 64])
def test_loo_stats_of_columns_read_by_blocks_are_the_full_reference(block_cells, monkeypatch):
    if block_cells:
        monkeypatch.setattr(stats, "LOO_FULL_BLOCK_CELLS", block_cells)  # blocks of 32 columns
    rng = np.random.default_rng(22)
    for n_rows, n_cols in ((2, 3), (5, 40), (8, 70), (33, 9)):
        values = rng.choice([0.5, 1.0, 2.0, 3.25, 7.0], size=(n_rows, n_cols)) + rng.normal(size=(n_rows, n_cols)) * (n_rows % 2)
        full = stats._loo_median_full(values)
        st = stats.LooStats.of_columns(values)
        np.testing.assert_array_equal(st.reference(values), full)
        for c0, c1 in ((0, 1), (3, 17), (n_cols - 2, n_cols)):
            np.testing.assert_array_equal(st.columns(c0, c1).reference(values[1:, c0:c1]), full[1:, c0:c1])


def test_transfer_ratio_flags_in_numpy_are_the_pandas_expression():
    from analyzers.checks import comm

    rng = np.random.default_rng(23)
    cfg = CommConfig()
    idx, cols = pd.Index([0, 1, 2, 5, 6], name="rank"), pd.Index(range(4, 40), name="step")
    for trial in range(12):
        def m(values, index=idx, columns=cols):
            return pd.DataFrame(rng.choice(values, size=(len(index), len(columns))), index=index, columns=columns)

        ratio = m([np.nan, 0.5, 1.0, 1.3, 1.31, 2.0, 9.0])
        extra = m([np.nan, -1.0, 0.0, 2.0, 1.99, 5.0, 40.0 if trial % 2 else 3.0])
        if trial % 3 == 2:  # waits of other ranks and steps: aligned by reindexing
            wait, wait_ref = m([np.nan, 0.0, 1.0, 3.0], idx[1:].append(pd.Index([9])), cols[2:]), \
                m([np.nan, 0.0, 1.0, 3.0], idx[1:].append(pd.Index([9])), cols[2:])
        else:
            wait, wait_ref = m([np.nan, 0.0, 1.0, 3.0]), m([np.nan, 0.0, 1.0, 3.0])
        got, floor = comm._transfer_ratio_flags(cfg, ratio, extra, wait, wait_ref)
        w, wr = wait.reindex(index=ratio.index, columns=ratio.columns), wait_ref.reindex(index=ratio.index, columns=ratio.columns)
        want = ((ratio >= cfg.rank_ratio) & (extra >= cfg.min_extra_ms) & ((wr >= w) | w.isna())).fillna(False)
        want_floor = cfg.min_extra_ms
        if want.to_numpy().any():
            want_floor = max(cfg.min_extra_ms, cfg.mad_k * stats.temporal_sigma(extra))
            want &= (extra >= want_floor).fillna(False)
        pd.testing.assert_frame_equal(got, want)
        assert floor == want_floor
