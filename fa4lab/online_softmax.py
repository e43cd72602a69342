"""The online-softmax state machine of FlashAttention(-4), in numpy, one small step at a time.

What it computes: the same attention as `fa4lab.reference.attention_reference`, but the way the
kernel does, streaming over K/V blocks of `block_n` keys with a per-row state
(row_max, row_sum, acc_o) and normalising only once at the end. Lesson 01 reads this file.

    state = init_state(...)                          # row_max = -inf, row_sum = 0, acc_o = 0
    for each K/V block:
        s = score_block(q, k_block, visible)         # raw scores, -inf where masked
        state, step = update_state(state, s, v_block, rescale_threshold=...)
    out, lse = finalize(state)

Constraints: numpy float64 throughout (torch CPU tensors are accepted and converted); small
problems (it is a lesson and a test oracle, not a fast path). `trace=True` keeps a copy of the
state after every block, so keep those problems small.

Also here: FA4's conditional rescaling (`rescale_threshold`), FA4's software exp2
(`exp2_poly3`), `merge_states` for split-KV (and `merge_out_lse`, its rule on finished
(out, lse) pairs, which the ring of `fa4lab.distributed` uses), and the failure modes a kernel
author meets (`MISTAKES`), each demonstrated wrong by a test.

Run: `python -c "import fa4lab.online_softmax as m; print(m.exp2_poly3_max_rel_error())"`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache

import numpy as np

from fa4lab.limits import EXP2_CLAMP_LOW, EXP2_POLY3, EXP2_POLY3_MAX_REL_ERROR, EXP2_ROUND_MAGIC
from fa4lab.limits import RESCALE_THRESHOLD as FA4_RESCALE_THRESHOLD
from fa4lab.reference import check_attention_inputs, kv_head_index, visible_mask
from fa4lab.spec import LN2, LOG2E, resolve_scale

# The failure modes lesson 01 demonstrates; `online_attention(..., mistake=name)`.
MISTAKES = {
    "skip_rescale": "the running max moves but acc_o and row_sum are not multiplied by alpha",
    "normalize_early": "P is divided by the running row_sum inside each block instead of once "
                       "at the end (earlier blocks keep a too-small denominator)",
    "gqa_modulo": "query head h reads kv head h % heads_kv instead of h // (heads_q // heads_kv)",
}

__all__ = [
    "SoftmaxState", "BlockStep", "OnlineTrace", "init_state", "score_block", "update_state",
    "finalize", "merge_weights", "merge_states", "merge_out_lse", "online_attention", "kv_blocks",
    "exp2_poly3", "exp2_poly3_max_rel_error", "fit_exp2_poly3", "emulated_pairs", "naive_softmax",
    "safe_softmax", "online_softmax_1d", "adversarial_inputs", "variant_errors", "MISTAKES",
    "FA4_RESCALE_THRESHOLD", "EXP2_POLY3", "EXP2_POLY3_MAX_REL_ERROR",
]


# ----------------------------------------------------------------------------------------------
# Softmax of one vector: naive -> safe -> online (the first half of lesson 01)
# ----------------------------------------------------------------------------------------------

def naive_softmax(x: np.ndarray) -> np.ndarray:
    """exp(x) / sum(exp(x)): overflows to inf/inf = NaN once a logit passes ~709 (float64)."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(x)
        return e / e.sum(axis=-1, keepdims=True)


def safe_softmax(x: np.ndarray) -> np.ndarray:
    """Subtract the row max first: every exponent is <= 0, so nothing overflows. Two passes."""
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def online_softmax_1d(x: Sequence[float]) -> tuple[np.ndarray, float, float]:
    """One pass for the normaliser: (probabilities, final max m, final sum l).

    m and l are updated element by element; when the max rises, the sum so far is rescaled by
    exp(m_old - m_new). This recurrence is the whole trick of FlashAttention.
    """
    m, total = -math.inf, 0.0
    for xi in x:
        m_new = max(m, float(xi))
        total = total * math.exp(m - m_new) + math.exp(float(xi) - m_new)
        m = m_new
    return np.exp(np.asarray(x, dtype=np.float64) - m) / total, m, total


# ----------------------------------------------------------------------------------------------
# FA4's software exp2: Cody-Waite range reduction + a degree-3 polynomial on the FMA pipes
# ----------------------------------------------------------------------------------------------
# Note [software exp2]
# On B200 the MUFU unit does 16 exp2 per cycle per SM while the tensor cores do 8192 FLOPs,
# so for a 128x128 tile the exponentials cost as much as the matmuls. FA4 computes a fraction
# of them on the FMA units instead: split x = n + f with n = floor(x) and f in [0, 1), evaluate
# 2**f with a cubic in Horner form (three FMAs), and put n into the float's exponent field with
# an integer add. A cubic gives ~1e-4 relative error: far below bf16's 2**-8 rounding of P.
# The lab's coefficients live once, in `fa4lab.limits.EXP2_POLY3`: the sm100 kernel's PTX and
# `exp2_poly3` below (its step-by-step numpy replay) read them; `fit_exp2_poly3` shows where
# they come from.

def _fma_f32(a, b, c):
    """a * b + c rounded once to float32, as the FFMA instruction does.

    A product of two float32 is exact in float64, so only the sum rounds (to float64, then to
    float32); the double rounding can differ from a true FMA only in rare ties.
    """
    return (np.float64(a) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(
        np.float32)


@cache
def fit_exp2_poly3(points: int = 4097, iterations: int = 300, *,
                   exact_at_zero: bool = False) -> tuple[float, ...]:
    """Coefficients (c0, c1, c2, c3) of the cubic closest to 2**f on [0, 1] in relative error.

    Lawson's algorithm: iteratively reweighted least squares whose weights grow where the
    error is large; it converges to the minimax (equi-oscillating) solution. The coefficients
    are then rounded to float32, the precision the kernel holds them in. exact_at_zero pins
    c0 = 1 so that p(0) = 1 bit for bit (2**n exact at integers, and a clamp at -127 then
    yields +0.0 exactly); that costs a little accuracy (8.6e-5 instead of 7.5e-5), and is the
    variant the lab uses: `fa4lab.limits.EXP2_POLY3` holds it (a test checks this fit
    reproduces it).
    """
    f = 0.5 - 0.5 * np.cos(np.linspace(0.0, math.pi, points))  # Chebyshev-spaced on [0, 1]
    target = np.exp2(f)
    powers = np.vander(f, 4, increasing=True) / target[:, None]  # rows: f**i / 2**f
    # minimise |p(f) / 2**f - 1|: a @ c ~ b, with c0 moved to the right side when pinned
    a, b = (powers[:, 1:], 1.0 - 1.0 / target) if exact_at_zero else (powers, np.ones(points))
    w = np.full(points, 1.0 / points)
    coeffs = np.zeros(a.shape[1])
    for _ in range(iterations):
        sw = np.sqrt(w)
        coeffs = np.linalg.lstsq(a * sw[:, None], b * sw, rcond=None)[0]
        w = w * np.abs(a @ coeffs - b)
        w /= w.sum()
    if exact_at_zero:
        coeffs = np.concatenate([[1.0], coeffs])
    return tuple(float(np.float32(c)) for c in coeffs)


def exp2_poly3(x, coeffs: Sequence[float] = EXP2_POLY3) -> np.ndarray:
    """2**x in float32 arithmetic, step by step as the sm100 kernel's PTX computes it on the FMA
    units (`fa4lab.kernels.device.exp2`). See Note [software exp2].

    With the lab's coefficients (`fa4lab.limits.EXP2_POLY3`, p(0) = 1, so integer powers of two
    are exact): max relative error 8.6e-05 over x in [-125, 8] (the range P is evaluated on
    with rescale_threshold <= 8; measured by `exp2_poly3_max_rel_error()`, and checked by a
    test). Inputs are clamped at -127, which gives +0.0 exactly, so -inf (a masked score) gives
    P = 0; x = 128 gives inf and larger x wrap around (the softmax never passes x > 8).
    coeffs: another cubic (c0, c1, c2, c3), e.g. the free minimax fit `fit_exp2_poly3()`
    (max relative error 7.5e-05).
    """
    x = np.asarray(x, dtype=np.float32)
    xc = np.maximum(x, np.float32(EXP2_CLAMP_LOW))
    magic = np.float32(EXP2_ROUND_MAGIC)
    # add.rm: floor(x) + magic is exactly representable, so floor first, then add.
    n = np.floor(xc.astype(np.float64)).astype(np.float32)
    r = (n.astype(np.float64) + magic).astype(np.float32)
    f = (xc - (r - magic)).astype(np.float32)                 # exact in float32
    c0, c1, c2, c3 = (np.float32(c) for c in coeffs)
    p = _fma_f32(c3, f, c2)
    p = _fma_f32(p, f, c1)
    p = _fma_f32(p, f, c0)                                    # ~2**f in [1, 2)
    # multiply by 2**n: the rounded sum's low bits hold n; shifted by 23 they add to the exponent
    e = (r.view(np.int32).astype(np.int64) << 23) & 0xFFFFFFFF
    bits = (p.view(np.int32).astype(np.int64) + e) & 0xFFFFFFFF
    return bits.astype(np.uint32).view(np.float32)


def emulated_pairs(num_elements: int, fraction: float) -> tuple[bool, ...]:
    """Which element pairs (0, 1), (2, 3), ... of a score row the sm100 softmax computes with
    `exp2_poly3` instead of MUFU.EX2, spread evenly.

    Pair p is emulated iff floor((p + 1) * fraction) > floor(p * fraction): exactly
    round-down(fraction * pairs) pairs, evenly interleaved with MUFU ones so both pipes stay
    busy. The choice is made at compile time (the kernel unrolls the row); the data-carrying
    simulator makes the same one.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"exp2_emulation_fraction must be in [0, 1], got {fraction}")
    pairs = num_elements // 2
    return tuple(int((p + 1) * fraction) > int(p * fraction) for p in range(pairs))


def exp2_poly3_max_rel_error(lo: float = -125.0, hi: float = FA4_RESCALE_THRESHOLD,
                             samples: int = 1 << 20, *,
                             coeffs: Sequence[float] = EXP2_POLY3) -> float:
    """Measured max |exp2_poly3(x) / 2**x - 1| over float32 x in [lo, hi].

    Samples evenly over the range plus densely over one period of f (the error depends only
    on the fractional part, up to float32 rounding of the result).
    """
    x = np.concatenate([
        np.linspace(lo, hi, samples, dtype=np.float64),
        np.linspace(0.0, 1.0, samples, endpoint=False) + math.floor(lo) + 1.0,
    ]).astype(np.float32)
    x = x[(x >= lo) & (x <= hi)]
    exact = np.exp2(x.astype(np.float64))
    approx = exp2_poly3(x, coeffs).astype(np.float64)
    return float(np.max(np.abs(approx / exact - 1.0)))


# ----------------------------------------------------------------------------------------------
# The state machine
# ----------------------------------------------------------------------------------------------

@dataclass
class SoftmaxState:
    """Per-row running state. Shapes: (..., rows) and (..., rows, head_dim_v).

    row_max is the *basis* the state is stored on, in raw-score units (before softmax_scale):
    row_sum = sum_j 2**((s_j - row_max) * scale_log2), acc_o = the same weights times v_j.
    -inf means no key seen yet. With conditional rescaling the basis may lag the true max.
    """

    row_max: np.ndarray
    row_sum: np.ndarray
    acc_o: np.ndarray
    scale_log2: float


@dataclass
class BlockStep:
    """What one `update_state` did, per row (arrays shaped like row_max)."""

    row_max_before: np.ndarray
    block_max: np.ndarray
    row_max_after: np.ndarray
    alpha: np.ndarray          # factor applied to acc_o and row_sum (1 where not rescaled)
    rescaled: np.ndarray       # bool: a live state was rescaled (alpha applied to nonzero state)
    row_sum: np.ndarray        # after the block


def init_state(rows_shape: tuple[int, ...], head_dim_v: int, scale_log2: float) -> SoftmaxState:
    """row_max = -inf, row_sum = 0, acc_o = 0: the state before any key."""
    return SoftmaxState(
        row_max=np.full(rows_shape, -np.inf),
        row_sum=np.zeros(rows_shape),
        acc_o=np.zeros((*rows_shape, head_dim_v)),
        scale_log2=float(scale_log2),
    )


def score_block(q: np.ndarray, k_block: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """S = q @ k_block^T in raw units, -inf where the mask hides a key.

    q: (..., rows, head_dim), k_block: (..., block_n, head_dim), visible: (rows, block_n).
    softmax_scale is not applied here: it is folded into scale_log2 inside the exp2 (one FMA).
    """
    s = q @ np.swapaxes(k_block, -1, -2)
    return np.where(visible, s, -np.inf)


def _xp(x):
    """The array module of x: torch for torch tensors (the ring merges CUDA tensors with the same
    rule, `fa4lab.distributed`), numpy otherwise."""
    if type(x).__module__.startswith("torch"):
        import torch

        return torch
    return np


def _finite_or_zero(m):
    # Note [-inf minus -inf]: a row that has seen no visible key has max -inf; subtracting it
    # from a masked score gives -inf - -inf = NaN. Use 0 as the basis there: every visible
    # score is then exp2(-inf) = 0 anyway.
    xp = _xp(m)
    return xp.where(xp.isneginf(m), 0.0, m)


def update_state(state: SoftmaxState, s: np.ndarray, v_block: np.ndarray, *,
                 rescale_threshold: float = 0.0, exp2: Callable | None = None,
                 mistake: str | None = None) -> tuple[SoftmaxState, BlockStep]:
    """Fold one block of scores s (..., rows, block_n) and values v_block in; returns the new
    state and a record of what happened.

    Conditional rescaling (FA4): the basis moves to the block's max only when that max exceeds
    the basis by more than rescale_threshold in log2 units; otherwise the stale basis is kept,
    P may reach 2**rescale_threshold, and no multiply by alpha is needed. The answer stays
    exact because finalize divides acc_o and row_sum, which share whatever basis they have.
    """
    exp2 = np.exp2 if exp2 is None else exp2
    m_old, scale_log2 = state.row_max, state.scale_log2
    m_blk = s.max(axis=-1)
    live = np.isfinite(m_old)
    with np.errstate(invalid="ignore"):
        # how far the block's max is above the basis, in log2 units; inf for a fresh row,
        # -inf when the block shows this row nothing
        rise = np.where(np.isneginf(m_blk), -np.inf, (m_blk - m_old) * scale_log2)
    rescale = rise > rescale_threshold
    m_new = np.where(rescale, m_blk, m_old)
    if mistake == "skip_rescale":
        m_new = np.maximum(m_old, m_blk)          # tracks the max ...
        alpha = np.ones_like(m_old)               # ... but forgets to rescale
    else:
        # alpha = 2**((m_old - m_new) * scale_log2) where the basis moves on a live row;
        # elsewhere 1, a fresh row included: its acc_o and row_sum are 0, there is nothing to
        # rescale (the kernels' rule, `update_max` in fa4lab.kernels.device.softmax). The
        # exponent is masked before exp2, so no inf is ever formed.
        shift = np.where(rescale & live, _finite_or_zero(m_old) - _finite_or_zero(m_new), 0.0)
        alpha = np.exp2(shift * scale_log2)
    basis = _finite_or_zero(m_new)
    p = np.asarray(exp2(s * scale_log2 - (basis * scale_log2)[..., None]), dtype=np.float64)
    row_sum = alpha * state.row_sum + p.sum(axis=-1)
    if mistake == "normalize_early":
        safe = np.where(row_sum > 0, row_sum, 1.0)
        p = p / safe[..., None]                    # normalised now; earlier blocks never redone
    acc_o = alpha[..., None] * state.acc_o + p @ v_block
    new = SoftmaxState(m_new, row_sum, acc_o, scale_log2)
    step = BlockStep(row_max_before=m_old, block_max=m_blk, row_max_after=m_new, alpha=alpha,
                     rescaled=rescale & live, row_sum=row_sum)
    return new, step


def finalize(state: SoftmaxState, *, normalized: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """out = acc_o / row_sum (0 where no key was visible) and the natural-log lse.

    lse = ln(row_sum) + row_max * softmax_scale, i.e. (log2(row_sum) + row_max * scale_log2)
    * ln 2; -inf for a row that saw no key. `normalized` is for the normalize_early mistake,
    whose acc_o is already divided.
    """
    seen = state.row_sum > 0      # not for 0 nor NaN (Note [empty rows] in kernels.device.softmax)
    denom = np.where(seen, state.row_sum, 1.0)
    out = state.acc_o if normalized else state.acc_o / denom[..., None]
    out = np.where(seen[..., None], out, 0.0)
    lse = np.where(seen, (np.log2(denom) + _finite_or_zero(state.row_max) * state.scale_log2)
                   * LN2, -np.inf)
    return out, lse


# Note [merge rule]
# Two partial results over disjoint key sets each carry a log-magnitude per row: a state's
# basis row_max (raw-score units, scale_log2 turns it into log2 units) or a finished output's
# lse (natural log, scale_log2 = log2(e)). The merge moves both to the larger one, m = max(a, b),
# and weighs each side by 2**((its log - m) * scale_log2) <= 1: nothing overflows, and a side
# that saw no key (log -inf) weighs exactly 0 without forming -inf - -inf. `merge_weights` is
# that rule; `merge_states` (split-KV states, lesson 01) and `merge_out_lse` (normalised
# outputs, the ring of `fa4lab.distributed`) both call it.

def merge_weights(log_a, log_b, scale_log2: float):
    """(m, w_a, w_b): the merged basis max(log_a, log_b) and each side's weight relative to it,
    0 for a side that saw no key. numpy arrays or torch tensors. See Note [merge rule]."""
    xp = _xp(log_a)
    m = xp.maximum(log_a, log_b)
    base = _finite_or_zero(m)

    def weight(x):
        empty = xp.isneginf(x)
        return xp.where(empty, 0.0, xp.exp2(xp.where(empty, 0.0, x - base) * scale_log2))

    return m, weight(log_a), weight(log_b)


def merge_states(a: SoftmaxState, b: SoftmaxState) -> SoftmaxState:
    """Combine two partial states over disjoint key sets (split-KV): commutative, associative.

    Both are moved to the larger basis; a state that saw no key (row_max -inf) contributes 0
    (`merge_weights`, Note [merge rule]).
    """
    if a.scale_log2 != b.scale_log2:
        raise ValueError(f"cannot merge states with different scale_log2 "
                         f"({a.scale_log2} vs {b.scale_log2}): they came from different problems")
    if a.acc_o.shape != b.acc_o.shape:
        raise ValueError(f"cannot merge states of different shapes {a.acc_o.shape} and "
                         f"{b.acc_o.shape}")
    m, wa, wb = merge_weights(a.row_max, b.row_max, a.scale_log2)
    return SoftmaxState(
        row_max=m,
        row_sum=wa * a.row_sum + wb * b.row_sum,
        acc_o=wa[..., None] * a.acc_o + wb[..., None] * b.acc_o,
        scale_log2=a.scale_log2,
    )


def merge_out_lse(out_a, lse_a, out_b, lse_b):
    """(out, lse) of attention over the union of two disjoint key sets, from each set's
    normalised output out (..., rows, head_dim_v) and natural-log lse (..., rows).

    out = (w_a out_a + w_b out_b) / (w_a + w_b), lse = m + ln(w_a + w_b) with the weights of
    `merge_weights` (Note [merge rule]); a row neither side saw stays out 0, lse -inf, no NaN.
    numpy arrays or torch tensors (any device); compute in the dtype you pass.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape \
            or tuple(lse_a.shape) != tuple(out_a.shape[:-1]):
        raise ValueError(f"merge_out_lse needs two partial results of one shape: out "
                         f"(..., rows, d) and lse (..., rows); got out {tuple(out_a.shape)} / "
                         f"{tuple(out_b.shape)}, lse {tuple(lse_a.shape)} / {tuple(lse_b.shape)}")
    xp = _xp(lse_a)
    m, wa, wb = merge_weights(lse_a, lse_b, LOG2E)
    total = wa + wb
    seen = total > 0
    denom = xp.where(seen, total, 1.0)
    lse = xp.where(seen, _finite_or_zero(m) + xp.log(denom), -math.inf)
    out = (wa[..., None] * out_a + wb[..., None] * out_b) / denom[..., None]
    return out, lse


# ----------------------------------------------------------------------------------------------
# The whole forward pass
# ----------------------------------------------------------------------------------------------

def kv_blocks(seqlen_k: int, block_n: int) -> list[tuple[int, int]]:
    """[(start, stop), ...] covering the keys; the last block is a tail when block_n does not
    divide seqlen_k."""
    return [(n0, min(seqlen_k, n0 + block_n)) for n0 in range(0, seqlen_k, block_n)]


@dataclass
class OnlineTrace:
    """online_attention(..., trace=True): the answer plus the state after every block."""

    out: np.ndarray                      # (batch, seqlen_q, heads_q, head_dim_v)
    lse: np.ndarray                      # (batch, heads_q, seqlen_q)
    blocks: list[tuple[int, int]]        # key range of each step, in processing order
    steps: list[BlockStep]
    states: list[SoftmaxState]           # state after each step (acc_o shaped (b, h, rows, d))
    rescale_threshold: float
    scale_log2: float
    notes: dict = field(default_factory=dict)

    @property
    def rescales(self) -> int:
        """Row-blocks where a live state was multiplied by alpha."""
        return int(sum(int(s.rescaled.sum()) for s in self.steps))

    @property
    def max_rises(self) -> int:
        """Row-blocks where a block's max exceeded the true max of the keys before it on a row
        that had seen a key: the rescales a threshold-0 state machine does."""
        seen = np.full(self.steps[0].block_max.shape, -np.inf) if self.steps else None
        rises = 0
        for s in self.steps:
            rises += int((np.isfinite(seen) & (s.block_max > seen)).sum())
            seen = np.maximum(seen, s.block_max)
        return rises

    @property
    def rescales_saved(self) -> int:
        return self.max_rises - self.rescales

    def partial_out(self, i: int) -> np.ndarray:
        """The output as if the keys stopped after step i: (batch, seqlen_q, heads_q, d)."""
        out, _ = finalize(self.states[i])
        return out.transpose(0, 2, 1, 3)


def _as_numpy(t) -> np.ndarray:
    if hasattr(t, "detach"):
        t = t.detach().cpu().double().numpy()
    return np.asarray(t, dtype=np.float64)


def _check_threshold(rescale_threshold) -> float:
    thr = float(rescale_threshold)
    if not math.isfinite(thr) or thr < 0:
        raise ValueError(f"rescale_threshold must be a finite number >= 0 (log2 units; FA4 uses "
                         f"{FA4_RESCALE_THRESHOLD}), got {rescale_threshold}")
    if thr > 64:
        raise ValueError(f"rescale_threshold={thr} lets P grow to 2**{thr:g}, which overflows the "
                         f"kernel's fp32 accumulators; use at most 64 (FA4 uses "
                         f"{FA4_RESCALE_THRESHOLD:g})")
    return thr


def online_attention(q, k, v, *, block_n: int = 128, causal: bool = False,
                     softmax_scale: float | None = None, return_lse: bool = False,
                     rescale_threshold: float = 0.0, exp2: Callable | None = None,
                     trace: bool = False, block_order: Sequence[int] | None = None,
                     mistake: str | None = None):
    """Attention by streaming over K/V blocks of block_n keys (numpy, float64 state).

    Returns out (batch, seqlen_q, heads_q, head_dim_v), or (out, lse) when return_lse, or an
    `OnlineTrace` when trace=True (out, lse, the state after every block and the rescale
    counts). rescale_threshold: 0 rescales on every rise of the max; FA4 uses 8 (log2 units).
    exp2: the exponential for P (np.exp2 by default; `exp2_poly3` is FA4's software one).
    block_order: a permutation of the block indices (the answer does not depend on it; FA4
    walks causal blocks from the last). mistake: one of MISTAKES, to see it go wrong.
    """
    check_attention_inputs(q, k, v)
    q, k, v = _as_numpy(q), _as_numpy(k), _as_numpy(v)
    if isinstance(block_n, bool) or not isinstance(block_n, (int, np.integer)) or block_n < 1:
        raise ValueError(f"block_n must be a positive integer, got {block_n!r}")
    if mistake is not None and mistake not in MISTAKES:
        raise ValueError(f"unknown mistake {mistake!r}; choose one of {sorted(MISTAKES)}")
    threshold = _check_threshold(rescale_threshold)
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    scale_log2 = resolve_scale(softmax_scale, head_dim) * LOG2E

    if mistake == "gqa_modulo":
        kv_of = np.arange(heads_q) % heads_kv
    else:
        kv_of = kv_head_index(heads_q, heads_kv)
    qh = q.transpose(0, 2, 1, 3)                     # (batch, heads_q, seqlen_q, head_dim)
    kh = k[:, :, kv_of].transpose(0, 2, 1, 3)        # (batch, heads_q, seqlen_k, head_dim)
    vh = v[:, :, kv_of].transpose(0, 2, 1, 3)
    visible = visible_mask(seqlen_q, seqlen_k, causal)

    blocks = kv_blocks(seqlen_k, int(block_n))
    order = list(range(len(blocks))) if block_order is None else [int(i) for i in block_order]
    if sorted(order) != list(range(len(blocks))):
        raise ValueError(f"block_order must be a permutation of 0..{len(blocks) - 1} "
                         f"({len(blocks)} blocks of {block_n} keys), got {list(block_order)}")

    state = init_state((batch, heads_q, seqlen_q), head_dim_v, scale_log2)
    steps, states = [], []
    for i in order:
        n0, n1 = blocks[i]
        s = score_block(qh, kh[:, :, n0:n1], visible[:, n0:n1])
        state, step = update_state(state, s, vh[:, :, n0:n1], rescale_threshold=threshold,
                                   exp2=exp2, mistake=mistake)
        if trace:
            steps.append(step)
            states.append(state)
    out, lse = finalize(state, normalized=mistake == "normalize_early")
    out = out.transpose(0, 2, 1, 3)
    if trace:
        return OnlineTrace(out=out, lse=lse, blocks=[blocks[i] for i in order], steps=steps,
                           states=states, rescale_threshold=threshold, scale_log2=scale_log2)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------------
# Inputs that break the wrong variants, and their errors
# ----------------------------------------------------------------------------------------------

def adversarial_inputs(kind: str = "rising", *, batch: int = 1, seqlen_q: int = 16,
                       seqlen_k: int = 256, heads_q: int = 4, heads_kv: int = 2,
                       head_dim: int = 32, magnitude: float = 1e4, rng=None):
    """(q, k, v) float64 whose scores stress the state machine.

    "rising": scores grow with the key index (each block raises the max: every block needs a
    rescale); magnitude is the largest logit (after softmax_scale).
    "extreme": random logits of size ~magnitude (exp overflows without the max trick).
    """
    rng = np.random.default_rng(0) if rng is None else rng
    q = rng.standard_normal((batch, seqlen_q, heads_q, head_dim))
    k = rng.standard_normal((batch, seqlen_k, heads_kv, head_dim))
    v = rng.standard_normal((batch, seqlen_k, heads_kv, head_dim))
    scale = 1.0 / math.sqrt(head_dim)
    if kind == "rising":
        # q's first coordinate is 1 (others small), k's first coordinate ramps up with j:
        # score_j ~ magnitude * j / seqlen_k, rising across every block.
        q = 0.01 * q
        q[..., 0] = 1.0
        k = 0.01 * k
        k[:, :, :, 0] = (magnitude / scale) * (np.arange(1, seqlen_k + 1) / seqlen_k)[None, :,
                                                                                       None]
    elif kind == "extreme":
        q = q / np.linalg.norm(q, axis=-1, keepdims=True)
        k = k / np.linalg.norm(k, axis=-1, keepdims=True)
        q = q * math.sqrt(magnitude / scale)
        k = k * math.sqrt(magnitude / scale)
    else:
        raise ValueError(f"unknown kind {kind!r}; use 'rising' or 'extreme'")
    return q, k, v


def variant_errors(q, k, v, *, block_n: int = 64, causal: bool = False,
                   rescale_threshold: float = FA4_RESCALE_THRESHOLD) -> dict[str, float]:
    """Max |out - reference| for the correct state machine, its FA4 options and each mistake."""
    from fa4lab.reference import attention_reference

    ref = attention_reference(q, k, v, causal=causal)
    runs = {
        "online (threshold 0)": dict(),
        f"online (threshold {rescale_threshold:g})": dict(rescale_threshold=rescale_threshold),
        "online + exp2_poly3": dict(rescale_threshold=rescale_threshold, exp2=exp2_poly3),
    }
    runs.update({name: dict(mistake=name) for name in MISTAKES})
    errors = {}
    for name, kw in runs.items():
        out = online_attention(q, k, v, block_n=block_n, causal=causal, **kw)
        errors[name] = float(np.max(np.abs(out - ref)))
    return errors
