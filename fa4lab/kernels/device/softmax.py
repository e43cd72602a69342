"""The online-softmax row step, in base 2, with FA4's conditional rescale (device code).

Two levels:

* the rules for one row, which both kernels call: `update_max` (threshold and row scale),
  `exp2_basis`, `update_sum`, `rescale_needed` / `warp_rescale_needed` (the rescale vote),
  `finalize_row` (1/sum, LSE, the empty-row rule and a learnable sink: Note [sinks]),
  `sink_log2` and `store_lse`;
* `OnlineSoftmax`, the sm90 form over a thread's scores as a register tensor in an (rows, cols)
  view -- the "MN view" -- of a wgmma accumulator, where four threads (a quad) hold pieces of each
  row, so row reductions finish with a 4-wide butterfly shuffle (`threads_per_row=4`). The sm100
  softmax holds one row per thread, loaded from TMEM, and calls the row rules directly: its
  exp2 is split between MUFU and the polynomial (`fa4lab.kernels.device.exp2`) and its row
  scale goes to another warpgroup, the correction, which applies it and finalizes.

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
`tests/test_sm90.py` (the extreme-logit and fully-masked-row cases hit every branch of the row
rules; `fa4lab.kernels.sharing` counts what of the sm100 kernel runs there).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from fa4lab.kernels.device.pack_gqa import unpack_row
from fa4lab.spec import LN2, LOG2E

# Independent accumulators per row reduction (Note [sm90 softmax chains]).
REDUCE_CHAINS = 4


def chain_into(chains: list, j: int, value, op, width: int = REDUCE_CHAINS) -> None:
    """Feed the j-th value (j = 0, 1, ... in order) into `width` interleaved running chains:
    `chains` is a plain list, updated in place at trace time."""
    if j < width:
        chains.append(value)
    else:
        chains[j % width] = op(chains[j % width], value)


def join_chains(chains: list, op):
    """The chains joined by a pairwise tree."""
    while len(chains) > 1:
        half = (len(chains) + 1) // 2
        chains = [op(chains[c], chains[c + half]) if c + half < len(chains) else chains[c]
                  for c in range(half)]
    return chains[0]


def _reduce_in_chains(values: list, op):
    """op over `values` as REDUCE_CHAINS interleaved running chains, then a pairwise tree (plain
    Python at trace time: the order of the emitted instructions)."""
    chains = []
    for j, v in enumerate(values):
        chain_into(chains, j, v, op)
    return join_chains(chains, op)


# Note [sm90 softmax chains]
# A consumer thread holds n_block / 4 scores of each of its rows. Reducing them in one running
# chain makes every FMNMX (and every FADD of the row sum) wait for the previous one's result;
# four interleaved chains joined by a small tree give the scheduler independent work to
# interleave with the MUFU.EX2s, as upstream FA4's `fmax_reduce` does. The sum's order differs
# from a left-to-right sum only by fp32 rounding. The sm100 softmax sums P the same way, on f32x2
# pairs (Note [packed exp2] in fa4lab.kernels.device.exp2).


@cute.jit
def _row_reduce_max(row: cute.Tensor, threads_per_row: cutlass.Constexpr[int]) -> Float32:
    """Max over a thread's slice of a row (Note [sm90 softmax chains]), then over the row's
    threads."""
    m = _reduce_in_chains([row[j] for j in range(cute.size(row))], cute.arch.fmax)
    if cutlass.const_expr(threads_per_row > 1):
        m = cute.arch.warp_reduction_max(m, threads_in_group=threads_per_row)
    return m


# ---- one row's rules, called by both kernels ---------------------------------------------------

@cute.jit
def softcap_row(row: cute.Tensor, pre_scale: Float32) -> None:
    """row[j] = tanh(row[j] * pre_scale): Note [softcap], before any mask.

    Note [softcap]
        Gemma 2's logit cap turns a scaled score s = softmax_scale * q.k into c * tanh(s / c).
        The kernels fold the constants as for the plain scale (Note [exp2 and scale_log2]): the
        score is replaced by t = tanh(raw * pre_scale), pre_scale = softmax_scale / c, and the
        softmax runs on t with scale_log2 = c * log2(e), both runtime arguments
        (`fa4lab.kernels.compile.scale_args`). The cap comes before the mask: tanh(-inf) = -1
        would let a masked key back in. t lies in [-1, 1], so the row max moves by at most
        2c * log2(e) in log2 units, and the LSE (m * scale_log2 + log2 sum) is the log-sum-exp of
        the capped scores, as the reference defines it.
    """
    for j in cutlass.range_constexpr(cute.size(row)):
        row[j] = cute.math.tanh(row[j] * pre_scale, fastmath=True)


@cute.jit
def update_max(m_old: Float32, blk_max: Float32, scale_log2: Float32, threshold: Float32):
    """(m_new, row_scale) for a row whose block max is `blk_max`: Note [conditional rescale].

    The max moves only when it grows by more than `threshold` (log2 units); row_scale is then
    2^((m_old - m_new) * scale_log2), else 1. A row still at -inf (nothing seen) takes any
    finite max with row_scale 1 -- its O and sum are 0, there is nothing to rescale -- and a
    row that stays at -inf keeps it (-inf - -inf is NaN, and NaN > threshold is False).
    """
    m_cand = cute.arch.fmax(m_old, blk_max)
    grow = (m_cand - m_old) * scale_log2 > threshold
    m_new = m_cand if grow else m_old
    m_from = m_new if m_old == -Float32.inf else m_old
    row_scale = (cute.math.exp2((m_from - m_new) * scale_log2, fastmath=True)
                 if grow else Float32(1.0))
    return m_new, row_scale


@cute.jit
def exp2_basis(m: Float32, scale_log2: Float32) -> Float32:
    """The subtrahend of P = exp2(s * scale_log2 - basis): 0 for a row still at -inf, so masked
    scores give exp2(-inf) = 0 and never -inf - -inf = NaN."""
    return Float32(0.0) if m == -Float32.inf else m * scale_log2


@cute.jit
def update_sum(row_sum: Float32, row_scale: Float32, block_sum: Float32) -> Float32:
    """The running row sum in the basis of the (possibly moved) max."""
    return row_sum * row_scale + block_sum


@cute.jit
def rescale_needed(row_scale: Float32):
    """True when the row's max moved (Note [conditional rescale]: most blocks move none, so the
    O multiply is skipped; both kernels vote per warp: `warp_rescale_needed`, and on sm90
    `OnlineSoftmax.needs_rescale`)."""
    return row_scale != Float32(1.0)


@cute.jit
def warp_rescale_needed(row_scale: Float32):
    """True when any row of the warp moved its max: the warp rescales its 32 rows of O."""
    return cute.arch.vote_ballot_sync(rescale_needed(row_scale)) != 0


@cute.jit
def finalize_row(row_sum: Float32, row_max: Float32, scale_log2: Float32, sink_log2=None):
    """(factor, LSE in natural log) of a row's final state: O = O_acc * factor, factor being
    1 / row_sum without a sink. Note [empty rows]; with a sink (`sink_log2`, the row's sink
    logit times log2(e)), Note [sinks].

    Note [empty rows]
        A row that saw no key (fully masked, or a CTA with no key block) has row_sum 0; a row
        whose sum became NaN (an infinite score) is treated the same way, so neither divides by
        0 nor writes a NaN LSE: the scale is 0 (O = 0) and LSE = -inf, the values the float64
        reference gives a row with no visible key.

    Note [sinks]
        A learnable sink adds e^{sink[h]} to the softmax denominator of every row of query head
        h, unscaled and uncapped, with no value (`fa4lab.spec`). The row's O and row_sum are
        sums of 2^(s * scale_log2 - b) in the basis b = row_max * scale_log2 (Note [conditional
        rescale]); the sink in the same base-2 units is sink * log2(e) (`sink_log2`), so the
        denominator is row_sum + 2^(sink_log2 - b). That term overflows fp32 once the sink
        exceeds the row's max by 128 log2 units, and a row that saw no key has no basis at all,
        so finalize moves to the basis t = max(b, sink_log2) (b = -inf for an empty row):
            sum = row_sum * 2^(b - t) + 2^(sink_log2 - t),   factor = 2^(b - t) / sum,
            LSE = (t + log2(sum)) * ln 2,
        every exp2 of a non-positive number. A row with no visible key gets sum = 1, O = 0 and
        LSE = sink; a sink of -inf adds 0 (a row with no key then stays at 0 and -inf). Each row
        reads the sink of its own query head: with pack-GQA head * g + row % g (`sink_log2`,
        the same map as `store_lse`). The sink is read once per row, in the finalize step only.
    """
    empty = row_sum == Float32(0.0) or row_sum != row_sum
    if cutlass.const_expr(sink_log2 is None):
        factor = Float32(0.0) if empty else cute.arch.rcp_approx(row_sum)
        lse = (-Float32.inf if empty
               else (row_max * scale_log2 + cute.math.log2(row_sum, fastmath=True))
               * Float32(LN2))
    else:
        basis = -Float32.inf if empty else row_max * scale_log2
        top = cute.arch.fmax(basis, sink_log2)
        top = Float32(0.0) if top == -Float32.inf else top   # no key and a -inf sink
        keep = cute.math.exp2(basis - top, fastmath=True)
        total = ((Float32(0.0) if empty else row_sum) * keep
                 + cute.math.exp2(sink_log2 - top, fastmath=True))
        nothing = total == Float32(0.0)
        factor = Float32(0.0) if nothing else keep * cute.arch.rcp_approx(total)
        lse = (-Float32.inf if nothing
               else (top + cute.math.log2(total, fastmath=True)) * Float32(LN2))
    return factor, lse


@cute.jit
def sink_log2(mSink: cute.Tensor, row, head, pack: cutlass.Constexpr[int]) -> Float32:
    """sink[q_head] * log2(e) for tile row `row` of grid head `head` (the KV head with pack-GQA:
    q_head = head * g + row % g, `unpack_row`). See Note [sinks]."""
    _, q_head = unpack_row(row, head, pack)
    return mSink[q_head] * Float32(LOG2E)


@cute.jit
def store_lse(mLSE: cute.Tensor, row, lse: Float32, head, batch, seqlen_q,
              pack: cutlass.Constexpr[int]) -> None:
    """LSE of tile row `row` into mLSE (seqlen_q, heads_q, batch); rows past seqlen_q dropped.

    With pack-GQA (pack = g > 1) the row is a packed row: position row // g of query head
    head * g + row % g, `head` being the KV head (Note [pack-GQA rows] in fa4lab.gqa).
    """
    if row < seqlen_q * pack:
        pos, q_head = unpack_row(row, head, pack)
        mLSE[pos, q_head, batch] = lse


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
            if cutlass.const_expr(is_first):  # what update_max gives from -inf, without the exp2
                m_new = blk_max
                row_scale[r] = Float32(1.0)
            else:
                m_new, scale = update_max(self.row_max[r], blk_max, scale_log2, threshold)
                row_scale[r] = scale
            self.row_max[r] = m_new
            m_basis = exp2_basis(m_new, scale_log2)
            for j in cutlass.range_constexpr(cute.size(row)):
                acc_mn[r, j] = cute.math.exp2(acc_mn[r, j] * scale_log2 - m_basis, fastmath=True)
            part = _reduce_in_chains([acc_mn[r, j] for j in range(cute.size(row))],
                                     lambda a, b: a + b)
            if cutlass.const_expr(is_first):
                self.row_sum[r] = part
            else:
                self.row_sum[r] = update_sum(self.row_sum[r], row_scale[r], part)
        return row_scale

    @cute.jit
    def needs_rescale(self, row_scale: cute.Tensor):
        """True when any row of the warp changed its max (`rescale_needed`, voted per warp): a
        warp-uniform branch, which keeps the sm90 loop's state in uniform registers (Note
        [sm90 wait after the softmax] in fa4lab.kernels.fwd_sm90). A row that kept its max has
        row_scale 1.0, so rescaling it with the others changes nothing."""
        need = rescale_needed(row_scale[0])
        for r in cutlass.range_constexpr(1, self.num_rows):
            need = need or rescale_needed(row_scale[r])
        return cute.arch.vote_ballot_sync(need) != 0

    @cute.jit
    def all_summed(self):
        """True in every thread, computed from every row's sum, so only once the last step's
        exponentials are: no lane of the warp has a negative sum (none can; a NaN is not
        negative either), voted per warp like `needs_rescale`, so the branch on it is
        warp-uniform. The sm90 kernel's value-wgmma wait depends on it (Note [sm90 wait after
        the softmax] in fa4lab.kernels.fwd_sm90)."""
        total = self.row_sum[0]
        for r in cutlass.range_constexpr(1, self.num_rows):
            total = total + self.row_sum[r]
        return cute.arch.vote_ballot_sync(total < Float32(0.0)) == 0

    def rescale(self, acc_o_mn: cute.Tensor, row_scale: cute.Tensor) -> None:
        rescale_rows(acc_o_mn, row_scale)

    @cute.jit
    def finalize(self, sinks=None) -> tuple[cute.Tensor, cute.Tensor]:
        """(row_scale = 1/sum, lse in natural log) per row, after the sum's reduction over the
        row's threads (`finalize_row`: 0 and -inf for rows that saw no key). `sinks`: None, or
        each row's sink logit times log2(e) (Note [sinks])."""
        scale_log2 = Float32(self.scale_log2)
        inv_sum = cute.make_rmem_tensor(self.num_rows, Float32)
        lse = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            s = self.row_sum[r]
            if cutlass.const_expr(self.threads_per_row > 1):
                s = cute.arch.warp_reduction_sum(s, threads_in_group=self.threads_per_row)
            if cutlass.const_expr(sinks is None):
                inv_sum[r], lse[r] = finalize_row(s, self.row_max[r], scale_log2)
            else:
                inv_sum[r], lse[r] = finalize_row(s, self.row_max[r], scale_log2, sinks[r])
        return inv_sum, lse
