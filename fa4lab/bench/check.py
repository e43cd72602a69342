"""The check before timing: a provider's output against the float64 reference.

See Note [the check before timing].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fa4lab.acceptance import same_dtype_attention

# Note [the check before timing]
# Each provider runs once on the full input (that first call also compiles, where the provider
# compiles) and its output for batch element 0, heads 0..1, all rows, is compared with the
# float64 reference of the same slice (`fa4lab.reference.attention_reference`, on the GPU).
# With GQA (heads_q = r * heads_kv, `fa4lab bench --decode`) the slice is KV heads 0..1 and
# the 2r query heads that read them, so a kernel that maps a query head to the wrong KV head,
# or packs a group wrongly, fails; `batches` may name more batch elements than 0 (the decode
# mode checks the first and the last). The attention options of `fa4lab bench --features`
# (window_size, softcap, learnable_sink, score_mod, mask_mod, aux_tensors) go to the reference
# as they go to the provider; the slice keeps heads 0.. and batch 0, so a mod sees the same
# (b, h) indices in the slice as in the full call, and a sink is cut to the checked heads.
# The tolerance is FA4's rule: at most twice the error of a plain PyTorch attention computed in
# the input dtype (scores rounded to bf16, softmax in fp32, P rounded to bf16: what a correct
# flash kernel also does), plus ATOL for the final rounding of the output. With options, that
# plain attention applies them as a bf16 PyTorch program would: softcap and sink in fp32, the
# score_mod's result held in the input dtype (as a materialized bias passed to SDPA is), the
# masks exact (`fa4lab.acceptance.same_dtype_attention`). A provider whose error is above that,
# or whose output has a NaN or the wrong shape, is "failed" and not timed.
CHECK_HEADS = 2
ATOL = {"bf16": 2.0**-9, "fp16": 2.0**-12}
# The attention options the check passes on to the reference (`fa4lab.reference`'s names).
OPTIONS = ("window_size", "softcap", "learnable_sink", "score_mod", "mask_mod", "aux_tensors")


@dataclass
class CheckSlice:
    """The reference for one shape's checked slice (computed once, shared by every provider)."""

    ref: Any            # float64 (len(batches), seqlen_q, checked query heads, head_dim_v)
    tol: float
    baseline_err: float
    batches: tuple[int, ...] = (0,)   # the batch elements checked


def reference_slice(q, k, v, shape, *, batches: tuple[int, ...] = (0,),
                    options: dict | None = None) -> CheckSlice:
    """The float64 reference of the checked slice of q, k, v, for a `BenchShape` or any shape
    with a `.spec` (an AttentionSpec) and `.dtype`: batches `batches`, KV heads 0..1 and the
    query heads that read them (Note [the check before timing]). `options`: attention options
    (names in OPTIONS) for the reference and the baseline; causal and the scale are the spec's."""
    from fa4lab.reference import attention_reference

    spec = shape.spec
    opts = dict(options or {})
    unknown = sorted(set(opts) - set(OPTIONS))
    if unknown:
        raise ValueError(f"reference_slice: unknown option(s) {unknown}; it passes on {OPTIONS}")
    n_kv = min(CHECK_HEADS, spec.heads_kv)
    n_q = n_kv * (spec.heads_q // spec.heads_kv)
    bs = sorted({int(b) % spec.batch for b in batches})
    if bs != [0] and (opts.get("score_mod") or opts.get("mask_mod")):
        raise ValueError(f"reference_slice: a score_mod / mask_mod reads the batch index, so "
                         f"the checked slice must be batch 0 alone, not {bs}")
    at = slice(0, 1) if bs == [0] else bs     # batch 0 alone: a view, as the sweep always had
    qs, ks, vs = q[at, :, :n_q], k[at, :, :n_kv], v[at, :, :n_kv]
    if opts.get("learnable_sink") is not None:
        opts["learnable_sink"] = opts["learnable_sink"][:n_q]
    scale = spec.scale
    ref = attention_reference(qs, ks, vs, causal=spec.causal, softmax_scale=scale, **opts)
    base = same_dtype_attention(qs, ks, vs, spec.causal, scale, opts).double()
    baseline_err = float((base - ref).abs().max())
    return CheckSlice(ref, 2.0 * baseline_err + ATOL[shape.dtype], baseline_err, tuple(bs))


def check_output(out, check: CheckSlice, shape) -> tuple[bool, float, str]:
    """(passed, max_err, note) for a provider's full output against the checked slice."""
    spec = shape.spec
    expect = (spec.batch, spec.seqlen_q, spec.heads_q, spec.head_dim_v)
    if tuple(out.shape) != expect:
        return False, math.inf, f"output shape {tuple(out.shape)}, expected {expect}"
    at = slice(0, 1) if check.batches == (0,) else list(check.batches)
    got = out[at, :, : check.ref.shape[2]].double()
    if not bool(got.isfinite().all()):
        return False, math.inf, "output has NaN or inf on the checked slice"
    err = float((got - check.ref).abs().max())
    if err > check.tol:
        return False, err, (f"max error {err:.2e} > tolerance {check.tol:.2e} (2 x same-dtype "
                            f"PyTorch error {check.baseline_err:.2e} + {ATOL[shape.dtype]:.1e})")
    return True, err, ""
