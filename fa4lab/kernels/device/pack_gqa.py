"""pack-GQA views for TMA: Q and O addressed by packed rows (host-side layout code, both archs).

Shared by the sm90 and sm100 kernels. With g = qhead_per_kvhead query heads per KV head packed
into M (Note [pack-GQA rows] in fa4lab.gqa: packed row r is position r // g of query head
kv * g + r % g), a tile of `rows` packed rows is a TMA box of g heads x rows / g positions whose
SMEM rows come out head-fastest -- exactly the packed order. That needs g to divide `rows`
(the plans check it: `fa4lab.plan.tiles.check_pack_gqa`).

How: the (seqlen, d, heads, batch) tensor is viewed as ((heads, seqlen), d, batch)
(`heads_positions`: heads and positions as one mode, so the TMA box stays 4-D), the atom is made
over that view with the tile ((g, rows / g), cols), and the atom's coordinate tensor is re-split
into ((g, seqlen), d, heads_kv, batch) (`split_packed`), so a kernel tiles mode 0 with
local_tile and picks the group with the KV head. Rows past seqlen * g are positions past seqlen,
which TMA zero-fills on load and clips on store, as without packing.

The sm100 kernel's Q is tcgen05's A operand: `packed_a_tma` makes its atom the same way (Note
[sm100 pack-GQA kernel] in fa4lab.kernels.fwd_sm100).

On the device, `unpack_row` is the same map for one row: (position, query head) of a tile row,
which the LSE store and the learnable sink read (fa4lab.kernels.device.softmax).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync


def unpack_row(row, head, pack: int):
    """(position, query head) of tile row `row` of grid head `head`: (row, head) unpacked;
    with pack = g > 1, head is the KV head and the row is packed: (row // g, head * g + row %
    g) (Note [pack-GQA rows] in fa4lab.gqa). Ints or DSL Int32, row >= 0."""
    if pack == 1:
        return row, head
    pos = row // pack
    return pos, head * pack + (row - pos * pack)


def heads_positions(mX: cute.Tensor) -> cute.Tensor:
    """(seqlen, d, heads, batch) -> ((heads, seqlen), d, batch), same memory."""
    hs = cute.make_layout(
        ((mX.shape[2], mX.shape[0]), mX.shape[1], mX.shape[3]),
        stride=((mX.stride[2], mX.stride[0]), mX.stride[1], mX.stride[3]))
    return cute.make_tensor(mX.iterator, hs)


def split_packed(coords: cute.Tensor, g: int) -> cute.Tensor:
    """TMA coordinates over ((heads, seqlen), d, batch) -> ((g, seqlen), d, heads_kv, batch).

    Mode 0 is the packed row (query head within the group fastest); mode 2 the KV head.
    """
    sh, st = coords.shape, coords.stride
    packed = cute.make_layout(
        ((g, sh[0][1]), sh[1], sh[0][0] // g, sh[2]),
        stride=((st[0][0], st[0][1]), st[1], st[0][0] * g, st[2]))
    return cute.make_tensor(coords.iterator, packed)


def packed_tma(op, mX: cute.Tensor, smem_layout, tile: tuple[int, int], g: int):
    """TMA atom and ((g, seqlen), d, heads_kv, batch) coordinates for (seqlen, d, heads, batch)
    `mX`, tiled by `tile` = (rows, cols) packed rows x columns."""
    rows, cols = tile
    atom, coords = cpasync.make_tiled_tma_atom(op, heads_positions(mX), smem_layout,
                                               ((g, rows // g), cols))
    return atom, split_packed(coords, g)


def packed_a_tma(op, mQ: cute.Tensor, sQ_layout, tiled_mma_qk, mma_tiler_qk, cluster_shape,
                 g: int):
    """TMA of the Q tiles (the sm100 score MMA's A operand) for (seqlen_q, d, heads_q, batch)
    `mQ`.

    Returns the atom and its coordinates: (seqlen_q, d, heads_q, batch), or with g > 1
    (pack-GQA) ((g, seqlen_q), d, heads_kv, batch), the M tile being (g heads, m_block / g
    positions). See Note [sm100 pack-GQA kernel] in fa4lab.kernels.fwd_sm100.
    """
    smem = cute.select(sQ_layout, mode=[0, 1, 2])
    if g == 1:
        return cute.nvgpu.make_tiled_tma_atom_A(op, mQ, smem, mma_tiler_qk, tiled_mma_qk,
                                                cluster_shape)
    m, n, k = mma_tiler_qk
    atom, coords = cute.nvgpu.make_tiled_tma_atom_A(
        op, heads_positions(mQ), smem, ((g, m // g), n, k), tiled_mma_qk, cluster_shape)
    return atom, split_packed(coords, g)
