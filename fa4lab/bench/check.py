"""The check before timing: a provider's output against the float64 reference.

See Note [the check before timing].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fa4lab.bench.sweep import BenchShape

# Note [the check before timing]
# Each provider runs once on the full input (that first call also compiles, where the provider
# compiles) and its output for batch element 0, heads 0..1, all rows, is compared with the
# float64 reference of the same slice (`fa4lab.reference.attention_reference`, on the GPU).
# The tolerance is FA4's rule: at most twice the error of a plain PyTorch attention computed in
# the input dtype (scores rounded to bf16, softmax in fp32, P rounded to bf16: what a correct
# flash kernel also does), plus ATOL for the final rounding of the output. A provider whose
# error is above that, or whose output has a NaN or the wrong shape, is "failed" and not timed.
CHECK_HEADS = 2
ATOL = {"bf16": 2.0**-9, "fp16": 2.0**-12}


def _same_dtype_attention(q, k, v, causal: bool, scale: float):
    """(b, s, h, d) -> (b, s, h, d) in q.dtype, one head at a time; the baseline of the rule."""
    import torch

    outs = []
    for h in range(q.shape[2]):
        qh, kh, vh = q[:, :, h], k[:, :, h], v[:, :, h]
        s = torch.matmul(qh, kh.transpose(-1, -2)).float() * scale
        if causal:
            sq, sk = s.shape[-2], s.shape[-1]
            i = torch.arange(sq, device=s.device)[:, None]
            j = torch.arange(sk, device=s.device)[None, :]
            s = s.masked_fill(j > i + (sk - sq), -math.inf)
        p = torch.softmax(s, dim=-1).to(q.dtype)
        outs.append(torch.matmul(p, vh))
    return torch.stack(outs, dim=2)


@dataclass
class CheckSlice:
    """The reference for one shape's checked slice (computed once, shared by every provider)."""

    ref: Any            # float64 (1, seqlen, CHECK_HEADS, head_dim)
    tol: float
    baseline_err: float


def reference_slice(q, k, v, shape: BenchShape) -> CheckSlice:
    from fa4lab.reference import attention_reference

    hs = slice(0, min(CHECK_HEADS, shape.heads))
    qs, ks, vs = q[:1, :, hs], k[:1, :, hs], v[:1, :, hs]
    scale = shape.spec.scale
    ref = attention_reference(qs, ks, vs, causal=shape.causal, softmax_scale=scale)
    base = _same_dtype_attention(qs, ks, vs, shape.causal, scale).double()
    baseline_err = float((base - ref).abs().max())
    return CheckSlice(ref, 2.0 * baseline_err + ATOL[shape.dtype], baseline_err)


def check_output(out, check: CheckSlice, shape: BenchShape) -> tuple[bool, float, str]:
    """(passed, max_err, note) for a provider's full output against the checked slice."""
    expect = (shape.batch, shape.seqlen, shape.heads, shape.head_dim)
    if tuple(out.shape) != expect:
        return False, math.inf, f"output shape {tuple(out.shape)}, expected {expect}"
    got = out[:1, :, : check.ref.shape[2]].double()
    if not bool(got.isfinite().all()):
        return False, math.inf, "output has NaN or inf on the checked slice"
    err = float((got - check.ref).abs().max())
    if err > check.tol:
        return False, err, (f"max error {err:.2e} > tolerance {check.tol:.2e} (2 x same-dtype "
                            f"PyTorch error {check.baseline_err:.2e} + {ATOL[shape.dtype]:.1e})")
    return True, err, ""
