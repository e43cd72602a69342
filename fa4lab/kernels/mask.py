"""Masking a score tile in registers: the key-length tail and the causal diagonal (device code).

Shared by the sm90 and sm100 kernels. Inputs are arch-neutral: a thread's scores in an
(rows, cols) view and the matching view of an identity (coordinate) tensor, which tells each
register which (row, col) of the tile it holds. The caller offsets the tile into the whole
problem with `m_offset` (first query row of the tile) and `n_offset` (first key of the block).

The rule (bottom-right aligned causal, the contract in `fa4lab.spec`): query i sees key j iff
j < seqlen_k and, when causal, j <= i + seqlen_k - seqlen_q. Masked scores become -inf so the
softmax step gives them probability exactly 0; a row with no visible key stays at -inf and the
softmax's finalize turns it into output 0 and LSE -inf.

With pack-GQA (sm90, `qhead_per_kvhead` = g > 1) a tile row is a packed row: the causal rule
compares keys with its POSITION (m_offset + row) // g (Note [pack-GQA rows] in fa4lab.tiling).

Which blocks need this at all comes from the tile kinds (`fa4lab.tiling`, see
`fa4lab.kernels.scheduler`): FULL blocks skip it, MASKED / TAIL blocks call `apply_mask`.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


@cute.jit
def apply_mask(
    acc_mn: cute.Tensor,    # (rows, cols) scores of one thread
    coord_mn: cute.Tensor,  # (rows, cols) -> (row, col) inside the tile
    m_offset: Int32,        # query index of tile row 0
    n_offset: Int32,        # key index of tile column 0
    seqlen_q: Int32,
    seqlen_k: Int32,
    causal: cutlass.Constexpr[bool],
    qhead_per_kvhead: cutlass.Constexpr[int] = 1,  # g > 1: rows are packed rows (pack-GQA)
) -> None:
    """Set to -inf every score whose key is past seqlen_k or, if causal, right of the diagonal."""
    num_rows = cute.size(acc_mn, mode=[0])
    num_cols = cute.size(acc_mn, mode=[1])
    for r in cutlass.range_constexpr(num_rows):
        # First key index (relative to the tile) this row may NOT see.
        limit = seqlen_k - n_offset
        if cutlass.const_expr(causal):
            row = m_offset + coord_mn[r, 0][0]
            if cutlass.const_expr(qhead_per_kvhead > 1):
                row = row // qhead_per_kvhead  # the position; row >= 0, so // truncates = floors
            limit = cutlass.min(limit, row + seqlen_k - seqlen_q + 1 - n_offset)
        for c in cutlass.range_constexpr(num_cols):
            if coord_mn[r, c][1] >= limit:
                acc_mn[r, c] = -Float32.inf
