"""The collectives' dedupe index with a node agent's folded records (ranksight/collective_fold.py): their sequence
numbers are each step's first op's, a step's ops apart. The index keeps them as a strided range (no interval per
record), knows every one of them as seen, and still takes a key off the progression as new."""

from __future__ import annotations

import numpy as np

from head.store.dedupe import CollectiveIndex, SeqIndex


def mask(ix: SeqIndex, rank, seqs, attempt=0):
    seqs = np.asarray(seqs, np.int64)
    return ix.new_mask(np.full(len(seqs), rank, np.int64), np.full(len(seqs), attempt, np.int64), seqs).tolist()


def test_strided_keys_stay_one_range_and_duplicates_are_caught():
    ix = SeqIndex()
    for step in range(2000):  # one folded record per step and cycle, 16 ops apart
        assert mask(ix, 3, [step * 16]) == [True]
    assert not ix.extra and not ix.progressions
    assert ix.nbytes() < 1000  # bounded by groups, not records
    assert mask(ix, 3, [0, 16, 31984, 160]) == [False] * 4  # resent: every one seen
    assert mask(ix, 3, [8]) == [True]  # off the progression: a key never seen
    assert mask(ix, 3, [8, 32000]) == [False, True]
    assert mask(ix, 3, [16, 32]) == [False, False]


def test_a_new_stride_keeps_the_old_range():
    ix = SeqIndex()
    assert mask(ix, 0, [0, 16, 32]) == [True] * 3
    assert mask(ix, 0, [40, 48, 56]) == [True] * 3  # a step cut in two, then 8 ops a step
    assert mask(ix, 0, [0, 16, 32, 40, 56]) == [False] * 5
    assert mask(ix, 0, [24, 64]) == [True, True]
    assert mask(ix, 0, [24, 64, 48]) == [False] * 3


def test_per_op_sequences_are_unchanged():
    ix = CollectiveIndex()
    a = np.zeros(6, np.int64)
    g = ix._b(np.zeros(6, np.int64), np.array(["tp"] * 6, dtype=object))
    assert ix.new_mask(a, g, np.arange(6)).tolist() == [True] * 6
    assert ix.new_mask(a, g, np.arange(6)).tolist() == [False] * 6
    assert int(ix.stride[0]) == 1 and not ix.extra


def test_random_strided_streams_match_an_exact_set():
    """Folded streams with resends, stride changes, gaps and keys below the range: the index answers as a set of
    every key seen would."""
    import random

    rnd = random.Random(7)
    ix, seen = SeqIndex(), set()
    nxt = {}
    for _ in range(400):
        batch = []
        for _ in range(rnd.randint(1, 12)):
            r = rnd.randint(0, 5)
            roll = rnd.random()
            stride = 1 + (r % 3) * 7
            if roll < 0.75:
                s = nxt.get(r, 0)
                nxt[r] = s + (stride if rnd.random() < 0.9 else rnd.randint(1, 40))
            elif roll < 0.9:
                s = rnd.randint(0, max(nxt.get(r, 1), 1))
            else:
                s = rnd.randint(0, nxt.get(r, 0) + 50)
            batch.append((r, s))
        want = []
        for k in batch:
            want.append(k not in seen)
            seen.add(k)
        got = ix.new_mask(np.array([k[0] for k in batch], np.int64), np.zeros(len(batch), np.int64),
                          np.array([k[1] for k in batch], np.int64)).tolist()
        assert got == want
