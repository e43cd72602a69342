"""The acceptance rule every GPU result is held to: FA4's, against the float64 reference.

The rule (upstream FA4's tests, and this lab's: tests/kernel_checks.py, `fa4lab.fuzz`):
* the kernel's max error against the float64 reference (`fa4lab.reference`), over the rows
  that see a key, is at most twice the error of PyTorch's own attention in the inputs' 16-bit
  dtype plus ATOL = 1e-3 (`output_tolerance`). The yardstick (`same_dtype_yardstick`) is SDPA
  (`fa4lab.api.sdpa_same_dtype`; a window or causal is a mask, which SDPA takes), and with a
  softcap or a learnable sink, which SDPA cannot do, `torch_same_dtype`: the same attention
  written in eager PyTorch in the 16-bit dtype; with a score_mod / mask_mod
  `same_dtype_attention`, eager too, one head at a time, its softmax in fp32 (the bench's
  baseline, which takes mods; the rule's tests of softcap and sinks were written against
  `torch_same_dtype`, so each option keeps the yardstick it has always had). A varlen result
  is held to it sequence by sequence, against `torch_same_dtype` of each sequence;
* ATOL is a floor for cases where the yardstick happens to be exact (seqlen_k = 1, or one-hot
  rows at extreme logits): it is below half a bf16 ulp at magnitude 0.5 (2**-9 ~ 2e-3), so it
  absorbs fp32 summation-order noise but not one output rounded the wrong way. With extreme
  logits the floor is one output ulp (`output_ulp_atol`, Note [extreme logits]);
* rows that see no key give exactly 0 and LSE -inf (with a learnable sink: the sink's logit, to
  the LSE tolerance; -inf for a -inf sink);
* nothing is NaN;
* the LSE matches the reference to 1e-3 + 1e-5 * |lse| (`lse_tolerance`: fp32 accumulation of
  16-bit products);
* two runs on the same inputs agree bit for bit (the caller runs twice and compares).

`rule_violations` applies the rule to one problem's rows and says what is broken, in words (an
empty list: it passes). A yardstick whose error is not finite on a row (an overflow of its
16-bit scores) counts 0 there: such a row cannot loosen the tolerance.

    from fa4lab.acceptance import rule_violations, same_dtype_yardstick
    pt = same_dtype_yardstick(q, k, v, causal=True)
    problems = rule_violations(out, ref, sees, pt, lse=lse_rows, ref_lse=ref_lse_rows)

The backward's gradients are held to the same rule, gradient by gradient (`gradient_violations`):
each one's max error against the float64 `fa4lab.reference_backward` at most twice that of
`same_dtype_gradients` (autograd of `torch_same_dtype`'s attention, in the 16-bit dtype) plus
upstream's floor, `gradient_atol` (twice the dtype's rounding of the reference near 0.3; for
d(sink), a sum over rows and keys, `sink_gradient_atol`), and none NaN or inf.

    pt = same_dtype_gradients(q, k, v, dout, causal=True)
    problems = gradient_violations(kernel_grads, ref_grads, pt)
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = ["ATOL", "GRADIENT_NAMES", "GradientError", "LSE_ATOL", "LSE_RTOL", "gradient_atol",
           "gradient_error", "gradient_violations", "lse_tolerance", "output_tolerance",
           "output_ulp_atol", "rule_violations", "same_dtype_attention", "same_dtype_gradients",
           "same_dtype_yardstick", "sink_gradient_atol", "torch_same_dtype"]

ATOL = 1e-3
# The LSE's tolerance: LSE_ATOL + LSE_RTOL * |lse| (fp32 accumulation of 16-bit products).
LSE_ATOL = 1e-3
LSE_RTOL = 1e-5
# Mantissa bits of the 16-bit dtypes, for one ulp of an output.
_MANTISSA = {"bf16": 7, "fp16": 10}


def output_tolerance(yardstick_error: float, atol: float = ATOL) -> float:
    """The largest max error the rule accepts: 2 x the yardstick's error + atol."""
    return 2.0 * yardstick_error + atol


def lse_tolerance(ref_lse):
    """The LSE's tolerance at each reference value (a tensor or a number)."""
    return LSE_ATOL + LSE_RTOL * abs(ref_lse)


def output_ulp_atol(v, dtype) -> float:
    """One ulp of `dtype` ("bf16"/"fp16" or a torch dtype) at the output's magnitude, at least
    ATOL. See Note [extreme logits].

    Note [extreme logits]: with logits ~1e4 rows are nearly one-hot and SDPA's largest P is
    exactly 1, so it returns v exactly. With FA4's conditional rescale (the sm100 kernel's: Note
    [rescale threshold by arch] in fa4lab.limits) the kept (stale) max may sit up to 8 log2
    units below the row max, so the largest P is up to 2**8 and is itself
    rounded to 16 bits before P V: the output can land one rounding step away. A wrong max, a
    lost rescale or an overflow would be off by O(|v|), far beyond this.
    """
    from fa4lab.spec import normalize_dtype

    top = v.abs().max().item() if v.numel() else 0.0
    if top == 0.0:
        return ATOL
    return max(ATOL, 2.0 ** (math.floor(math.log2(top)) - _MANTISSA[normalize_dtype(dtype)]))


def _same_dtype_scores(q, k, v, *, causal, scale, softcap, window_size):
    """The scores of `torch_same_dtype` and `same_dtype_gradients`, in q's dtype: (batch,
    heads_q, seqlen_q, seqlen_k), capped, the keys a row does not see -inf; the values per query
    head (batch, heads_q, seqlen_k, head_dim_v); the visible mask (seqlen_q, seqlen_k)."""
    import torch

    from fa4lab.reference import visible_mask

    sq, sk = q.shape[1], k.shape[1]
    g = q.shape[2] // k.shape[2]
    kk, vv = (x.repeat_interleave(g, dim=2).transpose(1, 2) for x in (k, v))
    s = (q.transpose(1, 2) @ kk.transpose(-1, -2)) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    mask = torch.as_tensor(visible_mask(sq, sk, causal, window_size=window_size),
                           device=q.device)
    return s.masked_fill(~mask, float("-inf")), vv, mask


def _with_sink(s, sink):
    """The scores with the sink as one more logit per head, in the scores' dtype."""
    import torch

    return torch.cat([s, sink.to(s.dtype)[None, :, None, None].expand(*s.shape[:3], 1)], dim=-1)


def torch_same_dtype(q, k, v, *, causal=False, softmax_scale=None, softcap=0.0,
                     window_size=(None, None), learnable_sink=None):
    """Attention in eager PyTorch in the inputs' 16-bit dtype, for the options SDPA lacks (a
    softcap, a learnable sink): scores, cap, softmax and P V each rounded to q.dtype, as a
    straightforward PyTorch implementation would; bottom-right causal and windows
    (`fa4lab.reference.visible_mask`); the sink as one more logit per head, dropped after the
    softmax. q, k, v (batch, seqlen, heads, d). Rows that see no key come out NaN (0 with a
    sink)."""
    import torch

    scale = q.shape[3] ** -0.5 if softmax_scale is None else softmax_scale
    s, vv, _ = _same_dtype_scores(q, k, v, causal=causal, scale=scale, softcap=softcap,
                                  window_size=window_size)
    if learnable_sink is not None:
        p = torch.softmax(_with_sink(s, learnable_sink), dim=-1)[..., :k.shape[1]]
    else:
        p = torch.softmax(s, dim=-1)
    return (p @ vv).transpose(1, 2)


def same_dtype_attention(q, k, v, causal: bool, scale: float, options: dict | None = None):
    """Attention in eager PyTorch in q's dtype, one head at a time, with every option a mod
    included: the yardstick with a score_mod / mask_mod, and the bench's baseline (Note [the
    check before timing] in fa4lab.bench.check). q, k, v (b, s, h, d) -> (b, s, h, d) in
    q.dtype; `options` holds window_size, softcap, learnable_sink, score_mod, mask_mod and
    aux_tensors (`fa4lab.reference`'s names). Scores rounded to 16 bits, softcap, sink and
    softmax in fp32, the score_mod's result held in the input dtype (as a materialized bias
    passed to SDPA is), the masks exact, P rounded to 16 bits before P V. Query head h reads KV
    head h // (heads_q // heads_kv) (GQA). A row that sees nothing gives 0, as in the
    reference."""
    import torch

    from fa4lab.mods import check_mods
    from fa4lab.reference import visible_mask

    opts = options or {}
    softcap, sink = opts.get("softcap", 0.0), opts.get("learnable_sink")
    mods, aux = check_mods(opts.get("score_mod"), opts.get("mask_mod"),
                           opts.get("aux_tensors"), q.device)
    sq, sk = q.shape[1], k.shape[1]
    visible = torch.as_tensor(visible_mask(sq, sk, causal,
                                           window_size=opts.get("window_size", (None, None))),
                              device=q.device)
    idx = (torch.arange(q.shape[0], device=q.device)[:, None, None],
           torch.arange(sq, device=q.device)[None, :, None],
           torch.arange(sk, device=q.device)[None, None, :])
    outs = []
    group = q.shape[2] // k.shape[2]
    for h in range(q.shape[2]):
        qh, kh, vh = q[:, :, h], k[:, :, h // group], v[:, :, h // group]
        s = torch.matmul(qh, kh.transpose(-1, -2)).float() * scale     # (b, sq, sk)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        seen = visible
        if mods:
            b_idx, q_idx, kv_idx = idx
            h_idx = torch.full((1, 1, 1), h, dtype=torch.int64, device=q.device)
            if mods.score_mod is not None:
                s = mods.score(s, b_idx, h_idx, q_idx, kv_idx, aux).to(q.dtype).float()
            if mods.mask_mod is not None:
                seen = seen & mods.mask(b_idx, h_idx, q_idx, kv_idx, aux)
        s = s.masked_fill(~seen, -math.inf)
        if sink is not None:
            column = sink[h].float().expand(*s.shape[:-1], 1)
            p = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(s, dim=-1)
        outs.append(torch.matmul(p.nan_to_num(0.0).to(q.dtype), vh))
    return torch.stack(outs, dim=2)


def same_dtype_yardstick(q, k, v, *, causal=False, softmax_scale=None,
                         window_size=(None, None), softcap=0.0, learnable_sink=None,
                         score_mod=None, mask_mod=None, aux_tensors=None):
    """PyTorch's attention of q, k, v (batch, seqlen, heads, d) in their 16-bit dtype, the
    rule's yardstick for these options: SDPA, `torch_same_dtype` with a softcap or a sink,
    `same_dtype_attention` with mods. Rows that see no key may come out NaN."""
    if score_mod is not None or mask_mod is not None:
        from fa4lab.spec import resolve_scale

        options = dict(window_size=window_size, softcap=softcap, learnable_sink=learnable_sink,
                       score_mod=score_mod, mask_mod=mask_mod, aux_tensors=aux_tensors)
        return same_dtype_attention(q, k, v, causal, resolve_scale(softmax_scale, q.shape[-1]),
                                    options)
    if softcap or learnable_sink is not None:
        return torch_same_dtype(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                softcap=softcap, window_size=window_size,
                                learnable_sink=learnable_sink)
    from fa4lab.api import sdpa_same_dtype

    return sdpa_same_dtype(q, k, v, causal=causal, softmax_scale=softmax_scale,
                           window_size=window_size)


def _first_row(mask) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0].tolist())


def rule_violations(out, ref, sees, yardstick=None, *, lse=None, ref_lse=None,
                    atol: float = ATOL, where: str = "") -> list[str]:
    """What of the rule one problem's result breaks, one sentence each (empty: it passes).

    out (..., head_dim_v) the kernel's output and ref its float64 reference; sees a bool
    tensor of out.shape[:-1], True for the rows that see a key; yardstick the same-dtype
    PyTorch output (None only when no row sees a key); lse / ref_lse the kernel's and the
    reference's LSE laid out like `sees` (None: not checked). `where` prefixes each sentence.
    """
    import torch

    problems = []
    if torch.isnan(out).any():
        problems.append(f"{where}out has NaN at row {_first_row(torch.isnan(out).any(-1))}")
    if lse is not None and torch.isnan(lse).any():
        problems.append(f"{where}LSE has NaN at row {_first_row(torch.isnan(lse))}")
    unseen_nonzero = ~sees & (out != 0).any(-1)
    if unseen_nonzero.any():
        problems.append(f"{where}{int(unseen_nonzero.sum())} row(s) that see no key are not "
                        f"exactly 0, the first at {_first_row(unseen_nonzero)}")
    if lse is not None:
        finite = torch.isfinite(ref_lse)
        wrong_empty = ~finite & (lse != -math.inf)
        if wrong_empty.any():
            problems.append(f"{where}{int(wrong_empty.sum())} row(s) that see no key have an "
                            f"LSE other than -inf, the first at {_first_row(wrong_empty)}")
        lse_err = (lse.double() - ref_lse).abs()
        off = finite & ~(lse_err <= lse_tolerance(ref_lse))
        if off.any():
            first = _first_row(off)
            problems.append(f"{where}LSE error up to {lse_err[off].max().item():.3g} (tolerance "
                            f"{LSE_ATOL:g} + {LSE_RTOL:g} |lse|), the first at {first}: "
                            f"{lse[first].item():.6g} for {ref_lse[first].item():.6g}")
    if sees.any():
        diff = (out.double() - ref).abs().amax(-1)
        pt_diff = (yardstick.double() - ref).abs().amax(-1)
        pt_err = torch.where(torch.isfinite(pt_diff), pt_diff, 0.0)[sees].max().item()
        err = diff[sees].max().item()
        tol = output_tolerance(pt_err, atol)
        if not err <= tol:
            worst = _first_row(sees & ~(diff <= tol))
            problems.append(f"{where}error {err:.3g} > 2 x PyTorch's same-dtype error "
                            f"{pt_err:.3g} + {atol:.3g}, the first such row at {worst}")
    return problems


# ---- The backward: the same rule per gradient ----

GRADIENT_NAMES = ("dq", "dk", "dv", "dsink")


def same_dtype_gradients(q, k, v, dout, *, causal=False, softmax_scale=None,
                         window_size=(None, None), softcap=0.0, learnable_sink=None, dlse=None):
    """The gradients' yardstick: autograd of `torch_same_dtype`'s attention in q's dtype (as
    upstream's tests' `attention_ref(upcast=False)`), a `fa4lab.reference_backward.Gradients`
    (dq, dk, dv like q, k, v; dsink like learnable_sink, None without one). dout is the gradient
    of out, dlse (batch, heads_q, seqlen_q) of the lse or None. Rows that see no key give 0
    (their scores are zeroed before the softmax and P after it)."""
    import torch

    from fa4lab.reference_backward import Gradients
    from fa4lab.spec import resolve_scale

    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    leaves = (q, k, v)
    sink = learnable_sink
    if sink is not None:
        sink = sink.detach().clone().requires_grad_()
        leaves = (q, k, v, sink)
    s, vv, mask = _same_dtype_scores(q, k, v, causal=causal,
                                     scale=resolve_scale(softmax_scale, q.shape[-1]),
                                     softcap=softcap, window_size=window_size)
    seen = mask.any(dim=1) if sink is None else torch.ones_like(mask[:, 0])
    s = s.masked_fill(~seen[:, None], 0.0)
    if sink is not None:
        s = _with_sink(s, sink)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1)[..., :k.shape[1]] * seen[:, None]
    out = (p @ vv).transpose(1, 2)
    loss = (out * dout).sum()
    if dlse is not None:
        loss = loss + (torch.where(seen, lse, 0.0) * dlse).sum()
    grads = torch.autograd.grad(loss, leaves)
    return Gradients(*grads[:3], grads[3] if sink is not None else None)


def gradient_atol(ref, dtype) -> float:
    """A gradient's floor, upstream's: twice `dtype`'s rounding of the reference near 0.3."""
    r = ref.to(dtype)
    return 2 * (r + 0.3 - 0.3 - r).abs().max().item() + 1e-5


def sink_gradient_atol(ref_dsink) -> float:
    """d(sink)'s floor: 1e-3 scaled to the magnitude of its sum over rows and keys."""
    return 1e-3 * (1 + ref_dsink.abs().max().item())


class GradientError(NamedTuple):
    """One gradient's max error against the float64 reference, the yardstick's, and the floor
    the rule adds: it passes when err <= tol."""

    err: float
    yardstick_err: float
    atol: float

    @property
    def tol(self) -> float:
        return output_tolerance(self.yardstick_err, self.atol)


def gradient_error(name: str, g, r, p) -> GradientError:
    """The numbers `gradient_violations` judges gradient `name` ("dq", "dk", "dv", "dsink") by:
    g the kernel's, r the float64 reference, p the yardstick's (same shapes)."""
    atol = sink_gradient_atol(r) if name == "dsink" else gradient_atol(r, p.dtype)
    return GradientError((g.double() - r).abs().max().item(),
                         (p.double() - r).abs().max().item(), atol)


def gradient_violations(grads, ref, yardstick) -> list[str]:
    """What of the rule the backward's gradients break, one sentence each (empty: they pass):
    each gradient finite, shaped and typed as the yardstick's, its max error against the
    float64 reference at most `output_tolerance` of the yardstick's, with `gradient_atol`
    (`sink_gradient_atol` for dsink). grads (dq, dk, dv[, dsink]) the kernel's; ref the
    float64 `Gradients` (`fa4lab.reference_backward.attention_backward_reference`); yardstick
    `same_dtype_gradients` with the same options. A gradient whose reference is None (no sink)
    is not checked."""
    import torch

    problems = []
    for name, g, r, p in zip(GRADIENT_NAMES, grads, ref, yardstick):
        if r is None:
            continue
        if g.shape != p.shape or g.dtype != p.dtype:
            problems.append(f"{name} is {tuple(g.shape)} {g.dtype}, expected "
                            f"{tuple(p.shape)} {p.dtype}")
            continue
        if not torch.isfinite(g).all():
            problems.append(f"{name} has NaN/inf")
            continue
        e = gradient_error(name, g, r, p)
        if not e.err <= e.tol:
            problems.append(f"{name}: max error {e.err:.3g} > 2 x PyTorch's same-dtype error "
                            f"{e.yardstick_err:.3g} + {e.atol:.3g}")
    return problems
