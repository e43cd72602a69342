"""score_mod and mask_mod inside the kernels (device code): one path for sm90 and sm100.

The user's functions (`fa4lab.mods`, Note [one body, two worlds]) are called once per score
while the kernel is traced, with Float32 scores and Int32 indices; `aux` is the kernel's tuple
of aux tensors (cute.Tensors in global memory). A kernel builds one `ModRows` per tile -- the
(batch, query head, q_idx) of each score row its thread holds -- and calls, per key block:

* `ModRows.scores` where softcap would be applied (before any mask): the raw q.k becomes the
  scaled (and capped) score the mod expects, then the mod's result (Note [score_mod and the
  scale]);
* `ModRows.mask` after a masked block's causal / window / key-length mask: -inf where the
  mask_mod is False (Note [mask_mod blocks]).

A row holds scores in a (rows, cols) view, with `cols` the coordinates of a thread's columns in
the block's own frame (thread 0's compile-time ones plus `col_offset`, as in
`fa4lab.kernels.device.mask`: Note [static columns]); `n_offset` is the block's first key.

Note [score_mod and the scale]
    The kernels fold softmax_scale * log2(e) into the FFMA of the exp2 (Note [exp2 and
    scale_log2]), so their scores are raw q.k. A score_mod needs the scaled score, so with one
    `fa4lab.kernels.compile.scale_args` hands the kernel pre_scale = softmax_scale and
    scale_log2 = log2(e): the hook computes s = raw * pre_scale, the mod rewrites s, and the
    softmax exponentiates the result in natural units. With a softcap c as well, the runtime
    arguments stay softcap's (pre_scale = softmax_scale / c, scale_log2 = c * log2(e)): the hook
    gives the mod c * tanh(raw * pre_scale), c read back as scale_log2 * ln 2, and stores the
    result divided by c, which the softmax's c * log2(e) undoes. One multiply per score more
    than softcap alone, and every value stays a runtime argument.

Note [mod indices]
    A tile has rows past seqlen_q (its tail) and a block keys past seqlen_k (the key-length
    tail). Their scores are never stored or are masked anyway, but a mod reading
    aux[0][q_idx] there would read past the tensor. So q_idx is clamped to seqlen_q - 1 once
    per tile, and kv_idx to seqlen_k - 1 in blocks that may hold the key tail (the masked
    ones); the mask there is the key-length bound, whatever the mod says.

Note [mask_mod blocks]
    With a mask_mod the kernel takes the mod's block table (Note [mask_mod block table] in
    fa4lab.tiling, built by `fa4lab.mods_blocks.block_table`): the CTA skips the key blocks the
    mod hides from all its rows and visits the blocks it shows whole to all of them unmasked,
    without calling the mod; every other visited block is masked, by the key-length / causal /
    window limits and by the mod, per score (the mod and one select), with kv_idx clamped. So a
    document or prefix mask costs about its visible fraction, as FlexAttention's BlockMask
    does, and the loops keep their two kinds (masked, unmasked): the audit holds the binary to
    the same protocol.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32
from cutlass.base_dsl.typing import Float

from fa4lab.mods import ModCompileError, call_mod, describe, one_line, where
from fa4lab.spec import LN2

_AUX_TYPES = {"float32": cutlass.Float32, "int32": cutlass.Int32}


def fake_aux(mods):
    """Fake tensors for the aux tuple of `mods` (`fa4lab.mods.KernelMods`): any shape and
    strides, 4-byte aligned; None when there are none (the kernel's parameter is then None)."""
    if mods is None or not mods.aux_signature:
        return None
    from cutlass.cute.runtime import make_fake_tensor

    return tuple(
        make_fake_tensor(_AUX_TYPES[dtype], tuple(cute.sym_int() for _ in range(ndim)),
                         tuple(cute.sym_int64() for _ in range(ndim)), assumed_align=4)
        for dtype, ndim in mods.aux_signature)


def fake_mask_blocks(mods):
    """A fake (cta tiles, 4) int32 block table, contiguous, when `mods` has a mask_mod (Note
    [mask_mod blocks]); None otherwise (the kernel's parameter is then None)."""
    if mods is None or mods.mask_mod is None:
        return None
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(Int32, (cute.sym_int(), 4), (4, 1), assumed_align=4)


def query_of_row(row, head, seqlen_q, pack: int):
    """(query head, q_idx) of tile row `row` of grid head `head`: with pack-GQA (pack = g > 1)
    the row is a packed row, position row // g of query head head * g + row % g (Note
    [pack-GQA rows] in fa4lab.tiling). q_idx is clamped (Note [mod indices])."""
    if pack > 1:
        pos = row // pack
        head_q = head * pack + (row - pos * pack)
    else:
        pos, head_q = row, head
    return Int32(head_q), cutlass.min(Int32(pos), seqlen_q - 1)


def _traced(kind: str, fn, takes_aux: bool, args: tuple, aux: tuple, want):
    """The user's mod on DSL values; any failure becomes a ModCompileError naming it."""
    try:
        out = call_mod(fn, takes_aux, args, aux)
    except ModCompileError:
        raise
    except Exception as err:
        raise ModCompileError(
            f"{kind} {describe(fn)} cannot be compiled into the kernel: {type(err).__name__}: "
            f"{one_line(err)}. See Note [one body, two worlds] in fa4lab.mods") from err
    if want is Float32:
        if isinstance(out, (Float, float)):
            return Float32(out)
    elif isinstance(out, (Boolean, bool)):
        return out
    raise ModCompileError(f"{kind} {describe(fn)} returned {type(out).__name__} in the kernel; "
                          f"it must return a {'float score' if want is Float32 else 'bool'}")


class ModRows:
    """The mods' view of one thread's rows of a tile, built once per tile (not a DSL struct:
    construct it inside a kernel). `rows` are the tile rows' absolute indices (packed rows
    with pack-GQA), `head` the grid's head (the KV head when packed)."""

    def __init__(self, mods, aux, batch, head, rows, seqlen_q, seqlen_k, pack: int,
                 col_offset=0):
        self.mods = mods
        self.aux = () if aux is None else tuple(aux)
        self.batch = Int32(batch)
        self.seqlen_k = seqlen_k
        self.col_offset = col_offset
        self.rows = [query_of_row(r, head, seqlen_q, pack) for r in rows]

    def _kv(self, col, n_offset, clamp: bool):
        kv = Int32(n_offset + self.col_offset + col)
        return cutlass.min(kv, self.seqlen_k - 1) if clamp else kv

    def scores(self, r: int, row: cute.Tensor, cols: cute.Tensor, n_offset, pre_scale: Float32,
               scale_log2: Float32, softcap: bool, clamp: bool) -> None:
        """row[j] = score_mod(scaled raw score) for row r of this thread: Note [score_mod and
        the scale]; `clamp` in blocks that may hold keys past seqlen_k (Note [mod indices])."""
        mods = self.mods
        head_q, q_idx = self.rows[r]
        if softcap:
            cap = scale_log2 * Float32(LN2)
            inv_cap = cute.arch.rcp_approx(cap)
        for j in range(cute.size(row)):
            s = row[j] * pre_scale
            if softcap:
                s = cute.math.tanh(s, fastmath=True) * cap
            kv = self._kv(cols[j][1], n_offset, clamp)
            out = _traced("score_mod", mods.score_mod, mods.score_takes_aux,
                          (s, self.batch, head_q, q_idx, kv), self.aux, Float32)
            row[j] = out * inv_cap if softcap else out

    def mask(self, r: int, row: cute.Tensor, cols: cute.Tensor, n_offset, clamp: bool) -> None:
        """row[j] = -inf where mask_mod is False, for row r (after the block's other masks)."""
        mods = self.mods
        head_q, q_idx = self.rows[r]
        for j in range(cute.size(row)):
            kv = self._kv(cols[j][1], n_offset, clamp)
            visible = _traced("mask_mod", mods.mask_mod, mods.mask_takes_aux,
                              (self.batch, head_q, q_idx, kv), self.aux, Boolean)
            row[j] = where(visible, row[j], -Float32.inf)

    def scores_mn(self, acc_mn: cute.Tensor, coord0_mn: cute.Tensor, n_offset,
                  pre_scale: Float32, scale_log2: Float32, softcap: bool, clamp: bool) -> None:
        """`scores` over every row of a thread's (rows, cols) view (sm90's accumulator)."""
        for r in range(cute.size(acc_mn, mode=[0])):
            self.scores(r, acc_mn[r, None], coord0_mn[r, None], n_offset, pre_scale,
                        scale_log2, softcap, clamp)

    def mask_mn(self, acc_mn: cute.Tensor, coord0_mn: cute.Tensor, n_offset,
                clamp: bool) -> None:
        """`mask` over every row of a thread's (rows, cols) view."""
        for r in range(cute.size(acc_mn, mode=[0])):
            self.mask(r, acc_mn[r, None], coord0_mn[r, None], n_offset, clamp)


def tile_rows(coord_mn: cute.Tensor, m_offset) -> list:
    """Absolute tile rows of a thread's (rows, cols) coordinate view (the first column's)."""
    return [m_offset + coord_mn[r, 0][0] for r in range(cute.size(coord_mn, mode=[0]))]
