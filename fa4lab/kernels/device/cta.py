"""The sm100 kernel's CTA state (Note [CTA state]): what a CTA's roles share, as small typed
records, and a work tile. Trace-time Python: the records hold DSL values and emit no code."""

from __future__ import annotations

from typing import NamedTuple

import cutlass.cute as cute
from cutlass import Float32, Int32

from fa4lab.kernels.device import seqlen

# Note [CTA state]
# What a CTA's roles share is built once in the kernel (`FlashForwardSm100.kernel`), before
# the role branches, as the small typed records below (trace-time Python: they hold DSL
# values, they emit no code): the tensors and TMA atoms (`Io`), the SMEM views (`Smem`), the
# pipelines (`Pipes`), the MMAs and the TMEM allocator (`Mmas`), the launch's sizes and
# options (`Launch`), together a `Cta`. A work tile is a `Tile`. Each role is one method with
# one tile loop (`each_tile`, Note [one tile loop] in fa4lab.kernels.fwd_sm100) over a
# per-tile method that takes the Cta, the Tile and the role's pipeline states.


def as_tuple(state) -> tuple:
    """A per-tile method's returned states as a tuple (a role with one state returns it)."""
    return state if isinstance(state, tuple) else (state,)


class Io(NamedTuple):
    """The kernel's global tensors and their TMA atoms (`kernel`'s parameters)."""
    tma_atom_Q: cute.CopyAtom
    mQ: cute.Tensor
    tma_atom_K: cute.CopyAtom
    mK: cute.Tensor
    tma_atom_V: cute.CopyAtom
    mV: cute.Tensor
    tma_atom_O: cute.CopyAtom
    mO: cute.Tensor
    mLSE: cute.Tensor | None
    mSink: cute.Tensor | None
    mOPartial: cute.Tensor | None
    mLSEPartial: cute.Tensor | None
    mPageTable: cute.Tensor | None


class Smem(NamedTuple):
    """The SMEM views: Q, K, V (in K's buffers), the O staging and the stats mailbox."""
    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    o: cute.Tensor
    scale: cute.Tensor


class Pipes(NamedTuple):
    """The protocol table's pipelines (`_PIPELINES` in fa4lab.kernels.fwd_sm100, in its order)
    and the p_part barriers (or None)."""
    q: object
    kv: object
    s: object
    o: object
    stats: object
    epi: object
    p_part: object


class Mmas(NamedTuple):
    """The two tiled MMAs, their thread slices, P's TMEM layout and the TMEM allocator."""
    tiled_qk: cute.TiledMma
    tiled_pv: cute.TiledMma
    thr_qk: object
    thr_pv: object
    tP_layout: cute.ComposedLayout
    tmem: object


class Launch(NamedTuple):
    """The launch's sizes and options: seqlen_q and seqlen_k as launched (a sequence's own are
    the Tile's), the window's sides, the scales, the mods' aux tensors, the mask_mod's block
    table, the varlen tuple (Note [sm100 varlen]) and the split count."""
    seqlen_q: object
    seqlen_k: object
    left: object
    right: object
    scale_log2: Float32
    pre_scale: Float32
    aux: tuple | None
    mask_blocks: cute.Tensor | None
    varlen: tuple
    num_splits: Int32


class Tile(NamedTuple):
    """A work tile: its m_block, head (the KV head, packed), batch, split (None without
    split-KV) and sequence (`seqlen.of_launch`; None until `tile_at` reads it)."""
    m_block: Int32
    head: Int32
    batch: Int32
    split: Int32 | None
    seq: seqlen.Sequence | None


class Cta(NamedTuple):
    """What every role of a CTA reads (Note [CTA state]); `tile` is its one work tile when it
    has one and the launch names it (not persistent, not varlen), else None."""
    io: Io
    smem: Smem
    pipes: Pipes
    mmas: Mmas
    launch: Launch
    tile: Tile | None
