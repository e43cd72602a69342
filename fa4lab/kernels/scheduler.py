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
  `fa4lab.kernels.mask.apply_limits`.

The functions take Python ints (tests, notebooks) or DSL Int32 values (inside a kernel): they
use only +, -, *, // on non-negative numbers and `cutlass.max` / `cutlass.min`.

Scheduling: one CTA per (m_block, head, batch) tile. With a causal mask the tiles near the
bottom of the matrix have the most key blocks, so the grid's x index walks m_blocks from the
last one down: the longest tiles start first and the short ones fill the tail of the wave
(a light form of the LPT order FA4 uses).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


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


def grid_shape(seqlen_q, heads_q, batch, cta_m) -> tuple:
    """(m_blocks, heads_q, batch): one CTA per output tile."""
    return (num_m_blocks(seqlen_q, cta_m), heads_q, batch)


@cute.jit
def tile_coords(causal: cutlass.Constexpr[bool]):
    """(m_block, head, batch) of this CTA; causal grids run the longest tiles first."""
    bx, by, bz = cute.arch.block_idx()
    m_block = bx
    if cutlass.const_expr(causal):
        gx, _, _ = cute.arch.grid_dim()
        m_block = gx - 1 - bx
    return m_block, by, bz
