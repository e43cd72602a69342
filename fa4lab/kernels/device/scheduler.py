"""Which tile a CTA computes and which key blocks it visits (device code, also plain Python).

Shared by the sm90 and sm100 kernels. The formulas are the ones `fa4lab.tiling` teaches
(`n_block_range`, `classify_tiles`): for a CTA owning query rows [m0, m0 + cta_m), with
d = seqlen_k - seqlen_q (bottom-right causal alignment):

* non-causal: key blocks [0, ceil(seqlen_k / n_block));
* causal: the last row m0 + cta_m - 1 sees keys up to m0 + cta_m - 1 + d, so blocks
  [0, min(ceil(seqlen_k / n), ceil((m0 + cta_m + d) / n))); blocks past that are SKIP.
* A block is FULL (no mask needed) when every key in it is visible to the CTA's FIRST row and
  lies inside seqlen_k: n < min(seqlen_k // n_block, floor((m0 + d + 1) / n_block)).
  The others in range are MASKED (diagonal) or TAIL (key-length edge) and go through
  `fa4lab.kernels.device.mask.apply_limits`.

The functions take Python ints (tests, notebooks) or DSL Int32 values (inside a kernel): they
use only +, -, *, // on non-negative numbers and `cutlass.max` / `cutlass.min`.

Scheduling: one CTA per (m_block, head, batch) tile, in the order the plan names
(`plan.tiles.order`, from `fa4lab.tiling.kernel_tile_order`; see Note [tile order]).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from fa4lab.tiling import L2_KV_BUDGET_BYTES


def ceil_div(a, b):
    return (a + b - 1) // b


def n_block_max(m_block, cta_m, n_block_size, seqlen_q, seqlen_k, causal: bool):
    """One past the last key block the CTA visits (0 when causal hides every key)."""
    n_max = ceil_div(seqlen_k, n_block_size)
    if causal:
        last_visible = cutlass.max((m_block + 1) * cta_m + seqlen_k - seqlen_q, 0)
        n_max = cutlass.min(n_max, ceil_div(last_visible, n_block_size))
    return n_max


def n_block_full_end(m_block, cta_m, n_block_size, seqlen_q, seqlen_k, causal: bool):
    """Key blocks [0, this) need no mask for any row of the CTA (FULL tiles)."""
    full = seqlen_k // n_block_size
    if causal:
        first_row_sees = cutlass.max(m_block * cta_m + seqlen_k - seqlen_q + 1, 0)
        full = cutlass.min(full, first_row_sees // n_block_size)
    return full


def num_m_blocks(seqlen_q, cta_m):
    return ceil_div(seqlen_q, cta_m)


# Note [tile order]
# "grid": a (m_blocks, heads, batch) grid; the hardware dispatches blockIdx.x fastest, so the
#   m_blocks of one head run side by side and share that head's K/V in L2. Every tile of a
#   non-causal problem costs the same, so nothing is gained by reordering them.
# "lpt": causal. Tile costs grow with m_block, and a grid that ends with some head's longest
#   tiles leaves most SMs idle while a few finish them (the ragged last wave of notebook 02).
#   The grid is one-dimensional and linear tile t maps to `fa4lab.tiling.lpt_order`'s t-th row,
#   FA4's longest-processing-time-first order: (batch, head) pairs in L2 sections (Note [L2
#   swizzle] in fa4lab.tiling), inside a section the last m_block of every pair first. The
#   hardware hands each next CTA to the first free SM, so this is greedy LPT list scheduling.
# "grid_reversed": causal on sm100: the grid with blockIdx.x read as m_blocks - 1 - x, so each
#   head's longest tile starts first but heads still follow one another. The sm100 kernel reads
#   its tile coordinates once and keeps them for the whole CTA; the LPT divisions there cost
#   15 spill instructions in its register-tight softmax warps, and what the order would gain
#   on a B200 has not been measured.


def grid_shape(rows, heads, batch, cta_m, order: str = "grid") -> tuple:
    """One CTA per output tile: (m_blocks, heads, batch), or (all tiles, 1, 1) for "lpt".

    `rows` are the query rows of one grid head (seqlen_q, or seqlen_q * g packed)."""
    n_m = num_m_blocks(rows, cta_m)
    if order not in ("grid", "grid_reversed", "lpt"):
        raise ValueError(f"unknown tile order {order!r}: 'grid', 'grid_reversed' or 'lpt'")
    if order == "lpt":
        return (n_m * heads * batch, 1, 1)
    return (n_m, heads, batch)


def pow2_floor(x):
    """The largest power of two <= x, for 1 <= x < 2**31 (int or Int32: shifts and ors only)."""
    for s in (1, 2, 4, 8, 16):
        x = x | (x >> s)
    return x - (x >> 1)


def l2_swizzle(seqlen_k, bytes_per_key: int, budget: int):
    """(batch, head) pairs per L2 section: the largest power of two whose K + V (seqlen_k *
    bytes_per_key each) fit `budget`, at least 1. Same rule as `fa4lab.tiling.Workload`."""
    # budget // bytes_per_key is a compile-time number: no product that could overflow Int32.
    fit = (budget // bytes_per_key) // cutlass.max(seqlen_k, 1)
    return pow2_floor(cutlass.max(fit, 1))


def lpt_coords(t, num_m, heads, batch, swizzle):
    """(m_block, head, batch) of linear tile t in the LPT order (`fa4lab.tiling.lpt_order`)."""
    n_hb = heads * batch
    swizzle = cutlass.min(swizzle, n_hb)
    full = n_hb // swizzle  # >= 1
    section = t // (swizzle * num_m)
    within = t - section * (swizzle * num_m)
    # The last section holds the n_hb % swizzle leftover pairs; section // full is 1 there
    # and 0 before it (section <= full), so `width` needs no branch.
    residual = n_hb - full * swizzle
    width = swizzle - (swizzle - residual) * (section // full)
    block = within // width
    hb = section * swizzle + (within - block * width)
    b = hb // heads
    return num_m - 1 - block, hb - b * heads, b


@cute.jit
def tile_coords(order: cutlass.Constexpr[str], mQ: cute.Tensor, seqlen_k,
                cta_m: cutlass.Constexpr[int], bytes_per_key: cutlass.Constexpr[int]):
    """(m_block, head, batch) of this CTA for a grid made by `grid_shape(..., order)`.

    mQ (or mO) as the kernel sees it: (rows, d, heads, batch), rows packed with pack-GQA."""
    bx, by, bz = cute.arch.block_idx()
    m_block, head, batch = bx, by, bz
    if cutlass.const_expr(order == "grid_reversed"):
        gx, _, _ = cute.arch.grid_dim()
        m_block = gx - 1 - bx
    if cutlass.const_expr(order == "lpt"):
        swizzle = l2_swizzle(seqlen_k, bytes_per_key, L2_KV_BUDGET_BYTES)
        m_block, head, batch = lpt_coords(
            bx, num_m_blocks(cute.size(mQ.shape[0]), cta_m), cute.size(mQ.shape[2]),
            cute.size(mQ.shape[3]), swizzle)
    return m_block, head, batch
