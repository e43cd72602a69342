"""From any call upstream FA4's forward answers to one the kernels build.

`fa4lab.attention` and `attention_varlen` take what upstream's `flash_attn_func` /
`flash_attn_varlen_func` take; the kernels take a narrower form. This module is the bridge,
applied on the kernel path by `fa4lab.call.Call.for_kernel`, which then asserts the form:

* `empty_answer`: a call with no query row or no key is answered without a launch (Note
  [empty calls]);
* `for_kernel`: head dims the kernel does not build are zero-padded to the smallest built pair
  that holds them (Note [padded head dims]), and views TMA cannot read (a strided last dim,
  unaligned data or strides) are copied into a fresh contiguous tensor (Note [copied
  layouts]); `narrow_out` cuts the padded output back.

Each costs only the calls that need it: a call already in the kernels' form passes through
untouched (no copy, no launch). What each costs when it does is measured beside upstream in
benchmarks/ (the parity record).
"""

from __future__ import annotations

import math

import torch

from fa4lab.errors import InputError

# Note [empty calls]
# A batch of 0, a seqlen_q of 0 or a seqlen_k of 0 (and a varlen batch with no packed query,
# or no packed key at all) has an answer without any arithmetic: a row that sees no key gives
# output 0 and LSE -inf, or the sink's logit (the softmax of the sink alone puts no weight on
# V, and log e^sink = sink: Note [sinks] in fa4lab.kernels.device.softmax); no row gives an
# empty output. The API answers them on every path (kernel, reference, custom op) before
# anything launches, as upstream FA4 does. The kernels themselves never see an empty axis.


def empty_answer(q, head_dim_v: int, learnable_sink, return_lse: bool, *, varlen: bool = False):
    """(out, lse or None) of a call whose rows see no key (Note [empty calls]): out zeros like
    q with head_dim_v, lse -inf or the sink; lse (batch, heads_q, seqlen_q), or (heads_q,
    total_q) with `varlen`."""
    out = q.new_zeros((*q.shape[:-1], head_dim_v))
    if not return_lse:
        return out, None
    if varlen:
        total_q, heads_q = q.shape[0], q.shape[1]
        shape, sink_view = (heads_q, total_q), (slice(None), None)
    else:
        b, sq, heads_q = q.shape[0], q.shape[1], q.shape[2]
        shape, sink_view = (b, heads_q, sq), (None, slice(None), None)
    lse = torch.full(shape, -math.inf, dtype=torch.float32, device=q.device)
    if learnable_sink is not None:
        lse.copy_(learnable_sink.to(torch.float32)[sink_view].expand(shape))
    return out, lse


# Note [padded head dims]
# Each kernel builds a few (head_dim, head_dim_v) pairs (`fa4lab.limits.KERNEL_HEAD_DIMS`).
# Any narrower pair runs on the smallest built pair that holds it
# (`fa4lab.limits.covering_head_dims`): q and k zero-padded to its head_dim, v to its
# head_dim_v. Zeros change no score (q.k over the padded columns adds 0) and no output column
# that is kept (the padded V columns give padded output columns, cut off by `narrow_out`); the
# default softmax_scale stays 1/sqrt of the caller's head_dim, passed explicitly. The price:
# one copy of q, k and v (a whole paged cache, for a paged call) and of the output, and the
# kernel's work at the padded width (head_dim 8 runs at 64's cost). Upstream's sm90 kernel
# pads inside the kernel instead (its tiles are wider than the tensor); the copies are what
# fa4lab pays more. Sides above the widest built pair (256) are refused.

# Note [copied layouts]
# TMA reads rows of 16-byte aligned, 16-byte strided data with a contiguous last dim
# (`fa4lab.spec.check_kernel_layout`). A view that is not (a slice of the last dim, a storage
# offset of one element, a transposed tensor) is copied into a fresh contiguous tensor first,
# as upstream FA4 does: `.contiguous()`, or a clone when the tensor is contiguous but its data
# pointer is not aligned. One copy of that tensor per call; a layout TMA can read, however it
# was made (a contiguous tensor, a (batch, heads, seqlen, d) tensor transposed to (batch,
# seqlen, heads, d)), is never copied.


def tma_ready(t) -> bool:
    """Whether TMA can read `t` in place (Note [copied layouts])."""
    stride = t.stride()
    return (stride[-1] == 1 or t.shape[-1] == 1) and t.data_ptr() % 16 == 0 and all(
        s % 8 == 0 or n == 1 for s, n in zip(stride[:-1], t.shape[:-1]))


def _readable(t, width: int):
    """`t` zero-padded on its last dim to `width` and in a layout TMA reads: `t` itself when
    it already is (Notes [padded head dims] and [copied layouts])."""
    if t.shape[-1] != width:
        return torch.nn.functional.pad(t, (0, width - t.shape[-1]))
    if tma_ready(t):
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


def for_kernel(arch: str, q, k, v, softmax_scale):
    """(q, k, v, softmax_scale) in the form the kernel of `arch` builds: q and k at the
    covering pair's head_dim, v at its head_dim_v (`fa4lab.limits.covering_head_dims`), each
    readable by TMA, and the scale explicit when padding would change its default. Tensors
    already in that form come back as they are. Raises `InputError` for a pair no built pair
    holds."""
    from fa4lab.limits import covering_head_dims, unsupported_head_dims

    d, dv = q.shape[-1], v.shape[-1]
    cover = covering_head_dims(arch, d, dv)
    if cover is None:
        raise InputError(unsupported_head_dims(arch, d, dv))
    if cover[0] != d and softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    return (_readable(q, cover[0]), _readable(k, cover[0]), _readable(v, cover[1]),
            softmax_scale)


def narrow_out(out, head_dim_v: int):
    """The caller's output columns of a kernel output computed at a padded head_dim_v."""
    if out.shape[-1] == head_dim_v:
        return out
    return out[..., :head_dim_v].contiguous()
