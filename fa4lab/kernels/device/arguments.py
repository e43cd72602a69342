"""The forward kernels' argument contract, checked once for both (host side, at trace time).

The sm90 and sm100 kernels take the same arguments in the same order (`KernelArgs`: their
`__call__`s; `KernelArgs.of` fills them from a checked call, `KernelArgs.fake` makes the fake
ones a compile traces): which of them a variant takes follows from its spec -- a mask_mod its
block table, a paged cache its page table and seqused_k, a varlen batch its cu_seqlens and
tile table, a split-KV kernel its partials -- and this module says so once. `scale_args` and
`window_args` turn the call's scale and window into the kernels' runtime arguments (Note
[runtime scale] and Note [runtime window] in fa4lab.kernels.compile).
`check_variant` runs in a kernel's constructor (the combinations no kernel builds yet),
`check_call` when the call is traced (a missing or extra tensor is a ValueError naming the
Note that describes it, never a kernel that reads None), and `packed_views` gives a varlen
call's packed (total, ...) tensors the batch mode the kernels' views expect. The backward
kernels' arguments are `BackwardArgs`, said the same way.
"""

from __future__ import annotations

from typing import NamedTuple

from fa4lab.spec import LOG2E, resolve_scale


class KernelArgs(NamedTuple):
    """The forward kernels' arguments in their order: both kernels' `__call__`s take them so
    (then the stream), `fake` makes them fake for a compile, and every launch in
    `fa4lab.kernels.launch` fills them from its checked call (`fn(*KernelArgs.of(call, ...))`).
    A variant takes the optional tensors its spec says (`check_call`); the rest stay None
    (num_splits 1)."""

    q: object
    k: object
    v: object
    out: object
    lse: object = None
    sink: object = None
    scale_log2: object = None
    pre_scale: object = None
    window_left: object = 0
    window_right: object = 0
    aux: object = None
    mask_blocks: object = None
    cu_seqlens_q: object = None
    cu_seqlens_k: object = None
    seqused_k: object = None
    tile_table: object = None
    page_table: object = None
    num_splits: object = 1
    out_partial: object = None
    lse_partial: object = None

    @classmethod
    def of(cls, call, out, lse=None, **slots) -> KernelArgs:
        """The arguments of a launch of checked `call` (a `fa4lab.call.Call` in the kernel's
        form, `Call.for_kernel`): its q, k, v, sink, aux tensors, page table and seqused_k; the
        scale from its spec (`scale_args`, pre_scale the scale itself with a score_mod) and the
        window's sizes (`window_args`, clamped to the spec's seqlen_q and seqlen_k: a varlen
        call's longest, a paged one's keys per sequence); `out` and `lse` the outputs. `slots`
        fills the rest by name (mask_blocks, a varlen launch's tables, a split launch's count
        and partials) or replaces one (a split launch's sink, None: the combine adds it)."""
        s = call.spec
        score_mod = call.mods is not None and call.mods.score_mod is not None
        scale_log2, pre_scale = scale_args(s.softmax_scale, s.head_dim, s.softcap, score_mod)
        left, right = window_args(s.window_size, s.seqlen_q, s.seqlen_k)
        args = dict(q=call.q, k=call.k, v=call.v, out=out, lse=lse, sink=call.sink,
                    scale_log2=scale_log2, pre_scale=pre_scale, window_left=left,
                    window_right=right, aux=call.aux or None, seqused_k=call.seqused_k,
                    page_table=call.page_table)
        return cls(**{**args, **slots})

    @classmethod
    def fake(cls, of, mods=None, seqused_k: bool | None = None) -> KernelArgs:
        """The kernels' contract for the kernel `of` (a `fa4lab.plan.key.KernelKey`, or the
        AttentionSpec of a plan: the canonical spec a key plans from): fake q, k, v, out, lse,
        sink, scale_log2, pre_scale, window_left, window_right, aux, mask_blocks, cu_seqlens_q,
        cu_seqlens_k, seqused_k, tile_table, page_table, num_splits, out_partial and
        lse_partial (a compile adds the stream: `fa4lab.kernels.compile.compile_plan`).

        Batch, sequence lengths and head counts are symbolic 32-bit values; strides are symbolic
        64-bit values divisible by 8 elements (16 bytes, what TMA needs), the last dim has stride 1,
        and tensors are 16-byte aligned (lse, sink: 4). 64-bit strides keep tensors of more than
        2^31 elements addressable. lse is None when the spec does not return it, sink when it has no
        learnable sink (a (heads_q,) float32 tensor of any stride); scale_log2 and pre_scale are
        runtime floats (Note [runtime scale] in fa4lab.kernels.compile), the window's sides runtime
        Int32 (Note [runtime window] there); aux the tuple of aux tensors of `mods`
        (`fa4lab.mods.KernelMods`), None without any (`fa4lab.kernels.device.mods.fake_aux`);
        mask_blocks a mask_mod's block table, None without one (`fake_mask_blocks`, Note [mask_mod
        block table] in fa4lab.tiling); with `spec.split_kv`, num_splits a runtime Int32 and the
        float32 partials (num_splits, batch, seqlen_q, heads_q, head_dim_v) and (num_splits, batch,
        seqlen_q, heads_q), heads last and contiguous (`fa4lab.splitkv`'s layout), else 1, None,
        None.

        With spec.varlen (Note [sm90 varlen] in fa4lab.kernels.fwd_sm90): q, out (total_q, heads,
        d), k, v (total_k, heads_kv, d), lse (heads_q, total_q), int32 cu_seqlens_q / cu_seqlens_k
        (batch + 1,) and seqused_k (batch + 1,) (the launch always passes the key counts: the user's
        seqused_k or cu_seqlens_k's differences, and the phantom sequence's 0) and the (rows, 2)
        int32 tile table (contiguous: Note [varlen tile table] in fa4lab.kernels.device.scheduler);
        else all four None. `seqused_k` True gives a seqused_k without varlen (a ragged key count on
        the padded layout); None means spec.varlen or a paged spec.

        With `spec.page_size` P, k and v are a paged cache (num_pages, P, heads_kv, d) with symbolic
        num_pages (never varlen's packed layout), page_table an int32 (batch, pages_per_seq) tensor
        (rows of any stride; with varlen its row count is its own, not seqused_k's) and seqused_k
        always present (each sequence's key count: Note [paged key blocks] in
        fa4lab.kernels.device.paged), cu_seqlens_k None even with varlen (q and out packed, the
        cache not); else page_table None.
        """
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_tensor

        spec = of.spec() if callable(getattr(of, "spec", None)) else of
        dtype = cutlass.BFloat16 if spec.dtype == "bf16" else cutlass.Float16
        b, sq, sk, hq, hkv = (cute.sym_int() for _ in range(5))

        def bshd(s, h, d):
            strides = tuple(cute.sym_int64(divisibility=8) for _ in range(3))
            return make_fake_tensor(dtype, (b, s, h, d), (*strides, 1), assumed_align=16)

        def thd(s, h, d):
            strides = tuple(cute.sym_int64(divisibility=8) for _ in range(2))
            return make_fake_tensor(dtype, (s, h, d), (*strides, 1), assumed_align=16)

        def int32s(n):
            return make_fake_tensor(cutlass.Int32, (n,), (cute.sym_int64(),), assumed_align=4)

        layout = thd if spec.varlen else bshd
        q, o = layout(sq, hq, spec.head_dim), layout(sq, hq, spec.head_dim_v)
        page_table = None
        if spec.page_size is None:
            k, v = layout(sk, hkv, spec.head_dim), layout(sk, hkv, spec.head_dim_v)
        else:
            pages = cute.sym_int()
            k, v = (make_fake_tensor(dtype, (pages, spec.page_size, hkv, d),
                                     (*(cute.sym_int64(divisibility=8) for _ in range(3)), 1),
                                     assumed_align=16)
                    for d in (spec.head_dim, spec.head_dim_v))
            # A varlen launch's seqused_k has one more entry than the table has rows (the
            # padding tiles' phantom sequence: `fa4lab.varlen_tiles.launch_lengths`), so the
            # rows are their own size there.
            rows = cute.sym_int() if spec.varlen else b
            page_table = make_fake_tensor(cutlass.Int32, (rows, cute.sym_int()),
                                          (cute.sym_int64(), 1), assumed_align=4)
        lse = None
        if spec.return_lse and spec.varlen:
            lse = make_fake_tensor(cutlass.Float32, (hq, sq), (cute.sym_int64(), 1),
                                   assumed_align=4)
        elif spec.return_lse:
            lse = make_fake_tensor(cutlass.Float32, (b, hq, sq),
                                   (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
        varlen = [None] * 4
        if spec.varlen:
            varlen[0] = int32s(cute.sym_int())
            if spec.page_size is None:   # a paged varlen batch's keys are its pages
                varlen[1] = int32s(cute.sym_int())
            varlen[3] = make_fake_tensor(cutlass.Int32, (cute.sym_int(), 2), (2, 1),
                                         assumed_align=4)
        if spec.page_size is not None or (spec.varlen if seqused_k is None else seqused_k):
            varlen[2] = int32s(b)
        sink = None
        if spec.learnable_sink:
            sink = make_fake_tensor(cutlass.Float32, (hq,), (cute.sym_int64(),), assumed_align=4)
        from fa4lab.kernels.device.mods import fake_aux, fake_mask_blocks  # the DSL

        score_mod = mods is not None and mods.score_mod is not None
        scale_log2, pre_scale = scale_args(spec.softmax_scale, spec.head_dim, spec.softcap,
                                           score_mod=score_mod)
        left, right = window_args(spec.window_size, spec.seqlen_q, spec.seqlen_k)
        out_partial = lse_partial = None
        if spec.split_kv:
            splits = cute.sym_int()
            out_partial = make_fake_tensor(
                cutlass.Float32, (splits, b, sq, hq, spec.head_dim_v),
                (*(cute.sym_int64(divisibility=4) for _ in range(4)), 1), assumed_align=16)
            lse_partial = make_fake_tensor(cutlass.Float32, (splits, b, sq, hq),
                                           (*(cute.sym_int64() for _ in range(3)), 1),
                                           assumed_align=4)
        cu_q, cu_k, used, tiles = varlen
        return cls(q, k, v, o, lse, sink, cutlass.Float32(scale_log2),
                   cutlass.Float32(pre_scale), cutlass.Int32(left), cutlass.Int32(right),
                   fake_aux(mods), fake_mask_blocks(mods), cu_q, cu_k, used, tiles, page_table,
                   cutlass.Int32(1), out_partial, lse_partial)


class BackwardArgs(NamedTuple):
    """The backward kernels' arguments in their order: both kernels' `__call__`s take them so
    (then the stream), `fake` makes them fake for a compile and the launch
    (`fa4lab.kernels.launch_backward.backward`) fills them. lse is in log2 units (+inf on a row
    that sees no key) and d is rowsum(dO * O) - dLSE, both (batch, heads_q, padded seqlen_q)
    float32; dq_accum the zeroed float32 dQ accumulator; the semaphore one int32 per query
    block with deterministic=True (Note [deterministic dQ] in fa4lab.kernels.bwd_sm90), else
    None. The sm100 kernel builds no cap, window or deterministic mode: it takes pre_scale and
    the window's sides unused and the semaphore None."""

    q: object
    k: object
    v: object
    dout: object
    lse: object
    d: object
    dq_accum: object
    dk: object
    dv: object
    scale_log2: object
    pre_scale: object
    softmax_scale: object
    window_left: object = 0
    window_right: object = 0
    semaphore: object = None

    @classmethod
    def fake(cls, key) -> BackwardArgs:
        """The contract of `key`'s kernel (a `fa4lab.plan.key.BackwardKey`): symbolic batch,
        sequence lengths and head counts; 64-bit strides divisible by 8 elements and 16-byte
        alignment for the 16-bit tensors (last dim contiguous); lse and d (batch, heads_q,
        padded seqlen_q) float32 (16-byte aligned rows for the sm100 kernel's TMA), dq_accum
        (batch, heads_q, padded seqlen_q, head_dim) float32 contiguous in the last dim; the
        semaphore (batch, heads_q, query blocks) int32 with key.deterministic, else None (a
        compile adds the stream)."""
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_tensor

        dtype = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[key.dtype]
        b, sq, sk, hq, hkv, sq_pad = (cute.sym_int() for _ in range(6))

        def bshd(s, h, d):
            strides = tuple(cute.sym_int64(divisibility=8) for _ in range(3))
            return make_fake_tensor(dtype, (b, s, h, d), (*strides, 1), assumed_align=16)

        def rows(*shape, dt=cutlass.Float32, align=4, div=1):
            strides = tuple(cute.sym_int64(divisibility=div) for _ in range(len(shape) - 1))
            return make_fake_tensor(dt, shape, (*strides, 1), assumed_align=align)

        d, dv = key.head_dim, key.head_dim_v
        row_align, row_div = (16, 4) if key.arch == "sm100" else (4, 1)
        q, dout = bshd(sq, hq, d), bshd(sq, hq, dv)
        k, v = bshd(sk, hkv, d), bshd(sk, hkv, dv)
        lse, drows = (rows(b, hq, sq_pad, align=row_align, div=row_div) for _ in range(2))
        dq_accum = rows(b, hq, sq_pad, d, align=16, div=4)
        sem = rows(b, hq, cute.sym_int(), dt=cutlass.Int32) if key.deterministic else None
        one = cutlass.Float32(1.0)
        return cls(q, k, v, dout, lse, drows, dq_accum, bshd(sk, hkv, d), bshd(sk, hkv, dv),
                    one, one, one, cutlass.Int32(0), cutlass.Int32(0), sem)


def scale_args(softmax_scale: float | None, head_dim: int, softcap: float = 0.0,
               score_mod: bool = False):
    """The compiled functions' (scale_log2, pre_scale) arguments (Note [runtime scale] in
    fa4lab.kernels.compile): softmax_scale (default 1/sqrt(head_dim)) times log2(e) and 1; with a
    softcap c, c * log2(e) and softmax_scale / c (Note [softcap] in fa4lab.kernels.device.softmax);
    with a score_mod and no softcap, log2(e) and softmax_scale (Note [score_mod and the scale] in
    fa4lab.kernels.device.mods)."""
    scale = resolve_scale(softmax_scale, head_dim)
    if softcap:
        return softcap * LOG2E, scale / softcap
    if score_mod:
        return LOG2E, scale
    return scale * LOG2E, 1.0


def window_args(window_size, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """The compiled functions' (window_left, window_right) arguments (Note [runtime window] in
    fa4lab.kernels.compile): each side of the stored window_size (`fa4lab.spec.normalize_mask`'s
    form; causal's right = 0 is the kernel's constant), clamped to seqlen_k (left) and seqlen_q
    (right), 0 for a side that is None. A negative side (Note [window and causal] in fa4lab.spec) is
    clamped at -seqlen_q (left) and -seqlen_k (right), where every row already sees no key, so no
    edge overflows Int32."""
    left, right = window_size
    return (0 if left is None else max(min(int(left), int(seqlen_k)), -int(seqlen_q)),
            0 if right is None else max(min(int(right), int(seqlen_q)), -int(seqlen_k)))


def check_variant(varlen: bool, split_kv: bool, pack_gqa: bool, note: str) -> None:
    """The variants no kernel builds yet (`note`: the kernel's varlen Note, for the message)."""
    if varlen and pack_gqa:
        raise ValueError(f"a varlen kernel runs without pack-GQA: plan it with pack_gqa=False "
                         f"({note})")
    if varlen and split_kv:
        raise ValueError("split-KV does not compose with varlen yet: one or the other")


def check_call(kernel, note: str, mask_blocks, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK,
               mTileTable, mPageTable, mOPartial, mLSEPartial) -> None:
    """The optional tensors of a call against what `kernel` (its has_mask_mod, page_size,
    varlen and split_kv) takes; `note` names the kernel's varlen Note."""
    paged, varlen, split = kernel.page_size is not None, kernel.varlen, kernel.split_kv
    if kernel.has_mask_mod != (mask_blocks is not None):
        raise ValueError("a mask_mod kernel takes its block table (mask_blocks) and only it "
                         "does: see Note [mask_mod block table] in fa4lab.tiling")
    if paged != (mPageTable is not None) or (paged and mSeqUsedK is None):
        raise ValueError("a paged kernel (spec.page_size) takes a page table and seqused_k, "
                         "and only it takes a page table: see Note [paged key blocks] in "
                         "fa4lab.kernels.device.paged")
    if split != (mOPartial is not None) or split != (mLSEPartial is not None):
        raise ValueError("a split-KV kernel (spec.split_kv) takes mOPartial and mLSEPartial, "
                         "and only it does")
    if (varlen != (mTileTable is not None) or varlen != (mCuSeqlensQ is not None)
            or (varlen and not paged) != (mCuSeqlensK is not None)):
        raise ValueError(f"a varlen kernel takes cu_seqlens_q, its tile table and, unless "
                         f"paged, cu_seqlens_k, and only it does ({note})")
    if varlen and mask_blocks is not None:
        raise ValueError("a varlen kernel takes no mask_mod block table")


def packed_views(varlen: bool, paged: bool, mQ, mK, mV, mO, mLSE) -> tuple:
    """(mQ, mK, mV, mO, mLSE) of a varlen call as batches of one ((total, h, d) -> (1, total,
    h, d); lse (heads_q, total_q) -> (1, heads_q, total_q)), a paged cache left as its pages;
    the tensors themselves when not varlen."""
    if not varlen:
        return mQ, mK, mV, mO, mLSE
    from fa4lab.kernels.device import seqlen  # the DSL, at trace time only

    mQ, mO = [seqlen.as_batch_of_one(x) for x in (mQ, mO)]
    if not paged:
        mK, mV = [seqlen.as_batch_of_one(x) for x in (mK, mV)]
    if mLSE is not None:
        mLSE = seqlen.as_batch_of_one(mLSE)
    return mQ, mK, mV, mO, mLSE
