"""Which tile a CTA computes and which key blocks it visits, in what order (device code).

Shared by the sm90 and sm100 kernels. The block ranges are `fa4lab.tiling`'s own functions
(`block_range`, `mask_split`, `visit_block`: Note [sliding window tiles] and Note [block visit
order] there), called here on the DSL's Int32 values with the DSL's min and max, for a tile of
`rows` M rows (a CTA, or one Q tile of it) holding query positions [m * rows / g, (m + 1) *
rows / g) (g = qhead_per_kvhead with pack-GQA, else 1):

* `block_range`: the key blocks [n_block_min, n_block_max) the CTA visits; blocks outside it
  are SKIP (right of the causal diagonal or a window's right edge, left of its left edge);
* `mask_split`: which of them need the element mask (`fa4lab.kernels.device.mask`): the runs
  [n_block_mask_min, n_block_max) (diagonal, right edge, seqlen_k tail) and [n_block_min,
  n_block_left_mask_end) (left edge); the blocks between them are FULL;
* `visit_block`: the block of each step, in the order every role of the CTA walks them (Note
  [block visit order] in fa4lab.tiling: the masked runs first, then the FULL run).
* `table_row`, `table_range`, `table_split`: with a mask_mod, the range and the FULL run
  narrowed to the CTA's row of the mod's block table (Note [mask_mod block table] there).

A window side is None (unbounded: a compile-time choice), the constant 0 (causal: right = 0)
or a runtime Int32 (`window_left` / `window_right`, Note [runtime window] in
`fa4lab.kernels.compile`). With Python ints these functions run on the CPU too (tests).

Scheduling: one CTA per (m_block, head, batch) tile, or persistent CTAs that loop over linear
tiles (sm100, Note [persistent CTAs] in fa4lab.plan.sm100), in the order the plan names
(`plan.tiles.order`, from `fa4lab.scheduling.kernel_tile_order`; see Note [tile order]); linear
index -> tile is `fa4lab.scheduling.tile_at`. A varlen launch instead reads its tiles from a table
(`varlen_coords`, Note [varlen tile table]). `work_tiles` and `work` are each kernel's one way
to ask: its persistent loop's range and a linear tile's (m_block, head, batch, split).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from fa4lab import scheduling, tiling
from fa4lab.kernels.device import split as split_mod

_DSL_MIN_MAX = {"imin": cutlass.min, "imax": cutlass.max}


def block_range(m_block, rows: int, pack: int, n_block: int, seqlen_q, seqlen_k, left, right):
    """(n_block_min, n_block_max) of tile `m_block` of `rows` M rows (`fa4lab.tiling`)."""
    pos_lo, pos_hi = tiling.tile_positions(m_block, rows, pack)
    return tiling.block_range(pos_lo, pos_hi, seqlen_q, seqlen_k, n_block, left, right,
                              **_DSL_MIN_MAX)


def mask_split(m_block, rows: int, pack: int, n_block: int, seqlen_q, seqlen_k, left, right,
               n_block_min, n_block_max):
    """(n_block_left_mask_end, n_block_mask_min) of tile `m_block` of `rows` M rows within the
    visited range [n_block_min, n_block_max), which may be a wider tile's (`fa4lab.tiling`)."""
    pos_lo, pos_hi = tiling.tile_positions(m_block, rows, pack)
    return tiling.mask_split(pos_lo, pos_hi, n_block_min, n_block_max, seqlen_q, seqlen_k,
                             n_block, left, right, **_DSL_MIN_MAX)


def visit_block(step, n_block_max, n_block_mask_min, left_run=None):
    """The key block of step `step` (`fa4lab.tiling.visit_block`); left_run = (n_block_min,
    n_block_left_mask_end) only with a window's left side."""
    return tiling.visit_block(step, n_block_max, n_block_mask_min, left_run, **_DSL_MIN_MAX)


def table_row(mask_blocks, m_block):
    """(lo, hi, full_lo, full_hi) of CTA tile `m_block` in a mask_mod's block table
    (`mask_blocks`, (num_m_blocks, 4) int32: Note [mask_mod block table] in fa4lab.tiling), or
    None without one."""
    if mask_blocks is None:
        return None
    return tuple(mask_blocks[m_block, i] for i in range(4))


def table_range(n_block_min, n_block_max, row):
    """[n_block_min, n_block_max) narrowed to a table row (`fa4lab.tiling.table_range`)."""
    return tiling.table_range(n_block_min, n_block_max, row[0], row[1], **_DSL_MIN_MAX)


def table_split(n_block_min, n_block_max, left_end, mask_min, row):
    """(left_end, mask_min) narrowed to a table row's full run (`fa4lab.tiling.table_split`)."""
    return tiling.table_split(n_block_min, n_block_max, left_end, mask_min, row[2], row[3],
                              **_DSL_MIN_MAX)


def num_m_blocks(rows, cta_m):
    return tiling.ceil_div(rows, cta_m)


# Note [tile order]
# "grid": a (m_blocks, heads, batch) grid; the hardware dispatches blockIdx.x fastest, so the
#   m_blocks of one head run side by side and share that head's K/V in L2. Every tile of a
#   non-causal problem costs the same, so nothing is gained by reordering them.
# "lpt": causal. Tile costs grow with m_block, and a grid that ends with some head's longest
#   tiles leaves most SMs idle while a few finish them (the ragged last wave of notebook 02).
#   Linear tile t is `fa4lab.scheduling.tile_at`'s t-th tile in FA4's longest-processing-time-first
#   order: (batch, head) pairs in L2 sections (Note [L2 swizzle] in fa4lab.scheduling), inside a
#   section the last m_block of every pair first. One CTA per tile (sm90): the hardware hands
#   each next CTA to the first free SM, greedy LPT list scheduling. Persistent (sm100): CTA c
#   takes tiles c, c + gridDim.x, ... (`fa4lab.scheduling.persistent_tiles`), longest first.
# "grid_reversed": causal, one CTA per tile on sm100 (the plans that stage O in Q's bytes: Note
#   [persistent CTAs] in fa4lab.plan.sm100): the grid with blockIdx.x read as m_blocks - 1 - x,
#   so each head's longest tile starts first but heads still follow one another.
# A persistent kernel (`num_ctas` set) launches min(tiles, num_ctas) CTAs on a 1-D grid and maps
# its linear tile index with the same `tile_at` as the one-CTA-per-tile grids.


def grid_shape(rows, heads, batch, cta_m, order: str = "grid", num_ctas=None) -> tuple:
    """One CTA per output tile: (m_blocks, heads, batch), or (all tiles, 1, 1) for "lpt"; with
    `num_ctas` (persistent CTAs, at most one per SM) (min(all tiles, num_ctas), 1, 1).

    `rows` are the query rows of one grid head (seqlen_q, or seqlen_q * g packed)."""
    n_m = num_m_blocks(rows, cta_m)
    if order not in scheduling.TILE_ORDERS:
        raise ValueError(f"unknown tile order {order!r}: one of {scheduling.TILE_ORDERS}")
    if num_ctas is not None:
        tiles = n_m * heads * batch
        return (min(tiles, num_ctas) if isinstance(tiles, int) else cutlass.min(tiles, num_ctas),
                1, 1)
    if order == "lpt":
        return (n_m * heads * batch, 1, 1)
    return (n_m, heads, batch)


def coords(t, order: str, num_m, heads, batch, swizzle=1):
    """(m_block, head, batch) of linear tile t in `order` (`fa4lab.scheduling.tile_at`)."""
    b, h, m = scheduling.tile_at(t, order, num_m, heads, batch, swizzle, imin=_DSL_MIN_MAX["imin"])
    return m, h, b


def lpt_coords(t, num_m, heads, batch, swizzle):
    """(m_block, head, batch) of linear tile t in the LPT order (`fa4lab.scheduling.tile_at`)."""
    return coords(t, "lpt", num_m, heads, batch, swizzle)


def num_tiles(mQ: cute.Tensor, cta_m: int, splits=1):
    """Work tiles of a launch: m_blocks x heads x batch of the kernel's (rows, d, heads, batch)
    view of Q (rows packed with pack-GQA), times `splits` with split-KV
    (`fa4lab.kernels.device.split`: the splits fold into the head axis)."""
    return num_m_blocks(cute.size(mQ.shape[0]), cta_m) * cute.size(mQ.shape[2]) * splits * \
        cute.size(mQ.shape[3])


# Note [varlen tile table]
# A varlen launch runs only real tiles (Note [varlen tiles] in fa4lab.varlen_tiles): the host builds
# `fa4lab.varlen_tiles.varlen_tile_table`, (rows, 2) int32 (batch, m_block) in LPT order, uploads it
# as mTileTable, and launches rows * heads linear tiles (one CTA each, or persistent CTAs
# looping over them). Linear tile t is row t // heads, head t % heads: the heads of one
# (sequence, m_block) run side by side (they read the same K/V rows with GQA, the same
# sequence's without), and the table stays heads times smaller than the tile list.


def varlen_coords(t, tile_table, heads):
    """(m_block, head, batch) of linear tile t of a varlen launch (Note [varlen tile table]);
    `tile_table` a (rows, 2) int32 tensor or array of (batch, m_block) rows."""
    row = t // heads
    return tile_table[row, 1], t - row * heads, tile_table[row, 0]


def varlen_num_tiles(tile_table, heads):
    """Linear tiles of a varlen launch: the table's rows times the grid's heads."""
    return cute.size(tile_table.shape[0]) * heads


@cute.jit
def tile_coords(order: cutlass.Constexpr[str], mQ: cute.Tensor, seqlen_k,
                cta_m: cutlass.Constexpr[int], bytes_per_key: cutlass.Constexpr[int],
                tile=None, splits=1, tile_table: cute.Tensor | None = None):
    """(m_block, head, batch) of this CTA for a grid made by `grid_shape(..., order)`, or of
    linear tile `tile` of a persistent CTA (`grid_shape(..., num_ctas)`); with `tile_table`
    (varlen) the table's tile (`varlen_coords`) whatever the order.

    mQ (or mO) as the kernel sees it: (rows, d, heads, batch), rows packed with pack-GQA. With
    split-KV the grid's head axis holds heads * `splits` (`fa4lab.kernels.device.split.split_of`
    unfolds the head returned here)."""
    if cutlass.const_expr(tile_table is not None):
        if cutlass.const_expr(tile is None):
            tile = cute.arch.block_idx()[0]
        return varlen_coords(tile, tile_table, cute.size(mQ.shape[2]) * splits)
    if cutlass.const_expr(tile is None and order != "lpt"):
        bx, by, bz = cute.arch.block_idx()
        m_block, head, batch = bx, by, bz
        if cutlass.const_expr(order == "grid_reversed"):
            gx, _, _ = cute.arch.grid_dim()
            m_block = gx - 1 - bx
        return m_block, head, batch
    if cutlass.const_expr(tile is None):
        tile = cute.arch.block_idx()[0]
    swizzle = 1
    if cutlass.const_expr(order == "lpt"):
        swizzle = scheduling.l2_swizzle(seqlen_k, bytes_per_key, imax=cutlass.max)
    return coords(tile, order, num_m_blocks(cute.size(mQ.shape[0]), cta_m),
                  cute.size(mQ.shape[2]) * splits, cute.size(mQ.shape[3]), swizzle)


# ---- a kernel's work tiles (both kernels: their split_kv, varlen, tile_order, cta_m and
# bytes_per_key) ----
def work_tiles(kernel, mQ: cute.Tensor, varlen: tuple, num_splits):
    """(start, stop, step) of this CTA's linear work tiles (cutlass.range's arguments):
    `fa4lab.scheduling.persistent_tiles` over the grid's tiles, or the varlen tile table's rows
    times the heads; mQ (or mO) as the kernel views it, `varlen` its varlen tuple."""
    splits = num_splits if cutlass.const_expr(kernel.split_kv) else 1
    stop = num_tiles(mQ, kernel.cta_m, splits)
    if cutlass.const_expr(kernel.varlen):
        stop = varlen_num_tiles(varlen[4], cute.size(mQ.shape[2]) * splits)
    return cute.arch.block_idx()[0], stop, cute.arch.grid_dim()[0]


def work(kernel, mQ: cute.Tensor, seqlen_k, varlen: tuple, num_splits, tile=None):
    """(m_block, head, batch, split) of linear tile `tile` (`fa4lab.scheduling.tile_at`, or the
    tile table's with varlen; None: this CTA's one tile); split is None without split-KV
    (`fa4lab.kernels.device.split.split_of` unfolds it from the grid's head axis)."""
    splits = num_splits if cutlass.const_expr(kernel.split_kv) else 1
    m_block, head, batch = tile_coords(kernel.tile_order, mQ, seqlen_k, kernel.cta_m,
                                       kernel.bytes_per_key, tile, splits, varlen[4])
    if cutlass.const_expr(not kernel.split_kv):
        return m_block, head, batch, None
    head, split = split_mod.split_of(head, num_splits)
    return m_block, head, batch, split
