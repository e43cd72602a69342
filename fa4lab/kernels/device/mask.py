"""Masking a score tile in registers: the key-length tail, the causal diagonal and a sliding
window's edges (device code).

Shared by the sm90 and sm100 kernels. Inputs are arch-neutral: a thread's scores in an
(rows, cols) view and the matching view of an identity (coordinate) tensor, which tells each
register which (row, col) of the tile it holds. The caller offsets the tile into the whole
problem with `m_offset` (first query row of the tile) and `n_offset` (first key of the block):
`row_limits` turns the rows into their limits, once per tile; `apply_limits` masks a block.
Both are built from the one-row forms `key_range` and `mask_row`, which the sm100 softmax (one
row per thread) calls directly.

The rule (the contract in `fa4lab.spec`, one row's form `fa4lab.tiling.key_bounds`): query
position p sees key j iff first <= j < end, with end = min(seqlen_k, p + d + right + 1) (seqlen_k
without a right side; causal is right = 0) and first = p + d - left (no bound without a left
side), d = seqlen_k - seqlen_q. A side is None (unbounded, compile time), 0 (causal) or a
runtime Int32 (Note [runtime window] in fa4lab.kernels.compile). Masked scores become -inf so
the softmax step gives them probability exactly 0; a row with no visible key stays at -inf and
the softmax's finalize turns it into output 0 and LSE -inf (Note [empty rows]).

With pack-GQA (`qhead_per_kvhead` = g > 1) a tile row is a packed row: the rule compares keys
with its POSITION (m_offset + row) // g (Note [pack-GQA rows] in fa4lab.gqa).

Which blocks need this at all comes from `fa4lab.kernels.device.scheduler.mask_split`: FULL
blocks skip it, the others (both edges of a window, the diagonal, the seqlen_k tail) call
`apply_limits`.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32

from fa4lab.tiling import key_bounds


def window_sides(window_size, causal: bool, window_left, window_right):
    """(left, right) as `key_range` and the block ranges take them: None for a side the spec's
    stored `window_size` (`fa4lab.spec.normalize_mask`) lacks, 0 for causal's right side, else
    the kernel's runtime argument `window_left` / `window_right` (Note [runtime window])."""
    left, right = window_size
    return (None if left is None else window_left,
            0 if causal else (None if right is None else window_right))


def key_range(row, seqlen_q, seqlen_k, left, right, qhead_per_kvhead: int = 1):
    """(first, end) for tile row `row`: its first visible key (None without a left side) and
    its first invisible key (the rule above, one row)."""
    if qhead_per_kvhead > 1:
        row = row // qhead_per_kvhead  # the position; row >= 0, so // truncates = floors
    return key_bounds(row, seqlen_q, seqlen_k, left, right, imin=cutlass.min)


@cute.jit
def mask_row(row: cute.Tensor, cols: cute.Tensor, end, first=None) -> None:
    """row[j] = -inf where cols[j]'s column is at or past `end`, or (with a left side) before
    `first` (both in the block's own column frame).

    `cols` holds (row, col) coordinates; when they are compile-time constants each test is one
    compare with an immediate (Note [static columns]).
    """
    # Note [select, not if]
    # A conditional expression lowers to one select per score. An `if` statement with a
    # runtime condition becomes a structured branch that yields every value it might change --
    # here the whole accumulator -- and ptxas turned that into ~16 FSEL per score (H200 profile
    # at head_dim 64: 1058 FSEL in a masked block of 64 scores per thread, about as many
    # instructions as the rest of the block step).
    for j in cutlass.range_constexpr(cute.size(row)):
        row[j] = -Float32.inf if cols[j][1] >= end else row[j]
        if cutlass.const_expr(first is not None):
            row[j] = -Float32.inf if cols[j][1] < first else row[j]


# Note [bitmask masking]
# Per score, masking is a compare and a select for each bound (`mask_row`). In a row of the
# sm90 accumulator a thread's columns rise with the element index in a fixed pattern, pairs
# every 8 (thread 0 holds columns 0, 1, 8, 9, 16, ...), which `column_pattern` reads off thread
# 0's compile-time coordinates. So "column < limit" is "element < count(limit)": one count per
# row and bound (`elements_below`), and the counts become a 32-bit mask per 32 elements (one
# shift each; a window's two bounds one AND) whose bits are the selects' predicates: ptxas
# moves seven bits into predicates per R2P instruction. A masked block then costs about one
# select per score, against two (causal) or four (a window's two sides) instructions before.
# Upstream FA4 masks its tiles the same way (`mask_r2p_lambda` in flash_attn/cute/mask.py).
# Shifts go through PTX (`shr.u32` / `shl.u32`, which give 0 for a shift of 32 or more): in
# LLVM such a shift is undefined.
MASK_BITS = 32


def column_pattern(c: list) -> tuple[int, int] | None:
    """(w, s) when element j of a row holds column c[j] = (j // w) * s + j % w (runs of w
    columns every s), from compile-time column coordinates; None for any other layout (or
    runtime coordinates)."""
    if not c or not all(isinstance(x, int) for x in c) or c[0] != 0:
        return None
    w = 1
    while w < len(c) and c[w] == w:
        w += 1
    s = c[w] if w < len(c) else w
    if all(x == (j // w) * s + j % w for j, x in enumerate(c)):
        return w, s
    return None


def elements_below(limit, pattern: tuple[int, int], imax=cutlass.max, imin=cutlass.min):
    """How many elements of a row of this `pattern` hold a column < `limit` (an Int32 on the
    device; `imax` / `imin` the builtins for Python ints)."""
    w, s = pattern
    lim = imax(limit, 0)
    return lim // s * w + imin(lim % s, w)


def _shift_u32(op: str, val, shift):
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    return Uint32(llvm.inline_asm(T.i32(), [Uint32(val).ir_value(), Uint32(shift).ir_value()],
                                  f"{op}.b32 $0, $1, $2;", "=r,r,r", has_side_effects=False,
                                  is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def mask_row_bits(row: cute.Tensor, pattern: cutlass.Constexpr, end, first=None) -> None:
    """`mask_row` by bitmask (Note [bitmask masking]): row[j] = -inf where element j's column
    is at or past `end` or before `first`, for a row whose columns follow `pattern`."""
    n = cute.size(row)
    below = elements_below(end, pattern)
    above = None
    if cutlass.const_expr(first is not None):
        above = elements_below(first, pattern)
    for chunk in cutlass.range_constexpr((n + MASK_BITS - 1) // MASK_BITS):
        base = chunk * MASK_BITS
        keep = _shift_u32("shr", Uint32(0xFFFFFFFF),
                          cutlass.max(Int32(base + MASK_BITS) - below, Int32(0)))
        if cutlass.const_expr(first is not None):
            keep = keep & _shift_u32("shl", Uint32(0xFFFFFFFF),
                                     cutlass.max(above - Int32(base), Int32(0)))
        for i in cutlass.range_constexpr(min(MASK_BITS, n - base)):
            seen = cutlass.Boolean(keep & (Uint32(1) << i))
            row[base + i] = row[base + i] if seen else -Float32.inf


@cute.jit
def row_limits(
    coord_mn: cute.Tensor,  # (rows, cols) -> (row, col) inside the tile
    coord0_mn: cute.Tensor,  # the same view for thread 0: see Note [static columns]
    m_offset: Int32,        # query index of tile row 0
    seqlen_q: Int32,
    seqlen_k: Int32,
    left,                   # the window's sides: None, 0 (causal) or Int32
    right,
    qhead_per_kvhead: cutlass.Constexpr[int] = 1,  # g > 1: rows are packed rows (pack-GQA)
):
    """Per row of this thread: (ends, firsts) -- its first invisible key and (with a left side,
    else None) its first visible key, in thread 0's column frame.

    Computed once per tile, so a masked block costs one subtraction per row and bound and one
    compare with an immediate per score and bound (`apply_limits`).
    """
    # Note [static columns]
    # In an MMA accumulator a thread's column coordinates are thread 0's plus one offset per
    # thread (the layout is affine in the thread index). Comparing thread 0's columns --
    # compile-time constants -- against (limit - offset) makes each test one compare with an
    # immediate; comparing the thread's own coordinates keeps one live register per column,
    # which a 160-register consumer (three sm90 warpgroups) cannot afford.
    num_rows = cute.size(coord_mn, mode=[0])
    col_offset = coord_mn[0, 0][1] - coord0_mn[0, 0][1]
    ends = cute.make_rmem_tensor(num_rows, Int32)
    firsts = None
    if cutlass.const_expr(left is not None):
        firsts = cute.make_rmem_tensor(num_rows, Int32)
    for r in cutlass.range_constexpr(num_rows):
        first, end = key_range(m_offset + coord_mn[r, 0][0], seqlen_q, seqlen_k, left, right,
                               qhead_per_kvhead)
        ends[r] = end - col_offset
        if cutlass.const_expr(left is not None):
            firsts[r] = first - col_offset
    return ends, firsts


@cute.jit
def apply_limits(
    acc_mn: cute.Tensor,     # (rows, cols) scores of one thread
    coord0_mn: cute.Tensor,  # thread 0's (row, col) coordinates (compile-time)
    limits,                  # (ends, firsts) from row_limits
    n_offset: Int32,         # key index of tile column 0
) -> None:
    """Set to -inf every score whose key index is outside its row's [first, end): by bitmask
    where the row's columns have a pattern (Note [bitmask masking]), else score by score."""
    ends, firsts = limits
    for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        end = ends[r] - n_offset
        first = None if cutlass.const_expr(firsts is None) else firsts[r] - n_offset
        pattern = column_pattern([coord0_mn[r, j][1]
                                  for j in range(cute.size(coord0_mn, mode=[1]))])
        if cutlass.const_expr(pattern is not None):
            mask_row_bits(acc_mn[r, None], pattern, end, first)
        else:
            mask_row(acc_mn[r, None], coord0_mn[r, None], end, first)
