"""The online-softmax row step, in base 2, with FA4's conditional rescale (device code).

Shared by the sm90 and sm100 kernels. It works on a thread's scores as a register tensor in an
(rows, cols) view -- the "MN view" -- whatever the MMA that produced them:

* sm90: a wgmma accumulator, where four threads (a quad) hold pieces of each row, so row
  reductions finish with a 4-wide butterfly shuffle (`threads_per_row=4`);
* sm100: a row loaded from TMEM, one thread per row (`threads_per_row=1`).

State per row: `row_max` (the raw score max, not yet scaled) and `row_sum` (this thread's part of
the sum of exp2; reduced across the row's threads only once, in `finalize`).

Note [exp2 and scale_log2]
    softmax(s * scale) = 2^(s * scale * log2(e) - m * scale * log2(e)) / sum. Folding log2(e)
    into the scale (`scale_log2`) turns every exp into one FFMA plus one MUFU.EX2.

Note [conditional rescale]
    When a new block raises a row's max from m_old to m_new, the usual online softmax multiplies
    O and the row sum by 2^((m_old - m_new) * scale_log2). FA4 skips that unless the max grew by
    more than `rescale_threshold` (8 in log2 units): the row keeps its stale max, so P values may
    reach 2^8 = 256 -- harmless in fp32 accumulators and in bf16/fp16 P. The result is exact
    because O and the sum are always expressed in the same basis (the kept max), and the final
    normalisation O / sum and LSE = (m * scale_log2 + log2(sum)) * ln 2 use that basis.
    A row whose max is still -inf (every key masked so far) takes any finite new max; a row
    that stays at -inf uses 0 as its basis, so exp2(-inf - 0) = 0 and nothing turns into NaN.

How to run: imported by `fa4lab.kernels.fwd_sm90` / `fwd_sm100`; exercised on the GPU by
`tests/test_sm90.py` (the extreme-logit and fully-masked-row cases hit every branch here).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

LN2 = math.log(2.0)


@cute.jit
def _row_reduce_max(row: cute.Tensor, threads_per_row: cutlass.Constexpr[int]) -> Float32:
    """Max over a thread's slice of a row, then over the row's threads."""
    m = row[0]
    for j in cutlass.range_constexpr(1, cute.size(row)):
        m = cute.arch.fmax(m, row[j])
    if cutlass.const_expr(threads_per_row > 1):
        m = cute.arch.warp_reduction_max(m, threads_in_group=threads_per_row)
    return m


@cute.jit
def rescale_rows(acc_o_mn: cute.Tensor, row_scale: cute.Tensor) -> None:
    """O[r, :] *= row_scale[r] on a thread's (rows, cols) view of the O accumulator."""
    for r in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[0])):
        for j in cutlass.range(cute.size(acc_o_mn, mode=[1]), unroll_full=True):
            acc_o_mn[r, j] = acc_o_mn[r, j] * row_scale[r]


class OnlineSoftmax:
    """Row max / row sum registers and the three steps: `step`, `rescale`, `finalize`.

    Not a DSL struct: construct it inside a kernel (the tensors are register fragments).
    """

    def __init__(self, num_rows: int, scale_log2: float, rescale_threshold: float,
                 threads_per_row: int):
        self.num_rows = num_rows
        self.scale_log2 = scale_log2
        self.rescale_threshold = rescale_threshold
        self.threads_per_row = threads_per_row
        self.row_max = cute.make_rmem_tensor(num_rows, Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)

    def reset(self) -> None:
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def step(self, acc_mn: cute.Tensor, is_first: cutlass.Constexpr[bool] = False) -> cute.Tensor:
        """Overwrite scores `acc_mn` (rows, cols) with P = exp2(s*scale_log2 - max*scale_log2).

        Returns `row_scale` (one per row): the factor the caller multiplies O by (1.0 where the
        row kept its max). See Note [conditional rescale].
        """
        scale_log2 = Float32(self.scale_log2)
        threshold = Float32(self.rescale_threshold)
        row_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            row = acc_mn[r, None]
            blk_max = _row_reduce_max(row, self.threads_per_row)
            m_old = self.row_max[r]
            m_new = blk_max
            if cutlass.const_expr(is_first):
                row_scale[r] = Float32(1.0)
            else:
                m_cand = cute.arch.fmax(m_old, blk_max)
                # NaN (both -inf) compares False: the row keeps -inf and scale 1.
                grow = (m_cand - m_old) * scale_log2 > threshold
                m_new = m_cand if grow else m_old
                row_scale[r] = (
                    cute.math.exp2((m_old - m_new) * scale_log2, fastmath=True)
                    if grow else Float32(1.0)
                )
            self.row_max[r] = m_new
            m_basis = Float32(0.0) if m_new == -Float32.inf else m_new * scale_log2
            part = Float32(0.0)
            for j in cutlass.range_constexpr(cute.size(row)):
                p = cute.math.exp2(acc_mn[r, j] * scale_log2 - m_basis, fastmath=True)
                acc_mn[r, j] = p
                part = part + p
            if cutlass.const_expr(is_first):
                self.row_sum[r] = part
            else:
                self.row_sum[r] = self.row_sum[r] * row_scale[r] + part
        return row_scale

    @cute.jit
    def needs_rescale(self, row_scale: cute.Tensor):
        """True when any of this thread's rows changed its max (a row_scale other than 1).

        With the conditional rescale most blocks change no max, so the O multiply can be
        skipped; the branch is per thread (the rows' quads agree on their own scales).
        """
        need = row_scale[0] != Float32(1.0)
        for r in cutlass.range_constexpr(1, self.num_rows):
            need = need or row_scale[r] != Float32(1.0)
        return need

    def rescale(self, acc_o_mn: cute.Tensor, row_scale: cute.Tensor) -> None:
        rescale_rows(acc_o_mn, row_scale)

    @cute.jit
    def finalize(self) -> tuple[cute.Tensor, cute.Tensor]:
        """(row_scale = 1/sum, lse in natural log): 0 and -inf for rows that saw no key."""
        scale_log2 = Float32(self.scale_log2)
        inv_sum = cute.make_rmem_tensor(self.num_rows, Float32)
        lse = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            s = self.row_sum[r]
            if cutlass.const_expr(self.threads_per_row > 1):
                s = cute.arch.warp_reduction_sum(s, threads_in_group=self.threads_per_row)
            empty = s == Float32(0.0) or s != s
            inv_sum[r] = cute.arch.rcp_approx(Float32(1.0) if empty else s)
            m = self.row_max[r]
            lse[r] = (
                -Float32.inf if empty
                else (m * scale_log2 + cute.math.log2(s, fastmath=True)) * Float32(LN2)
            )
        return inv_sum, lse
