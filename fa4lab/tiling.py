"""Tiles and masks as plain-Python rules; the kernels share the block ranges.

What it computes, for an attention forward pass cut into (m_block, n_block) tiles of
`m_block_size` query rows by `n_block_size` keys:

- `n_block_range`: the K/V blocks a query tile must visit (half-open), and
  `n_block_masked_range`: the last of those that need an element mask (causal or seqlen_k bound),
  `n_block_left_masked_range`: the first of those that need one (a sliding window's left edge),
  `visit_order`: the order the kernels visit them in; underneath, on positions, the functions
  the kernels call too (`key_bounds`, `block_range`, `mask_split`, `visit_block`);
- `classify_tiles`: every tile as SKIP / FULL / MASKED / TAIL, with counts;
- (the GQA maps, query head -> KV head and pack-GQA's rows, are `fa4lab.gqa`'s);
- (the tile orders and schedulers, with the cost model that compares them, are
  `fa4lab.scheduling`'s).

The math contract (the same as `fa4lab.spec`): with `causal=True` the mask is bottom-right
aligned, query i sees key j iff j <= i + seqlen_k - seqlen_q; without it every key j < seqlen_k
is visible. A sliding window `window_size=(left, right)` (None = unbounded side, causal is
right = 0) keeps i + d - left <= j <= i + d + right, d = seqlen_k - seqlen_q (Note [window and
causal] in `fa4lab.spec`). Query head h reads KV head h // (heads_q // heads_kv).

The block-range rules are integer arithmetic (ceil-div, min, max) written once, for Python ints
and the CuTe DSL's Int32 alike: the kernels in `fa4lab/kernels/` call `block_range`,
`mask_split` and `visit_block` themselves (Note [sliding window tiles]). Pure functions and frozen
dataclasses; bad arguments raise ValueError naming the argument (TypeError for a window_size
that is not a pair of int/None). CPU only, no GPU needed:

    from fa4lab.tiling import n_block_range, classify_tiles
    classify_tiles(seqlen_q=1000, seqlen_k=1000, m_block_size=128, n_block_size=128,
                   causal=True).counts
    classify_tiles(4096, 4096, 128, 128, causal=True, window_size=(1024, 0)).counts
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from fa4lab.spec import effective_window, normalize_mask, visible_key_counts

__all__ = [
    "TileClasses",
    "TileKind",
    "block_range",
    "ceil_div",
    "classify_tiles",
    "key_bounds",
    "query_block_range",
    "mask_split",
    "n_block_left_masked_range",
    "n_block_masked_range",
    "n_block_range",
    "num_m_blocks",
    "num_n_blocks",
    "tile_positions",
    "visit_block",
    "visit_order",
]


# --------------------------------------------------------------------------- argument checks


def _positive(name: str, value, hint: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be a positive integer, got {type(value).__name__} "
                         f"{value!r}{hint}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}{hint}")
    return int(value)


def _check_sizes(seqlen_q, seqlen_k, m_block_size, n_block_size, qhead_per_kvhead=1):
    _positive("seqlen_q", seqlen_q)
    _positive("seqlen_k", seqlen_k)
    _positive("m_block_size", m_block_size, " (rows of Q per tile, e.g. 128)")
    _positive("n_block_size", n_block_size, " (keys per K/V block, e.g. 128)")
    _positive("qhead_per_kvhead", qhead_per_kvhead, " (1 = no pack-GQA)")


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for a >= 0, b > 0 (the only case used: see Note [bottom-right causal])."""
    return (a + b - 1) // b


def num_m_blocks(seqlen_q: int, m_block_size: int, qhead_per_kvhead: int = 1) -> int:
    """Query tiles per (batch, head): the M extent is seqlen_q * qhead_per_kvhead (pack-GQA)."""
    return ceil_div(seqlen_q * qhead_per_kvhead, m_block_size)


def num_n_blocks(seqlen_k: int, n_block_size: int) -> int:
    return ceil_div(seqlen_k, n_block_size)


# --------------------------------------------------------------------------- block ranges

# Note [bottom-right causal]
# Query position i sees key j iff j <= i + seqlen_k - seqlen_q (the last query row sees every
# key; with seqlen_q > seqlen_k the first seqlen_q - seqlen_k rows see nothing). A query tile
# covers M-space rows [m_block * m_block_size, (m_block + 1) * m_block_size). Without pack-GQA
# an M row is a query position; with pack-GQA row r is position r // qhead_per_kvhead (see
# Note [pack-GQA rows] in fa4lab.gqa), so the tile covers positions
#     pos_lo = (m_block * m_block_size) // qhead_per_kvhead                (its first row)
#     pos_hi = ceil_div((m_block + 1) * m_block_size, qhead_per_kvhead)  (one past its last)
# The tile's last row sees keys j < pos_hi + seqlen_k - seqlen_q, so the blocks to visit are
#     n_block_min = 0
#     n_block_max = min(ceil_div(seqlen_k, n_block_size),
#                       ceil_div(max(pos_hi + seqlen_k - seqlen_q, 0), n_block_size))
# (a tile running past seqlen_q has pos_hi + seqlen_k - seqlen_q > seqlen_k, so the first term
# bounds it). The range is empty (n_block_max == n_block_min == 0) when no row of the tile
# sees a key. The clamp to >= 0 comes BEFORE the ceil-div: Python's // floors but the DSL's
# integer division truncates toward zero, and on a non-negative numerator both agree.
#
# The tile's first row is the most restricted one (it sees j <= pos_lo + seqlen_k - seqlen_q).
# Block n (columns [n * n_block_size, min((n + 1) * n_block_size, seqlen_k))) is fully visible
# to every in-bounds row iff its last in-bounds column is within that reach:
#     min((n + 1) * n_block_size, seqlen_k) - 1 <= pos_lo + seqlen_k - seqlen_q
# For a whole block that holds iff n < (pos_lo + seqlen_k - seqlen_q + 1) // n_block_size.
# A block that runs past seqlen_k (the last one when seqlen_k % n_block_size != 0) needs the
# seqlen_k bound mask anyway, so the blocks that need any element mask are the last ones:
#     n_block_mask_min = min(seqlen_k // n_block_size,
#                            max(pos_lo + seqlen_k - seqlen_q + 1, 0) // n_block_size)
# clamped into [n_block_min, n_block_max]. (Upstream FA4 uses (pos_lo + sk - sq) // n, which
# marks one extra block as masked when pos_lo + sk - sq + 1 is a multiple of n: harmless but
# not exact; this one is exact, and the tests check it against a brute-force element mask.)
# The kernels iterate the masked blocks first (from n_block_max - 1 down to n_block_mask_min),
# then the unmasked ones (down to n_block_min), as FA does, so the mask code runs only where
# it must. Rows past seqlen_q are computed and dropped at the store: they need no mask.
# A sliding window generalises both edges: see Note [sliding window tiles].

# Note [sliding window tiles]
# With an effective window (left, right) (`fa4lab.spec.effective_window`: causal is right = 0,
# None is an unbounded side) position p sees keys p + d - left <= j <= p + d + right, j <
# seqlen_k, d = seqlen_k - seqlen_q. Each row's visible keys are one interval and the next
# row's interval starts and ends one key later, so a tile's visible columns are one interval
# too, from its first row's left edge to its last row's right edge. With pos_lo, pos_hi as in
# Note [bottom-right causal]:
#     right side (when right is not None; causal is right = 0, the formula above):
#         n_block_max = min(ceil_div(seqlen_k, n_block_size),
#                           ceil_div(max(pos_hi + seqlen_k - seqlen_q + right, 0), n_block_size))
#     left side (when left is not None; else n_block_min = 0):
#         n_block_min = min(max(pos_lo + seqlen_k - seqlen_q - left, 0) // n_block_size,
#                           n_block_max)
# Blocks left of n_block_min are SKIP, like the blocks right of the causal diagonal. (The
# first row is in bounds, so pos_lo + d - left <= seqlen_k - 1: a window never pushes a tile
# past the last key block; the min only keeps a tile that sees nothing at [max, max).)
# The element mask is needed on two runs of blocks of the range, never in between:
#     right edge (and the seqlen_k tail), the LAST blocks [n_block_mask_min, n_block_max):
#         n_block_mask_min = min(seqlen_k // n_block_size,
#                                max(pos_lo + seqlen_k - seqlen_q + right + 1, 0) // n_block_size)
#         (no right-edge term when right is None), clamped into [n_block_min, n_block_max];
#     left edge, the FIRST blocks [n_block_min, n_block_left_mask_end): the LAST in-bounds row
#         is the most restricted one there; it is position min(pos_hi, seqlen_q) - 1 and its
#         first visible key is min(pos_hi + seqlen_k - seqlen_q, seqlen_k) - 1 - left, so
#         block n holds a key it cannot see iff n * n_block_size < that key:
#         n_block_left_mask_end = ceil_div(max(min(pos_hi + seqlen_k - seqlen_q, seqlen_k)
#                                              - 1 - left, 0), n_block_size)
#         (n_block_min when left is None), clamped into [n_block_min, n_block_mask_min] so the
#         two runs never overlap (a narrow window can mask every block of a tile).
# Blocks [n_block_left_mask_end, n_block_mask_min) need no mask at all (the order the kernels
# visit the three runs in: Note [block visit order]). With the window's left side the clamp to
# the last IN-BOUNDS row (min(.., seqlen_k) above) makes the split exact: rows past seqlen_q of
# the last tile do not widen the left-edge run (upstream, which uses the tile's last row, may
# mark an extra block). Every term is +, -, *, //, min, max on ints, each // on a non-negative
# value.
#
# Each edge above is one row's edge (`key_bounds`): n_block_max and the left-edge run come from
# the edges of the tile's last (in-bounds) row, n_block_min and n_block_mask_min from its first
# row's. `key_bounds`, `block_range`, `mask_split` and `visit_block` are the ONE implementation
# of these formulas: this module calls them on Python ints, the kernels
# (`fa4lab.kernels.device.scheduler`, `fa4lab.kernels.device.mask`) on the DSL's Int32 values,
# passing the DSL's min and max as `imin` / `imax`; None (no side) is a compile-time choice.

# Note [block visit order]
# Every role of a CTA walks the same key blocks in the same order (the loads, the MMAs and the
# softmax must agree block for block): first the blocks that need the element mask, then the
# unmasked ones, each run from its highest block down:
#     [n_block_mask_min, n_block_max)       the right edge (causal diagonal, seqlen_k tail),
#     [n_block_min, n_block_left_mask_end)  the window's left edge,
#     [n_block_left_mask_end, n_block_mask_min)  unmasked.
# So a kernel has exactly one masked loop and one unmasked loop (the protocol table's two loops
# per softmax role) whatever the window; upstream FA4 visits the left-edge run last, in a third
# loop. Without a left side the left-edge run is empty and the order is simply n_block_max - 1
# down to n_block_min. The online softmax gives the same result in any order (up to rounding).
# `visit_block(step)` is the block of step `step`; with a left-edge run it is
#     n_block_max - 1 - step - [step >= R] * (n_block_mask_min - n_block_left_mask_end)
#                            + [step >= M] * (n_block_mask_min - n_block_min)
# with R = n_block_max - n_block_mask_min the right-edge run's length, M = R + (n_block_left_
# mask_end - n_block_min) the masked steps, and [c] = 1 when c holds, written min(max(step - R +
# 1, 0), 1) so that ints and Int32 take the same formula. A kernel's unmasked loop may count
# the block index itself instead (n_block_mask_min - 1 down to n_block_left_mask_end).


def tile_positions(m_block, m_block_size, qhead_per_kvhead=1):
    """[pos_lo, pos_hi): the query positions tile `m_block` covers (Note [bottom-right causal];
    with pack-GQA, M rows are packed rows: Note [pack-GQA rows] in fa4lab.gqa). Ints or DSL
    Int32."""
    pos_lo = (m_block * m_block_size) // qhead_per_kvhead
    pos_hi = ceil_div((m_block + 1) * m_block_size, qhead_per_kvhead)
    return pos_lo, pos_hi


def key_bounds(pos, seqlen_q, seqlen_k, left, right, *, imin=min):
    """[first, end): the keys query position `pos` sees under the effective window (left,
    right) (None = unbounded side; causal is right = 0): first = pos + d - left (None without a
    left side; may be negative), end = min(seqlen_k, pos + d + right + 1) (seqlen_k without a
    right side), d = seqlen_k - seqlen_q. The row sees no key when end <= max(first, 0). Ints or
    DSL Int32 (`imin`: the DSL's min). See Note [sliding window tiles]."""
    d = seqlen_k - seqlen_q
    end = seqlen_k if right is None else imin(seqlen_k, pos + d + right + 1)
    first = None if left is None else pos + d - left
    return first, end


def block_range(pos_lo, pos_hi, seqlen_q, seqlen_k, n_block_size, left, right, *, imin=min,
                imax=max):
    """HALF-OPEN [n_block_min, n_block_max): the key blocks a tile of positions [pos_lo,
    pos_hi) visits; empty (0, 0) exactly when no row of the tile sees a key. The formulas of
    Note [bottom-right causal] and Note [sliding window tiles], on ints or DSL Int32."""
    # the last IN-BOUNDS row: past seqlen_q a negative right side would see more keys
    _, end = key_bounds(imin(pos_hi, seqlen_q) - 1, seqlen_q, seqlen_k, left, right, imin=imin)
    hi = imax(end, 0)
    first, _ = key_bounds(pos_lo, seqlen_q, seqlen_k, left, right, imin=imin)
    if first is None:
        return 0, ceil_div(hi, n_block_size)
    # keys [lo, hi) hold every visible one; none is visible when lo >= hi or, with both
    # sides, when each row's own interval is empty (left + right < 0: negative sides)
    lo = imin(imax(first, 0), hi)
    if right is not None:
        hi = lo + (hi - lo) * imin(imax(left + right + 1, 0), 1)
    n_block_max = ceil_div(hi, n_block_size) * imin(imax(hi - lo, 0), 1)
    return imin(lo // n_block_size, n_block_max), n_block_max


def query_block_range(n_block, n_block_size, m_block_size, seqlen_q, seqlen_k, left, right, *,
                      imin=min, imax=max):
    """HALF-OPEN [m_block_min, m_block_max): the query blocks of `m_block_size` rows in which
    some row sees a key of key block `n_block` -- the backward's loop, key blocks outside (Note
    [key blocks outside] in fa4lab.backward_blocks); empty (0, 0) when no row sees one.

    Key j is seen by position p iff p + d - left <= j <= p + d + right (d = seqlen_k -
    seqlen_q), so the block's keys [k_lo, k_hi) are seen by positions p >= k_lo - d - right
    and p <= k_hi - 1 - d + left, each side only where the window has it; with both sides a
    row's interval is empty when left + right < 0. Ints or DSL Int32 (`imin` / `imax`)."""
    d = seqlen_k - seqlen_q
    k_lo = n_block * n_block_size
    k_hi = imin(k_lo + n_block_size, seqlen_k)
    p_lo = 0 if right is None else imax(k_lo - d - right, 0)
    p_hi = seqlen_q if left is None else imin(k_hi - d + left, seqlen_q)
    some = imin(imax(p_hi - p_lo, 0), 1) * imin(imax(k_hi - k_lo, 0), 1)
    if left is not None and right is not None:
        some = some * imin(imax(left + right + 1, 0), 1)
    m_block_max = ceil_div(imax(p_hi, 0), m_block_size) * some
    return imin(p_lo // m_block_size, m_block_max), m_block_max


def mask_split(pos_lo, pos_hi, n_block_min, n_block_max, seqlen_q, seqlen_k, n_block_size,
               left, right, *, imin=min, imax=max):
    """(n_block_left_mask_end, n_block_mask_min): the blocks of [n_block_min, n_block_max)
    that a tile of positions [pos_lo, pos_hi) must mask, as two runs [n_block_min,
    n_block_left_mask_end) and [n_block_mask_min, n_block_max) (Note [sliding window tiles]).

    The range may be wider than the tile's own `block_range` (a CTA's, holding several tiles):
    blocks of it the tile cannot see at all fall into the masked runs. Ints or DSL Int32."""
    _, end = key_bounds(pos_lo, seqlen_q, seqlen_k, left, right, imin=imin)
    n_block_mask_min = imin(imax(imax(end, 0) // n_block_size, n_block_min), n_block_max)
    n_block_left_mask_end = n_block_min
    if left is not None:
        last_row = imin(pos_hi, seqlen_q) - 1       # the last in-bounds row
        first, _ = key_bounds(last_row, seqlen_q, seqlen_k, left, right, imin=imin)
        n_block_left_mask_end = imin(imax(ceil_div(imax(first, 0), n_block_size), n_block_min),
                                     n_block_mask_min)
    return n_block_left_mask_end, n_block_mask_min


def visit_block(step, n_block_max, n_block_mask_min, left_run=None, *, imin=min, imax=max):
    """The key block visited at step `step` of [0, n_block_max - n_block_min), in the order of
    Note [block visit order]. `left_run` is (n_block_min, n_block_left_mask_end) with a window's
    left side, else None: the blocks then simply go down from n_block_max - 1. Ints or DSL
    Int32 (`imin` / `imax`: the DSL's min and max)."""
    if left_run is None:
        return n_block_max - 1 - step
    n_block_min, n_block_left_mask_end = left_run
    right = n_block_max - n_block_mask_min                   # steps of the right-edge run
    masked = right + n_block_left_mask_end - n_block_min     # ... and of the left-edge run
    past_right = imin(imax(step - right + 1, 0), 1)          # [step >= right]
    past_masked = imin(imax(step - masked + 1, 0), 1)        # [step >= masked]
    return (n_block_max - 1 - step - past_right * (n_block_mask_min - n_block_left_mask_end)
            + past_masked * (n_block_mask_min - n_block_min))


# Note [mask_mod block table]
# A mask_mod (`fa4lab.mods`) may hide whole key blocks (documents, a prefix-LM's future). The
# host evaluates it once per call configuration and reduces it to one row per CTA tile
# (`fa4lab.mods_blocks.block_table`): [lo, hi), the first and one-past-last key block where ANY
# (batch, head, row of the tile) sees a key, and [full_lo, full_hi), a run of blocks where EVERY
# one sees every in-bounds key (empty: full_lo = full_hi). A CTA then narrows the formulas'
# range and unmasked middle to them (`table_range`, `table_split`):
#     n_block_max' = min(n_block_max, hi),  n_block_min' = min(max(n_block_min, lo), n_block_max')
#     the unmasked middle [left_end, mask_min) intersected with [full_lo, full_hi),
# and every other block of [n_block_min', n_block_max') joins a masked run, where the element
# mask AND the mask_mod apply. So the walk keeps the shape of Note [block visit order] (a left
# masked run, the unmasked middle, a right masked run), and the result depends on the table only
# through "blocks outside [lo, hi) are hidden from every row" and "blocks of [full_lo, full_hi)
# are visible to every row": a wider [lo, hi) or a narrower full run costs time, never accuracy.
# A row (0, 0, 0, 0) empties the range, and the CTA behaves as any CTA whose rows see nothing.


def table_range(n_block_min, n_block_max, lo, hi, *, imin=min, imax=max):
    """[n_block_min, n_block_max) narrowed to a mask table row's [lo, hi) (Note [mask_mod block
    table]); empty (n_block_max' == n_block_min') when they do not meet. Ints or DSL Int32."""
    n_block_max = imin(n_block_max, hi)
    return imin(imax(n_block_min, lo), n_block_max), n_block_max


def table_split(n_block_min, n_block_max, n_block_left_mask_end, n_block_mask_min, full_lo,
                full_hi, *, imin=min, imax=max):
    """`mask_split`'s (n_block_left_mask_end, n_block_mask_min) with the unmasked middle
    narrowed to a mask table row's [full_lo, full_hi) (Note [mask_mod block table]): still
    n_block_min <= left_end <= mask_min <= n_block_max. Ints or DSL Int32."""
    mask_min = imin(imax(imin(n_block_mask_min, full_hi), n_block_min), n_block_max)
    return imin(imax(n_block_left_mask_end, full_lo), mask_min), mask_min


def visit_order(m_block: int, *, seqlen_q: int, seqlen_k: int, m_block_size: int,
                n_block_size: int, causal: bool, qhead_per_kvhead: int = 1,
                window_size=(None, None)) -> tuple[list[int], int]:
    """(blocks, masked): the key blocks tile `m_block` visits in the kernels' order and how
    many of the first need the element mask. See Note [block visit order]."""
    n_min, left_end, mask_min, n_max = _split(m_block, seqlen_q, seqlen_k, m_block_size,
                                              n_block_size, causal, qhead_per_kvhead,
                                              window_size)
    left, _ = effective_window(causal, window_size)
    left_run = None if left is None else (n_min, left_end)
    blocks = [visit_block(s, n_max, mask_min, left_run) for s in range(n_max - n_min)]
    return blocks, (n_max - mask_min) + (left_end - n_min)


def _check_m_block(m_block, seqlen_q, m_block_size, qhead_per_kvhead):
    if isinstance(m_block, bool) or not isinstance(m_block, (int, np.integer)):
        raise ValueError(f"m_block must be an integer, got {type(m_block).__name__} {m_block!r}")
    n_m = num_m_blocks(seqlen_q, m_block_size, qhead_per_kvhead)
    if not 0 <= m_block < n_m:
        raise ValueError(f"m_block={m_block} is out of range: seqlen_q={seqlen_q} "
                         f"(x{qhead_per_kvhead} packed heads) in tiles of {m_block_size} rows "
                         f"gives m_block in [0, {n_m})")


def _tile(m_block, seqlen_q, seqlen_k, m_block_size, n_block_size, causal, qhead_per_kvhead,
          window_size):
    """Checked arguments of the public range functions: (pos_lo, pos_hi, left, right)."""
    _check_sizes(seqlen_q, seqlen_k, m_block_size, n_block_size, qhead_per_kvhead)
    _check_m_block(m_block, seqlen_q, m_block_size, qhead_per_kvhead)
    left, right = effective_window(causal, window_size)
    return (*tile_positions(m_block, m_block_size, qhead_per_kvhead), left, right)


def n_block_range(m_block: int, *, seqlen_q: int, seqlen_k: int, m_block_size: int,
                  n_block_size: int, causal: bool, qhead_per_kvhead: int = 1,
                  window_size=(None, None)) -> tuple[int, int]:
    """The K/V blocks query tile `m_block` visits: HALF-OPEN `[n_block_min, n_block_max)`.

    Empty (`n_block_min == n_block_max`) when no row of the tile sees any key (causal, or a
    window's right side, with seqlen_q > seqlen_k). `qhead_per_kvhead > 1` means pack-GQA: M
    rows are packed rows. `window_size=(left, right)` is a sliding window (None = unbounded
    side); its left side makes n_block_min > 0. See Note [bottom-right causal] and Note
    [sliding window tiles].
    """
    pos_lo, pos_hi, left, right = _tile(m_block, seqlen_q, seqlen_k, m_block_size, n_block_size,
                                        causal, qhead_per_kvhead, window_size)
    return block_range(pos_lo, pos_hi, seqlen_q, seqlen_k, n_block_size, left, right)


def _split(m_block, seqlen_q, seqlen_k, m_block_size, n_block_size, causal, qhead_per_kvhead,
           window_size):
    """(n_block_min, n_block_left_mask_end, n_block_mask_min, n_block_max) of a tile."""
    pos_lo, pos_hi, left, right = _tile(m_block, seqlen_q, seqlen_k, m_block_size, n_block_size,
                                        causal, qhead_per_kvhead, window_size)
    n_min, n_max = block_range(pos_lo, pos_hi, seqlen_q, seqlen_k, n_block_size, left, right)
    left_end, mask_min = mask_split(pos_lo, pos_hi, n_min, n_max, seqlen_q, seqlen_k,
                                    n_block_size, left, right)
    return n_min, left_end, mask_min, n_max


def n_block_masked_range(m_block: int, *, seqlen_q: int, seqlen_k: int, m_block_size: int,
                         n_block_size: int, causal: bool, qhead_per_kvhead: int = 1,
                         window_size=(None, None)) -> tuple[int, int]:
    """The blocks of `n_block_range` that need an element mask for the right edge: HALF-OPEN
    `[n_block_mask_min, n_block_max)`, always the last ones of the range.

    A block needs the mask when the causal diagonal (or a window's right edge) crosses its
    in-bounds part or it runs past seqlen_k. Without a window's left side, blocks
    `[n_block_min, n_block_mask_min)` are visited with no mask at all; with one, the first of
    them need the left-edge mask (`n_block_left_masked_range`). See Note [bottom-right causal]
    and Note [sliding window tiles].
    """
    _, _, mask_min, n_max = _split(m_block, seqlen_q, seqlen_k, m_block_size, n_block_size,
                                   causal, qhead_per_kvhead, window_size)
    return mask_min, n_max


def n_block_left_masked_range(m_block: int, *, seqlen_q: int, seqlen_k: int,
                              m_block_size: int, n_block_size: int, causal: bool,
                              qhead_per_kvhead: int = 1,
                              window_size=(None, None)) -> tuple[int, int]:
    """The blocks of `n_block_range` that need an element mask for a window's left edge and
    are not in `n_block_masked_range`: HALF-OPEN `[n_block_min, n_block_left_mask_end)`,
    always the first ones of the range; empty without a left side.

    Together with `n_block_masked_range` this splits the range into three runs: left-edge
    masked, unmasked `[n_block_left_mask_end, n_block_mask_min)`, right-edge masked. See Note
    [sliding window tiles].
    """
    n_min, left_end, _, _ = _split(m_block, seqlen_q, seqlen_k, m_block_size, n_block_size,
                                   causal, qhead_per_kvhead, window_size)
    return n_min, left_end


def block_counts(m_blocks, seqlen_q, seqlen_k, *, m_block_size: int, n_block_size: int,
                 causal: bool, qhead_per_kvhead: int = 1, window_size=(None, None)):
    """(unmasked, masked) key-block counts of tiles `m_blocks` (an int64 array) on sequences of
    `seqlen_q` / `seqlen_k` query / key positions (ints, or int64 arrays one per tile: a varlen
    batch's tiles at once), as int64 arrays: the three runs of `n_block_left_masked_range` and
    `n_block_masked_range` (`block_range` and `mask_split` on whole arrays), the masked count
    holding both edges of a window. A tile whose rows see no key counts 0 and 0. numpy arrays,
    or torch tensors (on any device, the lengths then tensors too: `fa4lab.varlen_tiles.tile_rows`
    builds a launch's tile table on the GPU with it)."""
    if _is_torch(m_blocks):
        m, sq, sk = (x.to(m_blocks.device, _torch_int64()) for x in _torch_broadcast(
            m_blocks, seqlen_q, seqlen_k))
        imin, imax = _torch_min, _torch_max
    else:
        m = np.asarray(m_blocks, dtype=np.int64)
        sq = np.broadcast_to(np.asarray(seqlen_q, dtype=np.int64), m.shape)
        sk = np.broadcast_to(np.asarray(seqlen_k, dtype=np.int64), m.shape)
        imin, imax = np.minimum, np.maximum
    left, right = effective_window(causal, window_size)
    pos_lo, pos_hi = tile_positions(m, m_block_size, qhead_per_kvhead)
    n_min, n_max = block_range(pos_lo, pos_hi, sq, sk, n_block_size, left, right,
                               imin=imin, imax=imax)
    left_end, mask_min = mask_split(pos_lo, pos_hi, n_min, n_max, sq, sk, n_block_size, left,
                                    right, imin=imin, imax=imax)
    unmasked = mask_min - left_end
    masked = (n_max - mask_min) + (left_end - n_min)
    return unmasked, masked


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _torch_int64():
    import torch

    return torch.int64


def _torch_broadcast(*xs):
    import torch

    device = xs[0].device
    return torch.broadcast_tensors(*(torch.as_tensor(x, device=device) for x in xs))


def _torch_min(a, b):
    """min of torch tensors and Python ints, elementwise (`block_range`'s imin)."""
    import torch

    if not isinstance(a, torch.Tensor):
        a, b = b, a
    if not isinstance(a, torch.Tensor):
        return min(a, b)
    return torch.minimum(a, b) if isinstance(b, torch.Tensor) else a.clamp(max=b)


def _torch_max(a, b):
    import torch

    if not isinstance(a, torch.Tensor):
        a, b = b, a
    if not isinstance(a, torch.Tensor):
        return max(a, b)
    return torch.maximum(a, b) if isinstance(b, torch.Tensor) else a.clamp(min=b)


# --------------------------------------------------------------------------- tile kinds


class TileKind(IntEnum):
    """What a tile costs the kernel. See Note [tile kinds]."""

    SKIP = 0     # no visible element: never loaded, never computed
    FULL = 1     # every element in bounds and visible: no mask work
    MASKED = 2   # the causal diagonal or a window edge crosses it: needs the element mask
    TAIL = 3     # all in-bounds elements visible, but rows or columns run past the end


# Note [tile kinds]
# Only in-bounds elements (row position < seqlen_q, key < seqlen_k) count. Precedence, first
# match wins: SKIP (nothing visible) > MASKED (some in-bounds element invisible, i.e. the causal
# boundary or a window edge is inside) > TAIL (the tile runs past seqlen_q or seqlen_k) > FULL.
# So a tile on the diagonal AND at the tail is MASKED: the kernel's mask routine applies the
# causal and the seqlen_k bound together. A TAIL tile needs the seqlen_k bound mask when it runs
# past seqlen_k (`TileClasses.needs_element_mask`); a tile that only runs past seqlen_q needs
# no mask (its extra rows are dropped at the store). `needs_element_mask` is exactly the union
# of the sets `n_block_masked_range` and `n_block_left_masked_range` return.


@dataclass(frozen=True, eq=False)
class TileClasses:
    """Every (m_block, n_block) tile of one (batch, head), classified."""

    seqlen_q: int
    seqlen_k: int
    m_block_size: int
    n_block_size: int
    causal: bool
    qhead_per_kvhead: int
    kinds: np.ndarray               # (num_m_blocks, num_n_blocks) int8 of TileKind
    needs_element_mask: np.ndarray  # (num_m_blocks, num_n_blocks) bool
    window_size: tuple = (None, None)   # as `fa4lab.spec.normalize_mask` stores it

    @property
    def effective_window(self) -> tuple[int | None, int | None]:
        """(left, right) in effect: right = 0 under causal, None = unbounded."""
        left, right = self.window_size
        return left, 0 if self.causal else right

    @property
    def shape(self) -> tuple[int, int]:
        return self.kinds.shape

    @property
    def counts(self) -> dict[str, int]:
        return {k.name: int((self.kinds == k).sum()) for k in TileKind}

    @property
    def num_tiles(self) -> int:
        return int(self.kinds.size)

    @property
    def skipped_fraction(self) -> float:
        """Fraction of tiles (hence of the dense MMA FLOPs) the kernel never computes."""
        return self.counts["SKIP"] / self.num_tiles

    @property
    def visible_element_fraction(self) -> float:
        """Fraction of the seqlen_q x seqlen_k scores that are visible (the exact math)."""
        sq, sk = self.seqlen_q, self.seqlen_k
        if self.effective_window == (None, None):
            return 1.0
        # causal: row i sees min(sk, max(0, i + sk - sq + 1)) keys
        return float(visible_key_counts(sq, sk, self.effective_window).sum() / (sq * sk))


def classify_tiles(seqlen_q: int, seqlen_k: int, m_block_size: int, n_block_size: int,
                   causal: bool, qhead_per_kvhead: int = 1, *,
                   window_size=(None, None)) -> TileClasses:
    """Classify every tile as SKIP / FULL / MASKED / TAIL. See Note [tile kinds]; with a
    sliding window `window_size=(left, right)`, Note [sliding window tiles]."""
    _check_sizes(seqlen_q, seqlen_k, m_block_size, n_block_size, qhead_per_kvhead)
    causal, window_size = normalize_mask(causal, window_size)
    left, right = window_size[0], 0 if causal else window_size[1]
    rows = seqlen_q * qhead_per_kvhead
    n_m, n_n = ceil_div(rows, m_block_size), ceil_div(seqlen_k, n_block_size)
    kinds = np.zeros((n_m, n_n), dtype=np.int8)
    needs_mask = np.zeros((n_m, n_n), dtype=bool)
    for m in range(n_m):
        n_min, n_max = n_block_range(m, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                                     m_block_size=m_block_size, n_block_size=n_block_size,
                                     causal=causal, qhead_per_kvhead=qhead_per_kvhead,
                                     window_size=window_size)
        pos_lo, pos_hi = tile_positions(m, m_block_size, qhead_per_kvhead)
        row_tail = (m + 1) * m_block_size > rows
        for n in range(n_min, n_max):
            last_col = min((n + 1) * n_block_size, seqlen_k) - 1
            col_tail = (n + 1) * n_block_size > seqlen_k
            # the first row sees up to its right edge; the last in-bounds row from its left edge
            right_cut = right is not None and last_col > pos_lo + seqlen_k - seqlen_q + right
            left_cut = left is not None and (
                n * n_block_size < min(pos_hi + seqlen_k - seqlen_q, seqlen_k) - 1 - left)
            if right_cut or left_cut:
                kinds[m, n] = TileKind.MASKED
            elif row_tail or col_tail:
                kinds[m, n] = TileKind.TAIL
            else:
                kinds[m, n] = TileKind.FULL
            needs_mask[m, n] = kinds[m, n] == TileKind.MASKED or col_tail
    return TileClasses(seqlen_q, seqlen_k, m_block_size, n_block_size, causal,
                       qhead_per_kvhead, kinds, needs_mask, window_size)
