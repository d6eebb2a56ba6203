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


def cut_and_mutate(data: bytes, seed: int, muts: list[tuple[int, bytes]]) -> bytes:
    """A fixture cut at a random point (its head or its tail) with byte runs overwritten: what a crashed job, a copy
    in progress or a corrupted file hands a reader."""
    import random

    buf = bytearray(data)
    rnd = random.Random(seed)
    buf = buf[rnd.randrange(len(buf)):] if rnd.random() < 0.3 else buf[: rnd.randrange(len(buf) + 1)]
    for pos, b in muts:
        p = pos % (len(buf) + 1)
        buf[p:p + len(b)] = b
    return bytes(buf)
