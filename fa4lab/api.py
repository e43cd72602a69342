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

Pack-GQA folds the query heads that share a KV head into one CTA's rows, so K/V are read once
per group (decode and short seqlen_q gain most). By default (`pack_gqa=None`) it is on whenever
heads_q / heads_kv > 1 divides the Q tile's rows (64 on Hopper, 128 on the B200) and packing
takes fewer Q tiles than not, or (on Hopper) at head_dim 64 or where a narrow window makes packed
tiles read far fewer keys (`fa4lab.limits.pack_gqa_default`); `pack_gqa=True` / `False` force it
(True with a ratio that does not divide the tile raises PlanError). The B200 packed kernel is
compiled and audited but not yet run on a B200. The reference ignores it.

`softcap=c > 0` caps the scores as Gemma 2 does: s -> c * tanh(s / c) on s = softmax_scale * q.k,
before the softmax (0, the default, is off; Note [softcap] in `fa4lab.kernels.device.softmax`).
`window_size=(left, right)` is a sliding window on the bottom-right diagonal: query i sees key
j iff i + d - left <= j <= i + d + right, d = seqlen_k - seqlen_q, None for an unbounded side
(causal=True is right = 0; a negative side moves its edge past the diagonal, as upstream reads
it, and both negative, FA2's (-1, -1), is no window: Note [window and causal] in
`fa4lab.spec`). The kernels never load the key blocks outside it. `learnable_sink` (heads_q,)
float32 adds e^{sink[h]} to every softmax denominator of query head h (GPT-OSS; Note [sinks]
in `fa4lab.kernels.device.softmax`): a row that sees no key then gives out 0 and lse =
sink[h]. A new window size, sink, scale or cap value never compiles a new kernel; which window
sides exist and whether a sink comes do. The argument names are upstream FA4's
`flash_attn_func`'s where the meaning is the same.

Split-KV (flash-decoding, `fa4lab.splitkv`): `num_splits=n > 1` cuts each tile's keys into n
ranges run by n CTAs, whose float32 partial outputs and LSEs the combine kernel merges (the sink
joins there); 1 never splits; None (the default) chooses for the shape and the GPU
(`fa4lab.splitkv.choose_num_splits`: decode shapes that cannot fill the GPU split, prefill does
not). The split count is a runtime value: no compile per count. Not with mods yet.

`score_mod(score, b, h, q_idx, kv_idx[, aux])`, `mask_mod(b, h, q_idx, kv_idx[, aux])` and
`aux_tensors` are FlexAttention-style user functions compiled into the kernel (`fa4lab.mods`:
the contract, what a mod may use, ready-made ALiBi / relative-bias / document / prefix-LM mods).
Each new mod compiles once per process (never cached on disk), and a call with mods skips the
custom op: torch.compile graph-breaks there (Note [mods in the kernels] in `fa4lab.mods`).

Bad inputs raise before anything runs, with what is wrong and what to do (one check per call,
`fa4lab.spec.check_inputs`). Gradients: on CPU tensors that require grad, autograd
differentiates the float64 reference (`fa4lab.backward`: the explicit backward of
`fa4lab.reference_backward`); on CUDA tensors there is no backward kernel yet, and inputs that
require grad raise `GradientNotSupportedError` while grad mode is on (a silently dropped
gradient is worse than an error). Compiled kernels are kept per configuration
(`fa4lab.kernels.launch`) and on disk (`fa4lab.kernels.cache`, shared across processes): the
same head_dim, dtype, causal flag, GQA ratio and LSE flag never compile twice, whatever the
batch, sequence lengths or softmax scale (a runtime argument of the kernel).

`page_table` (int32 (batch, pages_per_seq)) makes k and v a paged K/V cache (num_pages,
page_size, heads_kv, d), `fa4lab.varlen`'s layout: sequence b's keys are its pages
page_table[b, 0], page_table[b, 1], ..., pages_per_seq * page_size of them; q stays dense. The
kernels read the pages in place (Note [paged key blocks] in `fa4lab.kernels.device.paged`: the
page size must be a multiple of the kernel's key block or divide it); a new page table costs no
compile, a new page size does. num_splits splits a paged cache's keys as it does contiguous
ones (None chooses from the table's capacity). The reference gathers the sequences' K/V first.

`attention_varlen` takes variable-length batches (packed tokens + cu_seqlens) and paged K/V
caches (`fa4lab.varlen`): one varlen kernel launch per batch; a paged cache whose sequences
all have the same query count (decode) is one paged launch (split-KV and the combine when the
shape asks, as `attention` chooses); other paged batches (chunked prefill) are one varlen launch
over the pages on the archs where it has run (`fa4lab.kernels.launch.PAGED_VARLEN_ARCHS`: the
H100/H200), `attention` once per sequence elsewhere.

torch.compile and CUDA graphs: `attention` is backed by the custom op
`torch.ops.fa4lab.attention_forward` (Note [the attention op]), `attention_varlen` by
`torch.ops.fa4lab.attention_varlen_forward` (Note [the varlen op]).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from fa4lab import backward
from fa4lab.backward import needs_grad, refuse_gradients_on_cuda
from fa4lab.canonical import empty_answer, for_kernel, narrow_out, tma_ready
from fa4lab.errors import GradientNotSupportedError, InputTypeError, UnsupportedArchError
from fa4lab.kernels import launch
from fa4lab.spec import check_inputs, check_kernel_inputs, check_qkv_shapes, normalize_mask
from fa4lab.splitkv import check_num_splits
from fa4lab.varlen_forms import varlen_form, with_seqused_q

if TYPE_CHECKING:
    from fa4lab.varlen_metadata import SchedulerMetadata


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
# Gradients (Note [backward on CPU, not yet on the GPU] in fa4lab.backward): on CPU tensors
# that require grad, `attention` calls the op (not `_forward`) so autograd records it, and the
# op's autograd formula runs the float64 reference backward through its own op,
# `fa4lab::attention_backward`. On CUDA tensors `attention` raises before launch, and so does
# the op's autograd setup when the op is called directly: a gradient is never dropped silently.


def _forward(q, k, v, causal: bool, softmax_scale, return_lse: bool, pack_gqa: bool | None,
             softcap: float = 0.0, window_size=(None, None), learnable_sink=None,
             score_mod=None, mask_mod=None, aux_tensors=None, num_splits=None, page_table=None):
    """(out, lse or None): the kernel of q's GPU, or the float64 reference where none runs."""
    arch = launch.device_arch(q.device.index) if isinstance(q, torch.Tensor) and q.is_cuda \
        else None
    causal, window_size = normalize_mask(causal, window_size)
    if page_table is not None:
        from fa4lab.varlen import check_paged, gather_paged, paged_seqlen_k

        check_paged(q, k, v, page_table)
    check_inputs(q, k, v, softmax_scale=softmax_scale, softcap=softcap,
                 window_size=window_size, learnable_sink=learnable_sink, page_table=page_table)
    num_splits = check_num_splits(num_splits)
    mods, aux = None, ()
    if score_mod is not None or mask_mod is not None or aux_tensors is not None:
        from fa4lab.mods import check_mods, refuse_split_with_mods

        mods, aux = check_mods(score_mod, mask_mod, aux_tensors, q.device)
        refuse_split_with_mods(num_splits not in (None, 1), True, num_splits)
    if page_table is not None:
        seqlen_k = paged_seqlen_k(k, page_table)
    else:
        seqlen_k = k.shape[1]
    if q.numel() == 0 or seqlen_k == 0:
        return empty_answer(q, v.shape[-1], learnable_sink, return_lse)
    if arch is not None:
        dv = v.shape[-1]
        q, k, v, softmax_scale = for_kernel(arch, q, k, v, softmax_scale)
        check_kernel_inputs(q, k, v, arch)
        out, lse = launch.forward(q, k, v, arch, causal, softmax_scale, return_lse, pack_gqa,
                                  softcap, window_size, learnable_sink, mods, aux,
                                  num_splits=num_splits, page_table=page_table)
        return narrow_out(out, dv), lse
    if page_table is not None:     # the reference reads each sequence's gathered K/V
        seqlens = [seqlen_k] * q.shape[0]
        k, v = (torch.stack(gather_paged(x, page_table, seqlens)) for x in (k, v))
    out, lse = _reference(q, k, v, causal=causal, softmax_scale=softmax_scale, softcap=softcap,
                          window_size=window_size, learnable_sink=learnable_sink,
                          score_mod=score_mod, mask_mod=mask_mod, aux_tensors=aux_tensors)
    return out, (lse if return_lse else None)


def _forward_with_mods(q, k, v, causal, softmax_scale, return_lse, pack_gqa, softcap,
                       window_size, learnable_sink, score_mod, mask_mod, aux_tensors,
                       num_splits=None, page_table=None, grad: bool = False):
    """`_forward` outside any torch.compile graph: a callable cannot be an argument of the
    custom op, so a call with mods is a graph break (Note [mods in the kernels]). Eager calls
    (nothing tracing) call `_forward` directly: `torch.compiler.disable` imports torch._dynamo
    (about a second), which `import fa4lab` should not pay for. With `grad` (an input requires
    grad) the call is differentiated by `fa4lab.backward.ReferenceWithMods`."""
    fn = _differentiable_with_mods if grad else _forward
    if torch.compiler.is_compiling():
        fn = _outside_graph(fn)
    return fn(q, k, v, causal, softmax_scale, return_lse, pack_gqa, softcap, window_size,
              learnable_sink, score_mod, mask_mod, aux_tensors, num_splits, page_table)


def _differentiable_with_mods(q, k, v, causal, softmax_scale, return_lse, pack_gqa, softcap,
                              window_size, learnable_sink, score_mod, mask_mod, aux_tensors,
                              num_splits=None, page_table=None):
    """`_forward` with mods, recorded for autograd (CPU tensors; CUDA ones raise: Note
    [backward on CPU, not yet on the GPU] in fa4lab.backward)."""
    refuse_gradients_on_cuda(q, k, v, learnable_sink)

    def forward(q, k, v, learnable_sink):
        return _forward(q, k, v, causal, softmax_scale, True, pack_gqa, softcap, window_size,
                        learnable_sink, score_mod, mask_mod, aux_tensors, num_splits,
                        page_table)

    causal_n, window_n = normalize_mask(causal, window_size)
    options = dict(causal=causal_n, softmax_scale=softmax_scale, softcap=float(softcap),
                   window_size=window_n, score_mod=score_mod, mask_mod=mask_mod,
                   aux_tensors=aux_tensors, page_table=page_table)
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
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered op: (out, lse); lse is an empty float32 tensor unless return_lse. The
    window's sides are window_left / window_right (None = unbounded); with page_table, k and v
    are a paged cache."""
    out, lse = _forward(q, k, v, causal, softmax_scale, return_lse, pack_gqa, softcap,
                        (window_left, window_right), learnable_sink, num_splits=num_splits,
                        page_table=page_table)
    if lse is None:
        lse = q.new_empty((0,), dtype=torch.float32)
    return out, lse


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, causal, softmax_scale, return_lse, pack_gqa, softcap,
                            window_left=None, window_right=None, learnable_sink=None,
                            num_splits=None, page_table=None):
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


def _check_switches(pack_gqa, deterministic) -> None:
    """pack_gqa None (choose), True or False; deterministic a bool (the forward is
    deterministic whatever it says: it is accepted for upstream's signature)."""
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise InputTypeError(f"pack_gqa must be None (choose), True or False, got {pack_gqa!r}")
    if not isinstance(deterministic, bool):
        raise InputTypeError(f"deterministic must be True or False, got {deterministic!r}")


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
    None choosing from the table's capacity). `deterministic` is accepted for upstream's
    signature: the forward is deterministic whatever it says. Empty calls (batch, seqlen_q or
    seqlen_k 0) are answered without a launch (Note [empty calls] in fa4lab.canonical); head
    dims the kernel does not build run zero-padded to a built pair, and views TMA cannot read
    are copied first (`fa4lab.canonical.for_kernel`: what each costs)."""
    _check_switches(pack_gqa, deterministic)
    grad = needs_grad(q, k, v, learnable_sink)
    if grad and not torch.compiler.is_compiling():
        refuse_gradients_on_cuda(q, k, v, learnable_sink)   # traced: the op's autograd setup
    causal, return_lse = bool(causal), bool(return_lse)
    num_splits = check_num_splits(num_splits)
    if score_mod is not None or mask_mod is not None or aux_tensors is not None:
        out, lse = _forward_with_mods(q, k, v, causal, softmax_scale, return_lse, pack_gqa,
                                      softcap, window_size, learnable_sink, score_mod, mask_mod,
                                      aux_tensors, num_splits, page_table, grad)
    elif grad or _intercepted(q, k, v, learnable_sink, page_table):
        scale = None if softmax_scale is None else float(softmax_scale)
        causal, (left, right) = normalize_mask(causal, window_size)
        out, lse = attention_forward(q, k, v, causal, scale, return_lse, pack_gqa,
                                     float(softcap), left, right, learnable_sink, num_splits,
                                     page_table)
    else:
        out, lse = _forward(q, k, v, causal, softmax_scale, return_lse, pack_gqa, softcap,
                            window_size, learnable_sink, num_splits=num_splits,
                            page_table=page_table)
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
# the checks before launch are the same functions (`fa4lab.spec.check_inputs`, the varlen
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


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor | None = None,
                     cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                     max_seqlen_k: int | None = None, *, seqused_q: torch.Tensor | None = None,
                     seqused_k: torch.Tensor | None = None,
                     page_table: torch.Tensor | None = None, causal: bool = False,
                     softmax_scale: float | None = None,
                     window_size: tuple[int | None, int | None] = (None, None),
                     softcap: float = 0.0, learnable_sink: torch.Tensor | None = None,
                     num_splits: int | None = None, pack_gqa: bool | None = None,
                     deterministic: bool = False, return_lse: bool = False,
                     check_indices: bool | str = "device",
                     scheduler_metadata: SchedulerMetadata | None = None,
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention forward of a variable-length batch: out, or (out, lse) when return_lse.

    The layout (packed q (total_q, heads_q, head_dim), packed k / v with int32 cu_seqlens_k, or
    a paged cache (num_pages, page_size, heads_kv, d) with an int32 page_table and cu_seqlens_k
    None; optional seqused_k) is `fa4lab.varlen`'s, and the argument names upstream FA4's
    `flash_attn_varlen_func`'s. Each sequence is one attention problem with `attention`'s
    options and semantics on its own lengths. Upstream's other forms are taken too (Note
    [upstream varlen forms] in fa4lab.varlen_forms): a dense q (batch, seqlen_q, heads_q, d)
    with cu_seqlens_q None (out then (batch, seqlen_q, heads_q, dv), lse (batch, heads_q,
    seqlen_q)), dense k, v with cu_seqlens_k None and no page_table, and `seqused_q` (int32
    (batch,)): sequence i uses its first seqused_q[i] query rows, its causal diagonal aligned
    on them; the rows past them come back 0 (lse -inf or the sink; upstream leaves them
    unwritten): Note [seqused_q as phantom sequences]. out (total_q, heads_q, head_dim_v) in
    q's dtype; lse (heads_q, total_q) float32, -inf (or the sink) for rows that see no key. An
    empty batch (no packed query, or no key at all) is answered without a launch (Note [empty
    calls] in fa4lab.canonical), head dims the kernel does not build run zero-padded and views TMA
    cannot read are copied first (`fa4lab.canonical.for_kernel`), as in `attention`.
    num_splits and pack_gqa choose how a paged decode batch (one paged launch, below) is
    computed, as in `attention`; the varlen launch neither splits nor packs, whatever they say
    (the answer is the same). `deterministic` is accepted for upstream's signature: the forward
    is deterministic whatever it says.

    Bad inputs raise before anything runs (`fa4lab.varlen.check_varlen`, then the options as
    `attention` checks them); gradients as in `attention`: the float64 reference's on CPU
    tensors, `GradientNotSupportedError` on CUDA ones. The index tensors' values (cu_seqlens,
    seqused_k, page_table, against the max_seqlens) are checked as `check_indices` says (Note
    [reading the lengths] in fa4lab.varlen): "device" (the default) by one small kernel on the
    GPU, with no wait: a bad value raises its InputError (naming the tensor and its first bad
    index) at the next varlen or paged call after the check has run, or at
    `fa4lab.check_errors()`, which waits for it; the bad call itself has run by then, its
    outputs not meaningful (the kernels clamp page ids and sequences into their tensors, so a
    bad index never faults or writes outside out). True checks before the
    launch (one device-to-host copy: a synchronisation, for debugging); False skips the check where
    the caller vouches for the values. On CPU tensors "device" is True. A CUDA graph capture
    skips the check. Nothing else of the kernel path reads the values: the call never waits for
    the GPU and can be captured.
    On CPU tensors: the float64 reference
    (`fa4lab.reference.attention_varlen_reference`) cast back, with a `SlowReferenceWarning`.
    On a Hopper or B200 GPU without a page_table: the varlen kernel, one launch over the
    batch's real tiles (`fa4lab.kernels.launch.forward_varlen`; one compile per configuration,
    whatever the lengths). With a page_table there, when every sequence has the same query
    count L (decode: L = 1): one paged launch over q viewed as (batch, L, heads_q, d), each
    sequence's keys its seqused_k, split across CTAs when the shape asks (`_paged_same_length`);
    a page_table with ragged query counts (chunked prefill): one varlen launch over the pages
    on the archs of `fa4lab.kernels.launch.PAGED_VARLEN_ARCHS` (sm90; the sm100 kernel is
    compiled and audited, not yet run), elsewhere one `fa4lab.attention` call per sequence
    (a paged sequence's K/V gathered into contiguous tensors first).

    `scheduler_metadata` (`fa4lab.scheduler_metadata(...)` of the same index tensors) skips
    the work those tensors alone decide, their check included, in every layer after the first
    (Note [scheduler metadata] in fa4lab.varlen_metadata).

    torch.compile and CUDA graphs: backed by the custom op
    `torch.ops.fa4lab.attention_varlen_forward` (Note [the varlen op]); a traced call derives
    what it needs itself, whatever `scheduler_metadata` says.
    """
    grad = needs_grad(q, k, v, learnable_sink)
    if grad and not torch.compiler.is_compiling():     # traced: the op's autograd setup
        refuse_gradients_on_cuda(q, k, v, learnable_sink, entry="fa4lab.attention_varlen")
    causal, return_lse = bool(causal), bool(return_lse)
    _check_switches(pack_gqa, deterministic)
    num_splits = check_num_splits(num_splits)
    # On CPU tensors that require grad, the op: autograd records it (fa4lab.backward).
    intercepted = grad or _intercepted(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q,
                                       seqused_k, page_table, learnable_sink)
    if not intercepted:     # one path: the index work of Note [scheduler metadata]
        from fa4lab.varlen_metadata import SchedulerMetadata
        from fa4lab.varlen_metadata import scheduler_metadata as make

        if scheduler_metadata is None:      # this call's own, checked as check_indices says
            scheduler_metadata = make(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k, seqused_q=seqused_q, seqused_k=seqused_k,
                                      page_table=page_table, check_indices=check_indices)
        elif not isinstance(scheduler_metadata, SchedulerMetadata):
            raise InputTypeError(f"scheduler_metadata must be what fa4lab.scheduler_metadata("
                                 f"...) returns, got {type(scheduler_metadata).__name__}")
        form = scheduler_metadata.form_for(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q,
                                           seqused_k, page_table)
        out, lse = _forward_varlen(*form[:9], causal, softmax_scale, window_size, softcap,
                                   learnable_sink, return_lse, False, num_splits, pack_gqa,
                                   scheduler_metadata)
        out, lse = form.restore(out, lse if return_lse else None)
        return (out, lse) if return_lse else out
    # Traced: the op derives and checks the index work itself (Note [the varlen op]).
    form = varlen_form(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       seqused_q, seqused_k, page_table)
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = form[:7]
    if seqused_q is not None:   # Note [seqused_q as phantom sequences] in fa4lab.varlen_forms
        cu_seqlens_q, cu_seqlens_k, seqused_k, page_table = with_seqused_q(
            q, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table,
            None if page_table is None else int(k.shape[1]))
    from fa4lab.varlen import check_mode

    scale = None if softmax_scale is None else float(softmax_scale)
    causal, (left, right) = normalize_mask(causal, window_size)
    out, lse = attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, seqused_k, page_table, causal, scale,
                                        left, right, float(softcap), learnable_sink,
                                        return_lse, check_mode(check_indices), num_splits,
                                        pack_gqa)
    out, lse = form.restore(out, lse if return_lse else None)
    return (out, lse) if return_lse else out


def _forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                    page_table, causal: bool, softmax_scale, window_size, softcap: float,
                    learnable_sink, return_lse: bool, check_indices, num_splits=None,
                    pack_gqa: bool | None = None, metadata=None):
    """(out, lse or None) of `attention_varlen`: the kernel of q's GPU, or the reference;
    `metadata` a `fa4lab.varlen_metadata.SchedulerMetadata` of these index tensors (their
    lengths checked, the launch's tables kept: Note [scheduler metadata])."""
    from fa4lab.reference import attention_varlen_reference
    from fa4lab.varlen import check_varlen

    if metadata is not None:
        lengths = metadata.lengths
    else:
        lengths = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, seqused_k, page_table, check_indices=check_indices)
    causal, window_size = normalize_mask(causal, window_size)
    num_splits = check_num_splits(num_splits)
    arch = launch.device_arch(q.device.index) if q.is_cuda else None
    # The options are checked as `attention` checks them, on one-token stand-ins of q, k, v.
    check_inputs(*(t.new_empty((1, 1, t.shape[-2], t.shape[-1])) for t in (q, k, v)),
                 softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                 learnable_sink=learnable_sink)
    no_keys = (k.shape[0] == 0) if page_table is None else (page_table.shape[1] == 0)
    if q.shape[0] == 0 or no_keys:
        return empty_answer(q, v.shape[-1], learnable_sink, return_lse, varlen=True)
    if arch is not None:
        dv = v.shape[-1]
        q, k, v, softmax_scale = for_kernel(arch, q, k, v, softmax_scale)
        check_kernel_inputs(q, k, v, arch)
    options = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                   softcap=softcap, learnable_sink=learnable_sink)
    if arch is not None:
        out, lse = _varlen_on_kernel(q, k, v, lengths, seqused_k, page_table, arch, options,
                                     return_lse, num_splits, pack_gqa,
                                     None if metadata is None else metadata.launch)
        return narrow_out(out, dv), lse
    if not q.is_cuda:
        _warn_slow(q, "fa4lab.attention_varlen", stacklevel=4)
        out, lse = attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                              seqused_k=seqused_k, page_table=page_table,
                                              return_lse=True, finite=False, **options)
        return out.to(q.dtype), (lse.to(torch.float32) if return_lse else None)
    return _per_sequence(q, k, v, lengths, page_table, return_lse, options)


def _varlen_on_kernel(q, k, v, lengths, seqused_k, page_table, arch: str, options: dict,
                      return_lse: bool, num_splits, pack_gqa, tables: dict | None = None):
    """`_forward_varlen` on the kernel of `arch`, q, k, v in its form: a paged decode batch
    as one paged launch (split and packed as `attention` chooses, or as num_splits / pack_gqa
    say), other batches as one varlen launch (which neither splits nor packs: those two only
    choose how the same answer is computed), or one `attention` call per sequence where no
    varlen launch over pages runs (`launch.PAGED_VARLEN_ARCHS`); `options` are `attention`'s
    (causal, softmax_scale, window_size, softcap, learnable_sink); `tables` a scheduler
    metadata's launch tables (Note [scheduler metadata] in fa4lab.varlen_metadata)."""
    if page_table is not None and lengths.same_query_count(q.shape[0]):
        return _paged_same_length(q, k, v, lengths, seqused_k, page_table, arch, return_lse,
                                  options, num_splits, pack_gqa)
    if page_table is None or arch in launch.PAGED_VARLEN_ARCHS:
        # one launch over the batch's real tiles, over packed K/V or the pages in place
        return launch.forward_varlen(q, k, v, lengths, arch, options["causal"],
                                     options["softmax_scale"], return_lse,
                                     float(options["softcap"]), options["window_size"],
                                     options["learnable_sink"], page_table, tables)
    return _per_sequence(q, k, v, lengths, page_table, return_lse, options)


def _per_sequence(q, k, v, lengths, page_table, return_lse: bool, options: dict):
    """(out, lse or None) of a varlen batch as one `attention` call per sequence (a paged
    sequence's K/V gathered into contiguous tensors first)."""
    from fa4lab.reference import attention_varlen_reference
    from fa4lab.varlen import sequence_kv, unpack

    total_q, heads_q = q.shape[0], q.shape[1]
    out = q.new_zeros((total_q, heads_q, v.shape[-1]))
    lse = torch.full((heads_q, total_q), -float("inf"), dtype=torch.float32, device=q.device)
    cu = lengths.cu_seqlens_q
    for b, (q_b, (k_b, v_b)) in enumerate(zip(unpack(q, cu),
                                               sequence_kv(lengths, k, v, page_table))):
        rows = slice(cu[b], cu[b + 1])
        if q_b.shape[0] == 0:
            continue
        if k_b.shape[0] == 0:       # no key to launch over: the reference's empty rows
            cu_q_b, cu_k_b = (torch.tensor([0, n], dtype=torch.int32, device=q.device)
                              for n in (q_b.shape[0], 0))
            o_b, lse_b = attention_varlen_reference(q_b, k_b, v_b, cu_q_b, cu_k_b,
                                                    return_lse=True, **options)
            out[rows], lse[:, rows] = o_b.to(q.dtype), lse_b.to(torch.float32)
            continue
        o_b, lse_b = attention(q_b[None], k_b[None], v_b[None], return_lse=True, **options)
        out[rows], lse[:, rows] = o_b[0], lse_b[0]
    return out, (lse if return_lse else None)


# Note [the varlen op]
# `fa4lab::attention_varlen_forward` is `attention_varlen` as a torch custom op, as Note [the
# attention op] says of `attention`: eager calls skip the dispatcher, traced or intercepted
# calls go through the op. Its fake implementation checks what the shapes show
# (`fa4lab.varlen.check_varlen_shapes`) and gives out (total_q, heads_q, head_dim_v) and lse
# (heads_q, total_q) from the shapes alone: it never reads a length, so under
# torch.compile(dynamic=True) a new packed total or batch is a new size, not a new graph. The
# value check runs in the real implementation, when the graph runs (check_indices as a str of
# `fa4lab.varlen.CHECK_MODES`: "device" queues the device check, "sync" makes one
# device-to-host copy, "off" nothing; none inside a CUDA graph capture: Note [reading the
# lengths] in fa4lab.varlen).


@torch.library.custom_op("fa4lab::attention_varlen_forward", mutates_args=())
def attention_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor | None,
                             max_seqlen_q: int | None, max_seqlen_k: int | None,
                             seqused_k: torch.Tensor | None, page_table: torch.Tensor | None,
                             causal: bool, softmax_scale: float | None,
                             window_left: int | None, window_right: int | None,
                             softcap: float, learnable_sink: torch.Tensor | None,
                             return_lse: bool, check_indices: str,
                             num_splits: int | None = None, pack_gqa: bool | None = None,
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered op: (out, lse); lse is an empty float32 tensor unless return_lse."""
    out, lse = _forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               seqused_k, page_table, causal, softmax_scale,
                               (window_left, window_right), softcap, learnable_sink, return_lse,
                               check_indices, num_splits, pack_gqa)
    if lse is None:
        lse = q.new_empty((0,), dtype=torch.float32)
    return out, lse


@attention_varlen_forward.register_fake
def _attention_varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, seqused_k, page_table, causal, softmax_scale,
                                   window_left, window_right, softcap, learnable_sink,
                                   return_lse, check_indices, num_splits=None, pack_gqa=None):
    from fa4lab.varlen import check_varlen_shapes

    check_varlen_shapes(q, k, v, page_table is not None)
    normalize_mask(causal, (window_left, window_right))
    total_q, heads_q = q.shape[0], q.shape[1]
    return (q.new_empty((total_q, heads_q, v.shape[-1])),
            q.new_empty((heads_q, total_q) if return_lse else (0,), dtype=torch.float32))


attention_varlen_forward.register_autograd(backward.attention_varlen_forward_backward,
                                           setup_context=backward.save_attention_varlen)


def _paged_same_length(q, k_cache, v_cache, lengths, seqused_k, page_table, arch: str,
                       return_lse: bool, options: dict, num_splits=None,
                       pack_gqa: bool | None = None):
    """(out, lse or None) in varlen form of a paged batch whose sequences all have L queries
    (`VarlenLengths.same_query_count`): q (batch * L, heads_q, d) is a (batch, L, heads_q,
    d) batch, so ONE launch of the padded paged kernel serves it, each sequence's key count its
    seqused_k (all pages' keys without one: Note [paged key blocks] in
    fa4lab.kernels.device.paged); a decode shape too small for the GPU runs the split-KV
    kernel over the pages and the combine instead (`launch.forward`'s num_splits None: Note
    [choosing num_splits] in fa4lab.splitkv)."""
    batch, heads_q = lengths.batch, q.shape[1]
    q4 = q.reshape(batch, q.shape[0] // batch, heads_q, q.shape[2])
    out, lse = launch.forward(q4, k_cache, v_cache, arch, options["causal"],
                              options["softmax_scale"], return_lse, pack_gqa,
                              float(options["softcap"]), options["window_size"],
                              options["learnable_sink"], num_splits=num_splits,
                              page_table=page_table, seqused_k=seqused_k)
    out = out.view(q.shape[0], heads_q, out.shape[-1])
    if lse is not None:     # (batch, heads_q, L) -> (heads_q, batch * L)
        lse = lse.transpose(0, 1).reshape(heads_q, q.shape[0])
    return out, lse


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


__all__ = ["GradientNotSupportedError", "SlowReferenceWarning", "UnsupportedArchError",
           "attention", "attention_forward", "attention_varlen", "error_vs_reference",
           "sdpa_same_dtype"]
