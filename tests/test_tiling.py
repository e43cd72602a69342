"""fa4lab.tiling against a brute-force element mask, plus GQA maps and the schedulers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from matrix import matrix

from fa4lab.gqa import (
    gqa_group_size,
    kv_head_of,
    pack_gqa_row,
    q_heads_of,
    query_to_kv_heads,
    unpack_gqa_row,
)
from fa4lab.scheduling import (
    SCHEDULERS,
    CostModel,
    Workload,
    grid_order,
    grid_reversed_order,
    lpt_order,
    persistent_tiles,
    schedule,
    schedule_grid,
    schedule_lpt,
    schedule_persistent,
    schedule_static_persistent,
)
from fa4lab.spec import AttentionSpec, effective_window
from fa4lab.tiling import (
    TileKind,
    classify_tiles,
    n_block_left_masked_range,
    n_block_masked_range,
    n_block_range,
)


def brute_visible(seqlen_q, seqlen_k, causal, group=1, rows=None, window=(None, None)):
    """visible[r, j] over the padded M x N grid, from the math contract alone.

    Row r of the M dimension is query position r // group (pack-GQA; group 1 = no packing).
    Out-of-bounds rows or columns are never visible. window = (left, right), None unbounded.
    """
    rows = seqlen_q * group if rows is None else rows
    r = np.arange(rows)[:, None]
    pos = r // group
    j = np.arange(seqlen_k)[None, :]
    vis = (pos < seqlen_q) & (j < seqlen_k)
    if causal:
        vis &= j <= pos + seqlen_k - seqlen_q
    left, right = window
    if left is not None:
        vis &= j >= pos + seqlen_k - seqlen_q - left
    if right is not None:
        vis &= j <= pos + seqlen_k - seqlen_q + right
    return vis


def brute_kinds(seqlen_q, seqlen_k, bm, bn, causal, group=1, window=(None, None)):
    """Tile kinds and 'needs an element mask' by looking at every element."""
    rows = seqlen_q * group
    n_m, n_n = -(-rows // bm), -(-seqlen_k // bn)
    vis = np.zeros((n_m * bm, n_n * bn), dtype=bool)
    vis[:rows, :seqlen_k] = brute_visible(seqlen_q, seqlen_k, causal, group, window=window)
    inb = np.zeros_like(vis)
    inb[:rows, :seqlen_k] = True
    # every tile's elements at once, tv[m, n] and ti[m, n] being tile (m, n)'s bm x bn block
    tv = vis.reshape(n_m, bm, n_n, bn).swapaxes(1, 2)
    ti = inb.reshape(n_m, bm, n_n, bn).swapaxes(1, 2)
    seen = tv.any(axis=(2, 3))
    hidden = (ti & ~tv).any(axis=(2, 3))            # an in-bounds element not visible
    col_oob = ~ti[:, :, 0, :].all(axis=2)           # row 0 of a tile is always in bounds
    kinds = np.select([~seen, hidden, ~ti.all(axis=(2, 3))],
                      [int(TileKind.SKIP), int(TileKind.MASKED), int(TileKind.TAIL)],
                      int(TileKind.FULL))
    needs = seen & (hidden | col_oob)
    return kinds, needs


SEQLENS = (1, 2, 3, 5, 8, 13, 16, 17, 31, 33)
BLOCKS = ((1, 1), (2, 3), (4, 4), (8, 4), (4, 8), (16, 16), (3, 5))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bm,bn", BLOCKS)
def test_classify_matches_brute_force(bm, bn, causal):
    # every seqlen_q x seqlen_k pair, including seqlen 1 and seqlen_q > seqlen_k
    for sq, sk in itertools.product(SEQLENS, SEQLENS):
        tiles = classify_tiles(sq, sk, bm, bn, causal)
        want, needs = brute_kinds(sq, sk, bm, bn, causal)
        np.testing.assert_array_equal(tiles.kinds, want, err_msg=f"{sq=} {sk=}")
        np.testing.assert_array_equal(tiles.needs_element_mask, needs, err_msg=f"{sq=} {sk=}")


@pytest.mark.parametrize("group", [2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_classify_pack_gqa_matches_brute_force(group, causal):
    for (sq, sk), (bm, bn) in itertools.product(
            itertools.product((1, 3, 7, 16, 20), (1, 5, 16, 19)), ((4, 4), (8, 4), (6, 5))):
        tiles = classify_tiles(sq, sk, bm, bn, causal, qhead_per_kvhead=group)
        want, needs = brute_kinds(sq, sk, bm, bn, causal, group)
        np.testing.assert_array_equal(tiles.kinds, want, err_msg=f"{sq=} {sk=} {bm=} {bn=}")
        np.testing.assert_array_equal(tiles.needs_element_mask, needs)


def _check_ranges(sq, sk, bm, bn, causal, group=1, window=(None, None)):
    tiles = classify_tiles(sq, sk, bm, bn, causal, qhead_per_kvhead=group, window_size=window)
    vis = brute_visible(sq, sk, causal, group, window=window)
    for m in range(tiles.shape[0]):
        kw = dict(seqlen_q=sq, seqlen_k=sk, m_block_size=bm, n_block_size=bn, causal=causal,
                  qhead_per_kvhead=group, window_size=window)
        lo, hi = n_block_range(m, **kw)
        mlo, mhi = n_block_masked_range(m, **kw)
        llo, lhi = n_block_left_masked_range(m, **kw)
        assert 0 <= lo <= hi <= tiles.shape[1]
        # three runs, in order: left-edge masked, unmasked, right-edge masked
        assert lo == llo <= lhi <= mlo <= mhi == hi
        if window[0] is None:
            assert lhi == lo
        visited = np.zeros(tiles.shape[1], dtype=bool)
        visited[lo:hi] = True
        # the range is exactly the non-SKIP tiles of this row of tiles
        np.testing.assert_array_equal(visited, tiles.kinds[m] != TileKind.SKIP)
        masked = np.zeros(tiles.shape[1], dtype=bool)
        masked[mlo:mhi] = True
        masked[llo:lhi] = True
        np.testing.assert_array_equal(masked, tiles.needs_element_mask[m])
        # the visited columns hold every visible element of the tile's rows
        row_vis = vis[m * bm:(m + 1) * bm]
        cols = np.flatnonzero(row_vis.any(axis=0))
        if cols.size:
            assert lo * bn <= cols.min() and cols.max() < hi * bn
        else:
            assert lo == hi


@pytest.mark.parametrize("causal", [False, True])
def test_ranges_consistent_with_tiles(causal):
    for sq, sk in itertools.product(SEQLENS, SEQLENS):
        for bm, bn in BLOCKS:
            _check_ranges(sq, sk, bm, bn, causal)
        _check_ranges(sq, sk, 4, 4, causal, group=3)


# ---------------------------------------------------------------------- sliding windows

# Windows around the diagonal: the diagonal only, one side, both sides, wider than any seqlen.
WINDOWS = ((0, 0), (0, None), (None, 0), (2, 0), (5, 3), (1, None), (None, 2), (0, 4), (40, 40),
           # negative sides (upstream FA4's): edges past the diagonal, rows that see nothing
           (None, -1), (-2, None), (6, -3), (-1, 4), (-1, 0))


# The shapes each window runs on: the seqlens include 1, equal, and both longer; blocks square
# and not. Trimmed: every (seqlen_q, seqlen_k) pair, each on one block shape, sampled pairwise
# with the blocks (tests/matrix.py: 32 of the 150 shapes, 17 s -> 4 s over the windows on a
# 2-core machine); FA4LAB_FULL_MATRIX=1 runs every shape.
WINDOW_SHAPES = matrix([(1, 3, 8, 13, 17, 33), (1, 2, 8, 13, 31),
                        ((1, 1), (4, 4), (8, 4), (3, 5), (16, 16))])


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
def test_classify_windows_match_brute_force(window, causal):
    if causal and window[1] is not None:
        window = (window[0], 0)
    for sq, sk, (bm, bn) in WINDOW_SHAPES:
        tiles = classify_tiles(sq, sk, bm, bn, causal, window_size=window)
        want, needs = brute_kinds(sq, sk, bm, bn, causal, window=window)
        msg = f"{sq=} {sk=} {bm=} {bn=}"
        np.testing.assert_array_equal(tiles.kinds, want, err_msg=msg)
        np.testing.assert_array_equal(tiles.needs_element_mask, needs, err_msg=msg)
        _check_ranges(sq, sk, bm, bn, causal, window=window)


_SIDE = st.one_of(st.none(), st.integers(-45, 40))


# trimmed from 300 examples (5 s on a 2-core machine): test_classify_windows_match_brute_force
# walks the fixed windows and shapes, this one the random ones
@settings(max_examples=150, deadline=None)
@given(sq=st.integers(1, 60), sk=st.integers(1, 60), bm=st.integers(1, 20),
       bn=st.integers(1, 20), group=st.sampled_from([1, 1, 2, 3, 4]), causal=st.booleans(),
       left=_SIDE, right=_SIDE)
def test_window_tiles_and_ranges_match_brute_force(sq, sk, bm, bn, group, causal, left, right):
    # every tile kind and every block range against the element mask, pack-GQA included:
    # FULL = all visible, SKIP = none, MASKED = some in-bounds element hidden, TAIL = the rest
    if causal and right is not None:
        right = 0
    window = (left, right)
    if left is not None and right is not None and left < 0 and right < 0:
        window = (None, None)      # FA2's "no window", as check_window_size reads it
    tiles = classify_tiles(sq, sk, bm, bn, causal, qhead_per_kvhead=group, window_size=window)
    want, needs = brute_kinds(sq, sk, bm, bn, causal, group, window=window)
    np.testing.assert_array_equal(tiles.kinds, want)
    np.testing.assert_array_equal(tiles.needs_element_mask, needs)
    _check_ranges(sq, sk, bm, bn, causal, group, window)
    vis = brute_visible(sq, sk, causal, window=window)
    assert tiles.visible_element_fraction == pytest.approx(vis.mean(), abs=1e-15)
    # the work model counts the same blocks: masked = both edges, unmasked = the rest
    work = Workload(batch=1, heads=1, seqlen_q=sq, seqlen_k=sk, m_block_size=bm,
                    n_block_size=bn, causal=causal, qhead_per_kvhead=group, window_size=window)
    unmasked, masked = work.blocks_per_m_block()
    np.testing.assert_array_equal(masked, tiles.needs_element_mask.sum(axis=1))
    np.testing.assert_array_equal(unmasked + masked, (tiles.kinds != TileKind.SKIP).sum(axis=1))


def test_window_skips_blocks_left_of_the_window():
    # causal window of 256 keys, 128 x 128 tiles: each tile visits its diagonal block and the
    # ones the window reaches; everything further left is SKIP, like the causal right side
    kw = dict(seqlen_q=1024, seqlen_k=1024, m_block_size=128, n_block_size=128, causal=True,
              window_size=(256, None))
    assert [n_block_range(m, **kw) for m in range(8)] == [
        (0, 1), (0, 2), (0, 3), (1, 4), (2, 5), (3, 6), (4, 7), (5, 8)]
    # tile 5 (rows 640..767): rows see keys [row - 256, row]: block 3 (384..511) is cut by the
    # left edge for the last rows, block 4 is seen in full, block 5 holds the diagonal
    assert n_block_left_masked_range(5, **kw) == (3, 4)
    assert n_block_masked_range(5, **kw) == (5, 6)
    tiles = classify_tiles(1024, 1024, 128, 128, True, window_size=(256, None))
    assert list(tiles.kinds[5]) == [TileKind.SKIP] * 3 + [TileKind.MASKED, TileKind.FULL,
                                                          TileKind.MASKED] + [TileKind.SKIP] * 2
    # a window narrower than a tile masks every block it visits: the two runs meet
    narrow = {**kw, "window_size": (64, None)}
    assert n_block_range(5, **narrow) == (4, 6)
    assert n_block_left_masked_range(5, **narrow) == (4, 5)
    assert n_block_masked_range(5, **narrow) == (5, 6)
    assert TileKind.FULL not in classify_tiles(1024, 1024, 128, 128, True,
                                               window_size=(64, None)).kinds


def test_window_defaults_and_normal_form():
    kw = dict(seqlen_q=100, seqlen_k=300, m_block_size=16, n_block_size=32)
    causal = classify_tiles(causal=True, **kw)
    for window in [(None, None), (None, 0)]:
        t = classify_tiles(causal=True, window_size=window, **kw)
        np.testing.assert_array_equal(t.kinds, causal.kinds)
        assert t.window_size == (None, None) and t.causal
    t = classify_tiles(causal=False, window_size=(None, 0), **kw)
    assert t.causal and t.effective_window == (None, 0)
    np.testing.assert_array_equal(t.kinds, causal.kinds)
    w = Workload(batch=1, heads=1, causal=False, window_size=(8, 0), **kw)
    assert (w.causal, w.window_size) == (True, (8, None))


def test_workload_from_spec_carries_the_window():
    spec = AttentionSpec(batch=1, seqlen_q=2048, seqlen_k=2048, heads_q=8, heads_kv=8,
                         head_dim=64, causal=True, window_size=(255, 0))
    w = Workload.from_spec(spec, m_block_size=128, n_block_size=128)
    assert (w.causal, w.window_size) == (True, (255, None))
    unmasked, masked = w.blocks_per_m_block()
    # 255 keys to the left plus the diagonal: at most three blocks per tile, two masked
    assert unmasked.max() == 1 and masked.max() == 2 and (unmasked + masked).max() == 3
    assert w.tile_costs().max() < Workload.from_spec(spec.with_(window_size=(None, None)),
                                                     m_block_size=128,
                                                     n_block_size=128).tile_costs().max()


def test_seqlen_q_longer_than_seqlen_k_has_empty_tiles():
    # 20 queries, 4 keys: causal rows 0..15 see nothing, so tiles 0..3 visit no block
    for m in range(4):
        lo, hi = n_block_range(m, seqlen_q=20, seqlen_k=4, m_block_size=4, n_block_size=4,
                               causal=True)
        assert lo == hi
    assert n_block_range(4, seqlen_q=20, seqlen_k=4, m_block_size=4, n_block_size=4,
                         causal=True) == (0, 1)
    assert classify_tiles(20, 4, 4, 4, True).counts == {"SKIP": 4, "FULL": 0, "MASKED": 1,
                                                         "TAIL": 0}


def test_no_visible_element_in_skip_and_no_masked_in_full(rng):
    for _ in range(40):
        sq, sk = (int(x) for x in rng.integers(1, 70, size=2))
        bm, bn = (int(x) for x in rng.integers(1, 20, size=2))
        causal = bool(rng.integers(2))
        tiles = classify_tiles(sq, sk, bm, bn, causal)
        vis = np.zeros((tiles.shape[0] * bm, tiles.shape[1] * bn), dtype=bool)
        vis[:sq, :sk] = brute_visible(sq, sk, causal)
        for (m, n), kind in np.ndenumerate(tiles.kinds):
            block = vis[m * bm:(m + 1) * bm, n * bn:(n + 1) * bn]
            if kind == TileKind.SKIP:
                assert not block.any()
            if kind == TileKind.FULL:
                assert block.all()


def test_causal_square_counts_and_fractions():
    tiles = classify_tiles(1024, 1024, 128, 128, True)
    assert tiles.counts == {"SKIP": 28, "FULL": 28, "MASKED": 8, "TAIL": 0}
    assert tiles.skipped_fraction == pytest.approx(28 / 64)
    assert tiles.visible_element_fraction == pytest.approx((1024 * 1025 / 2) / 1024**2)
    dense = classify_tiles(1000, 1000, 128, 128, False)
    assert dense.counts["SKIP"] == 0 and dense.counts["MASKED"] == 0
    assert dense.counts["TAIL"] == 15 and dense.visible_element_fraction == 1.0


# ----------------------------------------------------------------------------------- GQA


def test_gqa_map():
    assert query_to_kv_heads(8, 2) == (0, 0, 0, 0, 1, 1, 1, 1)
    assert query_to_kv_heads(4, 4) == (0, 1, 2, 3)
    for h in range(12):
        assert kv_head_of(h, 12, 3) == h // 4
        assert h in q_heads_of(h // 4, 12, 3)
    assert list(q_heads_of(1, 12, 3)) == [4, 5, 6, 7]


@settings(max_examples=200, deadline=None)
@given(heads_kv=st.integers(1, 6), group=st.integers(1, 8), seqlen_q=st.integers(1, 300),
       data=st.data())
def test_pack_gqa_round_trip(heads_kv, group, seqlen_q, data):
    heads_q = heads_kv * group
    kw = dict(heads_q=heads_q, heads_kv=heads_kv, seqlen_q=seqlen_q)
    q_head = data.draw(st.integers(0, heads_q - 1))
    pos = data.draw(st.integers(0, seqlen_q - 1))
    kv_head, row = pack_gqa_row(q_head, pos, **kw)
    assert kv_head == kv_head_of(q_head, heads_q, heads_kv)
    assert 0 <= row < seqlen_q * group
    assert row // group == pos          # the causal row index is the position
    assert unpack_gqa_row(kv_head, row, **kw) == (q_head, pos)
    row2 = data.draw(st.integers(0, seqlen_q * group - 1))
    kv2 = data.draw(st.integers(0, heads_kv - 1))
    assert pack_gqa_row(*unpack_gqa_row(kv2, row2, **kw), **kw) == (kv2, row2)


def test_pack_gqa_is_a_bijection():
    heads_q, heads_kv, sq = 6, 2, 5
    kw = dict(heads_q=heads_q, heads_kv=heads_kv, seqlen_q=sq)
    images = {pack_gqa_row(h, p, **kw) for h in range(heads_q) for p in range(sq)}
    assert images == {(g, r) for g in range(heads_kv) for r in range(sq * 3)}


# ------------------------------------------------------------------------------ schedulers


def _work(**kw):
    base = dict(batch=2, heads=4, seqlen_q=1024, seqlen_k=1024, m_block_size=128,
                n_block_size=128, causal=True)
    base.update(kw)
    return Workload(**base)


def test_orders_are_permutations_of_the_grid():
    for swizzle_heads in (3, 8, 17):
        w = _work(heads=swizzle_heads, seqlen_k=40000, seqlen_q=700)
        grid = {tuple(x) for x in grid_order(w)}
        for order in (lpt_order(w), grid_reversed_order(w)):
            tiles = [tuple(x) for x in order]
            assert len(tiles) == len(set(tiles)) == w.num_tiles and set(tiles) == grid
    rev = grid_reversed_order(_work(batch=1, heads=2))
    assert list(rev[:, 2]) == [7, 6, 5, 4, 3, 2, 1, 0] * 2 and list(rev[:, 1]) == [0] * 8 + [1] * 8


def test_lpt_order_longest_first_within_a_section():
    w = _work(heads=4, batch=1)           # K/V of 4 heads fit in L2: one section
    order = lpt_order(w)
    assert list(order[:4, 2]) == [7, 7, 7, 7] and list(order[:4, 1]) == [0, 1, 2, 3]
    assert list(order[-4:, 2]) == [0, 0, 0, 0]
    costs = w.tile_costs()[order[:, 2]]
    assert np.all(np.diff(costs) <= 0)


def test_l2_swizzle():
    # 8192 keys x (128 + 128) x 2 bytes = 4 MiB per head: 12 fit in 50 MiB, rounded down to 8
    assert _work(seqlen_k=8192).l2_swizzle == 8
    assert _work(seqlen_k=10**6).l2_swizzle == 1


def test_tile_costs_follow_the_cost_model():
    w = _work(seqlen_q=512, seqlen_k=512)
    cm = CostModel(masked_block_cost=2.0, tile_overhead=0.5)
    # causal square: tile m sees m unmasked blocks and one masked (diagonal) block
    np.testing.assert_allclose(w.tile_costs(cm), [m + 2.0 + 0.5 for m in range(4)])


def test_schedules_cover_every_tile_once_without_overlap():
    w = _work(heads=3, seqlen_q=900, seqlen_k=1300)
    for name in SCHEDULERS:
        s = schedule(name, w, num_sms=7)
        assert sorted(map(tuple, s.order)) == sorted(map(tuple, grid_order(w)))
        for sm in range(7):
            idx = np.flatnonzero(s.sm == sm)
            iv = sorted(zip(s.start[idx], s.end[idx]))
            assert all(a[1] <= b[0] + 1e-9 for a, b in zip(iv, iv[1:]))
        assert s.busy.sum() == pytest.approx(s.total_work)
        assert s.makespan >= s.lower_bound - 1e-9
        assert 0 < s.efficiency <= 1 and s.imbalance >= 0


def test_static_persistent_assignment():
    w = _work(heads=1, batch=1)
    s = schedule_static_persistent(w, num_sms=3)
    assert list(s.sm) == [0, 1, 2, 0, 1, 2, 0, 1]
    costs = w.tile_costs()
    assert s.busy[0] == pytest.approx(costs[0] + costs[3] + costs[6])


@pytest.mark.parametrize("order", ["grid", "grid_reversed", "lpt"])
def test_persistent_ctas_take_their_tiles_in_turn(order):
    """CTA c runs tiles persistent_tiles(c, ...) of the order back to back, whatever the
    others do; with equal tile costs (non-causal) that is the first-free-SM schedule."""
    w = Workload(batch=2, heads=5, seqlen_q=1000, seqlen_k=1000, m_block_size=128,
                 n_block_size=128, causal=order != "grid")
    s = schedule_persistent(order, w, num_sms=7)
    assert np.array_equal(s.order, schedule(order, w, num_sms=7).order)
    costs = w.tile_costs()[s.order[:, 2]]
    for c in range(7):
        mine = list(persistent_tiles(c, 7, w.num_tiles))
        assert list(np.flatnonzero(s.sm == c)) == mine
        assert s.end[mine[-1]] == pytest.approx(costs[mine].sum())
    if order == "grid":
        assert s.makespan == pytest.approx(schedule(order, w, num_sms=7).makespan)
    with pytest.raises(ValueError, match="unknown tile order"):
        schedule_persistent("static", w)


def test_num_sms_from_hardware():
    w = _work()
    assert schedule_grid(w, arch="sm90").num_sms == 132
    assert schedule_grid(w, arch="sm100").num_sms == 148


def test_non_causal_equal_tiles_balance_the_same():
    w = _work(causal=False, heads=16, seqlen_q=2048)
    spans = {name: schedule(name, w, num_sms=132).makespan for name in SCHEDULERS}
    assert len(set(spans.values())) == 1


_SHAPES = dict(batch=st.integers(1, 4), heads=st.integers(1, 12),
               seqlen_q=st.integers(1, 3000), seqlen_k=st.integers(1, 3000),
               bm=st.sampled_from([64, 128, 256]), bn=st.sampled_from([64, 128]),
               causal=st.booleans(), num_sms=st.integers(1, 160),
               masked_cost=st.floats(1.0, 2.0), overhead=st.floats(0.0, 3.0))


@settings(max_examples=150, deadline=None)
@given(**_SHAPES)
def test_greedy_schedules_obey_grahams_bound(batch, heads, seqlen_q, seqlen_k, bm, bn, causal,
                                              num_sms, masked_cost, overhead):
    # Any list schedule that never leaves an SM idle while a tile waits ends by
    # total / m + (1 - 1/m) * longest tile (Graham 1966); an idle-SM bug breaks it.
    w = Workload(batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                 m_block_size=bm, n_block_size=bn, causal=causal)
    cm = CostModel(masked_block_cost=masked_cost, tile_overhead=overhead)
    longest = w.tile_costs(cm).max()
    for name in ("grid", "grid_reversed", "lpt"):
        s = schedule(name, w, num_sms=num_sms, cost=cm)
        bound = s.total_work / num_sms + (1 - 1 / num_sms) * longest
        assert s.lower_bound - 1e-9 <= s.makespan <= bound + 1e-9
    static = schedule_static_persistent(w, num_sms=num_sms, cost=cm)
    assert static.makespan == pytest.approx(static.busy.max())


@settings(max_examples=150, deadline=None)
@given(batch=st.integers(1, 4), heads=st.integers(1, 12), seqlen=st.integers(1, 4000),
       block=st.sampled_from([64, 128, 256]), num_sms=st.integers(1, 160),
       masked_cost=st.floats(1.0, 2.0), overhead=st.floats(0.0, 3.0))
def test_lpt_within_grahams_lpt_bound_of_grid(batch, heads, seqlen, block, num_sms,
                                              masked_cost, overhead):
    # Causal self-attention with one L2 section: the LPT order is longest-first, so Graham's
    # LPT theorem bounds it by (4/3 - 1/(3m)) x OPT <= (4/3 - 1/(3m)) x the grid's makespan.
    # (LPT is a heuristic: it is NOT always <= the grid; see the counterexample test below.)
    w = Workload(batch=batch, heads=heads, seqlen_q=seqlen, seqlen_k=seqlen,
                 m_block_size=block, n_block_size=block, causal=True, head_dim=64)
    assume(batch * heads <= w.l2_swizzle)
    cm = CostModel(masked_block_cost=masked_cost, tile_overhead=overhead)
    lpt = schedule_lpt(w, num_sms=num_sms, cost=cm)
    assert np.all(np.diff(lpt.end - lpt.start) <= 1e-9), "LPT order is not longest-first"
    grid = schedule_grid(w, num_sms=num_sms, cost=cm)
    assert lpt.makespan <= (4 / 3 - 1 / (3 * num_sms)) * grid.makespan + 1e-9


@pytest.mark.parametrize("batch,heads,seqlen,bm,num_sms", [
    (2, 16, 8192, 128, 132), (2, 16, 8192, 256, 148), (4, 16, 4096, 128, 132),
    (8, 16, 2048, 256, 148), (1, 32, 16384, 256, 148),
])
def test_lpt_beats_grid_on_causal_training_shapes(batch, heads, seqlen, bm, num_sms):
    w = Workload(batch=batch, heads=heads, seqlen_q=seqlen, seqlen_k=seqlen, m_block_size=bm,
                 n_block_size=128, causal=True)
    lpt, grid = schedule_lpt(w, num_sms=num_sms), schedule_grid(w, num_sms=num_sms)
    assert lpt.makespan < grid.makespan
    assert lpt.makespan <= 1.05 * lpt.lower_bound


def test_lpt_can_lose_to_grid_when_the_last_l2_section_is_short():
    # 9 (batch, head) pairs, 8 per L2 section: the residual section's longest tiles start
    # only after the first section is done, and end late. A known price of the swizzle.
    w = Workload(batch=3, heads=3, seqlen_q=8390, seqlen_k=8390, m_block_size=128,
                 n_block_size=128, causal=True)
    assert w.l2_swizzle == 8
    lpt, grid = schedule_lpt(w, num_sms=132), schedule_grid(w, num_sms=132)
    assert lpt.makespan > grid.makespan


def test_workload_from_spec_with_pack_gqa():
    spec = AttentionSpec(batch=2, seqlen_q=100, seqlen_k=300, heads_q=8, heads_kv=2,
                         head_dim=64, causal=True)
    w = Workload.from_spec(spec, m_block_size=128, n_block_size=128, pack_gqa=True)
    assert (w.heads, w.qhead_per_kvhead, w.num_m_blocks) == (2, 4, 4)
    plain = Workload.from_spec(spec, m_block_size=128, n_block_size=128)
    assert (plain.heads, plain.num_m_blocks) == (8, 1)


# ---------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("kwargs,match", [
    (dict(seqlen_q=0), "seqlen_q must be >= 1"),
    (dict(seqlen_k=-3), "seqlen_k must be >= 1"),
    (dict(m_block_size=0), "m_block_size must be >= 1"),
    (dict(n_block_size=2.5), "n_block_size must be a positive integer"),
    (dict(qhead_per_kvhead=0), "qhead_per_kvhead must be >= 1"),
])
def test_bad_sizes_raise(kwargs, match):
    args = dict(seqlen_q=8, seqlen_k=8, m_block_size=4, n_block_size=4, causal=True)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        classify_tiles(**args)
    with pytest.raises(ValueError, match=match):
        n_block_range(0, **args)


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(window_size=(None, -1)), ValueError, r"window_size=\(None, -1\).*stop 1"),
    (dict(window_size=(None, 2)), ValueError, r"causal=True with window_size=\(None, 2\)"),
    (dict(window_size=3), TypeError, "window_size must be a pair"),
    (dict(window_size=(1, 0.5)), TypeError, "right must be an int"),
])
def test_bad_windows_raise(kwargs, err, match):
    args = dict(seqlen_q=8, seqlen_k=8, m_block_size=4, n_block_size=4, causal=True, **kwargs)
    for call in (classify_tiles, n_block_range, n_block_masked_range, n_block_left_masked_range):
        with pytest.raises(err, match=match):
            call(**args) if call is classify_tiles else call(0, **args)
    with pytest.raises(err, match=match):
        Workload(batch=1, heads=1, **args)


def test_bad_m_block_and_heads_raise():
    with pytest.raises(ValueError, match=r"m_block=2 is out of range.*\[0, 2\)"):
        n_block_range(2, seqlen_q=8, seqlen_k=8, m_block_size=4, n_block_size=4, causal=False)
    with pytest.raises(ValueError, match="not a multiple of heads_kv=3.*choose heads_kv among"):
        gqa_group_size(8, 3)
    with pytest.raises(ValueError, match="heads_kv must be >= 1"):
        query_to_kv_heads(8, 0)
    with pytest.raises(ValueError, match="q_head=8 is out of range"):
        kv_head_of(8, 8, 2)
    with pytest.raises(ValueError, match="packed_row=12 is out of range"):
        unpack_gqa_row(0, 12, heads_q=4, heads_kv=2, seqlen_q=6)
    with pytest.raises(ValueError, match="unknown scheduler 'fifo'"):
        schedule("fifo", _work(), num_sms=4)
    with pytest.raises(ValueError, match="num_sms must be >= 1"):
        schedule_lpt(_work(), num_sms=0)
    with pytest.raises(ValueError, match="masked_block_cost"):
        CostModel(masked_block_cost=0.5)
    with pytest.raises(ValueError, match="batch must be >= 1"):
        _work(batch=0)


# ---------------------------------------------------------------------------------- figures


def test_figures_and_widgets_render():
    import matplotlib.pyplot as plt

    from fa4lab.viz.tiles import (
        gqa_figure,
        schedule_comparison_figure,
        schedule_gantt_figure,
        schedule_widget,
        tile_grid_figure,
        tiles_widget,
    )

    grid = tile_grid_figure(classify_tiles(300, 200, 64, 64, True, qhead_per_kvhead=2))
    assert grid.axes and "skipped" in grid.axes[0].get_title()
    local = tile_grid_figure(classify_tiles(300, 500, 32, 32, False, qhead_per_kvhead=2,
                                            window_size=(64, 16)))
    assert "window_size=(64, 16)" in local.axes[0].get_title()
    labels = [t.get_text() for t in local.axes[0].get_legend().get_texts()]
    assert any("window edges" in t for t in labels)
    plt.close(local)
    w = _work(seqlen_q=512, seqlen_k=512)
    scheds = [schedule(name, w, num_sms=5) for name in SCHEDULERS]
    gantt = schedule_gantt_figure(scheds[0], max_sms=3)
    # the SM that finishes last is always among the rows drawn
    last = int(np.argmax([scheds[0].end[scheds[0].sm == s].max() for s in range(5)]))
    assert str(last) in [t.get_text() for t in gantt.axes[0].get_yticklabels()]
    for fig in (gantt, schedule_comparison_figure(scheds), gqa_figure(8, 2), grid):
        plt.close(fig)
    tiles = tiles_widget(seqlen_q=300, seqlen_k=300)
    assert "SKIP" in tiles.text.value and tiles.image.value
    tiles.controls["heads_kv"].value = 3
    tiles.controls["pack_gqa"].value = True      # 8 heads over 3 KV heads: a clear error
    assert "not a multiple" in tiles.text.value
    sched = schedule_widget(seqlen=1024, batch=1, heads=2, num_sms=16)
    assert "lpt: makespan" in sched.text.value and sched.image.value


def test_kernel_scheduler_calls_the_tiling_rules():
    # The device helpers take Python ints too: the kernels and this plan must agree exactly
    # (the DSL's min/max on ints, the tile's rows and pack, windows included).
    ks = pytest.importorskip("fa4lab.kernels.device.scheduler")
    for sq, sk in itertools.product((1, 7, 64, 100, 129, 300, 513), (1, 5, 64, 127, 300, 640)):
        for bm, bn, causal, window in itertools.product((64, 128), (64, 128), (False, True),
                                                        ((None, None), (70, None), (3, 0))):
            kw = dict(seqlen_q=sq, seqlen_k=sk, m_block_size=bm, n_block_size=bn, causal=causal,
                      window_size=window)
            left, right = effective_window(causal, window)
            for m in range(-(-sq // bm)):
                lo, hi = n_block_range(m, **kw)
                mlo, _ = n_block_masked_range(m, **kw)
                _, left_end = n_block_left_masked_range(m, **kw)
                assert ks.block_range(m, bm, 1, bn, sq, sk, left, right) == (lo, hi), (kw, m)
                assert ks.mask_split(m, bm, 1, bn, sq, sk, left, right, lo, hi) == (
                    left_end, mlo), (kw, m)


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 4), heads=st.integers(1, 20), seqlen_q=st.integers(1, 3000),
       seqlen_k=st.sampled_from([1, 700, 40000, 400_000]), num_ctas=st.integers(1, 160),
       order=st.sampled_from(["grid", "grid_reversed", "lpt"]))
def test_persistent_ctas_visit_every_tile_once(batch, heads, seqlen_q, seqlen_k, num_ctas,
                                               order):
    # The persistent kernel's loop (CTA c: tiles c, c + G, ...) through the one index formula
    # (scheduling.tile_at, what the device scheduler calls), against the numpy order of the same
    # name: together the CTAs run each tile exactly once, and the t-th tile is the order's t-th.
    from fa4lab.scheduling import persistent_tiles, tile_at

    w = Workload(batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                 m_block_size=256, n_block_size=128, causal=True)
    want = {"grid": grid_order, "grid_reversed": grid_reversed_order, "lpt": lpt_order}[order](w)
    swizzle = w.l2_swizzle if order == "lpt" else 1
    grid = min(w.num_tiles, num_ctas)
    seen = []
    for cta in range(grid):
        for t in persistent_tiles(cta, grid, w.num_tiles):
            got = tile_at(t, order, w.num_m_blocks, heads, batch, swizzle)
            assert tuple(got) == tuple(want[t]), (order, t)
            seen.append(tuple(got))
    assert len(seen) == len(set(seen)) == w.num_tiles


def test_tile_at_rejects_an_unknown_order():
    from fa4lab.scheduling import tile_at

    with pytest.raises(ValueError, match="unknown tile order"):
        tile_at(0, "spiral", 4, 2, 1)
