"""The dedupe's sort-free steady state (``SeqIndex._next_keys``: each group's next key, once per call) gives the same
answers as an exact set of keys, on random streams that mix it with everything else: repeats inside one call, a
group twice in a call, resends, gaps, keys below the range, strides (folded collectives), new groups, and keys
outside the packed range."""

import numpy as np
import pytest

from head.store.dedupe import CollectiveIndex, SeqIndex


def _stream(rng, ranks: int, calls: int, stride: int):
    """Calls of (rank, attempt, key) arrays: mostly each rank's next key once, with noise."""
    nxt = {r: int(rng.integers(0, 3)) * stride for r in range(ranks)}
    out = []
    for _ in range(calls):
        rows = []
        for r in range(ranks):
            u = rng.random()
            if u < 0.75:  # the steady state: the next key
                rows.append((r, 0, nxt[r]))
                nxt[r] += stride
            elif u < 0.82:  # two keys of one group in one call
                rows += [(r, 0, nxt[r]), (r, 0, nxt[r] + stride)]
                nxt[r] += 2 * stride
            elif u < 0.87:  # a resend of an older key
                rows.append((r, 0, max(0, nxt[r] - stride * int(rng.integers(1, 4)))))
            elif u < 0.91:  # a gap
                nxt[r] += stride * int(rng.integers(2, 5))
                rows.append((r, 0, nxt[r]))
                nxt[r] += stride
            elif u < 0.94:  # the same row twice in one call
                rows += [(r, 0, nxt[r])] * 2
                nxt[r] += stride
            elif u < 0.96:  # another attempt (a restart), and a rank beyond the packed range
                rows += [(r, 1, nxt[r]), (-1 - r, 0, nxt[r])]
            elif u < 0.98:  # an off-stride key
                rows.append((r, 0, nxt[r] + 1))
        if rows:
            perm = rng.permutation(len(rows))
            out.append(np.array(rows, np.int64)[perm])
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("stride", [1, 4])
def test_seq_index_matches_an_exact_set(seed, stride):
    rng = np.random.default_rng(seed)
    idx, seen = SeqIndex(), set()
    for call in _stream(rng, ranks=40, calls=60, stride=stride):
        mask = idx.new_mask(call[:, 0], call[:, 1], call[:, 2])
        want = []
        for r in map(tuple, call.tolist()):
            want.append(r not in seen)
            seen.add(r)
        assert mask.tolist() == want


def test_the_steady_state_extends_ranges_and_a_resend_is_caught():
    idx = SeqIndex()
    ranks = np.arange(1000, dtype=np.int64)
    zeros = np.zeros(1000, np.int64)
    assert idx.new_mask(ranks, zeros, zeros).all()
    assert idx.new_mask(ranks, zeros, zeros + 1).all()
    for step in range(2, 6):  # the sort-free path takes these
        assert idx.new_mask(ranks[::-1], zeros, zeros + step).all()
    assert (idx.hi == 5).all() and len(idx) == 1000
    assert not idx.new_mask(ranks, zeros, zeros + 5).any()  # the whole last call again
    assert not idx.new_mask(ranks, zeros, zeros + 3).any()


def test_collectives_keep_their_strides_through_the_steady_state():
    idx = CollectiveIndex()
    groups = np.array([b"tp0", b"dp0", b"pp:0>8"] * 4, "S8")
    ranks = np.repeat(np.arange(4, dtype=np.int64), 3)
    att = np.zeros(12, np.int64)
    b = idx._b(att, groups)
    for step in range(8):
        assert idx.new_mask(ranks, b, np.full(12, step * 16, np.int64)).all()
    assert (idx.stride == 16).all()
    assert not idx.new_mask(ranks, b, np.full(12, 7 * 16, np.int64)).any()
    assert not idx.new_mask(ranks, b, np.full(12, 2 * 16, np.int64)).any()


def test_group_numbers_from_the_hash_look_up_match_the_first_numbering():
    idx = CollectiveIndex()
    rng = np.random.default_rng(7)
    names = [f"pp:{i}>{i + 8}".encode() for i in range(300)] + [b"dp", b"tp0", b"a" * 20]
    att = np.zeros(50, np.int64)
    first: dict[bytes, int] = {}
    for call in range(30):
        pool = names[: 50 + 10 * call]  # new names arrive now and then
        pick = [pool[i] for i in rng.integers(0, len(pool), 50)]
        width = max(len(x) for x in pick) + int(rng.integers(0, 9))  # the sender's width varies
        b = idx._b(att, np.array(pick, f"S{width}"))
        for name, code in zip(pick, (b & ((1 << idx._NAME_BITS) - 1)).tolist()):
            assert first.setdefault(name, code) == code, name
    assert len(set(first.values())) == len(first)  # one number per name
    assert idx._hashes  # the sort-free look-up was built and used
