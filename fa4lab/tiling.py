"""Tiles, masks, GQA and scheduling as plain-Python rules; the kernels share the block ranges.

What it computes, for an attention forward pass cut into (m_block, n_block) tiles of
`m_block_size` query rows by `n_block_size` keys:

- `n_block_range`: the K/V blocks a query tile must visit (half-open), and
  `n_block_masked_range`: the last of those that need an element mask (causal or seqlen_k bound),
  `n_block_left_masked_range`: the first of those that need one (a sliding window's left edge),
  `visit_order`: the order the kernels visit them in; underneath, on positions, the functions
  the kernels call too (`key_bounds`, `block_range`, `mask_split`, `visit_block`);
- `classify_tiles`: every tile as SKIP / FULL / MASKED / TAIL, with counts;
- the GQA maps: query head -> KV head, and pack-GQA (query heads sharing a KV head folded into M);
- tile schedulers (grid, grid with m_blocks reversed, static persistent, LPT) and a cost
  model that gives each one's makespan, per-SM busy time and load imbalance.

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

import heapq
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from fa4lab.limits import ELEMENT_BYTES
from fa4lab.spec import effective_window, normalize_mask, visible_key_counts

__all__ = [
    "CostModel",
    "L2_KV_BUDGET_BYTES",
    "SCHEDULERS",
    "Schedule",
    "TileClasses",
    "TileKind",
    "Workload",
    "block_range",
    "ceil_div",
    "classify_tiles",
    "gqa_group_size",
    "key_bounds",
    "kv_head_of",
    "lpt_order",
    "mask_split",
    "grid_order",
    "grid_reversed_order",
    "n_block_left_masked_range",
    "n_block_masked_range",
    "n_block_range",
    "num_m_blocks",
    "num_n_blocks",
    "pack_gqa_row",
    "q_heads_of",
    "query_to_kv_heads",
    "schedule",
    "schedule_grid",
    "schedule_grid_reversed",
    "schedule_lpt",
    "schedule_static_persistent",
    "schedule_persistent",
    "tile_positions",
    "unpack_gqa_row",
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
# Note [pack-GQA rows]), so the tile covers positions
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
    with pack-GQA, M rows are packed rows: Note [pack-GQA rows]). Ints or DSL Int32."""
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


# --------------------------------------------------------------------------- GQA


def gqa_group_size(heads_q: int, heads_kv: int) -> int:
    """qhead_per_kvhead: how many query heads share one KV head."""
    _positive("heads_q", heads_q)
    _positive("heads_kv", heads_kv)
    if heads_q % heads_kv:
        divisors = [d for d in range(1, heads_q + 1) if heads_q % d == 0]
        raise ValueError(f"heads_q={heads_q} is not a multiple of heads_kv={heads_kv}: each KV "
                         f"head must serve the same number of query heads; choose heads_kv "
                         f"among {divisors}")
    return heads_q // heads_kv


def kv_head_of(q_head: int, heads_q: int, heads_kv: int) -> int:
    """The KV head query head `q_head` reads: q_head // (heads_q // heads_kv)."""
    group = gqa_group_size(heads_q, heads_kv)
    if not 0 <= q_head < heads_q:
        raise ValueError(f"q_head={q_head} is out of range [0, {heads_q})")
    return q_head // group


def query_to_kv_heads(heads_q: int, heads_kv: int) -> tuple[int, ...]:
    """The whole map: element h is the KV head of query head h."""
    group = gqa_group_size(heads_q, heads_kv)
    return tuple(h // group for h in range(heads_q))


def q_heads_of(kv_head: int, heads_q: int, heads_kv: int) -> range:
    """The query heads that read KV head `kv_head` (a contiguous run)."""
    group = gqa_group_size(heads_q, heads_kv)
    if not 0 <= kv_head < heads_kv:
        raise ValueError(f"kv_head={kv_head} is out of range [0, {heads_kv})")
    return range(kv_head * group, (kv_head + 1) * group)


# Note [pack-GQA rows]
# With pack-GQA one CTA tile serves all qhead_per_kvhead query heads of a KV head, so K/V are
# loaded once for the group. The M dimension of KV head g holds seqlen_q * qhead_per_kvhead
# packed rows, query head fastest (FA's layout, which keeps a tile's rows at few positions):
#     packed_row = pos * qhead_per_kvhead + (q_head - g * qhead_per_kvhead)
#     q_head     = g * qhead_per_kvhead + packed_row % qhead_per_kvhead
#     pos        = packed_row // qhead_per_kvhead
# The causal mask (and a window's edges) compare key j with the POSITION (packed_row //
# qhead_per_kvhead), never with the packed row itself: see Note [bottom-right causal] and Note
# [sliding window tiles] for the tile bounds.


def pack_gqa_row(q_head: int, pos: int, *, heads_q: int, heads_kv: int,
                 seqlen_q: int) -> tuple[int, int]:
    """(query head, seqlen position) -> (kv head, packed row). See Note [pack-GQA rows]."""
    group = gqa_group_size(heads_q, heads_kv)
    _positive("seqlen_q", seqlen_q)
    if not 0 <= q_head < heads_q:
        raise ValueError(f"q_head={q_head} is out of range [0, {heads_q})")
    if not 0 <= pos < seqlen_q:
        raise ValueError(f"pos={pos} is out of range [0, seqlen_q={seqlen_q})")
    kv_head = q_head // group
    return kv_head, pos * group + (q_head - kv_head * group)


def unpack_gqa_row(kv_head: int, packed_row: int, *, heads_q: int, heads_kv: int,
                   seqlen_q: int) -> tuple[int, int]:
    """(kv head, packed row) -> (query head, seqlen position). See Note [pack-GQA rows]."""
    group = gqa_group_size(heads_q, heads_kv)
    _positive("seqlen_q", seqlen_q)
    if not 0 <= kv_head < heads_kv:
        raise ValueError(f"kv_head={kv_head} is out of range [0, {heads_kv})")
    if not 0 <= packed_row < seqlen_q * group:
        raise ValueError(f"packed_row={packed_row} is out of range [0, seqlen_q * "
                         f"qhead_per_kvhead = {seqlen_q * group})")
    return kv_head * group + packed_row % group, packed_row // group


# --------------------------------------------------------------------------- cost model

# Note [tile cost model]
# The unit of time is one unmasked K/V block iteration of one query tile (two MMAs, S = Q K^T
# and O += P V, plus the softmax of m_block_size x n_block_size scores). A block that needs the
# element mask costs `masked_block_cost` units: the mask is a compare-and-select on every score
# of the fragment before the row max, work the unmasked blocks never do (1.25 is a model
# assumption, not a measurement). Every tile also pays `tile_overhead` units whatever its
# length: loading Q, filling the K/V pipeline, normalising O and storing O and LSE. A tile with
# no visible block still pays it (it writes O = 0, LSE = -inf). The model is MMA-bound:
# `Schedule.predicted_seconds` turns units into seconds with 4 * m * n * head_dim FLOPs per
# unit at the chip's dense MMA rate, an optimistic floor, used only to compare schedules.


@dataclass(frozen=True)
class CostModel:
    """Work of one tile, in units of one unmasked K/V block. See Note [tile cost model]."""

    masked_block_cost: float = 1.25
    tile_overhead: float = 1.0

    def __post_init__(self):
        if not self.masked_block_cost >= 1.0:
            raise ValueError(f"masked_block_cost={self.masked_block_cost} must be >= 1 (a masked "
                             f"block does all of an unmasked block's work and more)")
        if not self.tile_overhead >= 0.0:
            raise ValueError(f"tile_overhead={self.tile_overhead} must be >= 0")

    def tile_cost(self, n_unmasked: int, n_masked: int) -> float:
        return n_unmasked + self.masked_block_cost * n_masked + self.tile_overhead


# Note [L2 swizzle]
# LPT walks the heads in sections of `swizzle` (batch, head) pairs whose K and V fit in L2 at
# once: inside a section every m_block of every head is issued before the next section starts,
# so CTAs running at the same time share K/V in L2. As FA4 does, the section is the largest
# power of two of heads whose K+V (seqlen_k * (head_dim + head_dim_v) * element_size bytes)
# fits in the L2 budget below. The budget is FA4's own constant (`size_l2` in
# flash_attn/cute/tile_scheduler.py, the same on Hopper and Blackwell), not a cache size: it
# stays below the H200's L2 (`fa4lab.hardware.H200_L2_BYTES`), leaving room for Q and O.
L2_KV_BUDGET_BYTES = 50 * 1024 * 1024


def pow2_floor(x):
    """The largest power of two <= x, for 1 <= x < 2**31 (int or Int32: shifts and ors only)."""
    for s in (1, 2, 4, 8, 16):
        x = x | (x >> s)
    return x - (x >> 1)


def l2_swizzle(seqlen_k, bytes_per_key: int, budget: int = L2_KV_BUDGET_BYTES, *, imax=max):
    """(batch, head) pairs per L2 section (Note [L2 swizzle]): the largest power of two whose
    K + V (seqlen_k * bytes_per_key each) fit `budget`, at least 1. The one rule, for Python
    ints (the order the plan and notebooks draw) and in the kernels (DSL Int32,
    imax=cutlass.max)."""
    # budget // bytes_per_key is a compile-time number: no product that could overflow Int32.
    fit = (budget // bytes_per_key) // imax(seqlen_k, 1)
    return pow2_floor(imax(fit, 1))


@dataclass(frozen=True)
class Workload:
    """The (batch, head, m_block) work items of one forward call.

    `heads` is the head axis of the grid: heads_q, or heads_kv with pack-GQA (then
    `qhead_per_kvhead` > 1 query heads are folded into M). `window_size` is a sliding window
    (stored as `fa4lab.spec.normalize_mask` does, which may set `causal`).
    """

    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    m_block_size: int
    n_block_size: int
    causal: bool
    qhead_per_kvhead: int = 1
    head_dim: int = 128
    head_dim_v: int | None = None
    element_size: int = ELEMENT_BYTES["bf16"]
    window_size: tuple = (None, None)

    def __post_init__(self):
        causal, window_size = normalize_mask(self.causal, self.window_size)
        object.__setattr__(self, "causal", causal)
        object.__setattr__(self, "window_size", window_size)
        _positive("batch", self.batch)
        _positive("heads", self.heads)
        _check_sizes(self.seqlen_q, self.seqlen_k, self.m_block_size, self.n_block_size,
                     self.qhead_per_kvhead)
        _positive("head_dim", self.head_dim)
        if self.head_dim_v is not None:
            _positive("head_dim_v", self.head_dim_v)
        _positive("element_size", self.element_size)

    @classmethod
    def from_spec(cls, spec, *, m_block_size: int, n_block_size: int,
                  pack_gqa: bool = False) -> Workload:
        """From an `AttentionSpec`: one tile per (batch, head, m_block)."""
        group = spec.qhead_per_kvhead if pack_gqa else 1
        return cls(batch=spec.batch, heads=spec.heads_kv if pack_gqa else spec.heads_q,
                   seqlen_q=spec.seqlen_q, seqlen_k=spec.seqlen_k, m_block_size=m_block_size,
                   n_block_size=n_block_size, causal=spec.causal, qhead_per_kvhead=group,
                   head_dim=spec.head_dim, head_dim_v=spec.head_dim_v,
                   element_size=spec.element_bytes, window_size=spec.window_size)

    @property
    def num_m_blocks(self) -> int:
        return num_m_blocks(self.seqlen_q, self.m_block_size, self.qhead_per_kvhead)

    @property
    def num_tiles(self) -> int:
        return self.batch * self.heads * self.num_m_blocks

    @property
    def l2_swizzle(self) -> int:
        """(batch, head) pairs per L2 section. See Note [L2 swizzle]."""
        hdv = self.head_dim if self.head_dim_v is None else self.head_dim_v
        return l2_swizzle(self.seqlen_k, (self.head_dim + hdv) * self.element_size)

    def blocks_per_m_block(self) -> tuple[np.ndarray, np.ndarray]:
        """(unmasked, masked) K/V block counts per m_block (the same for every batch, head);
        masked counts both edges of a sliding window (`block_counts`)."""
        return block_counts(np.arange(self.num_m_blocks, dtype=np.int64), self.seqlen_q,
                            self.seqlen_k, m_block_size=self.m_block_size,
                            n_block_size=self.n_block_size, causal=self.causal,
                            qhead_per_kvhead=self.qhead_per_kvhead,
                            window_size=self.window_size)

    def tile_costs(self, cost: CostModel | None = None) -> np.ndarray:
        """Cost of each m_block's tile, shape (num_m_blocks,). See Note [tile cost model]."""
        cost = cost or CostModel()
        unmasked, masked = self.blocks_per_m_block()
        return unmasked + cost.masked_block_cost * masked + cost.tile_overhead

    def unit_flops(self) -> float:
        """MMA FLOPs of one cost unit (one K/V block of one tile): 2*m*n*(d + d_v)."""
        hdv = self.head_dim if self.head_dim_v is None else self.head_dim_v
        return 2.0 * self.m_block_size * self.n_block_size * (self.head_dim + hdv)


# --------------------------------------------------------------------------- tile orders


TILE_ORDERS = ("grid", "grid_reversed", "lpt")


def tile_at(t, order: str, num_m, heads, batch, swizzle=1, *, imin=min):
    """(batch, head, m_block) of linear tile t in `order` (one of TILE_ORDERS), for ints, numpy
    arrays or the kernels' DSL Int32 (`imin`: the DSL's min). The one formula from linear tile
    index to tile: the orders below, the simulated schedules and both kernels' schedulers read it.

    "grid": m_block fastest, then head, then batch (how the hardware dispatches a (num_m, heads,
    batch) grid); "grid_reversed": the same with each head's m_blocks last-first; "lpt": FA4's
    longest-processing-time-first order in L2 sections of `swizzle` (batch, head) pairs (Note [L2
    swizzle]): inside a section m_block runs from the LAST to the first, the section's heads
    fastest; the last section may be shorter (the residual)."""
    if order not in TILE_ORDERS:
        raise ValueError(f"unknown tile order {order!r}: one of {TILE_ORDERS}")
    if order == "lpt":
        n_hb = heads * batch
        swizzle = imin(swizzle, n_hb)
        full = n_hb // swizzle  # >= 1
        section = t // (swizzle * num_m)
        within = t - section * (swizzle * num_m)
        # The last section holds the n_hb % swizzle leftover pairs; section // full is 1 there
        # and 0 before it (section <= full), so `width` needs no branch.
        width = swizzle - (swizzle - (n_hb - full * swizzle)) * (section // full)
        block = within // width
        hb = section * swizzle + (within - block * width)
        m = num_m - 1 - block
    else:
        hb = t // num_m
        m = t - hb * num_m
        if order == "grid_reversed":
            m = num_m - 1 - m
    b = hb // heads
    return b, hb - b * heads, m


def _order(work: Workload, order: str, swizzle: int = 1) -> np.ndarray:
    t = np.arange(work.num_tiles)
    return np.stack(tile_at(t, order, work.num_m_blocks, work.heads, work.batch, swizzle), axis=1)


def grid_order(work: Workload) -> np.ndarray:
    """(num_tiles, 3) rows (batch, head, m_block), m_block fastest then head then batch: the
    order the hardware dispatches a (num_m_blocks, heads, batch) grid."""
    return _order(work, "grid")


def grid_reversed_order(work: Workload) -> np.ndarray:
    """Grid order with each head's m_blocks reversed (last first): what a one-CTA-per-tile
    causal kernel gets by flipping blockIdx.x. Longest first within a head only."""
    return _order(work, "grid_reversed")


def lpt_order(work: Workload) -> np.ndarray:
    """(num_tiles, 3) rows (batch, head, m_block) in FA4's longest-processing-time-first order
    (`tile_at`, Note [L2 swizzle])."""
    return _order(work, "lpt", work.l2_swizzle)


def persistent_tiles(cta: int, num_ctas: int, num_tiles: int) -> range:
    """The linear tiles persistent CTA `cta` of `num_ctas` runs, in turn: cta, cta + num_ctas,
    ... (the kernels' tile loop; FA4's static persistent scheduler)."""
    return range(cta, num_tiles, num_ctas)


# --------------------------------------------------------------------------- schedules


@dataclass(frozen=True, eq=False)
class Schedule:
    """Which SM runs which tile when. Arrays are indexed by dispatch position."""

    name: str
    num_sms: int
    order: np.ndarray    # (T, 3) int: (batch, head, m_block) in dispatch order
    sm: np.ndarray       # (T,) int: the SM (persistent CTA) that runs it
    start: np.ndarray    # (T,) float: start time, cost units
    end: np.ndarray      # (T,) float
    unit_flops: float    # MMA FLOPs per cost unit (for predicted_seconds)

    def __repr__(self) -> str:
        return (f"Schedule({self.name!r}, num_sms={self.num_sms}, tiles={len(self.order)}, "
                f"makespan={self.makespan:.1f}, lower_bound={self.lower_bound:.1f}, "
                f"efficiency={self.efficiency:.3f})")

    @property
    def makespan(self) -> float:
        return float(self.end.max()) if self.end.size else 0.0

    @property
    def busy(self) -> np.ndarray:
        """Busy time of each SM, shape (num_sms,)."""
        return np.bincount(self.sm, weights=self.end - self.start, minlength=self.num_sms)

    @property
    def total_work(self) -> float:
        return float((self.end - self.start).sum())

    @property
    def lower_bound(self) -> float:
        """No schedule beats max(total work / num_sms, the longest tile)."""
        longest = float((self.end - self.start).max()) if self.end.size else 0.0
        return max(self.total_work / self.num_sms, longest)

    @property
    def efficiency(self) -> float:
        """Mean SM busy fraction until the makespan (1 = perfect balance)."""
        return self.total_work / (self.num_sms * self.makespan) if self.makespan else 1.0

    @property
    def imbalance(self) -> float:
        """makespan / mean per-SM busy time - 1 (0 = perfect balance)."""
        return 1.0 / self.efficiency - 1.0

    def predicted_seconds(self, hardware) -> float:
        """Makespan in seconds if one unit runs at the chip's dense MMA rate (a floor)."""
        per_sm = hardware.mma_flops_per_cycle * hardware.clock_ghz * 1e9
        return self.makespan * self.unit_flops / per_sm


def _resolve_sms(num_sms, arch):
    if num_sms is None:
        from fa4lab.hardware import hardware_for

        num_sms = hardware_for(arch).num_sms
    return _positive("num_sms", num_sms, " (e.g. 148 on B200, 132 on H200)")


def _greedy(name, work, order, num_sms, cost):
    """Each tile in `order` goes to the SM that frees up first (ties: the lowest SM): how the
    hardware dispatches a grid's CTAs, and how persistent CTAs that pull the next tile from a
    global counter behave."""
    costs = work.tile_costs(cost)[order[:, 2]]
    sm = np.empty(len(order), dtype=np.int64)
    start = np.empty(len(order))
    free = [(0.0, s) for s in range(num_sms)]
    for t, c in enumerate(costs):
        at, s = heapq.heappop(free)
        sm[t], start[t] = s, at
        heapq.heappush(free, (at + c, s))
    return Schedule(name, num_sms, order, sm, start, start + costs, work.unit_flops())


def schedule_grid(work: Workload, *, num_sms: int | None = None, arch: str = "sm100",
                  cost: CostModel | None = None) -> Schedule:
    """One CTA per tile in grid order; the hardware hands the next CTA to the first free SM."""
    return _greedy("grid", work, grid_order(work), _resolve_sms(num_sms, arch), cost)


def schedule_grid_reversed(work: Workload, *, num_sms: int | None = None, arch: str = "sm100",
                           cost: CostModel | None = None) -> Schedule:
    """One CTA per tile, each head's m_blocks last-first; the first free SM takes the next."""
    return _greedy("grid_reversed", work, grid_reversed_order(work), _resolve_sms(num_sms, arch),
                   cost)


def _round_robin(name, work, order, num_ctas, cost):
    """Persistent CTA c runs tiles c, c + num_ctas, ... of `order` in turn
    (`persistent_tiles`), whatever the other CTAs' progress: a static persistent kernel, as
    fa4lab's sm100 kernel and FA4's static scheduler run."""
    costs = work.tile_costs(cost)[order[:, 2]]
    n = len(order)
    sm = np.empty(n, dtype=np.int64)
    start = np.empty(n)
    for c in range(min(num_ctas, n)):
        clock = 0.0
        for t in persistent_tiles(c, num_ctas, n):
            sm[t], start[t] = c, clock
            clock += costs[t]
    return Schedule(name, num_ctas, order, sm, start, start + costs, work.unit_flops())


def schedule_static_persistent(work: Workload, *, num_sms: int | None = None,
                               arch: str = "sm100", cost: CostModel | None = None) -> Schedule:
    """num_sms persistent CTAs; CTA i takes grid-order tiles i, i + num_sms, ... in turn."""
    return _round_robin("static", work, grid_order(work), _resolve_sms(num_sms, arch), cost)


def schedule_persistent(order: str, work: Workload, *, num_sms: int | None = None,
                        arch: str = "sm100", cost: CostModel | None = None) -> Schedule:
    """min(tiles, num_sms) persistent CTAs taking the tiles of `order` (one of TILE_ORDERS)
    round-robin (`persistent_tiles`): how a persistent kernel's CTAs share them, where
    `schedule(order, ...)` hands each tile to the first free SM, as a grid of one CTA per tile
    runs."""
    orders = {"grid": grid_order, "grid_reversed": grid_reversed_order, "lpt": lpt_order}
    if order not in orders:
        raise ValueError(f"unknown tile order {order!r}: one of {TILE_ORDERS}")
    return _round_robin(order, work, orders[order](work), _resolve_sms(num_sms, arch), cost)


def schedule_lpt(work: Workload, *, num_sms: int | None = None, arch: str = "sm100",
                 cost: CostModel | None = None) -> Schedule:
    """LPT order (longest m_blocks first, L2-swizzled heads), each tile to the first free SM."""
    return _greedy("lpt", work, lpt_order(work), _resolve_sms(num_sms, arch), cost)


def kernel_tile_order(causal: bool, arch: str, persistent: bool = False) -> str:
    """The order fa4lab's `arch` kernel takes tiles in (a key of SCHEDULERS, a `tile_at`
    order): the plain grid where tile costs are equal (not causal); for causal, LPT on sm90 and
    in a persistent sm100 kernel, else the grid with each head's m_blocks reversed. See Note
    [tile order] in `fa4lab.kernels.device.scheduler`."""
    if not causal:
        return "grid"
    return "lpt" if arch == "sm90" or persistent else "grid_reversed"


SCHEDULERS = {
    "grid": schedule_grid,
    "grid_reversed": schedule_grid_reversed,
    "static": schedule_static_persistent,
    "lpt": schedule_lpt,
}


def schedule(name: str, work: Workload, *, num_sms: int | None = None, arch: str = "sm100",
             cost: CostModel | None = None) -> Schedule:
    """Run the scheduler called `name`: one of `SCHEDULERS` ('grid', 'grid_reversed',
    'static', 'lpt')."""
    if name not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {name!r}: choose one of {sorted(SCHEDULERS)}")
    return SCHEDULERS[name](work, num_sms=num_sms, arch=arch, cost=cost)

