"""The forward kernels' argument contract, checked once for both (host side, at trace time).

The sm90 and sm100 kernels take the same arguments in the same order (`KernelArgs`: their
`__call__`s, which `fa4lab.kernels.launch` fills): which of them a variant takes follows from
its spec --
a mask_mod its block table, a paged cache its page table and seqused_k, a varlen batch its
cu_seqlens and tile table, a split-KV kernel its partials -- and this module says so once.
`check_variant` runs in a kernel's constructor (the combinations no kernel builds yet),
`check_call` when the call is traced (a missing or extra tensor is a ValueError naming the
Note that describes it, never a kernel that reads None), and `packed_views` gives a varlen
call's packed (total, ...) tensors the batch mode the kernels' views expect.
"""

from __future__ import annotations

from typing import NamedTuple


class KernelArgs(NamedTuple):
    """The forward kernels' arguments in their order: both kernels' `__call__`s take them so
    (then the stream), `fa4lab.kernels.compile.fake_args` makes them fake, and every launch in
    `fa4lab.kernels.launch` fills them by name (`fn(*KernelArgs(...))`). A variant takes the
    optional tensors its spec says (`check_call`); the rest stay None (num_splits 1)."""

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
