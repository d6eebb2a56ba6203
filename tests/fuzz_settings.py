"""The hypothesis settings every fuzz test uses: short and seeded in the suite (the same examples every run, so CI
cannot turn red by chance); ``bench/fuzz.py`` sets RANKSIGHT_FUZZ_SCALE / RANKSIGHT_FUZZ_RANDOM for long random runs."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

SCALE = float(os.environ.get("RANKSIGHT_FUZZ_SCALE", "1"))
RANDOM = os.environ.get("RANKSIGHT_FUZZ_RANDOM") == "1"


def fuzz_settings(examples: int, **kw) -> settings:
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None, derandomize=not RANDOM,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much], **kw)
