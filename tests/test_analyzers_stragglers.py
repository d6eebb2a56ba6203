"""Stragglers on constructed runs: the culprit is named, its victims are not."""

import numpy as np
import pandas as pd
from analyzer_fixtures import build

from analyzers.builder import build_frame
from analyzers.checks import stragglers
from analyzers.checks.stragglers import StragglerConfig


def test_culprit_named_not_victims():
    # rank 1 computes 1.15x from step 10; everybody's step time grows (they wait for it)
    data = build(world=4, steps=30, compute_factor=lambda r, s: 1.15 if (r == 1 and s >= 10) else 1.0)
    st = data.steps
    late = st[st["step"] >= 12]
    # the victims show the long step times too: step time alone cannot name the culprit
    assert late.groupby("rank")["step_ms"].median().max() - late.groupby("rank")["step_ms"].median().min() < 1.0
    assert late[late["rank"] != 1]["sync_wait_ms"].mean() > 10.0
    fs = stragglers.analyze(build_frame(data))
    assert len(fs) == 1
    f = fs[0]
    assert f.kind == "straggler" and f.severity == "warning"
    assert f.ranks == [1] and f.nodes == [0]
    assert f.step_start == 10 and f.step_end == 29
    ev = f.evidence
    assert 1.12 <= ev["ratio"] <= 1.18
    assert ev["steps_affected"] == 20
    assert ev["detected_at_step"] == 12
    assert ev["last_arrival_share"] == 1.0
    assert 12.0 <= ev["arrival_lag_ms"] <= 18.0
    assert 12.0 <= ev["victims_mean_wait_ms"] <= 18.0
    assert ev["own_wait_ms"] < 1.0
    assert ev["compared_with"] == [0, 2, 3]
    assert "rank 1" in f.summary and f.recommendation


def test_device_time_finds_a_small_straggler_under_host_noise():
    # 20 % wall-clock scheduling noise per step (a shared CPU) hides a 1.15x slow rank in compute_ms; the device's
    # own busy time (device_ms) is free of it, so the straggler is confirmed within 3 steps of its onset
    kw = dict(world=4, steps=24, noise=0.01, host_noise=0.2, compute_factor=lambda r, s: 1.15 if (r == 1 and s >= 8) else 1.0)
    fs = stragglers.analyze(build_frame(build(device_time=True, **kw)))
    warn = [f for f in fs if f.severity != "info"]
    assert len(warn) == 1, [f.summary for f in fs]
    f = warn[0]
    assert f.ranks == [1] and f.evidence["signal"] == "device_ms"
    assert 8 <= f.step_start <= 9
    assert f.evidence["detected_at_step"] - 8 <= 3
    assert 1.12 <= f.evidence["ratio"] <= 1.18
    assert "device time" in f.summary


def test_device_time_clean_runs_stay_clean_under_host_noise():
    for seed in range(4):
        fs = stragglers.analyze(build_frame(build(world=4, steps=30, noise=0.01, host_noise=0.2, device_time=True, seed=seed)))
        assert [f for f in fs if f.severity != "info"] == [], [f.summary for f in fs]


def test_host_only_slowness_is_told_apart_from_a_slow_device():
    # rank 2's wall-clock compute is 1.5x from step 10 while its device time stays normal: a starved host
    data = build(world=4, steps=30, noise=0.01, device_time=True,
                 host_factor=lambda r, s: 1.5 if (r == 2 and s >= 10) else 1.0)
    fs = stragglers.analyze(build_frame(data))
    assert [f.ranks for f in fs] == [[2]]
    f = fs[0]
    assert f.evidence["signal"] == "compute_ms" and f.step_start == 10
    assert f.severity == "info" and "on the host" in f.summary


def test_clean_run_has_no_straggler():
    for seed in range(3):
        assert stragglers.analyze(build_frame(build(world=8, steps=40, noise=0.02, seed=seed))) == []


def test_one_noisy_step_is_not_a_finding():
    # rank 2 is 1.8x slow in two isolated steps only
    data = build(compute_factor=lambda r, s: 1.8 if (r == 2 and s in (7, 15)) else 1.0)
    assert stragglers.analyze(build_frame(data)) == []


def test_critical_at_twice_the_peers():
    data = build(compute_factor=lambda r, s: 2.2 if (r == 3 and s >= 5) else 1.0)
    (f,) = stragglers.analyze(build_frame(data))
    assert f.severity == "critical" and f.ranks == [3] and f.step_start == 5


def test_slow_node_is_one_finding():
    # 8 ranks on 2 nodes; every rank of node 1 (ranks 4..7) slows 1.3x from step 10
    data = build(world=8, nodes=2, compute_factor=lambda r, s: 1.3 if (r >= 4 and s >= 10) else 1.0)
    fs = stragglers.analyze(build_frame(data))
    assert len(fs) == 1
    f = fs[0]
    assert f.nodes == [1] and f.ranks == [4, 5, 6, 7]
    assert f.evidence["scope"] == "node" and f.step_start == 10
    assert "node 1" in f.summary


def test_slow_pipeline_stage():
    # pp=2, dp=2: stage 1 (ranks 2,3) slows 1.3x from step 12; stage 0 waits for it (pipeline wait), computes normally
    data = build(world=4, pp=2, compute_factor=lambda r, s: 1.3 if (r >= 2 and s >= 12) else 1.0)
    fs = stragglers.analyze(build_frame(data))
    assert len(fs) == 1
    f = fs[0]
    assert f.evidence["scope"] == "stage" and f.evidence["pp_stage"] == 1
    assert f.ranks == [2, 3] and f.step_start == 12


def test_rank_in_pipeline_compared_within_its_stage():
    # stages do different amounts of work; the slow rank is compared with its own stage's ranks only
    data = build(world=8, pp=2, stage_compute_ms=[80.0, 120.0],
                 compute_factor=lambda r, s: 1.2 if (r == 5 and s >= 8) else 1.0)
    fs = stragglers.analyze(build_frame(data))
    assert [f.ranks for f in fs] == [[5]]
    assert fs[0].evidence["compared_with"] == [4, 6, 7]
    assert fs[0].step_start == 8
    # p2p waits equalise arrival at the gradient sync; the culprit is the rank of its stage that waits least
    assert fs[0].severity == "warning" and fs[0].evidence["arrival_corroborated"] is True
    assert fs[0].evidence["least_wait_share"] == 1.0 and fs[0].evidence["peers_wait_minus_own_ms"] > 15


def test_persistence_config_is_honoured():
    data = build(compute_factor=lambda r, s: 1.5 if (r == 1 and 10 <= s <= 12) else 1.0)
    assert [f.ranks for f in stragglers.analyze(build_frame(data))] == [[1]]
    # a 3-step burst: with 4 steps required, 80 % of them slow, it is not a straggler
    assert stragglers.analyze(build_frame(data), StragglerConfig(min_steps=4, high_share=0.8)) == []


def test_noisy_run_needs_more_evidence():
    # same 1.15x straggler, but 10 % per-step noise: the CUSUM threshold rises with the noise
    quiet = stragglers.analyze(build_frame(build(steps=40, compute_factor=lambda r, s: 1.15 if (r == 1 and s >= 10) else 1.0)))
    noisy = stragglers.analyze(build_frame(build(steps=40, noise=0.10, seed=3,
                                     compute_factor=lambda r, s: 1.15 if (r == 1 and s >= 10) else 1.0)))
    assert [f.ranks for f in quiet] == [[1]] and [f.ranks for f in noisy] == [[1]]
    assert quiet[0].evidence["cusum_threshold"] < noisy[0].evidence["cusum_threshold"]
    assert quiet[0].evidence["detected_at_step"] <= noisy[0].evidence["detected_at_step"]
    assert 4 <= noisy[0].step_start <= 13  # the onset is less certain under noise


def test_slow_compute_without_late_arrival_is_only_info():
    # rank 1's compute grows after the gradient sync (it never arrives late, nobody waits for it)
    data = build()
    st = data.steps
    mask = (st["rank"] == 1) & (st["step"] >= 10)
    st.loc[mask, "compute_ms"] *= 1.4
    (f,) = stragglers.analyze(build_frame(data))
    assert f.ranks == [1] and f.severity == "info" and f.confidence < 0.5
    assert f.evidence["arrival_corroborated"] is False
    assert "not confirmed by arrival order" in f.summary


def _tp_run(slow: int = 1, factor: float = 1.3, onset: int = 10, victim_share: float = 1.0):
    """dp2 x tp2 (TP groups [0,1] and [2,3]): ``slow`` computes ``factor`` x from ``onset``. Its TP partner waits for it
    inside the TP all-reduces; ``victim_share`` of that wait leaks into the partner's compute_ms (an op timed late),
    and the two reach the gradient sync together, so neither compute nor sync arrival alone tells them apart."""
    from analyzer_fixtures import with_records

    from ranksight.schema import CollectiveRecord

    data = build(world=4, steps=30, compute_factor=lambda r, s: factor if (r == slow and s >= onset) else 1.0)
    st = data.steps
    partner = slow ^ 1
    recs = []
    for s in sorted(st["step"].unique()):
        row = {int(r): st[(st["step"] == s) & (st["rank"] == r)].iloc[0] for r in range(4)}
        for pair in ((0, 1), (2, 3)):
            extra = {r: row[r]["compute_ms"] - min(row[q]["compute_ms"] for q in pair) for r in pair}
            for i in range(4):  # four TP all-reduces a step; the faster member waits for the slower one in each
                for r in pair:
                    other = pair[1] if r == pair[0] else pair[0]
                    wait = max(0.0, extra[other] - extra[r]) / 4
                    t = float(row[r]["t_start"]) + 0.01 * (i + 1)
                    recs.append(CollectiveRecord(run_id="synth", rank=r, step=int(s), seq=int(s) * 4 + i, op="all_reduce",
                                                 group="tp", group_ranks=list(pair), nbytes=1 << 20, t_arrive=t,
                                                 t_done=t + (wait + 1.0) / 1000, duration_ms=wait + 1.0))
        if s >= onset:
            # the partner's compute shows part of its wait, and it arrives at the sync when the culprit does
            m = (st["step"] == s) & (st["rank"] == partner)
            ms = (st["step"] == s) & (st["rank"] == slow)
            st.loc[m, "compute_ms"] += victim_share * (st.loc[ms, "compute_ms"].iloc[0] - st.loc[m, "compute_ms"].iloc[0])
            st.loc[m, "sync_arrival"] = st.loc[ms, "sync_arrival"].iloc[0] + 0.0005 * (s % 2 * 2 - 1)
    return with_records(data, recs)


def test_tp_culprit_named_not_its_tp_partner():
    data = _tp_run(slow=1)
    fs = stragglers.analyze(build_frame(data))
    warn = [f for f in fs if f.severity != "info"]
    assert [f.ranks for f in warn] == [[1]]
    ev = warn[0].evidence
    assert ev["tp_group"] == [0, 1] and ev["tp_least_wait_share"] == 1.0
    assert ev["tp_partners_wait_minus_own_ms"] > 20 and ev["arrival_corroborated"] is True
    assert warn[0].step_start == 10 and "TP partners wait" in warn[0].summary
    # the partner computes as long (its wait leaked into compute_ms) but it waits in the TP all-reduces: info only
    (victim,) = [f for f in fs if f.ranks == [0]]
    assert victim.severity == "info" and victim.evidence["tp_least_wait_share"] == 0.0
    assert "TP partners do not wait for it" in victim.summary


def test_tp_culprit_other_group():
    # the same with the slow rank in the other TP group: rank 3 named, its partner 2 not warned about
    fs = stragglers.analyze(build_frame(_tp_run(slow=3, factor=1.5, onset=8)))
    assert [f.ranks for f in fs if f.severity != "info"] == [[3]]
    assert all(f.severity == "info" for f in fs if f.ranks == [2])


def test_large_slowdown_confirmed_in_three_steps_under_noise():
    # 1.5x with 12 % per-step noise: the fast CUSUM confirms it within 3 steps of the onset, the slow one later
    data = build(steps=30, noise=0.12, seed=2, compute_factor=lambda r, s: 1.5 if (r == 2 and s >= 12) else 1.0)
    (f,) = stragglers.analyze(build_frame(data))
    assert f.ranks == [2] and f.evidence["detected_at_step"] <= 15
    assert f.evidence["cusum_drift_ratio"] == 1.25
    slow_only = stragglers.analyze(build_frame(data), StragglerConfig(fast_ratio=10.0))
    assert slow_only[0].evidence["detected_at_step"] > f.evidence["detected_at_step"]


def test_noise_floor_from_warmup():
    # noise only in the first steps (the warm-up) raises sigma to baseline_noise_weight x the warm-up's spread
    data = build(steps=30, noise=0.01, seed=2)
    st = data.steps
    rng = np.random.default_rng(0)
    early = st["step"] <= 6
    st.loc[early, "compute_ms"] *= np.exp(0.2 * rng.standard_normal(int(early.sum())))
    from analyzers.checks.stragglers import noise_sigma
    import pandas as pd

    comp = st[st["step"] >= 1].pivot_table(index="rank", columns="step", values="compute_ms")
    logr = np.log(comp / comp.median())
    sigma, base = noise_sigma(logr, StragglerConfig())
    assert base is not None and base > 0.1
    assert sigma >= 0.75 * base
    assert noise_sigma(pd.DataFrame(logr.iloc[:, :6]), StragglerConfig())[1] is None  # too short for a warm-up


def test_single_peer_comparison_needs_more_evidence():
    # pp=2 x dp=2: each stage has two ranks, so a rank is compared with one peer only; thresholds are 1.35x higher
    data = build(world=4, pp=2, steps=30, noise=0.05, seed=4, compute_factor=lambda r, s: 1.6 if (r == 3 and s >= 10) else 1.0)
    (f,) = [f for f in stragglers.analyze(build_frame(data)) if f.severity != "info"]
    (g,) = [f for f in stragglers.analyze(build_frame(data), StragglerConfig(few_peers_h_factor=1.0)) if f.severity != "info"]
    assert f.ranks == g.ranks == [3] and f.evidence["compared_with"] == [2]
    assert abs(f.evidence["cusum_threshold"] / g.evidence["cusum_threshold"] - 1.35) < 0.02
    assert f.evidence["detected_at_step"] >= g.evidence["detected_at_step"]


def test_late_because_of_data_is_not_compute_corroboration():
    # rank 2's loader is 80 ms late from step 10 (it arrives late at the sync, the others wait for it), and its
    # compute_ms also reads 1.3x: the lag is its data wait, not its compute, so the straggler is info only
    data = build(data_extra_ms=lambda r, s: 80.0 if (r == 2 and s >= 10) else 0.0)
    st = data.steps
    st.loc[(st["rank"] == 2) & (st["step"] >= 10), "compute_ms"] *= 1.3
    (f,) = stragglers.analyze(build_frame(data))
    assert f.ranks == [2] and f.severity == "info"
    assert 75 <= f.evidence["data_extra_ms"] <= 85 and f.evidence["arrival_lag_ms"] > 75
    assert f.evidence["arrival_corroborated"] is False
    # the same lag from compute (no data stall) is corroborated
    slow = build(compute_factor=lambda r, s: 1.3 if (r == 2 and s >= 10) else 1.0)
    (g,) = stragglers.analyze(build_frame(slow))
    assert g.severity == "warning" and "data_extra_ms" not in g.evidence


def test_a_reformed_job_is_judged_one_attempt_at_a_time():
    """Node 1 (ranks 2, 3) was evicted after step 29; ranks 0 and 1 resumed as attempt 1 at step 30, with a few slow
    warm-up steps (checkpoint load, bucket rebuild). The culprit of attempt 0 is found; the survivors are not blamed
    for their warm-up or compared with ranks that left."""
    import pandas as pd

    from analyzers.loader import RunData

    before = build(world=4, nodes=2, steps=30, device_time=True, compute_factor=lambda r, s: 1.5 if (r == 3 and s >= 10) else 1.0)
    after = build(world=2, nodes=1, steps=20, device_time=True, seed=1,
                  compute_factor=lambda r, s: (1.6 if r == 0 else 1.4) if s < 4 else 1.0)
    st2 = after.steps.assign(step=after.steps["step"] + 30, attempt=1)
    data = RunData(run_id="synth", manifest=before.manifest, steps=pd.concat([before.steps, st2], ignore_index=True))
    fs = [f for f in stragglers.analyze(build_frame(data)) if f.severity != "info"]
    assert [(f.ranks, f.step_start) for f in fs] == [([3], 10)]
    assert fs[0].step_end == 29


def test_a_short_device_time_blip_nobody_waits_for_is_info():
    # rank 0's device time is 1.3x for three steps but it is not late at the sync (e.g. a process sharing its core)
    data = build(world=4, steps=30, device_time=True, compute_factor=lambda r, s: 1.3 if (r == 0 and 15 <= s <= 17) else 1.0)
    st = data.steps
    # its arrival is made normal: nobody waits for it
    early = (st["rank"] == 0) & st["step"].between(15, 17)
    med = st[~early].groupby("step")["sync_arrival"].median()
    st.loc[early, "sync_arrival"] = st.loc[early, "step"].map(med) - 0.005
    (f,) = stragglers.analyze(build_frame(data))
    assert f.ranks == [0] and f.severity == "info" and "only 3 slow steps at" in f.summary


def test_stage_drift_explained_by_a_named_member_is_info():
    # pp=2 x dp=2: rank 3 computes 1.5x from step 10 and its stage partner rank 2 1.1x (a busy neighbour on its core):
    # the stage's median rises ~1.3x, but the stage did not slow as a whole; rank 3 is the straggler
    data = build(world=4, pp=2, steps=30, compute_factor=lambda r, s: (1.5 if r == 3 else 1.1 if r == 2 else 1.0) if s >= 10 else 1.0)
    fs = stragglers.analyze(build_frame(data))
    assert [(f.ranks, f.severity) for f in fs if f.severity != "info"] == [([3], "warning")]
    (stage,) = [f for f in fs if f.evidence.get("scope") == "stage"]
    assert stage.severity == "info" and stage.evidence["explained_by_ranks"] == [3]
    assert 1.05 <= stage.evidence["rest_of_stage_drift"] <= 1.15
    # both ranks 1.3x: the whole stage slowed, a warning naming both
    both = build(world=4, pp=2, steps=30, compute_factor=lambda r, s: 1.3 if (r >= 2 and s >= 10) else 1.0)
    assert [(f.ranks, f.evidence.get("scope")) for f in stragglers.analyze(build_frame(both)) if f.severity != "info"] == [([2, 3], "stage")]


def test_unconfirmed_device_time_needs_a_long_or_large_episode():
    # device time 1.12x for 9 steps that nobody waits for (a neighbour on its core): info; 1.12x for 14 steps, or
    # 1.3x for 7, stands as a warning, confirmed only once it has lasted that long
    def run(factor, first, last):
        data = build(world=4, steps=30, device_time=True, compute_factor=lambda r, s: factor if (r == 0 and first <= s <= last) else 1.0)
        st = data.steps
        slow = (st["rank"] == 0) & st["step"].between(first, last)
        med = st[~slow].groupby("step")["sync_arrival"].median()
        st.loc[slow, "sync_arrival"] = st.loc[slow, "step"].map(med) - 0.005  # it arrives on time
        return [f for f in stragglers.analyze(build_frame(data)) if f.ranks == [0]]

    (short,) = run(1.12, 10, 18)
    assert short.severity == "info" and short.evidence["arrival_corroborated"] is False
    (long,) = run(1.12, 10, 23)
    assert long.severity == "warning" and long.evidence["detected_at_step"] >= long.step_start + 11
    (large,) = run(1.3, 10, 16)
    assert large.severity == "warning" and large.evidence["detected_at_step"] >= large.step_start + 5


def test_a_node_slow_on_the_host_only_is_info_not_an_eviction_candidate():
    # every rank of node 1 has its wall-clock compute stretched 1.4x (CPU contention) while the device's own busy time
    # stays normal: one node finding, info (a warning made the evict policy pick a healthy node in
    # bench/fault_injection.py); the same slow-down in device time stays a warning
    host = build(world=4, nodes=2, steps=30, device_time=True, host_factor=lambda r, s: 1.4 if (r >= 2 and s >= 10) else 1.0)
    (f,) = stragglers.analyze(build_frame(host))
    assert f.evidence["scope"] == "node" and f.nodes == [1] and f.ranks == [2, 3]
    assert f.severity == "info" and f.evidence["signal"] == "compute_ms" and "the slowness is on the host" in f.summary
    device = build(world=4, nodes=2, steps=30, device_time=True, compute_factor=lambda r, s: 1.4 if (r >= 2 and s >= 10) else 1.0)
    (g,) = stragglers.analyze(build_frame(device))
    assert g.evidence["scope"] == "node" and g.severity == "warning" and g.evidence["signal"] == "device_ms"


def test_has_ranks_is_nunique():
    from analyzers.checks.stragglers import has_ranks

    for values in ([], [3], [3, 3, 3], [3, 3, 4], [5, 1], [1.0, np.nan], [np.nan, np.nan], [2.0, 2.0, 7.0]):
        for dtype in (None, np.int32, np.int64):
            if dtype is not None and any(isinstance(v, float) for v in values):
                continue
            s = pd.Series(values, dtype=dtype if dtype is not None else (float if values else np.int64))
            for n in (0, 1, 2, 3):
                assert has_ranks(s, n) == (s.nunique() >= n), (values, dtype, n)
