"""Masking a score tile in registers: the key-length tail and the causal diagonal (device code).

Shared by the sm90 and sm100 kernels. Inputs are arch-neutral: a thread's scores in an
(rows, cols) view and the matching view of an identity (coordinate) tensor, which tells each
register which (row, col) of the tile it holds. The caller offsets the tile into the whole
problem with `m_offset` (first query row of the tile) and `n_offset` (first key of the block):
`row_limits` turns the rows into one limit each, once per tile; `apply_limits` masks a block.
Both are built from the one-row forms `key_limit` and `mask_row`, which the sm100 softmax (one
row per thread) calls directly.

The rule (bottom-right aligned causal, the contract in `fa4lab.spec`): query i sees key j iff
j < seqlen_k and, when causal, j <= i + seqlen_k - seqlen_q. Masked scores become -inf so the
softmax step gives them probability exactly 0; a row with no visible key stays at -inf and the
softmax's finalize turns it into output 0 and LSE -inf.

With pack-GQA (`qhead_per_kvhead` = g > 1) a tile row is a packed row: the causal rule
compares keys with its POSITION (m_offset + row) // g (Note [pack-GQA rows] in fa4lab.tiling).

Which blocks need this at all comes from the tile kinds (`fa4lab.tiling`, see
`fa4lab.kernels.device.scheduler`): FULL blocks skip it, MASKED / TAIL blocks call `apply_limits`.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


@cute.jit
def key_limit(row, seqlen_q, seqlen_k, causal: cutlass.Constexpr[bool],
              qhead_per_kvhead: cutlass.Constexpr[int] = 1):
    """The first key index query row `row` may NOT see (the rule above, one row)."""
    limit = seqlen_k
    if cutlass.const_expr(causal):
        if cutlass.const_expr(qhead_per_kvhead > 1):
            row = row // qhead_per_kvhead  # the position; row >= 0, so // truncates = floors
        limit = cutlass.min(limit, row + seqlen_k - seqlen_q + 1)
    return limit


@cute.jit
def mask_row(row: cute.Tensor, cols: cute.Tensor, limit) -> None:
    """row[j] = -inf where cols[j]'s column is at or past `limit` (a block's own column frame).

    `cols` holds (row, col) coordinates; when they are compile-time constants each test is one
    compare with an immediate (Note [static columns]).
    """
    # Note [select, not if]
    # A conditional expression lowers to one select per score. An `if` statement with a
    # runtime condition becomes a structured branch that yields every value it might change --
    # here the whole accumulator -- and ptxas turned that into ~16 FSEL per score (H200 profile
    # at head_dim 64: 1058 FSEL in a masked block of 64 scores per thread, about as many
    # instructions as the rest of the block step).
    for j in cutlass.range_constexpr(cute.size(row)):
        row[j] = -Float32.inf if cols[j][1] >= limit else row[j]


@cute.jit
def row_limits(
    coord_mn: cute.Tensor,  # (rows, cols) -> (row, col) inside the tile
    coord0_mn: cute.Tensor,  # the same view for thread 0: see Note [static columns]
    m_offset: Int32,        # query index of tile row 0
    seqlen_q: Int32,
    seqlen_k: Int32,
    causal: cutlass.Constexpr[bool],
    qhead_per_kvhead: cutlass.Constexpr[int] = 1,  # g > 1: rows are packed rows (pack-GQA)
) -> cute.Tensor:
    """Per row of this thread: the first key index it may NOT see, in thread 0's column frame.

    Computed once per tile, so a masked block costs one subtraction per row and one compare
    with an immediate per score (`apply_limits`).
    """
    # Note [static columns]
    # In an MMA accumulator a thread's column coordinates are thread 0's plus one offset per
    # thread (the layout is affine in the thread index). Comparing thread 0's columns --
    # compile-time constants -- against (limit - offset) makes each test one compare with an
    # immediate; comparing the thread's own coordinates keeps one live register per column,
    # which a 160-register consumer (three sm90 warpgroups) cannot afford.
    num_rows = cute.size(coord_mn, mode=[0])
    col_offset = coord_mn[0, 0][1] - coord0_mn[0, 0][1]
    limits = cute.make_rmem_tensor(num_rows, Int32)
    for r in cutlass.range_constexpr(num_rows):
        limits[r] = key_limit(m_offset + coord_mn[r, 0][0], seqlen_q, seqlen_k, causal,
                              qhead_per_kvhead) - col_offset
    return limits


@cute.jit
def apply_limits(
    acc_mn: cute.Tensor,     # (rows, cols) scores of one thread
    coord0_mn: cute.Tensor,  # thread 0's (row, col) coordinates (compile-time)
    limits: cute.Tensor,     # from row_limits
    n_offset: Int32,         # key index of tile column 0
) -> None:
    """Set to -inf every score whose key index is at or past its row's limit."""
    for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        mask_row(acc_mn[r, None], coord0_mn[r, None], limits[r] - n_offset)
