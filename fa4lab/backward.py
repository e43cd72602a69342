"""The backward of `fa4lab.attention` and `fa4lab.attention_varlen`: their ops' autograd.

    out = fa4lab.attention(q, k, v, causal=True)     # CPU tensors that require grad
    out.sum().backward()                              # q.grad, k.grad, v.grad: float64 math

On CPU tensors the forward is the float64 reference, and so is the backward: the explicit
FlashAttention backward of `fa4lab.reference_backward`, with every option the forward takes
(causal, windows, softcap, the learnable sink, GQA, score_mod / mask_mod, varlen, paged K/V),
rounded once to the inputs' dtypes. On CUDA tensors of a Hopper GPU (sm90) `fa4lab.attention`
is differentiated by the sm90 backward kernel (`fa4lab.kernels.launch_backward`), which reads
the forward's saved out and lse (Note [the backward on the GPU]); elsewhere, and for what that
kernel does not build (varlen, paged K/V, mods), an input that requires grad raises
`GradientNotSupportedError` naming what is missing (Note [backward on CPU, not yet on the
GPU]).

The autograd formulas are registered on the forward ops (`torch.library.register_autograd`,
in `fa4lab.api`) and call backward ops of their own, `torch.ops.fa4lab.attention_backward` and
`attention_varlen_backward`, with fake implementations, so a compiled training step traces
the backward as one opaque node too (Note [the backward ops]). A call with mods, which skips the
forward op, is differentiated by `ReferenceWithMods` (an autograd.Function over the same
backward).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from fa4lab.errors import GradientNotSupportedError
from fa4lab.spec import normalize_mask

__all__ = ["ReferenceWithMods", "attention_backward", "attention_varlen_backward",
           "cuda_backward", "dense_backward", "grad_error", "needs_grad",
           "refuse_gradients_on_cuda", "refuse_unbuilt"]


# Note [backward on CPU, not yet on the GPU]
# An input that requires grad, with grad mode on, is differentiated where the forward was the
# float64 reference's: CPU tensors (any non-CUDA device). There the backward recomputes the
# float64 O and LSE from the saved inputs rather than reading the forward's saved outputs:
# those are rounded to q's dtype and a float32 LSE, and P = exp(S - LSE) is only as exact as
# the LSE it reads (the GPU's backward kernel reads them: Note [the backward on the GPU]).
# On CUDA tensors only the sm90 kernel exists (Note [the backward on the GPU]); where no
# backward kernel runs the call, a silently dropped gradient is worse than an error, so
# GradientNotSupportedError is raised before anything runs: eagerly in
# `attention` / `attention_varlen`, and under torch.compile (where an exception raised in the
# traced Python becomes dynamo's "Observed exception", fa4lab's message buried in its debug
# context) from the ops' autograd setup: AOTAutograd traces the forward with its autograd
# context when a graph input requires grad, so `save_attention` raises at compile time; the
# backward ops raise on CUDA tensors too. On an sm90 GPU the eager check of `attention` lets
# the call through (it does not see the options) and `save_attention` refuses what the kernel
# does not build (`refuse_unbuilt` on the call's `check_call`: `fa4lab.kernels.launch_backward
# .unbuilt`), naming it.
#
# Note [the backward on the GPU]
# On CUDA tensors of an sm90 GPU, `attention_backward` runs `fa4lab.kernels.launch_backward
# .backward` on what the forward saved: the kernel reads the forward's out and its lse, so the
# forward is launched once per training step, as FlashAttention's is. `fa4lab.attention` asks
# the forward op for the lse whenever an input requires grad (its `return_lse` argument is
# then True whatever the caller's, and the caller gets the lse only if it asked), and the op's
# autograd setup (`save_attention`) saves q, k, v, out, lse and the sink; the lse a caller
# gets with return_lse=True is the saved one, so its gradient dlse flows into the backward's
# D = rowsum(dO * O) - dLSE. The op called directly with return_lse=False on CUDA inputs that
# require grad has no lse to save: `save_attention` refuses it, saying to pass True. dQ's
# float32 additions come in whatever order the CTAs reach them unless `deterministic`, which
# travels from `fa4lab.attention` through both ops to the kernel's ordered dQ.


def grad_error(device=None, entry: str = "fa4lab.attention",
               missing: str | None = None) -> GradientNotSupportedError:
    """The error of an input that requires grad where no backward runs (`device` a CUDA
    device: Note [backward on CPU, not yet on the GPU]; None: `entry` has no backward at all);
    `missing` says what the GPU's backward kernel lacks for the call, in words."""
    lacks = "" if missing is None else f" ({missing} is not built yet)"
    where = (f"has no backward kernel on the GPU yet{lacks}, and an input on {device} requires "
             f"grad" if device is not None
             else "has no backward pass yet, and an input requires grad")
    cpu = (f" On CPU tensors {entry} does differentiate: the float64 reference's backward "
           f"(fa4lab.reference_backward)." if device is not None else "")
    return GradientNotSupportedError(
        f"{entry} {where}: the gradient would be lost.{cpu} For training use "
        f"torch.nn.functional.scaled_dot_product_attention (or upstream "
        f"flash_attn.cute.flash_attn_func); for inference call {entry} under torch.no_grad() / "
        f"torch.inference_mode(), or pass q.detach(), k.detach(), v.detach().")


def needs_grad(*tensors) -> bool:
    """Grad mode is on and one of `tensors` (None allowed) requires grad."""
    return torch.is_grad_enabled() and any(getattr(t, "requires_grad", False)
                                           for t in tensors)


def refuse_gradients_on_cuda(*tensors, entry: str = "fa4lab.attention",
                             recording: bool = False) -> None:
    """GradientNotSupportedError (naming `entry`) when a gradient is asked of CUDA tensors
    (Note [backward on CPU, not yet on the GPU]); the tensors may include None. `recording`:
    the caller is an op's setup_context, which autograd calls only when it records the op, and
    with grad mode off (the forward ran below autograd), so grad mode is not asked."""
    if (recording and any(getattr(t, "requires_grad", False) for t in tensors)
            or needs_grad(*tensors)):
        cuda = next((t for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda), None)
        if cuda is not None and not (entry == "fa4lab.attention" and _kernel_arch(cuda)):
            raise grad_error(cuda.device, entry)


def _kernel_arch(t) -> str | None:
    """The kernel arch of CUDA tensor t's GPU when a backward kernel runs there (Note [the
    backward on the GPU]), else None (no GPU visible: fake CUDA tensors on a CPU machine)."""
    from fa4lab.limits import arch_of_capability

    if not torch.cuda.is_available():
        return None
    arch = arch_of_capability(torch.cuda.get_device_capability(t.device))
    return arch if arch == "sm90" else None


def refuse_unbuilt(call, *, entry: str = "fa4lab.attention",
                   deterministic: bool = False) -> None:
    """GradientNotSupportedError naming what the GPU's backward kernel does not build for the
    checked `call` (`fa4lab.kernels.launch_backward.unbuilt`), when one of its tensors
    requires grad and they are CUDA tensors (grad mode not asked: an op's setup_context runs
    with it off, as in `refuse_gradients_on_cuda`)."""
    if not (call.q.is_cuda and any(getattr(t, "requires_grad", False)
                                   for t in (call.q, call.k, call.v, call.sink))):
        return
    from fa4lab.kernels.launch_backward import unbuilt

    lacks = unbuilt(call, _kernel_arch(call.q), deterministic)
    if lacks is not None:
        raise grad_error(call.q.device, entry, lacks)


def _op_call(q, k, v, learnable_sink, page_table, causal, softmax_scale, softcap, window_left,
             window_right):
    """The checked `Call` (`fa4lab.call.check_call`) of the dense op's arguments: the
    forward's options, which the backward reads from it."""
    from fa4lab.call import check_call

    return check_call(q, k, v, causal=causal, softmax_scale=softmax_scale,
                      window_size=(window_left, window_right), softcap=softcap,
                      learnable_sink=learnable_sink, page_table=page_table,
                      check_indices=False)     # the forward's call checked the table's values


# Note [the backward ops]
# `fa4lab::attention_backward` and `fa4lab::attention_varlen_backward` take the gradients of
# (out, lse) and what the forward op saved, and give (dq, dk, dv, dsink); dsink is an empty
# tensor without a sink (an op returns tensors, not None), dlse an empty tensor when the lse
# was not returned. The dense one takes the forward's out and lse too (the GPU kernel reads
# them; the CPU reference recomputes both in float64: Note [backward on CPU, not yet on the
# GPU]). Their fakes give the inputs' shapes, so AOTAutograd traces a backward graph with one
# node per call and never runs Python on fake values. On CUDA tensors the varlen one raises
# GradientNotSupportedError (no backward kernel yet), the dense one runs the sm90 kernel.


def _options(causal, softmax_scale, softcap, window_left, window_right) -> dict:
    causal, window_size = normalize_mask(causal, (window_left, window_right))
    return dict(causal=causal, softmax_scale=softmax_scale, softcap=float(softcap),
                window_size=window_size)


def _finish(grads, q, k, v, learnable_sink):
    """The float64 gradients in the inputs' dtypes, contiguous as the op's fake says; an empty
    dsink without a sink."""
    dq, dk, dv, dsink = grads
    dsink = q.new_empty((0,)) if learnable_sink is None else dsink.to(learnable_sink.dtype)
    return (dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(),
            dv.to(v.dtype).contiguous(), dsink)


def dense_backward(dout, dlse, q, k, v, learnable_sink, page_table, **options):
    """Float64 `Gradients` of `attention`'s forward on CPU tensors (dlse None or (batch,
    heads_q, seqlen_q)); with a page_table k and v are the cache, each sequence's keys gathered
    for the reference backward and their gradients scattered back to the pages."""
    from fa4lab.reference_backward import attention_backward_reference, scatter_paged

    if page_table is None:
        return attention_backward_reference(q, k, v, dout, dlse=dlse,
                                            learnable_sink=learnable_sink, finite=False,
                                            **options)
    from fa4lab.varlen import gather_paged, paged_seqlen_k

    seqlens = [paged_seqlen_k(k, page_table)] * q.shape[0]
    kd, vd = (torch.stack(gather_paged(x, page_table, seqlens)) if seqlens
              else x.new_zeros((0, 0, *x.shape[2:])) for x in (k, v))
    g = attention_backward_reference(q, kd, vd, dout, dlse=dlse, learnable_sink=learnable_sink,
                                     finite=False, **options)
    return g._replace(dk=scatter_paged(list(g.dk), page_table, k.shape),
                      dv=scatter_paged(list(g.dv), page_table, v.shape))


@torch.library.custom_op("fa4lab::attention_backward", mutates_args=())
def attention_backward(dout: torch.Tensor, dlse: torch.Tensor, q: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                       causal: bool, softmax_scale: float | None, softcap: float,
                       window_left: int | None, window_right: int | None,
                       learnable_sink: torch.Tensor | None, page_table: torch.Tensor | None,
                       deterministic: bool = False,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsink) of `fa4lab::attention_forward` (Note [the backward ops]), given the
    forward's saved out and lse ((batch, heads_q, seqlen_q) float32); on CUDA tensors the sm90
    kernel's (Note [the backward on the GPU]), `deterministic` ordering its dQ additions (the
    CPU reference, which recomputes out and lse in float64, is deterministic whatever it
    says)."""
    if q.is_cuda:
        call = _op_call(q, k, v, learnable_sink, page_table, causal, softmax_scale, softcap,
                        window_left, window_right)
        return cuda_backward(call, dout, dlse, out, lse, deterministic=deterministic)
    g = dense_backward(dout, dlse if dlse.numel() else None, q, k, v, learnable_sink,
                       page_table, **_options(causal, softmax_scale, softcap, window_left,
                                              window_right))
    return _finish(g, q, k, v, learnable_sink)


def cuda_backward(call, dout, dlse, out, lse, *, deterministic: bool = False):
    """(dq, dk, dv, dsink) of the checked `call` on CUDA tensors: the backward kernel on the
    forward's saved out and lse, no forward launched (Note [the backward on the GPU]);
    GradientNotSupportedError naming what is missing where no kernel runs the call."""
    from fa4lab.kernels import launch_backward

    arch = _kernel_arch(call.q)
    lacks = launch_backward.unbuilt(call, arch, deterministic)
    if lacks is not None:
        raise grad_error(call.q.device, missing=lacks)
    q, k, v = (launch_backward.kernel_layout(t) for t in (call.q, call.k, call.v))
    dq, dk, dv, dsink = launch_backward.backward(
        replace(call, q=q, k=k, v=v).for_kernel(arch, pad=False), out,
        launch_backward.kernel_layout(dout), lse, dlse=dlse if dlse.numel() else None,
        deterministic=deterministic, arch=arch)
    # contiguous, as the fake says (a no-op where the kernel's layout already is)
    return (dq.contiguous(), dk.contiguous(), dv.contiguous(),
            q.new_empty((0,)) if dsink is None else dsink)


@attention_backward.register_fake
def _attention_backward_fake(dout, dlse, q, k, v, out, lse, causal, softmax_scale, softcap,
                             window_left, window_right, learnable_sink, page_table,
                             deterministic=False):
    # contiguous gradients whatever the inputs' strides: what cuda_backward returns (under
    # torch.compile the graph asserts the real op's strides against these)
    dsink = q.new_empty((0,)) if learnable_sink is None else torch.empty_like(learnable_sink)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsink


def _materialized(dout, dlse, out_like):
    """Autograd hands None for an output the loss did not read."""
    dout = torch.zeros_like(out_like) if dout is None else dout
    return dout, (out_like.new_empty((0,)) if dlse is None else dlse)


def save_attention(ctx, inputs, output) -> None:
    """setup_context of `fa4lab::attention_forward`: refuse what no backward runs (Note
    [backward on CPU, not yet on the GPU]), save the inputs and the forward's out and lse (Note
    [the backward on the GPU])."""
    (q, k, v, causal, softmax_scale, return_lse, _pack_gqa, softcap, window_left,
     window_right, learnable_sink, _num_splits, page_table, deterministic) = inputs
    refuse_gradients_on_cuda(q, k, v, learnable_sink, recording=True)
    if q.is_cuda:
        refuse_unbuilt(_op_call(q, k, v, learnable_sink, page_table, causal, softmax_scale,
                                softcap, window_left, window_right),
                       deterministic=deterministic)
    if q.is_cuda and not return_lse:
        raise GradientNotSupportedError(
            "fa4lab::attention_forward was called with return_lse=False on CUDA inputs that "
            "require grad: its backward kernel reads the forward's lse, which was not "
            "computed. Pass return_lse=True (fa4lab.attention does whenever an input requires "
            "grad), or call it under torch.no_grad().")
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, learnable_sink, page_table)
    ctx.set_materialize_grads(False)    # an lse nobody read: dlse None, as without it
    ctx.options = (causal, softmax_scale, softcap, window_left, window_right)
    ctx.deterministic = deterministic


def attention_forward_backward(ctx, dout, dlse):
    """The autograd formula of `fa4lab::attention_forward`: its backward op on the saved
    tensors, gradients for q, k, v and the sink, None for the other arguments."""
    q, k, v, out, lse, learnable_sink, page_table = ctx.saved_tensors
    dout, dlse = _materialized(dout, dlse, out)
    dq, dk, dv, dsink = torch.ops.fa4lab.attention_backward(
        dout, dlse, q, k, v, out, lse, *ctx.options, learnable_sink, page_table,
        ctx.deterministic)
    return (dq, dk, dv, None, None, None, None, None, None, None,
            None if learnable_sink is None else dsink, None, None, None)


@torch.library.custom_op("fa4lab::attention_varlen_backward", mutates_args=())
def attention_varlen_backward(dout: torch.Tensor, dlse: torch.Tensor, q: torch.Tensor,
                              k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                              cu_seqlens_k: torch.Tensor | None,
                              seqused_k: torch.Tensor | None,
                              page_table: torch.Tensor | None, causal: bool,
                              softmax_scale: float | None, softcap: float,
                              window_left: int | None, window_right: int | None,
                              learnable_sink: torch.Tensor | None,
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsink) of `fa4lab::attention_varlen_forward` (Note [the backward ops]):
    dk, dv shaped like k, v (the paged cache's with a page_table)."""
    from fa4lab.reference_backward import attention_varlen_backward_reference

    if q.is_cuda:
        raise grad_error(q.device, "fa4lab.attention_varlen")
    g = attention_varlen_backward_reference(
        q, k, v, cu_seqlens_q, cu_seqlens_k, dout, seqused_k=seqused_k, page_table=page_table,
        learnable_sink=learnable_sink, dlse=dlse if dlse.numel() else None, finite=False,
        **_options(causal, softmax_scale, softcap, window_left, window_right))
    return _finish(g, q, k, v, learnable_sink)


@attention_varlen_backward.register_fake
def _attention_varlen_backward_fake(dout, dlse, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                    page_table, causal, softmax_scale, softcap, window_left,
                                    window_right, learnable_sink):
    dsink = q.new_empty((0,)) if learnable_sink is None else torch.empty_like(learnable_sink)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsink


def save_attention_varlen(ctx, inputs, output) -> None:
    """setup_context of `fa4lab::attention_varlen_forward`, as `save_attention`."""
    (q, k, v, cu_seqlens_q, cu_seqlens_k, _max_q, _max_k, seqused_k, page_table, causal,
     softmax_scale, window_left, window_right, softcap, learnable_sink, _return_lse,
     _check_indices, _num_splits, _pack_gqa) = inputs
    refuse_gradients_on_cuda(q, k, v, learnable_sink, entry="fa4lab.attention_varlen",
                             recording=True)
    ctx.save_for_backward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table,
                          learnable_sink)
    ctx.options = (causal, softmax_scale, softcap, window_left, window_right)
    ctx.out_like = output[0]


def attention_varlen_forward_backward(ctx, dout, dlse):
    """The autograd formula of `fa4lab::attention_varlen_forward`."""
    q, k, v, cu_q, cu_k, seqused_k, page_table, learnable_sink = ctx.saved_tensors
    dout, dlse = _materialized(dout, dlse, ctx.out_like)
    dq, dk, dv, dsink = torch.ops.fa4lab.attention_varlen_backward(
        dout, dlse, q, k, v, cu_q, cu_k, seqused_k, page_table, *ctx.options, learnable_sink)
    return ((dq, dk, dv) + (None,) * 11 + (None if learnable_sink is None else dsink,)
            + (None,) * 4)


class ReferenceWithMods(torch.autograd.Function):
    """`attention` with score_mod / mask_mod on CPU tensors that require grad: a callable
    cannot be an argument of the forward op, so this Function carries the call instead.
    forward(q, k, v, learnable_sink, forward_fn, options) runs `forward_fn(q, k, v,
    learnable_sink)` -> (out, lse) (`fa4lab.api.dense._forward` with the call's options, lse
    always computed); backward is `dense_backward` with the mods in `options`. The caller
    (`fa4lab.api.dense`) has refused CUDA tensors (`refuse_gradients_on_cuda`, `refuse_unbuilt`
    on its checked call) before it applies this."""

    @staticmethod
    def forward(ctx, q, k, v, learnable_sink, forward_fn, options: dict):
        out, lse = forward_fn(q, k, v, learnable_sink)
        ctx.save_for_backward(q, k, v, learnable_sink)
        ctx.options = options
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, learnable_sink = ctx.saved_tensors
        options = dict(ctx.options)
        page_table = options.pop("page_table")
        g = dense_backward(dout, dlse, q, k, v, learnable_sink, page_table, **options)
        dq, dk, dv, dsink = _finish(g, q, k, v, learnable_sink)
        return dq, dk, dv, (None if learnable_sink is None else dsink), None, None
