"""The work tiles of a variable-length launch, and the pages its key blocks read.

A varlen launch runs only its real tiles (Note [varlen tiles]): `varlen_tile_table` lists them
as (batch, m_block) rows in LPT order by sequence on the host, `tile_rows` is the same rule on
tensors of any device, and `launch_tile_rows` the cheaper one a launch builds on the GPU with
no device-to-host copy (Note [launch tile table]), sized by `max_tile_rows` (Note [tile rows on
the device]); `launch_lengths` gives the lengths the kernels read beside it, and `varlen_tiles`
the tiles with their heads beside what a padded (batch, max_seqlen_q) grid would launch.
`key_block_pages` says which pages each key block of a paged sequence reads. The layout itself
and its one check are `fa4lab.varlen`'s.

    from fa4lab.varlen_tiles import varlen_tiles
    varlen_tiles([100, 3000], [100, 3000], heads=8, m_block_size=128, n_block_size=128,
                 causal=True).padding_tiles
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from fa4lab.errors import InputError
from fa4lab.scheduling import CostModel
from fa4lab.tiling import block_counts, ceil_div, num_m_blocks

if TYPE_CHECKING:
    from fa4lab.varlen import VarlenLengths

__all__ = ["PageRead", "VarlenTileTable", "VarlenTiles", "key_block_pages", "launch_lengths",
           "launch_tile_rows", "max_tile_rows", "seen_cap", "tile_rows", "varlen_tile_table",
           "varlen_tiles"]


# Note [varlen tiles]
# A padded launch of a varlen batch runs a (batch, heads, ceil(max_seqlen_q / m_block)) grid:
# short sequences leave tiles with no query row at all, which still start, find nothing to do
# and exit. A varlen launch enumerates only real tiles, ceil(len_q[b] / m_block) per sequence
# and head (with pack-GQA the M extent is len_q[b] * qhead_per_kvhead, `tiling.num_m_blocks`).
# The cost of a tile is `scheduling.CostModel`'s, from the key blocks `tiling`'s block-range
# functions give it on its own sequence's (len_q, len_k) (Note [tile cost model]). A tile's
# cost does not depend on its head, so the order is one of (batch, m_block) rows
# (`varlen_tile_table`) with the heads expanded innermost: the heads of one row run side by
# side (they read the same sequence's K/V). The rows are in LPT order by sequence: sequences
# by their longest tile, longest first, and each sequence's tiles longest first (ties in
# m_block order). A sequence is the varlen L2 section (Note [L2 swizzle]): the CTAs running
# at once share its K/V in L2. One LPT order over the whole batch (every sequence's last tile,
# then every sequence's next-to-last, ...) ran tiles of four or five sequences at once on the
# H200, whose K/V did not fit in L2 together: on the serving bench's varlen prefill (32
# sequences of 128..8192 tokens, hd128, GQA 4, causal) the sm90 kernel read 14.4 GB from DRAM
# against 2.1 GB for FA4's (ncu), and end to end ran at 0.93x FA4. By sequence it reads
# 2.14 GB and runs at 0.99x FA4 end to end, its kernel 1.04x (H200, one run beside FA4's:
# triton do_bench medians 11.20 / 11.12 ms, kernel medians 10.87 / 11.33 ms). A long prefill's
# tiles still start before a batch of decodes' one-block tiles, and the last tiles to start
# are the shortest sequence's. In `scheduling`'s model the order loses nothing with one CTA per
# tile (list scheduling: 1.0002x the average load at 132 SMs on that batch, as one LPT order)
# and little with static persistent CTAs (1.012x against 1.006x at 148). A sequence whose
# K/V alone overflow the L2 budget is still one section (heads are innermost in a row, so the
# table cannot cut a sequence by heads). The kernels launch from a table of the same tiles
# built with fewer GPU ops (Note [launch tile table]; Note [varlen tile table] in
# fa4lab.kernels.device.scheduler); `varlen_tiles` lists the same tiles.


@dataclass(frozen=True)
class VarlenTileTable:
    """The real tiles of a varlen launch as (batch, m_block) rows, LPT order by sequence (Note
    [varlen tiles]): table (rows, 2) int32, the kernels' mTileTable; costs (rows,) each row's
    tile cost (one head's), non-increasing within a sequence; key_blocks (rows,) the key
    blocks each tile visits."""

    table: np.ndarray
    costs: np.ndarray
    key_blocks: np.ndarray


def varlen_tile_table(seqlens_q, seqlens_k, *, m_block_size: int, n_block_size: int,
                      causal: bool = False, window_size=(None, None), qhead_per_kvhead: int = 1,
                      cost: CostModel | None = None) -> VarlenTileTable:
    """The (batch, m_block) rows of a varlen launch's real tiles in LPT order by sequence
    (Note [varlen tiles]); `m_block_size` is the rows of one work tile (a CTA's). On the
    host: the lengths are ints (`tile_rows` is the same rule on tensors, as a launch builds it
    on the GPU)."""
    import torch

    if len(seqlens_q) != len(seqlens_k):
        raise InputError(f"{len(seqlens_q)} query lengths but {len(seqlens_k)} key lengths: "
                         f"one of each per sequence")
    lq = torch.tensor([int(n) for n in seqlens_q], dtype=torch.int64)
    lk = torch.tensor([int(n) for n in seqlens_k], dtype=torch.int64)
    table, costs, blocks = tile_rows(lq, lk, None, m_block_size=m_block_size,
                                     n_block_size=n_block_size, causal=causal,
                                     window_size=window_size, qhead_per_kvhead=qhead_per_kvhead,
                                     cost=cost)
    return VarlenTileTable(table.numpy(), costs.numpy(), blocks.numpy())


def max_tile_rows(total_q: int, batch: int, m_block_size: int, qhead_per_kvhead: int = 1) -> int:
    """A bound on the real (batch, m_block) rows of any batch of `batch` sequences holding
    `total_q` queries: the sum of ceil(len_b * g / m) is at most (total_q * g + batch * (m -
    1)) / m. What a launch sizes its tile table and grid by without reading the lengths (Note
    [tile rows on the device])."""
    return (total_q * qhead_per_kvhead + batch * (m_block_size - 1)) // m_block_size


# Note [tile rows on the device]
# A launch cannot count its real tiles without reading the lengths (Note [reading the lengths]), so
# `tile_rows` (and the launch's cheaper `launch_tile_rows`) fills a table of `max_tile_rows` rows on
# the lengths' device: row r belongs to the sequence whose cumulative tile count first exceeds r (a
# searchsorted), and rows past the real ones are PADDING rows (batch, 0): tile 0 of a phantom
# sequence `batch`, one past the last, which the launch gives no query and no key (`launch_lengths`
# appends a zero-length entry to cu_seqlens and seqused_k). The padding rows cost -1, so the phantom
# sequence's longest tile is the shortest of all and the sort puts them last; a padding tile finds
# no row to store and no key block to visit, and ends. At most `batch` rows are padding: fewer than
# one tile per sequence. The lengths may be bad (the default check reports them after the launch:
# Note [reading the lengths]), so each sequence's tile count is clamped into [0, rows]: the
# cumulative counts stay sorted (what searchsorted needs) and every m_block is below `rows` (m_block
# * m_block_size cannot overflow int32); the kernels clamp each sequence's own offsets and
# lengths into the packed tensors (Note [clamped lengths] in fa4lab.kernels.device.seqlen). On
# good lengths the clamp changes nothing.


def tile_rows(lens_q, lens_k, rows: int | None, *, m_block_size: int, n_block_size: int,
              causal: bool = False, window_size=(None, None), qhead_per_kvhead: int = 1,
              cost: CostModel | None = None) -> tuple:
    """(table (rows, 2) int32 (batch, m_block), costs (rows,) float64, key_blocks (rows,)
    int64) of a varlen launch in LPT order by sequence (Note [varlen tiles]), from int64
    tensors of each sequence's query and key lengths on any device, without a device-to-host
    copy when `rows` is given (Note [tile rows on the device]: rows past the real tiles are
    padding (batch, 0), cost -1, last); `rows` None counts the real rows (one read) and
    returns exactly those."""
    import torch

    cost = cost or CostModel()
    batch = int(lens_q.shape[0])
    per_seq = (lens_q * qhead_per_kvhead + m_block_size - 1) // m_block_size
    if rows is not None:    # lengths nothing has checked yet: Note [tile rows on the device]
        per_seq = per_seq.clamp(0, rows)
    ends = per_seq.cumsum(0)
    if rows is None:
        rows = int(ends[-1]) if batch else 0
    r = torch.arange(rows, dtype=torch.int64, device=lens_q.device)
    b = torch.searchsorted(ends, r, right=True)
    real = b < batch
    seq = b.clamp(max=max(batch - 1, 0))
    m = torch.where(real, r - (ends - per_seq)[seq], 0)
    sk = lens_k[seq]
    unmasked, masked = block_counts(m, lens_q[seq], sk, m_block_size=m_block_size,
                                    n_block_size=n_block_size, causal=causal,
                                    qhead_per_kvhead=qhead_per_kvhead, window_size=window_size)
    # A sequence with no key visits no block: its tiles only write O = 0 and their LSE.
    seen = real & (sk > 0)
    unmasked, masked = torch.where(seen, unmasked, 0), torch.where(seen, masked, 0)
    costs = torch.where(real, cost.tile_cost(unmasked.double(), masked.double()), -1.0)
    # Sequences by their longest tile, then each sequence's tiles longest first (Note [varlen
    # tiles]): one sort on rank(sequence) * span - cost, span above every cost.
    top = costs.new_full((batch + 1,), -1.0).scatter_reduce_(0, b, costs, "amax")
    rank = torch.empty_like(top, dtype=torch.int64).scatter_(
        0, torch.argsort(-top, stable=True), torch.arange(batch + 1, device=b.device))
    order = torch.argsort(rank[b] * (costs.abs().sum() + 2.0) - costs, stable=True)
    table = torch.stack([b, m], dim=1)[order].to(torch.int32)
    return table, costs[order], (unmasked + masked)[order]


# Note [launch tile table]
# `tile_rows` orders a launch's tiles with the cost model: exact, and about a hundred small
# torch ops on the GPU, 2.7 ms of host time per varlen call on the H200 (torch profiler, 8
# sequences) where FA4's whole call takes 0.2 ms. `launch_tile_rows` builds the launch's table
# in about twenty: the same real (batch, m_block) rows, the same padding rows last, by
# sequence (the L2 sections of Note [varlen tiles]), sequences ordered by the keys their
# busiest tile sees (a sequence's key count, capped by the window's span) rather than by the
# model's cost of that tile, each sequence's tiles last m_block first when causal (where a
# tile's cost grows with m_block) and in m_block order otherwise. For causal batches without
# a window this is the order `tile_rows` gives whenever the key counts rank the sequences as
# their longest tiles' costs do; tests/test_varlen_kernels.py compares the two.


def seen_cap(m_block_size: int, causal: bool, window_size) -> int | None:
    """The keys one tile of `m_block_size` rows can see under `window_size` (left + right +
    m_block_size, right 0 when causal, at least 0): what a launch orders its sequences by
    (Note [launch tile table]); None with a side unbounded."""
    left, right = window_size
    if causal:
        right = 0
    if left is None or right is None:
        return None
    return max(left + right + m_block_size, 0)


def launch_tile_rows(lens_q, lens_k, rows: int, *, m_block_size: int, causal: bool = False,
                     window_size=(None, None)):
    """(rows, 2) int32 (batch, m_block) table of a varlen launch from int64 tensors of each
    sequence's query and key counts on the GPU, without a device-to-host copy (Note [launch
    tile table]; padding rows (batch, 0) last, Note [tile rows on the device])."""
    import torch

    batch = int(lens_q.shape[0])
    per_seq = torch.clamp((lens_q + (m_block_size - 1)) // m_block_size, 0, rows)
    cap = seen_cap(m_block_size, causal, window_size)
    seen = lens_k if cap is None else torch.clamp(lens_k, max=cap)
    order = torch.argsort(seen, descending=True, stable=True)
    ends = per_seq[order].cumsum(0)
    r = torch.arange(rows, dtype=torch.int64, device=lens_q.device)
    j = torch.clamp(torch.searchsorted(ends, r, right=True), max=max(batch - 1, 0))
    real = r < ends[-1:] if batch else torch.zeros_like(r, dtype=torch.bool)
    into = r - (ends - per_seq[order])[j]           # the row's place among its sequence's tiles
    m = (per_seq[order][j] - 1 - into) if causal else into
    table = torch.stack((torch.where(real, order[j], batch), torch.where(real, m, 0)), dim=1)
    return table.to(torch.int32)


def launch_lengths(lengths: VarlenLengths) -> tuple:
    """(cu_seqlens_q, cu_seqlens_k or None, seqused_k) as a varlen launch passes them: the
    caller's, each with one more, zero-length sequence appended (the phantom sequence the
    padding rows of the tile table name: Note [tile rows on the device]); seqused_k is
    `lengths.keys`, the key counts with seqused_k applied. No device-to-host copy."""
    import torch

    def one_more(t):
        return torch.cat([t, t[-1:]])

    cu_k = None if lengths.cu_k is None else one_more(lengths.cu_k)
    keys = torch.cat([lengths.keys, lengths.keys.new_zeros(1)])
    return one_more(lengths.cu_q), cu_k, keys


@dataclass(frozen=True)
class VarlenTiles:
    """The work tiles of a varlen launch, in LPT order by sequence (Note [varlen tiles]).

    tiles (num_tiles, 3) int64 rows (batch, head, m_block); costs (num_tiles,) their
    `CostModel` cost, non-increasing within a sequence; key_blocks (num_tiles,) the key
    blocks each visits; padded_tiles the tiles a padded (batch, heads, max_seqlen_q) grid
    would launch."""

    tiles: np.ndarray
    costs: np.ndarray
    key_blocks: np.ndarray
    padded_tiles: int

    @property
    def num_tiles(self) -> int:
        return int(self.tiles.shape[0])

    @property
    def padding_tiles(self) -> int:
        """Tiles of the padded grid with no query row: the launches varlen saves."""
        return self.padded_tiles - self.num_tiles


def varlen_tiles(seqlens_q, seqlens_k, *, heads: int, m_block_size: int, n_block_size: int,
                 causal: bool = False, window_size=(None, None), qhead_per_kvhead: int = 1,
                 max_seqlen_q: int | None = None, cost: CostModel | None = None) -> VarlenTiles:
    """The real tiles of a varlen launch, in LPT order by sequence (Note [varlen tiles]): the
    rows of `varlen_tile_table` with each row's `heads` tiles next to each other, as a kernel
    runs them (linear tile t is row t // heads, head t % heads).

    `heads` is the grid's head axis (heads_q, or heads_kv with pack-GQA and
    `qhead_per_kvhead` > 1 query heads folded into M). `max_seqlen_q` sizes the padded grid
    it is compared with (default: the longest sequence)."""
    rows = varlen_tile_table(seqlens_q, seqlens_k, m_block_size=m_block_size,
                             n_block_size=n_block_size, causal=causal, window_size=window_size,
                             qhead_per_kvhead=qhead_per_kvhead, cost=cost)
    n = len(rows.table)
    tiles = np.empty((n * heads, 3), dtype=np.int64)
    tiles[:, 0] = np.repeat(rows.table[:, 0], heads)
    tiles[:, 1] = np.tile(np.arange(heads, dtype=np.int64), n)
    tiles[:, 2] = np.repeat(rows.table[:, 1], heads)
    longest = max((int(n) for n in seqlens_q), default=0)
    if max_seqlen_q is None:
        max_seqlen_q = longest
    elif int(max_seqlen_q) < longest:
        raise InputError(f"max_seqlen_q={max_seqlen_q} is smaller than the longest query "
                         f"length {longest}")
    padded = len(seqlens_q) * heads * num_m_blocks(int(max_seqlen_q), m_block_size,
                                                   qhead_per_kvhead)
    return VarlenTiles(tiles, np.repeat(rows.costs, heads), np.repeat(rows.key_blocks, heads),
                       padded)


class PageRead(NamedTuple):
    """One contiguous piece of a key block: tokens [first, stop) of page table slot `slot`,
    which holds cache page `page`."""

    slot: int
    page: int
    first: int
    stop: int


def key_block_pages(seqlen_k: int, page_size: int, n_block_size: int,
                    page_table_row=None) -> list[tuple[PageRead, ...]]:
    """For each key block of a sequence of seqlen_k keys, the pages it reads, in key order.

    Block n holds keys [n * n_block_size, min((n + 1) * n_block_size, seqlen_k)); key t is
    token t % page_size of slot t // page_size. With page_size a multiple of n_block_size one
    page serves page_size / n_block_size whole blocks (a block is one piece: one TMA load);
    with page_size < n_block_size a block gathers n_block_size / page_size pages; sizes that
    do not divide make some blocks straddle a page edge (two pieces). `page_table_row` (a
    sequence's row of the page table, any int sequence) names the cache pages; without it
    `page` is the slot."""
    for name, x in (("page_size", page_size), ("n_block_size", n_block_size)):
        if isinstance(x, bool) or not hasattr(x, "__index__") or int(x) < 1:
            raise InputError(f"{name} must be a positive int, got {x!r}")
    if isinstance(seqlen_k, bool) or not hasattr(seqlen_k, "__index__") or int(seqlen_k) < 0:
        raise InputError(f"seqlen_k must be an int >= 0, got {seqlen_k!r}")
    row = None if page_table_row is None else [int(p) for p in (
        page_table_row.tolist() if hasattr(page_table_row, "tolist") else page_table_row)]
    if row is not None and len(row) < ceil_div(seqlen_k, page_size):
        raise InputError(f"page_table_row has {len(row)} slots but {seqlen_k} keys in pages of "
                         f"{page_size} need {ceil_div(seqlen_k, page_size)}")
    blocks = []
    for lo in range(0, seqlen_k, n_block_size):
        hi = min(lo + n_block_size, seqlen_k)
        pieces = []
        for slot in range(lo // page_size, ceil_div(hi, page_size)):
            first = max(lo, slot * page_size) - slot * page_size
            stop = min(hi, (slot + 1) * page_size) - slot * page_size
            pieces.append(PageRead(slot, slot if row is None else row[slot], first, stop))
        blocks.append(tuple(pieces))
    return blocks
