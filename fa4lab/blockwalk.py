"""The kernels' walk over key blocks, in float64: the one CPU model of the order in which a CTA
tile of either kernel visits K/V and folds it into its online softmax.

For every CTA tile of a plan's tiles (cta_m rows; with pack-GQA, packed rows: the query heads
of one KV head, Note [pack-GQA rows] in fa4lab.gqa), `walk`
  * takes the tile's key range and masked runs from `fa4lab.tiling` (`block_range`,
    `mask_split`: causal and window-aware), narrowed by a mask_mod's block table
    (`fa4lab.mods_blocks.block_table`, `tiling.table_range` / `table_split`);
  * visits the blocks in the kernels' order (`tiling.visit_block`, Note [block visit order]);
  * scores each block as the spec says (scaled q.k, then the softcap, then the score_mod:
    the reference's order) and applies the element mask (causal, window) and the mask_mod ONLY
    in the masked runs: the unmasked middle trusts the ranges and the table, as the kernels do;
  * folds the block in with `fa4lab.online_softmax.update_state` and FA4's conditional rescale.
So a range that drops a visible block, a table that claims too much, or a lost score transform
shows up against the float64 reference (`fa4lab.reference.attention_reference`); otherwise only
the order of the sums differs (`TOLERANCE`). The sm90 kernel also masks its first block always
and visits one fully masked block where the range is empty: more masking, the same result.
This models the kernels' order of work, not their binary (the GPU tests check that).

    from fa4lab import blockwalk
    out, lse, visits = blockwalk.walk(q, k, v, plan.spec, plan.tiles, mods=km, aux=aux)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fa4lab import tiling
from fa4lab.limits import RESCALE_THRESHOLD
from fa4lab.spec import LOG2E, AttentionSpec

__all__ = ["TOLERANCE", "TileBlocks", "block_table_of", "packed", "tile_blocks", "walk"]

# The walk against the float64 reference: both float64, so only the order of the sums differs
# (blocks in the kernels' order, rescaled bases): far below 1e-9 on O(1) outputs.
TOLERANCE = 1e-9


def packed(spec: AttentionSpec, tiles) -> int:
    """Query heads per tile row group: qhead_per_kvhead with pack-GQA, else 1."""
    return spec.qhead_per_kvhead if getattr(tiles, "pack_gqa", False) else 1


def block_table_of(spec: AttentionSpec, tiles, mods, aux: tuple = ()) -> np.ndarray | None:
    """The mask_mod's block table for these tiles (`fa4lab.mods_blocks.block_table`, one row
    (lo, hi, full_lo, full_hi) per CTA tile), as numpy; None without a mask_mod."""
    if mods is None or mods.mask_mod is None:
        return None
    from fa4lab.mods_blocks import block_table

    return block_table(mods, aux, batch=spec.batch, heads_q=spec.heads_q,
                       seqlen_q=spec.seqlen_q, seqlen_k=spec.seqlen_k, cta_m=tiles.cta_m,
                       n_block=tiles.n_block, pack=packed(spec, tiles), device="cpu").cpu().numpy()


@dataclass(frozen=True)
class TileBlocks:
    """The key blocks one CTA tile visits, in the kernels' order; the first `masked` of them
    take the element mask and the mask_mod, the rest (the unmasked middle) take neither."""

    blocks: tuple[int, ...]
    masked: int


def tile_blocks(spec: AttentionSpec, tiles, m_block: int, table_row=None) -> TileBlocks:
    """Tile `m_block`'s walk: `tiling.block_range` and `mask_split` of its positions, narrowed
    by a block table row (lo, hi, full_lo, full_hi) when given (Note [mask_mod block table]),
    in `tiling.visit_block`'s order."""
    sq, sk, n = spec.seqlen_q, spec.seqlen_k, tiles.n_block
    pos_lo, pos_hi = tiling.tile_positions(m_block, tiles.cta_m, packed(spec, tiles))
    left, right = spec.effective_window
    n_min, n_max = tiling.block_range(pos_lo, pos_hi, sq, sk, n, left, right)
    if table_row is not None:
        n_min, n_max = tiling.table_range(n_min, n_max, int(table_row[0]), int(table_row[1]))
    left_end, mask_min = tiling.mask_split(pos_lo, pos_hi, n_min, n_max, sq, sk, n, left, right)
    if table_row is not None:
        left_end, mask_min = tiling.table_split(n_min, n_max, left_end, mask_min,
                                                int(table_row[2]), int(table_row[3]))
    left_run = None if left is None and table_row is None else (n_min, left_end)
    return TileBlocks(tuple(tiling.visit_block(s, n_max, mask_min, left_run)
                            for s in range(n_max - n_min)),
                      (n_max - mask_min) + (left_end - n_min))


def _check(q, k, v, spec: AttentionSpec):
    """q, k, v as float64 arrays of the spec's shapes; a clear error otherwise."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    want = {"q": (spec.batch, spec.seqlen_q, spec.heads_q, spec.head_dim),
            "k": (spec.batch, spec.seqlen_k, spec.heads_kv, spec.head_dim),
            "v": (spec.batch, spec.seqlen_k, spec.heads_kv, spec.head_dim_v)}
    for name, x in zip(want, (q, k, v), strict=True):
        if x.shape != want[name]:
            raise ValueError(f"walk: {name} has shape {x.shape}, the spec says {want[name]} "
                             f"(batch, seqlen, heads, head_dim): build the spec from these "
                             f"tensors (AttentionSpec.from_tensors) or pass matching inputs")
    if spec.learnable_sink:
        raise ValueError("walk models no learnable sink: compare with fa4lab.reference "
                         "directly for a spec with learnable_sink=True")
    return q, k, v


def _grid(batch: int, heads: np.ndarray, pos: np.ndarray, keys: np.ndarray):
    """int64 torch indices b (B, 1, 1, 1), h (1, L, R, 1), q_idx (1, 1, R, 1), kv_idx (1, 1,
    1, C) over one block's scores (B, L, R, C), as the mods take them (fa4lab.mods)."""
    import torch

    return (torch.arange(batch).view(-1, 1, 1, 1), torch.from_numpy(heads)[None, :, :, None],
            torch.from_numpy(pos).view(1, 1, -1, 1), torch.from_numpy(keys).view(1, 1, 1, -1))


def walk(q, k, v, spec: AttentionSpec, tiles, mods=None, aux: tuple = (), *,
         rescale_threshold: float = RESCALE_THRESHOLD):
    """(out (batch, seqlen_q, heads_q, head_dim_v), lse (batch, heads_q, seqlen_q), blocks
    visited), float64, computed the way the kernels walk `tiles` (a plan's `TilePlan`: cta_m,
    n_block, pack_gqa) for `spec` (causal, window_size, softcap, softmax_scale); `mods` a
    `fa4lab.mods.KernelMods` (score_mod and/or mask_mod) reading `aux` (torch tensors, as
    `fa4lab.mods.check_mods` returns them). The module docstring describes the walk. Rows that
    see no key give out 0 and lse -inf."""
    import torch

    from fa4lab.online_softmax import finalize, init_state, update_state
    from fa4lab.reference import kv_head_index, visible_mask

    q, k, v = _check(q, k, v, spec)
    g = packed(spec, tiles)
    table = block_table_of(spec, tiles, mods, aux)
    # float aux tensors in float64, as the reference reads them
    aux = tuple(t.to(torch.float64) if t.is_floating_point() else t for t in aux)
    has_score = mods is not None and mods.score_mod is not None
    element = visible_mask(spec.seqlen_q, spec.seqlen_k, spec.causal,
                           window_size=spec.window_size)
    kv_of = kv_head_index(spec.heads_q, spec.heads_kv)
    # One lane per query head, or with pack-GQA one per KV head, its g query heads in the rows.
    lanes = spec.heads_kv if g > 1 else spec.heads_q
    out = np.zeros((spec.batch, spec.seqlen_q, spec.heads_q, spec.head_dim_v))
    lse = np.full((spec.batch, spec.heads_q, spec.seqlen_q), -np.inf)
    visits = 0
    for m in range(tiling.num_m_blocks(spec.seqlen_q, tiles.cta_m, g)):
        rows = np.arange(m * tiles.cta_m, min((m + 1) * tiles.cta_m, spec.seqlen_q * g))
        pos = rows // g
        heads = np.arange(lanes)[:, None] * g + rows[None, :] % g           # (lanes, R)
        kv = kv_of[heads[:, 0]]
        qt = q[:, pos[None, :], heads]                                     # (B, lanes, R, d)
        tile = tile_blocks(spec, tiles, m, None if table is None else table[m])
        state = init_state(qt.shape[:3], spec.head_dim_v, LOG2E)
        for step, n in enumerate(tile.blocks):
            keys = np.arange(n * tiles.n_block, min((n + 1) * tiles.n_block, spec.seqlen_k))
            kb, vb = (x[:, keys][:, :, kv].transpose(0, 2, 1, 3) for x in (k, v))
            s = spec.scale * (qt @ kb.swapaxes(-1, -2))                    # (B, lanes, R, C)
            if spec.softcap:
                s = spec.softcap * np.tanh(s / spec.softcap)
            grid = _grid(spec.batch, heads, pos, keys) if mods else None
            if has_score:
                s = torch.broadcast_to(mods.score(torch.from_numpy(s), *grid, aux).to(
                    torch.float64), s.shape).numpy()
            if step < tile.masked:
                seen = np.broadcast_to(element[np.ix_(pos, keys)], s.shape)
                if table is not None:
                    seen = seen & torch.broadcast_to(mods.mask(*grid, aux), s.shape).numpy()
                s = np.where(seen, s, -np.inf)
            state, _ = update_state(state, s, vb, rescale_threshold=rescale_threshold)
        visits += len(tile.blocks)
        o, row_lse = finalize(state)
        out[:, pos[None, :], heads] = o
        lse[:, heads, pos[None, :]] = row_lse
    return out, lse, visits
