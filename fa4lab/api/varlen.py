"""`fa4lab.attention_varlen`: the entry point of variable-length batches (packed tokens with
cu_seqlens, upstream's dense and seqused_q forms) and paged K/V caches, and its torch op
`fa4lab::attention_varlen_forward` (Note [the varlen op]). The dispatch and the options are
`fa4lab.attention`'s (`fa4lab.api.dense`); a batch no varlen launch runs is one `attention`
call per sequence.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from fa4lab import backward
from fa4lab.api.dense import _intercepted, _warn_slow, attention, op_arguments
from fa4lab.backward import needs_grad, refuse_gradients_on_cuda
from fa4lab.call import check_call
from fa4lab.canonical import empty_answer, narrow_out
from fa4lab.errors import InputTypeError
from fa4lab.kernels import launch
from fa4lab.spec import normalize_mask
from fa4lab.varlen_forms import varlen_form, with_seqused_q

if TYPE_CHECKING:
    from fa4lab.varlen_metadata import SchedulerMetadata


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
                                   scheduler_metadata, deterministic)
        out, lse = form.restore(out, lse if return_lse else None)
        return (out, lse) if return_lse else out
    # Traced: the op derives and checks the index work itself (Note [the varlen op]).
    num_splits, (left, right) = op_arguments(pack_gqa, deterministic, num_splits, window_size)
    form = varlen_form(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       seqused_q, seqused_k, page_table)
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = form[:7]
    if seqused_q is not None:   # Note [seqused_q as phantom sequences] in fa4lab.varlen_forms
        cu_seqlens_q, cu_seqlens_k, seqused_k, page_table = with_seqused_q(
            q, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table,
            None if page_table is None else int(k.shape[1]))
    from fa4lab.varlen import check_mode

    scale = None if softmax_scale is None else float(softmax_scale)
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
                    pack_gqa: bool | None = None, metadata=None, deterministic: bool = False):
    """(out, lse or None) of `attention_varlen`: the kernel of q's GPU, or the reference;
    `metadata` a `fa4lab.varlen_metadata.SchedulerMetadata` of these index tensors (their
    lengths checked, the launch's tables kept: Note [scheduler metadata]). The layout is
    checked by `fa4lab.varlen.check_varlen` (or was, by the metadata), the rest by
    `fa4lab.call.check_call`, once."""
    from fa4lab.reference import attention_varlen_reference
    from fa4lab.varlen import check_varlen

    if metadata is not None:
        lengths = metadata.lengths
    else:
        lengths = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, seqused_k, page_table, check_indices=check_indices)
    call = check_call(q, k, v, causal=causal, softmax_scale=softmax_scale,
                      window_size=window_size, softcap=softcap, learnable_sink=learnable_sink,
                      return_lse=return_lse, pack_gqa=pack_gqa, deterministic=deterministic,
                      num_splits=num_splits, page_table=page_table, seqused_k=seqused_k,
                      lengths=lengths)
    dv = call.spec.head_dim_v
    if call.empty:
        return empty_answer(q, dv, learnable_sink, return_lse, varlen=True)
    arch = launch.device_arch(q.device.index) if q.is_cuda else None
    if arch is not None:
        out, lse = _varlen_on_kernel(call.for_kernel(arch), arch,
                                     None if metadata is None else metadata.launch)
        return narrow_out(out, dv), lse
    if not q.is_cuda:
        _warn_slow(q, "fa4lab.attention_varlen", stacklevel=4)
        out, lse = attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                              seqused_k=seqused_k, page_table=page_table,
                                              return_lse=True, finite=False, **call.options())
        return out.to(q.dtype), (lse.to(torch.float32) if return_lse else None)
    return _per_sequence(call)


def _varlen_on_kernel(call, arch: str, tables: dict | None = None):
    """`_forward_varlen` on the kernel of `arch`, `call` in its form: a paged decode batch as
    one paged launch (split and packed as `attention` chooses, or as num_splits / pack_gqa
    say), other batches as one varlen launch (which neither splits nor packs: those two only
    choose how the same answer is computed), or one `attention` call per sequence where no
    varlen launch over pages runs (`launch.PAGED_VARLEN_ARCHS`); `tables` a scheduler
    metadata's launch tables (Note [scheduler metadata] in fa4lab.varlen_metadata)."""
    one_launch = call.page_table is None or arch in launch.PAGED_VARLEN_ARCHS
    # A ragged batch is never read to find out (Note [reading the lengths]), except where the
    # one launch over pages does not run and the per-sequence path reads the lengths anyway.
    if call.page_table is not None and call.lengths.same_query_count(call.q.shape[0],
                                                                     read=not one_launch):
        return _paged_same_length(call, arch)
    if one_launch:
        # one launch over the batch's real tiles, over packed K/V or the pages in place
        return launch.forward_varlen(call, arch, tables)
    return _per_sequence(call)


def _per_sequence(call):
    """(out, lse or None) of a checked varlen call as one `attention` call per sequence, with
    the call's options (a paged sequence's K/V gathered into contiguous tensors first)."""
    from fa4lab.reference import attention_varlen_reference
    from fa4lab.varlen import sequence_kv, unpack

    q, k, v, lengths, page_table = call.q, call.k, call.v, call.lengths, call.page_table
    return_lse, options = call.spec.return_lse, call.options()
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
# attention op] in fa4lab.api.dense says of `attention`: eager calls skip the dispatcher,
# traced or intercepted calls go through the op. Its fake implementation checks what the shapes
# show (`fa4lab.varlen.check_varlen_shapes`) and gives out (total_q, heads_q, head_dim_v) and lse
# (heads_q, total_q) from the shapes alone: it never reads a length, so under
# torch.compile(dynamic=True) a new packed total or batch is a new size, not a new graph. The
# value check runs in the real implementation, when the graph runs (check_indices as a str of
# `fa4lab.varlen.CHECK_MODES`: "device" queues the device check, "sync" makes one device-to-host
# copy, "off" nothing; none inside a CUDA graph capture: Note [reading the lengths] in
# fa4lab.varlen).


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


def _paged_same_length(call, arch: str):
    """(out, lse or None) in varlen form of a paged `call` whose sequences all have L queries
    (`VarlenLengths.same_query_count`): q (batch * L, heads_q, d) is a (batch, L, heads_q,
    d) batch, so ONE launch of the padded paged kernel serves it, each sequence's key count its
    seqused_k (all pages' keys without one: Note [paged key blocks] in
    fa4lab.kernels.device.paged); a decode shape too small for the GPU runs the split-KV
    kernel over the pages and the combine instead (`launch.forward`'s num_splits None: Note
    [choosing num_splits] in fa4lab.splitkv)."""
    from fa4lab.varlen import paged_seqlen_k

    q = call.q
    batch, heads_q = call.lengths.batch, q.shape[1]
    q4 = q.reshape(batch, q.shape[0] // batch, heads_q, q.shape[2])
    spec = call.spec.with_(varlen=False, seqlen_q=q4.shape[1],
                           seqlen_k=paged_seqlen_k(call.k, call.page_table))
    out, lse = launch.forward(replace(call, q=q4, spec=spec, lengths=None), arch)
    out = out.view(q.shape[0], heads_q, out.shape[-1])
    if lse is not None:     # (batch, heads_q, L) -> (heads_q, batch * L)
        lse = lse.transpose(0, 1).reshape(heads_q, q.shape[0])
    return out, lse
