"""The float64 attention backward, written the way a FlashAttention backward computes it.

Given the forward's inputs q, k, v (and sink), its saved O and LSE, and the gradient dO of the
output (and optionally dLSE of the lse), it gives dQ, dK, dV and d(sink):

    P    = exp(S - LSE)                  recomputed from the scores, never stored
    D    = rowsum(dO * O)                one number per query row
    dV   = P^T dO                        dP = dO V^T
    dS   = P * (dP - D + dLSE)           Note [the FlashAttention backward]
    dQ   = scale * dS K                  dK = scale * dS^T Q

with every option of `fa4lab.reference`: the softcap's chain rule (Note [softcap backward]),
score_mod through autograd of the mod (Note [score_mod backward]), masks and empty rows (Note
[masked rows in the backward]), GQA (Note [GQA backward]), the learnable sink (Note [sink
backward]), varlen and paged K/V (per sequence, gradients scattered back: `scatter_paged`).

It is the ground truth a GPU backward kernel will be measured against, and what
`fa4lab.attention` differentiates on CPU tensors (`fa4lab.backward`). The tests hold it equal to
torch autograd through `fa4lab.reference` (Note [gradients of the reference]), which gradcheck
holds to finite differences.

    from fa4lab.reference_backward import attention_backward_reference
    dq, dk, dv, dsink = attention_backward_reference(q, k, v, dout, causal=True)

Constraints: torch tensors (one device) or numpy arrays, as `attention_reference` takes them;
the gradients are float64, numpy in -> numpy out. Not differentiable a second time, and aux
tensors (ALiBi slopes, a bias table) get no gradient: they are constants of the mod.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from fa4lab.reference import (
    apply_mods,
    attention_reference,
    capped_scores,
    check_attention_inputs,
    check_sink,
    kv_head_index,
    score_chunks,
    visible_mask,
)
from fa4lab.spec import check_softcap, effective_window, resolve_scale

__all__ = ["Gradients", "attention_backward_reference", "attention_varlen_backward_reference",
           "scatter_paged"]


class Gradients(NamedTuple):
    """dq, dk, dv like q, k, v (float64); dsink (heads_q,) float64, None without a sink."""

    dq: object
    dk: object
    dv: object
    dsink: object


# Note [the FlashAttention backward]
# Per query row i (one head), with s_j the scores of the visible keys:
#     lse_i = log sum_j e^{s_ij}      P_ij = e^{s_ij - lse_i}      O_i = sum_j P_ij V_j
# O is linear in V and P: dV_j = sum_i P_ij dO_i (dV = P^T dO) and dP_ij = dO_i . V_j
# (dP = dO V^T). The softmax's Jacobian dP_ij / ds_il = P_ij (delta_jl - P_il) gives
#     dS_il = sum_j dP_ij P_ij (delta_jl - P_il) = P_il (dP_il - sum_j P_ij dP_ij)
# and sum_j P_ij dP_ij = dO_i . sum_j P_ij V_j = dO_i . O_i =: D_i. So D is read from the saved
# O, one dot product per row, not from a second pass over P: a kernel computes D first (FA2's
# preprocessing), then walks the key blocks once, recomputing P = exp(S - LSE) from the saved
# LSE (no max, no sum: LSE already normalises). An lse the caller differentiates adds
# d lse_i / d s_ij = P_ij, so dS = P * (dP - D + dLSE). Finally s = scale * q.k:
# dQ = scale * dS K and dK = scale * dS^T Q.
#
# Note [softcap backward]
# With a softcap c the score is s = c * tanh(u / c) of the scaled score u, so
# ds / du = 1 - tanh^2(u / c) = 1 - (s / c)^2: the factor is read from the capped score itself
# (what a kernel has in registers), and dS is multiplied by it before dQ and dK.
#
# Note [score_mod backward]
# A score_mod rewrites the capped score s into s' = mod(s, b, h, q_idx, kv_idx). Every mod of
# fa4lab.mods is a function of the score alone at each grid point (ALiBi and relative_bias add a
# bias: ds'/ds = 1; a user mod may use tanh, exp2, where, ...), so ds = dS' * mod'(s). Rather
# than differentiating each mod by hand, the reference asks torch autograd for that
# vector-Jacobian product of the mod at the chunk's scores (one `torch.autograd.grad` of the mod
# alone; the rest of the backward stays explicit). The mask then zeroes what the mod may give
# at hidden keys. A GPU kernel needs the derivative as code (FlexAttention derives it by
# tracing the mod); mask_mod only masks and has no derivative.
#
# Note [masked rows in the backward]
# A key hidden by causal, a window or mask_mod has P = 0, so dV, dP's use and dS are 0 there:
# no gradient flows through it, and masks need nothing else. A row that sees no key (and no
# sink) has LSE -inf and O = 0; exp(S - LSE) would be exp(-inf + inf) = NaN, so P is set to 0
# on such rows instead (a kernel's empty row writes LSE -inf and skips the row's P the same
# way): D = 0 and the row gets dQ = 0. With a sink its LSE is the sink (finite) and P = 0 on
# every key anyway.
#
# Note [GQA backward]
# Query head h reads KV head g(h) = h // (heads_q // heads_kv); the KV head's K and V are used
# by each head of its group, so dK and dV of KV head g are the sums over the group's query
# heads (a kernel accumulates them across the group, or reduces per-head partials).
#
# Note [sink backward]
# A sink adds e^{t_h} to the denominator, a logit with no value: lse_i = log(sum_j e^{s_ij} +
# e^{t}), P_sink,i = e^{t - lse_i}, O_i = sum_j P_ij V_j (the sink's value is zero). Then
# d lse_i / dt = P_sink,i and dO_i / dt = sum_j V_j dP_ij / dt = -P_sink,i O_i (every P_ij is
# e^{s_ij - lse_i}), so
#     d(sink_h) = sum over the rows i of head h (every batch) of P_sink,i (dLSE_i - D_i),
# -sum P_sink D when the lse is not differentiated. A row that sees no key has O = 0, lse = t,
# P_sink = 1: its sink gets dLSE only. A sink of -inf (no sink on the head) gets 0.


def _as_torch(x):
    import torch

    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64))


def attention_backward_reference(q, k, v, dout, *, causal: bool = False,
                                 softmax_scale: float | None = None, window_size=(None, None),
                                 softcap: float = 0.0, learnable_sink=None, score_mod=None,
                                 mask_mod=None, aux_tensors=None, out=None, lse=None, dlse=None,
                                 finite: bool = True) -> Gradients:
    """Exact (float64) gradients of `attention_reference` with the same options.

    dout is the gradient of out (batch, seqlen_q, heads_q, head_dim_v); dlse (batch, heads_q,
    seqlen_q), the gradient of the lse, or None (the lse not used). out and lse are the
    forward's saved outputs; None recomputes them in float64 (pass float64 ones: P = exp(S -
    LSE) is as exact as the LSE it reads). Returns `Gradients(dq, dk, dv, dsink)`.
    """
    import torch

    kind = check_attention_inputs(q, k, v, finite)
    scale = resolve_scale(softmax_scale, int(q.shape[-1]))
    effective_window(causal, window_size)
    softcap = check_softcap(softcap)
    sink = check_sink(learnable_sink, q, kind)
    if kind == "numpy":
        tq, tk, tv, tdo = (_as_torch(t) for t in (q, k, v, dout))
        tout, tlse, tdlse = (None if t is None else _as_torch(t) for t in (out, lse, dlse))
    else:
        tq, tk, tv, tdo = (t.detach().to(torch.float64) for t in (q, k, v, dout))
        tout, tlse, tdlse = (None if t is None else t.detach().to(torch.float64)
                             for t in (out, lse, dlse))
    if sink is not None:
        sink = sink.detach()
    batch, seqlen_q, heads_q, _ = tq.shape
    seqlen_k = tk.shape[1]
    if tuple(tdo.shape) != (batch, seqlen_q, heads_q, tv.shape[-1]):
        raise ValueError(f"dout has shape {tuple(tdo.shape)}; out's is "
                         f"{(batch, seqlen_q, heads_q, tv.shape[-1])}")
    if tdlse is not None and tuple(tdlse.shape) != (batch, heads_q, seqlen_q):
        raise ValueError(f"dlse has shape {tuple(tdlse.shape)}; lse's is "
                         f"{(batch, heads_q, seqlen_q)}")
    if batch * seqlen_q * seqlen_k == 0:
        grads = _no_key_gradients(tq, tk, tv, sink, tdlse)
    else:
        from fa4lab.mods import check_mods

        mods, aux = check_mods(score_mod, mask_mod, aux_tensors, tq.device)
        aux = tuple(t.detach().to(torch.float64) if t.is_floating_point() else t for t in aux)
        if tout is None or tlse is None:
            tout, tlse = attention_reference(
                tq, tk, tv, causal=causal, softmax_scale=scale, return_lse=True,
                window_size=window_size, softcap=softcap, learnable_sink=sink,
                score_mod=score_mod, mask_mod=mask_mod, aux_tensors=aux_tensors, finite=finite)
        with torch.no_grad():
            grads = _backward_torch(tq, tk, tv, tout, tlse, tdo, tdlse, causal=bool(causal),
                                    scale=scale, window_size=window_size, softcap=softcap,
                                    sink=sink, mods=mods, aux=aux)
    if kind == "numpy":
        grads = Gradients(*(None if g is None else g.numpy() for g in grads))
    return grads


def _no_key_gradients(q, k, v, sink, dlse) -> Gradients:
    """Gradients of a call where no row sees a key (no query, no key or an empty batch): out 0,
    lse -inf or the sink, so only the sink has a gradient: dLSE summed over its rows."""
    import torch

    dsink = None
    if sink is not None:
        dsink = torch.zeros_like(sink)
        if dlse is not None:
            dsink = torch.where(torch.isinf(sink), dsink, dlse.sum(dim=(0, 2)))
    return Gradients(torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dsink)


def _backward_torch(q, k, v, out, lse, dout, dlse, *, causal: bool, scale: float,
                    window_size, softcap: float, sink, mods, aux: tuple) -> Gradients:
    """float64 torch tensors in, `Gradients` out: Note [the FlashAttention backward] chunk by
    chunk, the forward's chunks (`fa4lab.reference.score_chunks`)."""
    import torch

    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    dev = q.device
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dsink = None if sink is None else torch.zeros_like(sink)
    kv_of = torch.as_tensor(kv_head_index(heads_q, heads_kv), device=dev)
    mask = torch.as_tensor(visible_mask(seqlen_q, seqlen_k, causal, window_size=window_size),
                           device=dev)
    for b, heads, rows in score_chunks(batch, seqlen_q, heads_q, seqlen_k):
        q_c = q[b, rows, heads]                     # (qc, hc, d)
        kb = k[b][:, kv_of[heads]]                  # (seqlen_k, hc, d): each query head's K
        vb = v[b][:, kv_of[heads]]
        do_c, o_c = dout[b, rows, heads], out[b, rows, heads]   # (qc, hc, dv)
        lse_c = lse[b, heads, rows][..., None]      # (hc, qc, 1)
        dlse_c = 0.0 if dlse is None else dlse[b, heads, rows][..., None]

        # The forward's scores, recomputed: scaled, capped, modded, masked.
        s_capped = capped_scores(q_c, kb, scale, softcap)
        visible = mask[rows]
        s, s_in = s_capped, None
        if mods:
            with torch.enable_grad():   # Note [score_mod backward]: the mod's own derivative
                s_in = s_capped.clone().requires_grad_(mods.score_mod is not None)
                s, visible = apply_mods(mods, aux, s_in, visible, b, heads, rows, seqlen_k)
        visible = torch.broadcast_to(visible, s.shape)

        # P from the saved LSE (Note [masked rows in the backward]: 0 on hidden keys and on
        # rows that see no key, whose LSE is -inf).
        seen = torch.isfinite(lse_c)
        lse_safe = torch.where(seen, lse_c, torch.zeros_like(lse_c))
        p = torch.where(visible & seen, torch.exp(s.detach() - lse_safe), torch.zeros_like(s))

        d_row = (do_c * o_c).sum(dim=-1).transpose(0, 1)[..., None]     # D: (hc, qc, 1)
        dv_c = torch.einsum("hqk,qhd->khd", p, do_c)                    # P^T dO
        dp = torch.einsum("qhd,khd->hqk", do_c, vb)                     # dO V^T
        ds = p * (dp - d_row + dlse_c)
        if s_in is not None and s_in.requires_grad:
            (ds,) = torch.autograd.grad(s, s_in, ds)
            ds = torch.where(visible, ds, torch.zeros_like(ds))
        if softcap:                                 # Note [softcap backward]
            ds = ds * (1.0 - (s_capped / softcap) ** 2)

        dq[b, rows, heads] = scale * torch.einsum("hqk,khd->qhd", ds, kb)
        dk_c = scale * torch.einsum("hqk,qhd->khd", ds, q_c)
        dk[b].index_add_(1, kv_of[heads], dk_c)     # Note [GQA backward]
        dv[b].index_add_(1, kv_of[heads], dv_c)
        if sink is not None:                        # Note [sink backward]
            p_sink = torch.where(seen, torch.exp(sink[heads][:, None, None] - lse_safe),
                                 torch.zeros_like(lse_c))
            dsink[heads] += (p_sink * (dlse_c - d_row)).sum(dim=(1, 2))
    return Gradients(dq, dk, dv, dsink)


def scatter_paged(grads, page_table, cache_shape):
    """The adjoint of `fa4lab.varlen.gather_paged`: sequence b's gradient grads[b] (n_b, heads,
    d), added into a float64 zero cache of `cache_shape` (num_pages, page_size, heads, d) at
    the slots gather_paged read (page ids clamped as it clamps them; a page that serves several
    sequences sums their gradients)."""
    import torch

    num_pages, page_size = int(cache_shape[0]), int(cache_shape[1])
    flat = torch.zeros((num_pages * page_size, *cache_shape[2:]), dtype=torch.float64,
                       device=page_table.device)
    for b, g in enumerate(grads):
        n = int(g.shape[0])
        if n == 0:
            continue
        token = torch.arange(n, device=page_table.device)
        pages = page_table[b].long()[token // page_size].clamp(0, num_pages - 1)
        flat.index_add_(0, pages * page_size + token % page_size, g.to(torch.float64))
    return flat.view(*cache_shape)


def attention_varlen_backward_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, dout, *,
                                        seqused_k=None, page_table=None, causal: bool = False,
                                        softmax_scale: float | None = None,
                                        window_size=(None, None), softcap: float = 0.0,
                                        learnable_sink=None, dlse=None,
                                        finite: bool = True) -> Gradients:
    """Exact (float64) gradients of `attention_varlen_reference` with the same layout and
    options: each sequence's `attention_backward_reference`, dK / dV added back where its keys
    came from (the packed rows, or the pages: `scatter_paged`). dout (total_q, heads_q,
    head_dim_v); dlse (heads_q, total_q) or None. dk, dv have k's and v's shapes (the cache's
    with a page_table); torch tensors only."""
    import torch

    from fa4lab.reference import _hide_every_key
    from fa4lab.varlen import check_varlen, sequence_kv, unpack

    lengths = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, None, None, seqused_k,
                           page_table)
    sink = check_sink(learnable_sink, q[None], "torch")
    dq = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    dsink = None if sink is None else torch.zeros_like(sink.detach())
    dk_seqs, dv_seqs = [], []
    starts = lengths.cu_seqlens_q
    for b, (q_b, (k_b, v_b)) in enumerate(zip(unpack(q, starts),
                                               sequence_kv(lengths, k, v, page_table))):
        n_k = k_b.shape[0]
        rows = slice(starts[b], starts[b + 1])
        dk_seqs.append(k_b.new_zeros(k_b.shape, dtype=torch.float64))
        dv_seqs.append(v_b.new_zeros(v_b.shape, dtype=torch.float64))
        if q_b.shape[0] == 0:
            continue
        mask_mod = None
        if n_k == 0:    # the forward's stand-in key that every row is denied
            k_b, v_b = k_b.new_zeros((1, *k_b.shape[1:])), v_b.new_zeros((1, *v_b.shape[1:]))
            mask_mod = _hide_every_key
        g = attention_backward_reference(
            q_b[None], k_b[None], v_b[None], dout[rows][None], causal=causal,
            softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
            learnable_sink=learnable_sink, mask_mod=mask_mod,
            dlse=None if dlse is None else dlse[:, rows][None], finite=finite)
        dq[rows] = g.dq[0]
        if n_k:
            dk_seqs[b], dv_seqs[b] = g.dk[0], g.dv[0]
        if dsink is not None:
            dsink += g.dsink
    if page_table is not None:
        dk, dv = (scatter_paged(gs, page_table, x.shape) for gs, x in ((dk_seqs, k),
                                                                        (dv_seqs, v)))
    else:
        dk = torch.zeros(k.shape, dtype=torch.float64, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float64, device=v.device)
        for s0, n, gk, gv in zip(lengths.k_starts, lengths.seqlens_k, dk_seqs, dv_seqs):
            dk[s0:s0 + n] += gk
            dv[s0:s0 + n] += gv
    return Gradients(dq, dk, dv, dsink)
