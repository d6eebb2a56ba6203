"""GPU sample dedupe keys: bounded by GPUs x a time horizon, not by every sample ever received, and still exactly
once: a resend inside the horizon is found exactly, one after it is dropped and counted, never stored twice."""

import numpy as np
import pyarrow as pa

from head.service import Head
from head.store.dedupe import make_index
from ranksight.tables import SPECS, read_table
from test_ingest_packed_gpu import TOKEN, gpu, request

HORIZON = 300.0


def second(t: float, gpus: int) -> pa.Table:
    """One sample of each of ``gpus`` GPUs (8 per node) at ``t``, key columns filled (the store's schema)."""
    g = np.arange(gpus, dtype=np.int64)
    cols = {"run_id": pa.array(["r1"] * gpus), "node": g // 8, "gpu": g % 8, "t": np.full(gpus, t)}
    return pa.table([pa.array(cols[f.name], f.type) if f.name in cols else pa.nulls(gpus, f.type)
                     for f in SPECS["gpu"].schema], schema=SPECS["gpu"].schema)


def test_gpu_keys_stay_bounded_over_an_hour():
    idx = make_index("gpu")
    gpus, seconds = 256, 1800
    for s in range(seconds):
        idx.add_table(second(1000.0 + s, gpus))
    # the exact keys are those of at most ~2 horizons per GPU (pruned when they double), not of every sample
    assert len(idx) <= gpus * (2 * HORIZON + 2) and len(idx) < gpus * seconds / 2
    assert idx.nbytes() < 20 * gpus * 2 * HORIZON + 200 * gpus


def test_resends_inside_the_horizon_are_exact_and_late_first_arrivals_kept():
    idx = make_index("gpu")
    for s in range(0, 100, 2):  # even seconds only
        idx.add_table(second(1000.0 + s, 16))
    resent = second(1050.0, 16)
    odd = second(1051.0, 16)  # never seen: older than each GPU's newest, inside the horizon
    t = pa.concat_tables([resent, odd, odd])
    from head.store.dedupe_sets import GpuIndex
    assert isinstance(idx, GpuIndex)
    codes = (t.column("node").to_numpy() << 20) | t.column("gpu").to_numpy()
    mask = idx._new_mask(codes, t.column("t").to_numpy())
    assert mask.tolist() == [False] * 16 + [True] * 16 + [False] * 16
    assert idx.stale == 0


def test_same_answers_as_an_exact_key_set_inside_the_horizon():
    rng = np.random.default_rng(7)
    idx, exact = make_index("gpu"), set()
    sent = []
    for s in range(400):
        rows = [(int(n), int(g), 1000.0 + s) for n in range(4) for g in range(8) if rng.random() < 0.9]
        sent.extend(rows)
        if rng.random() < 0.3 and len(sent) > 50:  # a resend of a recent stretch, maybe out of order
            k = int(rng.integers(1, 50))
            rows = rows + sent[-k - len(rows):-len(rows)]
            rng.shuffle(rows)
        code = np.array([(n << 20) | g for n, g, _ in rows], np.int64)
        t = np.array([x for _, _, x in rows])
        got = idx._new_mask(code, t).tolist()
        want = []
        for r in rows:
            want.append(r not in exact)
            exact.add(r)
        assert got == want, s
    assert idx.stale == 0


def test_a_resend_after_the_horizon_is_not_stored_twice_and_is_counted(tmp_path):
    h = Head(tmp_path, TOKEN, analyzer=None)
    first = [gpu(1, g, 1000.0 + s) for s in range(3) for g in range(4)]
    h.ingest.logs(request([first]))
    for s in range(3, 1000, 50):  # the GPUs go on sampling; their newest time moves far past the first batch
        h.ingest.logs(request([[gpu(1, g, 1000.0 + s) for g in range(4)]]))
    h.store.flush_all()
    before = h.stats["duplicates"]
    h.ingest.logs(request([first]))  # an outbox segment shipped again, long after
    h.ingest.logs(request([first], packed=False))
    h.store.flush_all()
    assert h.stats["duplicates"] - before == 2 * len(first)
    assert h.store.runs["r1"].indexes["gpu"].stale == 2 * len(first)
    # ... and the head's /metrics says so, per run
    from prometheus_client import generate_latest

    text = generate_latest(h.metrics.registry).decode()
    assert f'ranksight_head_gpu_samples_stale_total{{run_id="r1"}} {float(2 * len(first))}' in text, text[-2000:]
    h.close()
    h2 = Head(tmp_path, TOKEN, analyzer=None)  # after a restart the keys come back from the part files
    h2.ingest.logs(request([first]))
    h2.store.flush_all()
    assert h2.stats["duplicates"] == len(first)
    h2.close()
    df = read_table(tmp_path, "r1", "gpu")
    assert len(df) == len(first) + 4 * 20 and not df.duplicated(["node", "gpu", "t"]).any()


def test_keys_out_of_the_codes_range_keep_the_exact_set():
    idx = make_index("gpu")
    odd = [gpu(-1, 0, 5.0), gpu(2, 1 << 21, 5.0), gpu(1, 0, 5.0)]
    assert idx.new_rows(odd) == odd
    assert idx.new_rows(odd) == [] and len(idx.keys) == 2  # the two odd ones in the exact set
