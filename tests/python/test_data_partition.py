"""Order and partitioning of cairn.data: pure functions, checked exhaustively."""

import numpy as np
import pytest

from cairn.data import _partition as P


def test_order_is_a_pure_function_of_seed_and_epoch():
    a = P.epoch_order(100, seed=7, epoch=3, shuffle=True)
    b = P.epoch_order(100, seed=7, epoch=3, shuffle=True)
    assert np.array_equal(a, b)
    assert sorted(a.tolist()) == list(range(100))
    assert not np.array_equal(a, P.epoch_order(100, seed=7, epoch=4, shuffle=True))
    assert not np.array_equal(a, P.epoch_order(100, seed=8, epoch=3, shuffle=True))
    assert np.array_equal(P.epoch_order(5, 1, 1, shuffle=False), np.arange(5))


def _consumed_by_slots(n, start, ws, nw, bs, drop_last):
    out = []
    for r in range(ws):
        rp = P.rank_positions(n, start, ws, r, drop_last)
        parts = [P.worker_positions(rp, nw, w, bs) for w in range(nw)]
        assert sum(len(p) for p in parts) == len(rp)
        # Round-robin over workers, batch by batch, gives back rank order.
        merged, idx = [], [0] * nw
        k = 0
        while len(merged) < len(rp):
            w = k % nw
            merged.extend(parts[w][idx[w] : idx[w] + bs].tolist())
            idx[w] += bs
            k += 1
        assert merged == rp.tolist()
        out.append(rp)
    return out


@pytest.mark.parametrize("n,ws,nw,bs", [(27, 3, 3, 1), (29, 3, 3, 2), (10, 4, 2, 3), (3, 5, 1, 1)])
def test_every_rank_gets_the_same_count_and_each_sample_once(n, ws, nw, bs):
    for drop_last in (False, True):
        ranks = _consumed_by_slots(n, 0, ws, nw, bs, drop_last)
        counts = {len(r) for r in ranks}
        assert len(counts) == 1
        allpos = np.concatenate(ranks)
        assert len(np.unique(allpos)) == len(allpos)
        end = P.epoch_end(n, 0, ws, drop_last)
        assert sorted(allpos.tolist()) == list(range(end))
        if drop_last:
            assert end <= n
        else:
            assert end >= n and end - n < ws


def test_resume_with_another_world_size_continues_the_global_order():
    n, bs = 50, 2
    order = P.epoch_order(n, 3, 0, True)
    consumed = 4 * bs * 2  # 2 ranks took 4 steps
    end = P.epoch_end(n, consumed, 3, False)  # then 3 ranks finish the epoch
    pos = np.concatenate([P.rank_positions(n, consumed, 3, r, False) for r in range(3)])
    assert sorted(pos.tolist()) == list(range(consumed, end))
    items = P.padded(order, end)[pos]
    # The rest of the global order, each item once, plus < 3 wrap-around items.
    assert set(items.tolist()) | set(order[:consumed].tolist()) == set(range(n))
    assert len(items) - (n - consumed) < 3
