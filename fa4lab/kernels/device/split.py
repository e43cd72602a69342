"""Split-KV in the forward kernels (device code, shared by the sm90 and sm100 kernels).

A split kernel (`AttentionSpec.split_kv`) runs `num_splits` (a runtime Int32) CTAs per output
tile: the grid's head axis holds heads * num_splits entries, head-major (`split_of`), as upstream
folds it. Split s of a tile visits the key blocks of its tile's range that lie in split s's cut
of the WHOLE key axis, `fa4lab.splitkv.split_range` of ceil(seqlen_k / n_block) blocks (the
same arithmetic `split_blocks` and `partial_attention_reference` use), and writes a float32
partial output normalised over those keys and their LSE (`store_partial`) into the combine's
layout: out_partial (num_splits, batch, seqlen_q, heads_q, head_dim_v), lse_partial
(num_splits, batch, seqlen_q, heads_q). A learnable sink is the combine's business.
seqlen_k is the tile's sequence's own key count: with seqused_k (a paged K/V cache always has
it: Note [paged key blocks] in fa4lab.kernels.device.paged) each sequence is cut into the
splits by its own blocks, as `partial_attention_reference` cuts that sequence's keys alone.

Note [empty splits]
A split that keeps no block of its tile's range (more splits than blocks -- a short sequence of
a ragged batch among them --, or a causal / window range that misses the split's cut) takes the
path of a CTA none of whose rows sees a key, so the softmax's finalize gives out 0 and LSE -inf
(Note [empty rows]), which weigh exactly 0 in the combine, and no key of another split enters:
- sm100 visits no block (`narrow` gives lo == hi; every role skips a tile of 0 blocks);
- sm90 always visits at least one block (Note [fully masked CTAs] in fa4lab.kernels.fwd_sm90):
  one inside its TILE's range (never a block past seqlen_k; block 0 of a sequence with no key,
  whose first page slot a paged cache's producer reads), masked whole because its rows' limits
  are computed with no key at all (`keys_seen` gives seqlen_k 0: every key is at or past the
  end).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from fa4lab.kernels.device.pack_gqa import unpack_row
from fa4lab.splitkv import split_range
from fa4lab.tiling import ceil_div


def split_of(head_split, num_splits):
    """(head, split) of the grid's folded head index head * num_splits + split."""
    head = head_split // num_splits
    return head, head_split - head * num_splits


def narrow(n_block_min, n_block_max, seqlen_k, n_block: int, num_splits, split):
    """(lo, hi, seen) of split `split` in a tile's visited range [n_block_min, n_block_max):
    the range cut to the split's blocks (`fa4lab.splitkv.split_range`), and seen = 1 when that
    leaves a block, else 0 with lo == hi a block of the tile's own range (Note [empty splits]).
    Ints or DSL Int32."""
    lo, hi = split_range(ceil_div(seqlen_k, n_block), num_splits, split, imin=cutlass.min)
    lo = cutlass.max(lo, n_block_min)
    hi = cutlass.min(hi, n_block_max)
    seen = cutlass.min(cutlass.max(hi - lo, 0), 1)
    lo = cutlass.min(lo, cutlass.max(n_block_max - 1, n_block_min))
    return lo, lo + (hi - lo) * seen, seen


def keys_seen(seqlen_k, seen):
    """The key length a split's row limits are computed with: seqlen_k, or 0 for an empty split
    (every key hidden: Note [empty splits])."""
    return seqlen_k * seen


def split_views(mOPartial: cute.Tensor, mLSEPartial: cute.Tensor, split):
    """Split `split`'s (batch, seqlen_q, heads_q, head_dim_v) out_partial and its LSE viewed as
    (seqlen_q, heads_q, batch), the form `fa4lab.kernels.device.softmax.store_lse` writes."""
    mO = mOPartial[split, None, None, None, None]
    mL = mLSEPartial[split, None, None, None]
    return mO, cute.make_tensor(mL.iterator, cute.select(mL.layout, mode=[1, 2, 0]))


@cute.jit
def store_partial(mO: cute.Tensor, acc_o_mn: cute.Tensor, coord_mn: cute.Tensor, m_offset,
                  head, batch, seqlen_q, pack: cutlass.Constexpr[int]) -> None:
    """A thread's rows of the normalised float32 O into one split's out_partial `mO` (batch,
    seqlen_q, heads_q, head_dim_v), straight from the accumulator's (rows, cols) view;
    `coord_mn` the same view of the tile's (row, col) coordinates. Rows past seqlen_q (packed:
    seqlen_q * g) are dropped; packed rows go to their (position, query head) (`unpack_row`)."""
    for r in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[0])):
        row = m_offset + coord_mn[r, 0][0]
        if row < seqlen_q * pack:
            pos, q_head = unpack_row(row, head, pack)
            out_row = mO[batch, pos, q_head, None]
            for j in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[1])):
                out_row[coord_mn[r, j][1]] = Float32(acc_o_mn[r, j])
