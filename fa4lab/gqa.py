"""The GQA maps: which KV head a query head reads, and pack-GQA's rows.

With heads_q = g * heads_kv (g = qhead_per_kvhead), query head h reads KV head h // g
(`kv_head_of`, `q_heads_of`, `query_to_kv_heads`). Pack-GQA folds the g query heads of a KV
head into one tile's M rows (Note [pack-GQA rows]): `pack_gqa_row` and `unpack_gqa_row` map
(query head, position) to a packed row and back. Plain Python; bad arguments raise ValueError
naming the argument.

    from fa4lab.gqa import pack_gqa_row, unpack_gqa_row
    row = pack_gqa_row(5, 100, heads_q=8, heads_kv=2, seqlen_q=4096)
    unpack_gqa_row(1, row, heads_q=8, heads_kv=2, seqlen_q=4096)   # (5, 100)
"""

from __future__ import annotations

from fa4lab.tiling import _positive

__all__ = ["gqa_group_size", "kv_head_of", "pack_gqa_row", "q_heads_of", "query_to_kv_heads",
           "unpack_gqa_row"]


def gqa_group_size(heads_q: int, heads_kv: int) -> int:
    """qhead_per_kvhead: how many query heads share one KV head."""
    _positive("heads_q", heads_q)
    _positive("heads_kv", heads_kv)
    if heads_q % heads_kv:
        divisors = [d for d in range(1, heads_q + 1) if heads_q % d == 0]
        raise ValueError(f"heads_q={heads_q} is not a multiple of heads_kv={heads_kv}: each KV "
                         f"head must serve the same number of query heads; choose heads_kv "
                         f"among {divisors}")
    return heads_q // heads_kv


def kv_head_of(q_head: int, heads_q: int, heads_kv: int) -> int:
    """The KV head query head `q_head` reads: q_head // (heads_q // heads_kv)."""
    group = gqa_group_size(heads_q, heads_kv)
    if not 0 <= q_head < heads_q:
        raise ValueError(f"q_head={q_head} is out of range [0, {heads_q})")
    return q_head // group


def query_to_kv_heads(heads_q: int, heads_kv: int) -> tuple[int, ...]:
    """The whole map: element h is the KV head of query head h."""
    group = gqa_group_size(heads_q, heads_kv)
    return tuple(h // group for h in range(heads_q))


def q_heads_of(kv_head: int, heads_q: int, heads_kv: int) -> range:
    """The query heads that read KV head `kv_head` (a contiguous run)."""
    group = gqa_group_size(heads_q, heads_kv)
    if not 0 <= kv_head < heads_kv:
        raise ValueError(f"kv_head={kv_head} is out of range [0, {heads_kv})")
    return range(kv_head * group, (kv_head + 1) * group)


# Note [pack-GQA rows]
# With pack-GQA one CTA tile serves all qhead_per_kvhead query heads of a KV head, so K/V are
# loaded once for the group. The M dimension of KV head g holds seqlen_q * qhead_per_kvhead
# packed rows, query head fastest (FA's layout, which keeps a tile's rows at few positions):
#     packed_row = pos * qhead_per_kvhead + (q_head - g * qhead_per_kvhead)
#     q_head     = g * qhead_per_kvhead + packed_row % qhead_per_kvhead
#     pos        = packed_row // qhead_per_kvhead
# The causal mask (and a window's edges) compare key j with the POSITION (packed_row //
# qhead_per_kvhead), never with the packed row itself: see Note [bottom-right causal] and Note
# [sliding window tiles] in fa4lab.tiling for the tile bounds.


def pack_gqa_row(q_head: int, pos: int, *, heads_q: int, heads_kv: int,
                 seqlen_q: int) -> tuple[int, int]:
    """(query head, seqlen position) -> (kv head, packed row). See Note [pack-GQA rows]."""
    group = gqa_group_size(heads_q, heads_kv)
    _positive("seqlen_q", seqlen_q)
    if not 0 <= q_head < heads_q:
        raise ValueError(f"q_head={q_head} is out of range [0, {heads_q})")
    if not 0 <= pos < seqlen_q:
        raise ValueError(f"pos={pos} is out of range [0, seqlen_q={seqlen_q})")
    kv_head = q_head // group
    return kv_head, pos * group + (q_head - kv_head * group)


def unpack_gqa_row(kv_head: int, packed_row: int, *, heads_q: int, heads_kv: int,
                   seqlen_q: int) -> tuple[int, int]:
    """(kv head, packed row) -> (query head, seqlen position). See Note [pack-GQA rows]."""
    group = gqa_group_size(heads_q, heads_kv)
    _positive("seqlen_q", seqlen_q)
    if not 0 <= kv_head < heads_kv:
        raise ValueError(f"kv_head={kv_head} is out of range [0, {heads_kv})")
    if not 0 <= packed_row < seqlen_q * group:
        raise ValueError(f"packed_row={packed_row} is out of range [0, seqlen_q * "
                         f"qhead_per_kvhead = {seqlen_q * group})")
    return kv_head * group + packed_row % group, packed_row // group
