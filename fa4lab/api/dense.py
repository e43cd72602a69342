"""`fa4lab.attention`: the entry point of dense (batch, seqlen, heads, d) tensors and its torch op
`fa4lab::attention_forward` (Note [the attention op]); the arguments, the dispatch and what each
option means are `fa4lab.api`'s docstring. `sdpa_same_dtype` and `error_vs_reference` are the
yardstick the GPU tests and notebook 06 measure the kernels' error with.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from fa4lab import backward
from fa4lab.backward import needs_grad, refuse_gradients_on_cuda
from fa4lab.call import check_call, check_switches
from fa4lab.canonical import empty_answer, narrow_out, tma_ready
from fa4lab.kernels import launch
from fa4lab.spec import check_qkv_shapes, check_window_size, normalize_mask
from fa4lab.splitkv import check_num_splits


class SlowReferenceWarning(UserWarning):
    """No fa4lab kernel runs on these tensors; the float64 reference computed the answer."""


# Note [the attention op]
# `fa4lab::attention_forward` is a torch custom op (torch.library.custom_op) with a fake
# implementation, so torch.compile (fullgraph too) treats a call as one opaque node with known
# output shapes, and CUDA graphs capture the launch. Eager calls of `attention` skip the
# dispatcher and call the same implementation directly (`_forward`): the dispatcher's Python
# round trip costs as much as the rest of the host work. The op is used whenever something
# sits between the caller and the tensors: torch.compile tracing, a dispatch or function mode
# (FakeTensorMode, FlopCounterMode, ...), or a tensor subclass.
#
# Gradients (Note [backward on CPU, not yet on the GPU] in fa4lab.backward): on tensors that
# require grad, `attention` calls the op (not `_forward`) so autograd records it, with
# return_lse True whatever the caller asked (the caller gets the lse only if it did): the op's
# autograd setup saves out and lse beside the inputs, and its formula runs its own op,
# `fa4lab::attention_backward`: the float64 reference backward on CPU tensors, the sm90
# kernel on the saved out and lse on a Hopper GPU, with no second forward (Note [the backward
# on the GPU]). Where no backward kernel runs a CUDA call `attention` raises before launch,
# and so does the op's autograd setup when the op is called directly: a gradient is never
# dropped silently.


def _forward(q, k, v, causal: bool, softmax_scale, return_lse: bool, pack_gqa: bool | None,
             softcap: float = 0.0, window_size=(None, None), learnable_sink=None,
             score_mod=None, mask_mod=None, aux_tensors=None, num_splits=None, page_table=None,
             deterministic: bool = False):
    """(out, lse or None) of `attention`'s arguments: checked once (`fa4lab.call.check_call`),
    then run (`_run`)."""
    return _run(check_call(q, k, v, causal=causal, softmax_scale=softmax_scale,
                           window_size=window_size, softcap=softcap,
                           learnable_sink=learnable_sink, return_lse=return_lse,
                           pack_gqa=pack_gqa, deterministic=deterministic,
                           num_splits=num_splits, score_mod=score_mod, mask_mod=mask_mod,
                           aux_tensors=aux_tensors, page_table=page_table))


def _run(call):
    """(out, lse or None) of a checked call: the kernel of q's GPU (on the call in its form:
    `Call.for_kernel`), or the float64 reference where none runs; an empty call without
    either (Note [empty calls] in fa4lab.canonical)."""
    q, spec = call.q, call.spec
    if call.empty:
        return empty_answer(q, spec.head_dim_v, call.sink, spec.return_lse)
    arch = launch.device_arch(q.device.index) if q.is_cuda else None
    if arch is not None:
        out, lse = launch.forward(call.for_kernel(arch), arch)
        return narrow_out(out, spec.head_dim_v), lse
    k, v = call.k, call.v
    if call.page_table is not None:     # the reference reads each sequence's gathered K/V
        from fa4lab.varlen import gather_paged

        seqlens = [spec.seqlen_k] * q.shape[0]
        k, v = (torch.stack(gather_paged(x, call.page_table, seqlens)) for x in (k, v))
    mods = call.mods
    out, lse = _reference(q, k, v, **call.options(),
                          score_mod=mods.score_mod if mods else None,
                          mask_mod=mods.mask_mod if mods else None,
                          aux_tensors=call.aux if mods else None)
    return out, (lse if spec.return_lse else None)


def _forward_with_mods(q, k, v, causal, softmax_scale, return_lse, pack_gqa, softcap,
                       window_size, learnable_sink, score_mod, mask_mod, aux_tensors,
                       num_splits=None, page_table=None, deterministic=False, grad: bool = False):
    """`_forward` outside any torch.compile graph: a callable cannot be an argument of the
    custom op, so a call with mods is a graph break (Note [mods in the kernels]). Eager calls
    (nothing tracing) call `_forward` directly: `torch.compiler.disable` imports torch._dynamo
    (about a second), which `import fa4lab` should not pay for. With `grad` (an input requires
    grad) the call is differentiated by `fa4lab.backward.ReferenceWithMods`."""
    fn = _differentiable_with_mods if grad else _forward
    if torch.compiler.is_compiling():
        fn = _outside_graph(fn)
    return fn(q, k, v, causal, softmax_scale, return_lse, pack_gqa, softcap, window_size,
              learnable_sink, score_mod, mask_mod, aux_tensors, num_splits, page_table,
              deterministic)


def _differentiable_with_mods(q, k, v, causal, softmax_scale, return_lse, pack_gqa, softcap,
                              window_size, learnable_sink, score_mod, mask_mod, aux_tensors,
                              num_splits=None, page_table=None, deterministic=False):
    """`_forward` with mods, recorded for autograd (CPU tensors; CUDA ones raise: Note
    [backward on CPU, not yet on the GPU] in fa4lab.backward); the LSE always computed."""
    refuse_gradients_on_cuda(q, k, v, learnable_sink)
    call = check_call(q, k, v, causal=causal, softmax_scale=softmax_scale,
                      window_size=window_size, softcap=softcap, learnable_sink=learnable_sink,
                      return_lse=True, pack_gqa=pack_gqa, deterministic=deterministic,
                      num_splits=num_splits, score_mod=score_mod, mask_mod=mask_mod,
                      aux_tensors=aux_tensors, page_table=page_table)
    backward.refuse_unbuilt(call)   # on a Hopper GPU: the backward kernel takes no mods

    def forward(q, k, v, learnable_sink):
        return _run(replace(call, q=q, k=k, v=v, sink=learnable_sink))

    options = call.options()
    del options["learnable_sink"]
    options.update(score_mod=score_mod, mask_mod=mask_mod, aux_tensors=aux_tensors,
                   page_table=page_table)
    out, lse = backward.ReferenceWithMods.apply(q, k, v, learnable_sink, forward, options)
    return out, (lse if return_lse else None)


_DISABLED: dict = {}


def _outside_graph(fn):
    """`fn` under torch.compiler.disable, made at the first traced call with mods (a tracer has
    imported torch._dynamo by then)."""
    if fn not in _DISABLED:
        _DISABLED[fn] = torch.compiler.disable(fn)
    return _DISABLED[fn]


@torch.library.custom_op("fa4lab::attention_forward", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      softmax_scale: float | None, return_lse: bool,
                      pack_gqa: bool | None, softcap: float, window_left: int | None = None,
                      window_right: int | None = None,
                      learnable_sink: torch.Tensor | None = None,
                      num_splits: int | None = None,
                      page_table: torch.Tensor | None = None,
                      deterministic: bool = False,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered op: (out, lse); lse is an empty float32 tensor unless return_lse
    (`attention` passes True whenever an input requires grad: the autograd setup saves out and
    lse for the backward, Note [the backward on the GPU] in fa4lab.backward). The window's
    sides are window_left / window_right (None = unbounded); with page_table, k and v are a
    paged cache; `deterministic` is the backward's (its autograd formula reads it). Checked as
    `attention` is (`fa4lab.call.check_call`)."""
    out, lse = _forward(q, k, v, causal, softmax_scale, return_lse, pack_gqa, softcap,
                        (window_left, window_right), learnable_sink, num_splits=num_splits,
                        page_table=page_table)
    if lse is None:
        lse = q.new_empty((0,), dtype=torch.float32)
    return out, lse


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, causal, softmax_scale, return_lse, pack_gqa, softcap,
                            window_left=None, window_right=None, learnable_sink=None,
                            num_splits=None, page_table=None, deterministic=False):
    if page_table is None:    # a paged cache's shapes are checked with its table's values
        check_qkv_shapes(q, k, v)
    normalize_mask(causal, (window_left, window_right))
    check_num_splits(num_splits)
    b, sq, hq, _ = q.shape
    lse_shape = (b, hq, sq) if return_lse else (0,)
    return (q.new_empty((b, sq, hq, v.shape[3])),
            q.new_empty(lse_shape, dtype=torch.float32))


attention_forward.register_autograd(backward.attention_forward_backward,
                                    setup_context=backward.save_attention)


def _intercepted(*tensors) -> bool:
    """Something traces or intercepts the call: go through the op (Note [the attention op])."""
    return (torch.compiler.is_compiling()
            or torch._C._is_torch_function_mode_enabled()
            or torch._C._len_torch_dispatch_stack() > 0
            or any(isinstance(t, torch.Tensor) and type(t) is not torch.Tensor
                   for t in tensors))


def op_arguments(pack_gqa, deterministic, num_splits, window_size):
    """(num_splits, (left, right)) as a torch op's schema takes them, checked for that
    (`fa4lab.call.check_switches`, `check_num_splits`, the window a pair of ints or None:
    `fa4lab.spec.check_window_size`); the op checks its call (`fa4lab.call.check_call`)."""
    check_switches(pack_gqa, None, deterministic)
    return check_num_splits(num_splits), check_window_size(window_size)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              softmax_scale: float | None = None, causal: bool = False,
              window_size: tuple[int | None, int | None] = (None, None),
              learnable_sink: torch.Tensor | None = None, softcap: float = 0.0,
              num_splits: int | None = None, pack_gqa: bool | None = None,
              score_mod: Callable | None = None, mask_mod: Callable | None = None,
              aux_tensors: Sequence[torch.Tensor] | None = None, return_lse: bool = False,
              page_table: torch.Tensor | None = None, deterministic: bool = False,
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention forward: out, or (out, lse) when return_lse. See the module docstring.

    The keyword arguments are upstream FA4's `flash_attn_func`'s, in its order (num_splits
    None, not upstream's 1, chooses: see the module docstring); `page_table` (int32 (batch,
    pages_per_seq)) makes k and v a paged cache (num_pages, page_size, heads_kv, d) whose
    sequence b is its pages page_table[b, 0], page_table[b, 1], ... (every sequence
    pages_per_seq * page_size keys; `fa4lab.varlen`'s layout, Note [paged key blocks] in
    fa4lab.kernels.device.paged for the kernels' page sizes; num_splits as with contiguous K/V,
    None choosing from the table's capacity). `deterministic`, upstream's: the forward is
    deterministic whatever it says; with inputs that require grad on a Hopper GPU it orders the
    backward's dQ additions, so two runs give the same gradients bit for bit (Note
    [deterministic dQ] in fa4lab.kernels.bwd_sm90). Empty calls (batch, seqlen_q or
    seqlen_k 0) are answered without a launch (Note [empty calls] in fa4lab.canonical); head
    dims the kernel does not build run zero-padded to a built pair, and views TMA cannot read
    are copied first (`fa4lab.canonical.for_kernel`: what each costs)."""
    grad = needs_grad(q, k, v, learnable_sink)
    if grad and not torch.compiler.is_compiling():
        refuse_gradients_on_cuda(q, k, v, learnable_sink)   # traced: the op's autograd setup
    causal, return_lse = bool(causal), bool(return_lse)
    if score_mod is not None or mask_mod is not None or aux_tensors is not None:
        out, lse = _forward_with_mods(q, k, v, causal, softmax_scale, return_lse, pack_gqa,
                                      softcap, window_size, learnable_sink, score_mod, mask_mod,
                                      aux_tensors, num_splits, page_table, deterministic, grad)
    elif grad or _intercepted(q, k, v, learnable_sink, page_table):
        num_splits, (left, right) = op_arguments(pack_gqa, deterministic, num_splits,
                                                 window_size)
        scale = None if softmax_scale is None else float(softmax_scale)
        # with grad the lse is computed for the backward (Note [the backward on the GPU])
        out, lse = attention_forward(q, k, v, causal, scale, return_lse or grad, pack_gqa,
                                     float(softcap), left, right, learnable_sink, num_splits,
                                     page_table, bool(deterministic))
    else:
        out, lse = _forward(q, k, v, causal, softmax_scale, return_lse, pack_gqa, softcap,
                            window_size, learnable_sink, num_splits=num_splits,
                            page_table=page_table, deterministic=deterministic)
    return (out, lse) if return_lse else out


def _warn_slow(q, entry: str, stacklevel: int) -> None:
    """The SlowReferenceWarning of an entry point that computes the float64 reference; a
    stacklevel of 1 is this function, so the caller's caller is 3."""
    where = f"CUDA device {q.device} (compute capability " \
            f"{torch.cuda.get_device_capability(q.device)})" if q.is_cuda else f"{q.device} tensors"
    warnings.warn(
        f"SLOW: {entry} has no kernel for {where}; computing the float64 reference "
        f"instead (correct, but orders of magnitude slower). The kernels run on Hopper "
        f"(sm90) and B200 (sm100) GPUs.", SlowReferenceWarning, stacklevel=stacklevel)


# Note [the same rules on CPU and GPU]
# fa4lab.attention and attention_varlen hold a call to the same rules whatever the device:
# the checks before launch are the same functions (`fa4lab.call.check_call`, the varlen
# check), head dims the kernels do not build run padded on both, and the values of q, k, v are
# not read: a NaN or inf flows through the CPU path's float64 arithmetic as it flows through a
# kernel (the outputs it reaches come out NaN, whatever the mask: 0 * NaN is NaN in P V too),
# where it once raised on the CPU only (after the slow-reference warning).
# `fa4lab.reference.attention_reference`, called explicitly, still refuses non-finite inputs.


def _reference(q, k, v, *, causal, softmax_scale, softcap=0.0, window_size=(None, None),
               learnable_sink=None, **mods):
    from fa4lab.reference import attention_reference

    _warn_slow(q, "fa4lab.attention", stacklevel=5)
    out, lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                   return_lse=True, softcap=softcap, window_size=window_size,
                                   learnable_sink=learnable_sink, finite=False, **mods)
    return out.to(q.dtype), lse.to(torch.float32)


def sdpa_same_dtype(q, k, v, *, causal=False, softmax_scale=None, window_size=(None, None)):
    """PyTorch's own attention in the inputs' dtype: the yardstick for the kernels' error.

    GQA through `enable_gqa`, causal and a window through an explicit bottom-right bool mask
    (`fa4lab.reference.visible_mask`; SDPA's `is_causal` is top-left aligned). Rows that see no
    key come out NaN here; callers drop them. Views TMA could not read either are copied first
    (`fa4lab.canonical.tma_ready`): on an H200 (torch 2.11) SDPA's cuDNN path faulted with a
    misaligned address on a decode q whose data pointer was one element off 16 bytes, a layout
    the fuzzer draws (its seed 4203, case 14); the yardstick's answer does not depend on the
    layout, its crash would kill the run.
    """
    import torch
    import torch.nn.functional as F

    from fa4lab.reference import visible_mask

    q, k, v = (x if tma_ready(x) else x.clone(memory_format=torch.contiguous_format)
               for x in (q, k, v))

    sq, sk = q.shape[1], k.shape[1]
    mask = None
    if normalize_mask(causal, window_size) != (False, (None, None)):
        mask = torch.as_tensor(visible_mask(sq, sk, causal, window_size=window_size),
                               device=q.device)
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
