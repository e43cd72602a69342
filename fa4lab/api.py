"""`fa4lab.attention`: the one validated entry point, dispatching by where the tensors live.

    out = fa4lab.attention(q, k, v, causal=True)
    out, lse = fa4lab.attention(q, k, v, return_lse=True)

q (batch, seqlen_q, heads_q, head_dim), k (batch, seqlen_k, heads_kv, head_dim),
v (batch, seqlen_k, heads_kv, head_dim_v) torch tensors; out like q with head_dim_v; lse
(batch, heads_q, seqlen_q) float32, natural log, -inf for rows that see no key.

Dispatch:
* CUDA tensors on compute capability 10.x (B200): the sm100 kernel (`fwd_sm100`);
* CUDA tensors on 9.0 (H100/H200): the sm90 kernel (`fwd_sm90`);
* anything else (CPU tensors, other GPUs): the float64 reference, with a `SlowReferenceWarning`
  -- correct but slow, so you always know when no kernel ran.

`pack_gqa=True` folds the query heads that share a KV head into one CTA's rows, so K/V are read
once per group (decode and short seqlen_q); it needs heads_q / heads_kv to divide 64 on Hopper
and 128 on the B200 (else PlanError). The B200 packed kernel is compiled and audited but not yet
run on a B200. The reference ignores it.

Bad inputs raise before anything runs, with what is wrong and what to do. Compiled kernels are
cached per configuration (`fa4lab.kernels.runtime`): the second call with the same head_dim,
dtype, causal flag, scale, GQA ratio and LSE flag does not compile again, whatever the batch or
sequence lengths.
"""

from __future__ import annotations

import warnings

from fa4lab.errors import UnsupportedArchError
from fa4lab.spec import check_qkv_shapes

SUPPORTED_HEAD_DIMS = (64, 128, 256)


class SlowReferenceWarning(UserWarning):
    """No fa4lab kernel runs on these tensors; the float64 reference computed the answer."""


def _validate(q, k, v, softmax_scale) -> None:
    import torch

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}; "
                            f"wrap numpy arrays with torch.from_numpy({name})")
    check_qkv_shapes(q, k, v)
    if not q.is_floating_point():
        raise TypeError(f"q has dtype {q.dtype}: attention needs floating point inputs; cast "
                        f"with q.to(torch.bfloat16)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; "
                        f"cast them, e.g. k.to(q.dtype)")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices ({q.device}, {k.device}, "
                         f"{v.device}); move them to one device with .to(q.device)")
    if softmax_scale is not None:
        s = float(softmax_scale)
        if not s > 0 or s == float("inf"):
            raise ValueError(f"softmax_scale must be a positive finite number, got {s}")


def _check_kernel_inputs(q, k, v) -> None:
    """What the GPU kernels additionally need: 16-bit dtype, head_dim, stride-1 last dim."""
    import torch

    if q.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"the GPU kernels take bfloat16 or float16, got {q.dtype}; cast with "
                        f"q.to(torch.bfloat16) (or run on CPU tensors for the reference)")
    d, dv = q.shape[-1], v.shape[-1]
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {d} is not supported by the kernels: use one of "
                         f"{SUPPORTED_HEAD_DIMS} (pad q and k with zeros to the next one)")
    if dv != d:
        raise ValueError(f"head_dim_v {dv} != head_dim {d}: the kernels need them equal")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} has strides {tuple(t.stride())}: the last dim must be "
                             f"contiguous (stride 1); pass {name}.contiguous()")


def _kernel_for(device):
    """The forward function for this CUDA device, or None where no kernel exists."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    if major == 10:
        from fa4lab.kernels.fwd_sm100 import attention_sm100

        return attention_sm100
    if (major, minor) == (9, 0):
        from fa4lab.kernels.fwd_sm90 import attention_sm90

        return attention_sm90
    return None


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
              return_lse: bool = False, pack_gqa: bool = False):
    """Attention forward: out, or (out, lse) when return_lse. See the module docstring."""
    _validate(q, k, v, softmax_scale)
    if not isinstance(pack_gqa, bool):
        raise TypeError(f"pack_gqa must be True or False, got {pack_gqa!r}")
    fn = None
    if q.is_cuda:
        fn = _kernel_for(q.device)
    if fn is not None:
        _check_kernel_inputs(q, k, v)
        return fn(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
                  pack_gqa=pack_gqa)
    return _reference(q, k, v, causal=causal, softmax_scale=softmax_scale,
                      return_lse=return_lse)


def _reference(q, k, v, *, causal, softmax_scale, return_lse):
    import torch

    from fa4lab.reference import attention_reference

    where = f"CUDA device {q.device} (compute capability " \
            f"{torch.cuda.get_device_capability(q.device)})" if q.is_cuda else f"{q.device} tensors"
    warnings.warn(
        f"SLOW: fa4lab.attention has no kernel for {where}; computing the float64 reference "
        f"instead (correct, but orders of magnitude slower). The kernels run on Hopper "
        f"(sm90) and B200 (sm100) GPUs.", SlowReferenceWarning, stacklevel=3)
    out, lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                   return_lse=True)
    out = out.to(q.dtype)
    return (out, lse.to(torch.float32)) if return_lse else out


def sdpa_same_dtype(q, k, v, *, causal=False, softmax_scale=None):
    """PyTorch's own attention in the inputs' dtype: the yardstick for the kernels' error.

    GQA through `enable_gqa`, causal through an explicit bottom-right bool mask (SDPA's
    `is_causal` is top-left aligned). Rows that see no key come out NaN here; callers drop them.
    """
    import torch
    import torch.nn.functional as F

    sq, sk = q.shape[1], k.shape[1]
    mask = None
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        mask = j <= i + sk - sq
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def error_vs_reference(q, k, v, *, causal=False, softmax_scale=None) -> dict:
    """Run `attention` and measure it against the float64 reference, beside SDPA's error.

    Returns max abs errors over rows that see a key ("kernel", "sdpa", "lse"), and whether rows
    that see no key came out exactly 0 with LSE -inf ("empty_rows_ok") and nothing is NaN
    ("no_nan"). FA4's acceptance rule is kernel <= 2 * sdpa + a small atol.
    """
    import math

    import torch

    from fa4lab.reference import attention_reference

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowReferenceWarning)
        out, lse = attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                             return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                       return_lse=True)
    seen = torch.isfinite(ref_lse)                   # (b, h, sq)
    rows = seen.transpose(1, 2)                      # (b, sq, h)
    pt = sdpa_same_dtype(q, k, v, causal=causal, softmax_scale=softmax_scale)

    def worst(x):
        return x.abs().max().item() if x.numel() else 0.0

    return {
        "kernel": worst((out.double() - ref)[rows]),
        "sdpa": worst((pt.double() - ref)[rows]),
        "lse": worst((lse.double() - ref_lse)[seen]),
        "empty_rows_ok": bool((out[~rows] == 0).all() and (lse[~seen] == -math.inf).all()),
        "no_nan": not (torch.isnan(out).any() or torch.isnan(lse).any()),
    }


__all__ = ["SlowReferenceWarning", "UnsupportedArchError", "attention", "error_vs_reference",
           "sdpa_same_dtype"]
