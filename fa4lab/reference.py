"""The float64 attention reference: the ground truth every test and notebook compares against.

What it computes (the math contract, see `fa4lab.spec` and notebook 01):

    O[b, i, h]   = sum_j softmax_j(softmax_scale * q[b, i, h] . k[b, j, g(h)]) v[b, j, g(h)]
    lse[b, h, i] = log(sum_j exp(softmax_scale * q[b, i, h] . k[b, j, g(h)]))   (natural log)

over the keys j visible to query i, with g(h) = h // (heads_q // heads_kv) (GQA; MQA when
heads_kv == 1). causal=True is bottom-right aligned: query i sees key j iff
j <= i + seqlen_k - seqlen_q. A row that sees no key gives O = 0 and lse = -inf, never NaN.

The options of upstream FA4 (semantics in `fa4lab.spec`): `window_size=(left, right)` limits
the visible keys to i + d - left <= j <= i + d + right (d = seqlen_k - seqlen_q, None = that
side unbounded, causal is right = 0); `softcap > 0` replaces each score s by
softcap * tanh(s / softcap); `learnable_sink` (heads_q,) adds e^{sink[h]} to every softmax
denominator of head h (no value), so lse = log(sum_j e^{s_ij} + e^{sink[h]}) and a row that sees
no key gives O = 0 and lse = sink[h].

FlexAttention-style mods (`fa4lab.mods`): `score_mod(score, b, h, q_idx, kv_idx[, aux])` rewrites
each scaled (and capped) score, `mask_mod(b, h, q_idx, kv_idx[, aux])` hides the keys where it is
False, ANDed with causal and the window (Note [order of score transforms] in `fa4lab.mods`).
The reference calls each mod once per chunk, on index tensors that broadcast over the chunk's
(heads, queries, keys) grid, with float64 scores and the float aux tensors in float64.

Constraints: q (batch, seqlen_q, heads_q, head_dim), k (batch, seqlen_k, heads_kv, head_dim),
v (batch, seqlen_k, heads_kv, head_dim_v), all floating point and finite; all numpy arrays or
all torch tensors (on one device). The answer is always float64: numpy in gives numpy out,
torch in gives a float64 torch tensor on the input's device (cast it yourself if you want the
input dtype; a reference that rounds to bf16 would hide the error it is meant to measure).

How: one code path in torch (numpy inputs are wrapped without a copy where possible). Scores
are materialised a chunk of (batch, heads, queries) at a time, at most `_SCORE_BUDGET`
elements, so a (1, 8192, 16, 128) problem on a GPU never holds all heads' S at once.

    from fa4lab.reference import attention_reference
    out, lse = attention_reference(q, k, v, causal=True, return_lse=True)
    out = attention_reference(q, k, v, window_size=(128, 0), softcap=30.0, learnable_sink=sink)
    out = attention_reference(q, k, v, score_mod=mod, mask_mod=mask, aux_tensors=(slopes,))
"""

from __future__ import annotations

import math

import numpy as np

from fa4lab.errors import check_same_device
from fa4lab.spec import (
    check_qkv_shapes,
    check_sink_shape,
    check_softcap,
    effective_window,
    resolve_scale,
)

# At most this many float64 scores live at once (2**25 * 8 B = 256 MiB, plus a few same-sized
# temporaries). Large enough that small problems run in one chunk.
_SCORE_BUDGET = 2**25

__all__ = ["attention_reference", "attention_varlen_reference", "visible_mask",
           "check_attention_inputs", "check_sink", "resolve_scale", "kv_head_index"]


def visible_mask(seqlen_q: int, seqlen_k: int, causal: bool, *,
                 window_size=(None, None)) -> np.ndarray:
    """Bool (seqlen_q, seqlen_k): True where query i may attend to key j.

    Without causal or a window every key is visible. With causal the diagonal is aligned to the
    bottom right: query i sees key j iff j <= i + seqlen_k - seqlen_q, so when seqlen_q >
    seqlen_k the first seqlen_q - seqlen_k queries see no key at all. A window (left, right)
    keeps i + d - left <= j <= i + d + right (d = seqlen_k - seqlen_q, None = unbounded; causal
    is right = 0; see Note [window and causal] in `fa4lab.spec`).
    """
    seqlen_q, seqlen_k = int(seqlen_q), int(seqlen_k)
    if seqlen_q < 1 or seqlen_k < 1:
        raise ValueError(f"seqlen_q and seqlen_k must be >= 1, got {seqlen_q}, {seqlen_k}")
    left, right = effective_window(causal, window_size)
    if left is None and right is None:
        return np.ones((seqlen_q, seqlen_k), dtype=bool)
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    diag = i + (seqlen_k - seqlen_q)
    mask = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if right is not None:
        mask &= j <= diag + right
    if left is not None:
        mask &= j >= diag - left
    return mask


def kv_head_index(heads_q: int, heads_kv: int) -> np.ndarray:
    """The KV head each query head reads: h // (heads_q // heads_kv) (grouped, as in FA4)."""
    if heads_q % heads_kv:
        raise ValueError(f"heads_q={heads_q} is not a multiple of heads_kv={heads_kv}")
    return np.arange(heads_q) // (heads_q // heads_kv)



def _is_torch(t) -> bool:
    mod = type(t).__module__
    return mod.startswith("torch") and hasattr(t, "is_floating_point")


def check_attention_inputs(q, k, v, finite: bool = True) -> str:
    """Shapes (via `fa4lab.spec.check_qkv_shapes`), dtype kind and (with `finite`) finiteness
    of q, k, v.

    Returns "torch" or "numpy", the kind all three share. Raises TypeError for a mix of kinds
    or a non-floating dtype and ValueError (naming the tensor) for a bad shape or a NaN/inf.
    """
    kinds = {name: ("torch" if _is_torch(t) else "numpy") for name, t in (("q", q), ("k", k),
                                                                          ("v", v))}
    if len(set(kinds.values())) != 1:
        raise TypeError(f"q, k and v must all be numpy arrays or all torch tensors, got {kinds}; "
                        f"convert with torch.from_numpy(x) or t.cpu().numpy()")
    kind = kinds["q"]
    if kind == "numpy":
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, np.ndarray):
                raise TypeError(f"{name} must be a numpy array or torch tensor, got "
                                f"{type(t).__name__}; wrap it with np.asarray({name})")
    check_qkv_shapes(q, k, v)
    if kind == "torch":
        devices = {str(t.device) for t in (q, k, v)}
        if len(devices) != 1:
            raise ValueError(f"q, k and v are on different devices {sorted(devices)}: move them "
                             f"to one device with .to(device)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if kind == "torch":
            floating = t.is_floating_point()
        else:
            floating = np.issubdtype(t.dtype, np.floating)
        if not floating:
            raise TypeError(f"{name} has dtype {t.dtype}: attention needs a real floating-point "
                            f"dtype (float16/bfloat16/float32/float64); cast with .astype/.to")
        if not finite:
            continue
        ok = bool(t.isfinite().all()) if kind == "torch" else bool(np.isfinite(t).all())
        if not ok:
            raise ValueError(f"{name} contains NaN or inf: the reference needs finite inputs "
                             f"(check how {name} was produced)")
    return kind


def check_sink(learnable_sink, q, kind: str):
    """The reference's check of a sink: None, or a finite (or -inf) floating (heads_q,) array of
    the same kind as q (numpy or torch, on q's device). Returns it as float64 torch on q's
    device (None stays None). -inf for a head means no sink (e^-inf = 0)."""
    if learnable_sink is None:
        return None
    import torch

    sink_kind = "torch" if _is_torch(learnable_sink) else "numpy"
    if sink_kind != kind or (kind == "numpy" and not isinstance(learnable_sink, np.ndarray)):
        like = "a torch tensor" if kind == "torch" else "a numpy array"
        raise TypeError(f"learnable_sink must be {like} like q, got "
                        f"{type(learnable_sink).__name__}; convert it with "
                        f"{'torch.as_tensor(sink)' if kind == 'torch' else 'np.asarray(sink)'}")
    check_sink_shape(learnable_sink, int(q.shape[2]))
    if kind == "torch":
        check_same_device("learnable_sink", learnable_sink.device, "q", q.device)
        floating = learnable_sink.is_floating_point()
    else:
        floating = np.issubdtype(learnable_sink.dtype, np.floating)
    if not floating:
        raise TypeError(f"learnable_sink has dtype {learnable_sink.dtype}: sink logits are "
                        f"floating point; cast with .float() / .astype(np.float32)")
    sink = (learnable_sink.to(torch.float64) if kind == "torch"
            else torch.from_numpy(np.asarray(learnable_sink, dtype=np.float64)))
    if torch.isnan(sink).any() or (sink == math.inf).any():
        raise ValueError("learnable_sink contains NaN or +inf: each sink is a finite logit "
                         "(or -inf for no sink on that head)")
    return sink


# Note [gradients of the reference]
# The reference is differentiable: torch autograd through it gives dQ, dK, dV and d(sink) of
# the float64 function it computes, the second opinion `fa4lab.reference_backward` (the explicit
# FlashAttention backward) is tested against, and what gradcheck checks against finite
# differences. Three details keep that gradient the true one, NaN-free:
#   * the row max m is a stabiliser, not a term: out and lse = m + log(sum_j e^{s_j - m}) are
#     the same for every m, so m is detached (d lse / d s_j = e^{s_j - m} / sum = P_j exactly,
#     with no +m -m pair for autograd to cancel in floating point);
#   * a masked score is -inf, e^{-inf - m} = 0, and masked_fill sends it no gradient;
#   * a row that sees no key (and no sink) has row_sum 0: its lse is -inf by a `where`, and the
#     log reads 1 there, so no 1/0 reaches the gradient (d lse = 0: lse is a constant there).


def _attention_torch(q, k, v, *, causal: bool, scale: float, window_size=(None, None),
                     softcap: float = 0.0, sink=None, mods=None, aux: tuple = ()):
    """float64 torch tensors in, (out, lse) float64 out. Chunked over batch, heads, queries
    (`score_chunks`); differentiable in q, k, v and sink (Note [gradients of the reference]).

    `sink` is None or float64 (heads_q,) on q's device (`check_sink`); `mods` a
    `fa4lab.mods.KernelMods` (or None) whose functions read `aux`."""
    import torch

    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    head_dim_v = v.shape[-1]
    dev = q.device
    out = torch.zeros((batch, seqlen_q, heads_q, head_dim_v), dtype=torch.float64, device=dev)
    lse = torch.full((batch, heads_q, seqlen_q), -math.inf, dtype=torch.float64, device=dev)
    kv_of = torch.as_tensor(kv_head_index(heads_q, heads_kv), device=dev)
    mask = torch.as_tensor(visible_mask(seqlen_q, seqlen_k, causal, window_size=window_size),
                           device=dev)

    for b, heads, rows in score_chunks(batch, seqlen_q, heads_q, seqlen_k):
        kb = k[b][:, kv_of[heads]]          # (seqlen_k, hc, head_dim)
        vb = v[b][:, kv_of[heads]]          # (seqlen_k, hc, head_dim_v)
        s = capped_scores(q[b, rows, heads], kb, scale, softcap)
        visible = mask[rows]
        if mods:
            s, visible = apply_mods(mods, aux, s, visible, b, heads, rows, seqlen_k)
        s = s.masked_fill(~visible, -math.inf)
        # The row max only keeps exp in range: out and lse do not depend on it, so neither does
        # their gradient (Note [gradients of the reference]).
        row_max = s.amax(dim=-1, keepdim=True).detach()
        if sink is not None:
            sink_h = sink[heads][:, None, None]          # (hc, 1, 1)
            row_max = torch.maximum(row_max, sink_h.detach())
        # A fully masked row has max -inf; subtract 0 there so exp gives 0, not NaN.
        row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        p = torch.exp(s - row_max)
        row_sum = p.sum(dim=-1, keepdim=True)
        if sink is not None:
            row_sum = row_sum + torch.exp(sink_h - row_max)
        o = torch.einsum("hqk,khd->qhd", p, vb)
        seen = row_sum > 0
        denom = torch.where(seen, row_sum, torch.ones_like(row_sum))
        out[b, rows, heads] = o / denom.squeeze(-1).transpose(0, 1)[..., None]
        row_lse = torch.where(seen, row_max + torch.log(denom), -math.inf)
        lse[b, heads, rows] = row_lse.squeeze(-1)
    return out, lse


def score_chunks(batch: int, seqlen_q: int, heads_q: int, seqlen_k: int):
    """(b, heads, rows) slices of the (batch, heads_q, seqlen_q) rows, each chunk's scores at
    most `_SCORE_BUDGET` elements: as many heads as fit with all queries, else one head and a
    slice of queries. The forward and `fa4lab.reference_backward` walk the same chunks."""
    per_head = seqlen_q * seqlen_k
    head_chunk = max(1, min(heads_q, _SCORE_BUDGET // per_head))
    q_chunk = seqlen_q if head_chunk > 1 or per_head <= _SCORE_BUDGET else max(
        1, _SCORE_BUDGET // seqlen_k)
    for b in range(batch):
        for h0 in range(0, heads_q, head_chunk):
            for i0 in range(0, seqlen_q, q_chunk):
                yield (b, slice(h0, min(heads_q, h0 + head_chunk)),
                       slice(i0, min(seqlen_q, i0 + q_chunk)))


def capped_scores(q_rows, k_heads, scale: float, softcap: float):
    """(hc, qc, seqlen_k) scores of one chunk: softmax_scale * q.k, then the softcap
    softcap * tanh(s / softcap) when softcap > 0 (Note [order of score transforms] in
    fa4lab.mods). q_rows (qc, hc, d), k_heads (seqlen_k, hc, d): each query head's K."""
    import torch

    s = torch.einsum("qhd,khd->hqk", q_rows, k_heads) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return s


def apply_mods(mods, aux: tuple, s, visible, b: int, heads: slice, rows: slice,
               seqlen_k: int):
    """(score_mod(s), visible & mask_mod) on one chunk: s (hc, qc, seqlen_k) float64, indices
    int64 shaped (1, 1, 1), (hc, 1, 1), (1, qc, 1), (1, 1, seqlen_k) to broadcast over it."""
    import torch

    dev = s.device
    bi = torch.full((1, 1, 1), b, dtype=torch.int64, device=dev)
    hi = torch.arange(heads.start, heads.stop, device=dev)[:, None, None]
    qi = torch.arange(rows.start, rows.stop, device=dev)[None, :, None]
    ki = torch.arange(seqlen_k, device=dev)[None, None, :]
    if mods.score_mod is not None:
        s = torch.broadcast_to(mods.score(s, bi, hi, qi, ki, aux).to(torch.float64), s.shape)
    if mods.mask_mod is not None:
        visible = visible & mods.mask(bi, hi, qi, ki, aux)
    return s, visible


def attention_reference(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
                        return_lse: bool = False, window_size=(None, None), softcap: float = 0.0,
                        learnable_sink=None, score_mod=None, mask_mod=None, aux_tensors=None,
                        finite: bool = True):
    """Exact (float64) attention forward; returns out, or (out, lse) when return_lse.

    out: (batch, seqlen_q, heads_q, head_dim_v) float64; lse: (batch, heads_q, seqlen_q)
    float64, natural log, -inf for rows that see no key (sink[h] with a sink). numpy in ->
    numpy out; torch in -> float64 torch out on the same device. window_size=(left, right)
    (None = unbounded), softcap (0.0 = off) and learnable_sink ((heads_q,) or None) have
    upstream FA4's semantics: see the module docstring and `fa4lab.spec`. score_mod, mask_mod
    and aux_tensors (torch tensors on q's device; on the CPU for numpy inputs) are
    `fa4lab.mods`'s, checked by `fa4lab.mods.check_mods`. q, k, v must be finite (a NaN or
    inf raises ValueError) unless `finite` is False: then they flow through the arithmetic as
    they would through a kernel (`fa4lab.attention`'s CPU path: Note [the same rules on CPU
    and GPU] in fa4lab.api.dense).
    """
    kind = check_attention_inputs(q, k, v, finite)
    scale = resolve_scale(softmax_scale, int(q.shape[-1]))
    effective_window(causal, window_size)       # checks window_size against causal
    softcap = check_softcap(softcap)
    import torch

    if kind == "numpy":
        tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(t, dtype=np.float64))
                      for t in (q, k, v))
    else:
        tq, tk, tv = (t.to(torch.float64) for t in (q, k, v))
    sink = check_sink(learnable_sink, q, kind)
    from fa4lab.mods import check_mods

    mods, aux = check_mods(score_mod, mask_mod, aux_tensors, tq.device)
    aux = tuple(t.to(torch.float64) if t.is_floating_point() else t for t in aux)
    out, lse = _attention_torch(tq, tk, tv, causal=bool(causal), scale=scale,
                                window_size=window_size, softcap=softcap, sink=sink,
                                mods=mods, aux=aux)
    if kind == "numpy":
        out, lse = out.numpy(), lse.numpy()
    return (out, lse) if return_lse else out


def _hide_every_key(b, h, q_idx, kv_idx):
    """A mask_mod under which no row sees any key."""
    return kv_idx < 0


def attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, *, seqused_k=None,
                               page_table=None, causal: bool = False,
                               softmax_scale: float | None = None, window_size=(None, None),
                               softcap: float = 0.0, learnable_sink=None,
                               return_lse: bool = False, finite: bool = True):
    """Exact (float64) attention of a variable-length batch; out, or (out, lse); `finite` as
    `attention_reference`'s.

    The layout is `fa4lab.varlen`'s (checked by `fa4lab.varlen.check_varlen`): q (total_q,
    heads_q, head_dim) packed, k / v packed (total_k, heads_kv, d) with cu_seqlens_k, or with a
    page_table the paged cache (num_pages, page_size, heads_kv, d) and cu_seqlens_k None.
    Each sequence is `attention_reference` of its own queries and keys (seqused_k applied), so
    every option keeps its meaning per sequence (bottom-right causal on that sequence's
    lengths). out (total_q, heads_q, head_dim_v) float64, lse (heads_q, total_q) float64 on
    q's device; an empty sequence has no rows, and a sequence with no key gives its rows what
    a row that sees no key gets (out 0, lse -inf or the sink).
    """
    import torch

    from fa4lab.varlen import check_varlen, sequence_kv, unpack

    lengths = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, None, None, seqused_k,
                           page_table)
    total_q, heads_q = q.shape[0], q.shape[1]
    out = torch.zeros((total_q, heads_q, v.shape[-1]), dtype=torch.float64, device=q.device)
    lse = torch.full((heads_q, total_q), -math.inf, dtype=torch.float64, device=q.device)
    starts = lengths.cu_seqlens_q
    for b, (q_b, (k_b, v_b)) in enumerate(zip(unpack(q, starts),
                                               sequence_kv(lengths, k, v, page_table))):
        if q_b.shape[0] == 0:
            continue
        mask_mod = None
        if k_b.shape[0] == 0:
            # One stand-in key that every row is denied: the rows get the reference's own
            # answer for a row that sees no key.
            k_b, v_b = k_b.new_zeros((1, *k_b.shape[1:])), v_b.new_zeros((1, *v_b.shape[1:]))
            mask_mod = _hide_every_key
        o_b, lse_b = attention_reference(
            q_b[None], k_b[None], v_b[None], causal=causal, softmax_scale=softmax_scale,
            window_size=window_size, softcap=softcap, learnable_sink=learnable_sink,
            mask_mod=mask_mod, return_lse=True, finite=finite)
        rows = slice(starts[b], starts[b + 1])
        out[rows], lse[:, rows] = o_b[0], lse_b[0]
    return (out, lse) if return_lse else out
