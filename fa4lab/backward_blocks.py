"""The FlashAttention backward block by block: the loop a backward kernel runs, in numpy.

`backward_step` is one (query block, key block) step, the five MMAs of Note [the FlashAttention
backward] (fa4lab.reference_backward) on one tile; `backward_blockwise` walks a whole problem
the way FA2, FA3 and FA4 schedule it (Note [key blocks outside]): the outer loop over key
blocks, each one's dK and dV accumulated in place (registers on Hopper, TMEM on a B200) and
written once, dQ added into a buffer shared by every key block.

    from fa4lab.backward_blocks import backward_blockwise
    dq, dk, dv, _ = backward_blockwise(q, k, v, dout, causal=True, block_m=4, block_n=4)

float64 by default, held equal to `fa4lab.reference_backward` by the tests; `dq_dtype=float32`
and `key_order=` show why the order of dQ's additions matters (Note [dQ's order of additions]).
Options: causal, a sliding window, GQA; softcap, the sink, mods and varlen are the reference's
(this walk is the lesson, not a second reference). numpy arrays in the reference's layout,
(batch, seqlen, heads, head_dim).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from fa4lab.reference import attention_reference, kv_head_index, visible_mask
from fa4lab.reference_backward import Gradients
from fa4lab.spec import resolve_scale

__all__ = ["backward_step", "backward_blockwise", "row_d", "block_pairs"]


def row_d(dout: np.ndarray, out: np.ndarray) -> np.ndarray:
    """D = rowsum(dO * O): one number per query row (the last axis summed), the only use of the
    forward's O in the backward (FA2's preprocessing pass)."""
    return np.sum(np.asarray(dout, dtype=np.float64) * np.asarray(out, dtype=np.float64),
                  axis=-1)


def backward_step(q, k, v, dout, lse, d_row, softmax_scale: float, visible):
    """One (query block, key block) step: (dq, dk, dv), this tile's contributions.

    q (m, d), dout (m, dv), lse (m,), d_row (m,) of the block's query rows; k (n, d), v (n, dv)
    of its keys; visible (m, n) the mask. dq (m, d) is added into dQ's buffer, dk (n, d) and
    dv (n, dv) into the key block's accumulators.
    """
    s = softmax_scale * (q @ k.T)                       # MMA 1: S = scale * Q K^T
    seen = np.isfinite(lse)                             # a row that sees no key: LSE = -inf
    show = visible & seen[:, None]
    p = np.zeros_like(s)                                # P from the saved LSE: no max, no sum
    p[show] = np.exp((s - np.where(seen, lse, 0.0)[:, None])[show])
    dv = p.T @ dout                                     # MMA 2: dV += P^T dO
    dp = dout @ v.T                                     # MMA 3: dP = dO V^T
    ds = p * (dp - d_row[:, None])                      # dS = P * (dP - D), D per query row
    dq = softmax_scale * (ds @ k)                       # MMA 4: dQ += scale * dS K
    dk = softmax_scale * (ds.T @ q)                     # MMA 5: dK += scale * dS^T Q
    return dq, dk, dv


# Note [key blocks outside]
# The backward's loop nest is the forward's turned inside out. The forward gives each query
# block to one CTA and streams the key blocks past it: O and the softmax state stay on chip.
# The backward has three outputs: dK and dV are sums over query rows (dV_j = sum_i P_ij dO_i),
# dQ a sum over keys. FA2, FA3 and FA4 give each KEY block to one CTA (upstream's backward
# schedules tiles by n_block) and stream the query blocks past it: dK and dV accumulate on chip
# and are written once, at the end. dQ is the price: every key block adds a partial dQ for every
# query block it visits, so the partials of one query block come from many CTAs at different
# times. They meet in a float32 buffer in global memory (dQ_accum), which a last pass converts
# to dQ's dtype (Note [accumulating dQ] in fa4lab.backward_budget).
#
# Note [dQ's order of additions]
# Floating-point addition is not associative: the same partials added in another order round
# differently. With atomic adds the order is whichever CTA arrives first, so two runs of the
# same backward can differ in dQ's last bits; a deterministic mode fixes the order (upstream's
# `deterministic=True` makes the CTAs of one query block take turns by key block, through a
# semaphore in global memory). `backward_blockwise(dq_dtype=np.float32, key_order=...)` shows
# the effect: float32 partials, added in two orders, give two dQs.


def block_pairs(visible: np.ndarray, block_m: int, block_n: int) -> list[tuple[int, list[int]]]:
    """[(key block, [query blocks it visits])], key blocks ascending: the (query block, key
    block) tiles with at least one visible element, as a kernel's block ranges skip the rest."""
    seqlen_q, seqlen_k = visible.shape
    out = []
    for j, n0 in enumerate(range(0, seqlen_k, block_n)):
        rows = [i for i, m0 in enumerate(range(0, seqlen_q, block_m))
                if visible[m0:m0 + block_m, n0:n0 + block_n].any()]
        out.append((j, rows))
    return out


def backward_blockwise(q, k, v, dout, out=None, lse=None, *, causal: bool = False,
                       softmax_scale: float | None = None, window_size=(None, None),
                       block_m: int = 128, block_n: int = 128, step: Callable = backward_step,
                       dq_dtype=np.float64, key_order: Sequence[int] | None = None) -> Gradients:
    """`Gradients(dq, dk, dv, None)` of attention, computed tile by tile (Note [key blocks
    outside]): for each key block (in `key_order`, default ascending) and each query block it
    sees, `step(...)`; dK and dV of the key block summed in place and stored once, dQ added into
    a `dq_dtype` buffer. out and lse are the forward's (None: the float64 reference's); D is
    computed once from them (`row_d`). GQA: each query head's dK and dV go to its KV head.
    """
    q, k, v, dout = (np.asarray(x, dtype=np.float64) for x in (q, k, v, dout))
    scale = resolve_scale(softmax_scale, q.shape[-1])
    if out is None or lse is None:
        out, lse = attention_reference(q, k, v, causal=causal, softmax_scale=scale,
                                       window_size=window_size, return_lse=True)
    out, lse = np.asarray(out, dtype=np.float64), np.asarray(lse, dtype=np.float64)
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    visible = visible_mask(seqlen_q, seqlen_k, causal, window_size=window_size)
    pairs = dict(block_pairs(visible, block_m, block_n))
    order = list(pairs) if key_order is None else [int(j) for j in key_order]
    if sorted(order) != list(pairs):
        raise ValueError(f"key_order must visit each of the {len(pairs)} key blocks once; got "
                         f"{order}")
    d_all = row_d(dout, out)                            # (batch, seqlen_q, heads_q)
    kv_of = kv_head_index(heads_q, heads_kv)
    dq_accum = np.zeros(q.shape, dtype=dq_dtype)
    dk, dv = np.zeros(k.shape), np.zeros(v.shape)
    for b in range(batch):
        for h in range(heads_q):
            g = kv_of[h]
            for j in order:                             # one CTA per key block
                keys = slice(j * block_n, (j + 1) * block_n)
                acc_dk = np.zeros((len(range(seqlen_k)[keys]), k.shape[-1]))
                acc_dv = np.zeros((acc_dk.shape[0], v.shape[-1]))
                for i in pairs[j]:                      # the query blocks this key block sees
                    rows = slice(i * block_m, (i + 1) * block_m)
                    dq, dk_part, dv_part = step(
                        q[b, rows, h], k[b, keys, g], v[b, keys, g], dout[b, rows, h],
                        lse[b, h, rows], d_all[b, rows, h], scale, visible[rows, keys])
                    acc_dk += dk_part
                    acc_dv += dv_part
                    dq_accum[b, rows, h] += np.asarray(dq).astype(dq_dtype)   # "atomic" add
                dk[b, keys, g] += acc_dk                # stored once per key block
                dv[b, keys, g] += acc_dv                # (+=: the query heads of a GQA group)
    return Gradients(dq_accum.astype(np.float64), dk, dv, None)
