"""``analyzers.stats.few_group_medians`` (the pipeline check's per-stage medians) against pandas' groupby median, the
general path it replaces: the same values bit for bit and the same dtypes and index, with NaN values, a group of NaN
only, even and odd counts, float32, float64 and integer columns, float keys with NaN."""

import numpy as np
import pandas as pd
import pytest

from analyzers.stats import few_group_medians


@pytest.mark.parametrize("seed", range(6))
def test_equals_pandas_groupby_median(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 5000))
    key = pd.Series(rng.integers(0, 5, n).astype(np.int32), name="pp_stage")
    f32 = rng.normal(100, 30, n).astype(np.float32)
    f32[rng.random(n) < 0.1] = np.nan
    f64 = rng.normal(0.2, 0.1, n)
    f64[key.to_numpy() == 3] = np.nan  # a group of NaN only
    ints = rng.integers(0, 1000, n)
    cols = dict(a=pd.Series(f32), b=pd.Series(f64), c=pd.Series(ints))
    want = pd.DataFrame(dict(cols, pp_stage=key)).groupby("pp_stage").agg(
        a=("a", "median"), b=("b", "median"), c=("c", "median"))
    got = few_group_medians(key, cols)
    pd.testing.assert_frame_equal(got, want, check_exact=True)


def test_float_keys_with_nan_are_left_out_as_groupby_does():
    key = pd.Series([0.0, 1.0, np.nan, 1.0, 0.0, np.nan], name="pp_stage")
    vals = pd.Series([1.0, 2.0, 50.0, 4.0, 3.0, 60.0])
    want = pd.DataFrame(dict(v=vals, pp_stage=key)).groupby("pp_stage").agg(v=("v", "median"))
    pd.testing.assert_frame_equal(few_group_medians(key, dict(v=vals)), want, check_exact=True)
