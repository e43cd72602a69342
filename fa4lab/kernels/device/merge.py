"""The split-KV merge rule in device form: each split's weight, and the merged row's scale and LSE.

This is `fa4lab.online_softmax.merge_out_lse` (Note [merge rule] there), taken over all of a
row's splits at once: the basis is the largest split LSE (0 when every split is empty), split s
weighs w_s = 2^((lse_s - basis) * log2(e)) <= 1 and 0 when lse_s is -inf, and

    out = sum_s w_s out_s / sum_s w_s,        lse = basis + ln(sum_s w_s),

a row no split saw giving out 0 and lse -inf, never NaN. Folding `merge_out_lse` pair by pair
gives the same numbers up to float32 rounding: each pairwise merge rescales the running weights
to the new basis, and the product of those rescales is the one factor used here. The LSEs are
natural logs, as `fa4lab.kernels.device.softmax.finalize_row` stores them; the exponentials go
through exp2 with log2(e), like the rest of the kernels (Note [exp2 and scale_log2]).

Called by `fa4lab.kernels.combine`, per row: `merge_basis` once the row's largest LSE is known,
`merge_weight` per split, `merge_finish` once the weights are summed.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32

from fa4lab.spec import LN2, LOG2E


@cute.jit
def merge_basis(lse_max: Float32) -> Float32:
    """The basis every split's weight is measured from: the row's largest split LSE, or 0 when
    every split is empty (lse_max -inf), so that no weight forms -inf - -inf."""
    return Float32(0.0) if lse_max == -Float32.inf else lse_max


@cute.jit
def merge_weight(lse: Float32, basis: Float32) -> Float32:
    """w = 2^((lse - basis) * log2(e)), in (0, 1] for a split that saw a key, exactly 0 for an
    empty one (lse -inf). The difference is taken before the scale, so an LSE of 1e4 loses no
    more than its own float32 rounding."""
    return (Float32(0.0) if lse == -Float32.inf
            else cute.math.exp2((lse - basis) * Float32(LOG2E), fastmath=True))


@cute.jit
def merge_finish(basis: Float32, total: Float32):
    """(factor, lse) of a row whose weights sum to `total`: out = factor * sum_s w_s out_s, with
    factor = 1 / total and lse = basis + ln(total); factor 0 and lse -inf for a row no split saw
    (total 0)."""
    seen = total > Float32(0.0)
    factor = cute.arch.rcp_approx(total) if seen else Float32(0.0)
    lse = (basis + cute.math.log2(total, fastmath=True) * Float32(LN2) if seen
           else -Float32.inf)
    return factor, lse
