"""A mask_mod's block table: which key blocks each CTA tile may skip, or visit unmasked.

`block_table` evaluates the mask_mod (`fa4lab.mods`) once on torch tensors on q's device, with
broadcast index tensors b (B, 1, 1, 1), h (1, H, 1, 1), q_idx (1, 1, rows, 1) and kv_idx (1, 1,
1, Sk) -- a mod that ignores b and h costs one (rows, Sk) evaluation -- in chunks of query rows
that keep each evaluation under `CHUNK_BYTES`, and reduces it to the kernel's tiles: one row
(lo, hi, full_lo, full_hi) per CTA tile, the UNION over every (batch, head) for "any key
visible" and the INTERSECTION for "every key visible", so one (num_m_blocks, 4) int32 table
serves every CTA. The kernels narrow their block ranges with it (Note [mask_mod block table] in
fa4lab.tiling; Note [mask_mod blocks] in fa4lab.kernels.device.mods).

    table = block_table(mods, aux, batch=2, heads_q=16, seqlen_q=8192, seqlen_k=8192,
                        cta_m=128, n_block=128, pack=1, device=q.device)

Note [block table cache]
    A table is a function of the mod's code (`fa4lab.mods.mod_key`, as the launch cache keys
    it), of the aux tensors' contents, of the shape (batch, heads, seqlen_q, seqlen_k) and of
    the tiles (cta_m, n_block, pack). The cache keys the contents by each aux tensor's identity
    and `_version`: torch bumps a tensor's version at every in-place change (`t[3] = 1`,
    `t.copy_(u)`, also through a view, which shares the counter), so an edited aux tensor is a
    miss and the table is rebuilt. The entry holds a weak reference to each aux tensor and a
    hit requires the very same object, so a freed tensor whose address (and id) a new one
    reuses is a miss too. A change torch does not count (writes through `.data`, DLPack or
    another library) is not seen: rebuild the aux tensor, or call `clear_cache()`.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

from fa4lab import tiling
from fa4lab.mods import mod_key

# Bytes of one chunk's evaluation, counted at 8 bytes per element of the (b, h, rows, Sk) grid
# the mod broadcasts to (its int64 index arithmetic): bounds the table's peak memory.
CHUNK_BYTES = 256 << 20
CACHE_ENTRIES = 32

_lock = threading.Lock()
_cache: OrderedDict = OrderedDict()


def clear_cache() -> None:
    """Forget every cached table (Note [block table cache])."""
    with _lock:
        _cache.clear()


def _visible_rows(mods, aux, batch, heads_q, rows, seqlen_k, device):
    """(any, all): (len(rows), seqlen_k) bool, whether some / every (b, h) sees each key."""
    import torch

    ar = torch.arange
    b = ar(batch, device=device).view(-1, 1, 1, 1)
    h = ar(heads_q, device=device).view(1, -1, 1, 1)
    q = rows.view(1, 1, -1, 1)
    kv = ar(seqlen_k, device=device).view(1, 1, 1, -1)
    out = torch.as_tensor(mods.mask(b, h, q, kv, aux), device=device).bool()
    out = out.reshape((1,) * (4 - out.dim()) + tuple(out.shape))
    shape = (len(rows), seqlen_k)
    dims = [d for d in (0, 1) if out.shape[d] > 1]
    if not dims:
        return (out[0, 0].expand(shape),) * 2
    return (out.any(dim=dims, keepdim=True)[0, 0].expand(shape),
            out.all(dim=dims, keepdim=True)[0, 0].expand(shape))


def _key_blocks(vis_any, vis_all, n_block: int):
    """Per key block: whether any key is visible, whether every in-bounds key is."""
    import torch.nn.functional as F

    pad = -vis_any.shape[1] % n_block
    vis_any = F.pad(vis_any, (0, pad), value=False)
    vis_all = F.pad(vis_all, (0, pad), value=True)
    rows = vis_any.shape[0]
    return (vis_any.view(rows, -1, n_block).any(-1), vis_all.view(rows, -1, n_block).all(-1))


def _longest_runs(full):
    """[start, end) of each row's longest run of True (first of equals; (0, 0) for none)."""
    import numpy as np

    m, n = full.shape
    best_len = np.zeros(m, dtype=np.int64)
    best_end = np.zeros(m, dtype=np.int64)
    run = np.zeros(m, dtype=np.int64)
    for j in range(n):
        run = np.where(full[:, j], run + 1, 0)
        longer = run > best_len
        best_len = np.where(longer, run, best_len)
        best_end = np.where(longer, j + 1, best_end)
    return best_end - best_len, best_end


def _build(mods, aux, batch, heads_q, seqlen_q, seqlen_k, cta_m, n_block, pack, device):
    import numpy as np
    import torch

    n_m = tiling.ceil_div(seqlen_q * pack, cta_m)
    n_n = tiling.ceil_div(seqlen_k, n_block)
    # Per query position: key blocks some (b, h) sees a key of / all (b, h) see whole.
    pos_any = torch.zeros((seqlen_q, n_n), dtype=torch.bool, device=device)
    pos_all = torch.zeros((seqlen_q, n_n), dtype=torch.bool, device=device)
    rows_per_chunk = max(1, CHUNK_BYTES // (8 * _broadcast_bh(mods, aux, batch, heads_q, device)
                                            * max(seqlen_k, 1)))
    for start in range(0, seqlen_q, rows_per_chunk):
        stop = min(seqlen_q, start + rows_per_chunk)
        rows = torch.arange(start, stop, device=device)
        vis_any, vis_all = _visible_rows(mods, aux, batch, heads_q, rows, seqlen_k, device)
        pos_any[start:stop], pos_all[start:stop] = _key_blocks(vis_any, vis_all, n_block)
    # Per tile: positions [pos_lo, min(pos_hi, seqlen_q)) (tiling.tile_positions), reduced by
    # prefix sums over positions.
    m = np.arange(n_m)
    pos_lo, pos_hi = tiling.tile_positions(m, cta_m, pack)
    pos_hi = np.minimum(pos_hi, seqlen_q)
    lo_t = torch.as_tensor(pos_lo, device=device)
    hi_t = torch.as_tensor(pos_hi, device=device)
    zero = torch.zeros((1, n_n), dtype=torch.int64, device=device)
    any_cs = torch.cat([zero, pos_any.long().cumsum(0)])
    hidden_cs = torch.cat([zero, (~pos_all).long().cumsum(0)])
    tile_any = ((any_cs[hi_t] - any_cs[lo_t]) > 0).cpu().numpy()
    tile_all = ((hidden_cs[hi_t] - hidden_cs[lo_t]) == 0).cpu().numpy()
    has = tile_any.any(axis=1)
    lo = np.where(has, tile_any.argmax(axis=1), 0)
    hi = np.where(has, n_n - tile_any[:, ::-1].argmax(axis=1), 0)
    full_lo, full_hi = _longest_runs(tile_all & tile_any)
    table = np.stack([lo, hi, full_lo, full_hi], axis=1).astype(np.int32)
    return torch.from_numpy(np.ascontiguousarray(table)).to(device)


def _broadcast_bh(mods, aux, batch, heads_q, device) -> int:
    """B' * H': how many (b, h) the mod's result varies over (1 when it ignores both)."""
    import torch

    ar = torch.arange
    out = torch.as_tensor(mods.mask(ar(batch, device=device).view(-1, 1, 1, 1),
                                    ar(heads_q, device=device).view(1, -1, 1, 1),
                                    torch.zeros((1, 1, 1, 1), dtype=torch.int64, device=device),
                                    torch.zeros((1, 1, 1, 1), dtype=torch.int64, device=device),
                                    aux), device=device)
    out = out.reshape((1,) * (4 - out.dim()) + tuple(out.shape))
    return int(out.shape[0] * out.shape[1])


def block_table(mods, aux: tuple, *, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int,
                cta_m: int, n_block: int, pack: int, device):
    """The (ceil(seqlen_q * pack / cta_m), 4) int32 table of `mods.mask_mod` (a
    `fa4lab.mods.KernelMods`) on `device`: per CTA tile of cta_m rows (packed rows with pack =
    qhead_per_kvhead > 1: positions of `tiling.tile_positions`), [lo, hi) the key blocks of
    n_block keys where some (batch, head, row) sees a key ((0, 0) when none does) and [full_lo,
    full_hi) the longest run of blocks every one sees whole (Note [mask_mod block table] in
    fa4lab.tiling). Cached: Note [block table cache]."""
    key = (mod_key(mods.mask_mod), mods.mask_takes_aux,
           tuple((id(t), t._version, tuple(t.shape), t.stride(), t.dtype) for t in aux),
           batch, heads_q, seqlen_q, seqlen_k, cta_m, n_block, pack, str(device))
    with _lock:
        entry = _cache.get(key)
        if entry is not None:
            refs, table = entry
            if all(r() is t for r, t in zip(refs, aux, strict=True)):
                _cache.move_to_end(key)
                return table
    table = _build(mods, aux, batch, heads_q, seqlen_q, seqlen_k, cta_m, n_block, pack, device)
    with _lock:
        _cache[key] = (tuple(weakref.ref(t) for t in aux), table)
        while len(_cache) > CACHE_ENTRIES:
            _cache.popitem(last=False)
    return table
