"""Paged K/V caches in the forward kernels: which cache rows feed each key block (device code).

Shared by the sm90 and sm100 kernels. The layout is `fa4lab.varlen`'s (upstream FA4's): the
cache is (num_pages, page_size, heads_kv, d) and key t of sequence b is
cache[page_table[b, t // page_size], t % page_size]. The kernels view the cache exactly as a
dense (batch, seqlen, heads, d) tensor with seqlen -> page_size and batch -> page, so the TMA
atoms and their (rows, d, head, batch) coordinates stay; only the coordinates of a key block
change (Note [paged key blocks]).

* `check_page_size`: the page sizes a kernel with key blocks of n_block rows takes (a
  multiple of n_block, or a divisor of it), a `PlanError` otherwise;
* `block_read` / `block_reads`: piece j of key block n, or all its pieces, (slot, row block,
  rows) each: THE mapping, on Python ints or DSL Int32 (tests check it against
  `fa4lab.varlen_tiles.key_block_pages`);
* `seqlen_k`: a paged launch's key count per sequence before seqused_k caps it;
* `page_tma`, `plain`, `stage_pieces`, `page_coords` (host side), `read_pages` and
  `copy_block` (producer side): the TMA atom of one piece, the SMEM slices and cache
  coordinates it copies between, the page indices of a block and its copies.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from fa4lab.errors import PlanError
from fa4lab.kernels.device.opaque import opaque_zero
from fa4lab.limits import page_fits

# Pieces of a gather issued per iteration of its run-time loop (Note [paged key blocks]).
GATHER_UNROLL = 2
# sm100's load warp runs at 48 registers (fa4lab.plan.sm100): a gather of pieces wider than 128
# columns (head_dim 256, four 64-column TMA boxes a piece) spilled there at GATHER_UNROLL
# pieces per iteration (44 STL/LDL, pages of 4 to 16, measured) and does not at one.
WIDE_GATHER_UNROLL = 1


def gather_unroll(widest_cols: int, tight: bool) -> int:
    """Pieces per iteration of a gather's loop for a kernel whose widest K/V row is
    `widest_cols`, `tight` for a load warp at sm100's register budget."""
    return WIDE_GATHER_UNROLL if tight and widest_cols > 128 else GATHER_UNROLL


# Lanes of the load warp, each holding the page of one piece of a key block per group.
WARP_LANES = 32

# Note [paged key blocks]
# Key block n of a sequence holds keys [n * n_block, (n + 1) * n_block). With the cache viewed
# as (page_size, d, heads_kv, num_pages) -- a dense (seqlen, d, heads, batch) tensor whose
# "sequences" are pages -- the block is read in one of two ways, chosen at compile time:
# * page_size a multiple of n_block (128, 256, ... with n_block 128): one page holds
#   page_size / n_block whole blocks, so the block is ONE TMA box of the usual (n_block, d)
#   shape at (row block n % (page_size / n_block), 0, head, page_table[b, n // (page_size /
#   n_block)]): the dense kernel's load with other coordinates.
# * page_size < n_block dividing it (1, 2, 4, ..., 64): a gather. The block is n_block /
#   page_size pages, slots n * (n_block / page_size) + j; a second TMA atom with a (page_size,
#   d) box copies page j into rows [j * page_size, (j + 1) * page_size) of the block's SMEM
#   stage. The TMA unit applies the 128-byte swizzle by SMEM address (the pattern repeats every
#   8 rows of 128 bytes, 1024 bytes; a box needs only 128-byte alignment), and each slice
#   starts on a row of the stage, so the stage is laid out exactly as one (n_block, d) box
#   would have left it, whether the slice starts on a swizzle atom (pages of 8 or more) or
#   inside one (pages of 1, 2, 4). At head_dim 96 a row of the atom is 64 bytes (the 64-byte
#   swizzle), so there a slice is 128-byte aligned only at an even row: the sm100 kernel refuses
#   pages of 1 at head_dim 96 (`fa4lab.limits.min_gather_page`). All copies of a block arrive on the
#   block's one full barrier, whose transaction bytes stay the block's. A block of more than
#   32 pages (pages of 1 or 2 with 128-key blocks) is gathered 32 pages at a time
#   (`page_groups`): lane j of the load warp reads the page of piece 32 g + j of group g.
#   What it costs: pages of 1 issue one TMA copy per key and 64 columns from one thread, and
#   ran at 0.19x FA4's cp.async gather (H200, prefill 4 x 4096 causal, hd128); pages of 4 at
#   0.62x, 16 at 1.03x (benchmarks/2026-12-02_nvidia-h200_parity-cost.txt). Eight pieces per
#   iteration instead of two gained 10% at pages of 1: the TMA issue, not the loop, is the
#   limit. The sm90 kernel copies pages below 16 with cp.async instead, all 128 producer
#   threads at once (Note [cp.async gather] in fa4lab.kernels.device.page_rows).
#   On sm100 the stages are the MMA operands' layouts, read here in their plain (keys, d) form
#   (`plain`; V as (d, keys), keys_mode 1, since its head_dim is contiguous).
#   The copies are a run-time loop over the pieces (`copy_block`), GATHER_UNROLL of them per
#   iteration, piece j's SMEM slice, row block and page (a shuffle from lane j) computed from
#   j inside it. Fully unrolled, ptxas issued a block's pieces together, every piece's page
#   index and TMA operands live at once, and spilled (hd128, STL/LDL instructions): on sm100,
#   whose load warp runs at 48 registers (setmaxnreg, fa4lab.plan.sm100), 62 (68 causal) with
#   pages of 16 and 6 with pages of 32 causal; on sm90 18 with pages of 16 and 2 with pages of
#   32 (non-causal). The loop spills nowhere, on either kernel, and leaves a 2-page gather
#   (pages of 64 with 128-key blocks) fully unrolled, its code as before.
#   What a gather costs, then, is producer instructions, not registers. The load warp's SASS
#   per key block (its K and V; hd128, sm100 / sm90): one box 66 / 79 instructions, pages of
#   64 96-98 / 121, of 32 198 / 241-247, of 16 338 / 433-451 (fully unrolled: 32 152 / 220, 16
#   341-353 / 340-405), issued by one elected lane while the block's MMAs take thousands of
#   cycles; four pieces per iteration cost about the same (sm90, 16: 438).
# Sizes that neither divide n_block nor are a multiple of it are refused before launch
# (`check_page_size`). The page indices are read from global memory by the producer: lane j
# of the load warp reads slot j of the block (one transaction for the warp) and the copy of
# piece j takes it by a shuffle, so a block costs one page-table latency however many pages it
# gathers; the V copy of a block reuses the indices its K copy read. A slot past the
# sequence's last page (the last block of a gather when pages_per_seq * page_size is not a
# multiple of n_block) is clamped to the last page: its rows are keys >= seqlen_k, masked like
# any tail, and a real page holds finite values (the rows of a page past seqlen_k are read as
# they are, so a cache must not hold NaN or Inf there, as with upstream's TMA path).
# See Note [clamped indices] for what a bad page table can and cannot do.
# A paged kernel always takes seqused_k ((batch,) int32; the launch passes pages_per_seq *
# page_size for every sequence when the caller gives none): the launch-level seqlen_k is
# pages_per_seq * page_size (`seqlen_k`), and each tile's key count is its sequence's
# seqused_k (`fa4lab.kernels.device.seqlen.of_launch`), so keys may end inside a page and the
# slots past a sequence's last used page are never read. The page-table row is the sequence's
# index (never the packed view's batch 0 of a varlen launch), and a paged cache is neither
# offset by cu_seqlens_k (a paged launch has none) nor viewed as a packed batch of one.
# Split-KV reads pages the same way: a split kernel's CTA walks its split's blocks of its
# sequence's seqused_k keys (Note [empty splits] in fa4lab.kernels.device.split), so a block's
# pages do not depend on the split that reads them.

# Note [clamped indices]
# Nothing on the host reads the page table's values before the launch (Note [reading the
# lengths] in fa4lab.varlen); the default check runs on the device beside the launch and reports
# a bad entry afterwards (Note [index check on the device] in fa4lab.indexcheck). So the
# producer keeps every read inside the tensors whatever the table and seqused_k hold
# (`read_pages`): the row is clamped to the table's last, the slot to the sequence's last page
# and to the row's last slot (a seqused_k above the table's capacity is not clamped itself: it
# steers TMA loads, which zero-fill outside the view, and this slot), and the page into
# [0, num_pages):
# below by `read_pages` (one max per lane and key block), above by `copy_block` against the
# cache view's page extent (one min per piece, an operand from the kernel's parameters). A bad
# page then reads another page of the cache: a wrong answer, never a fault (the TMA unit would
# zero-fill a box outside the view in any case). The sm100 kernel's one-box branch (page_size a
# multiple of n_block) takes its coordinate from `read_pages` and clamps it the same way.


def check_page_size(page_size: int, n_block: int, min_page: int = 1) -> None:
    """Raise `PlanError` unless a kernel with key blocks of `n_block` rows can read pages of
    `page_size` tokens (Note [paged key blocks]); `min_page` the smallest page its gather
    takes (`fa4lab.limits.min_gather_page`)."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise PlanError(f"page_size must be a positive int, got {page_size!r}")
    if page_fits(page_size, n_block, min_page):
        return
    divisors = [p for p in range(min_page, n_block, min_page) if n_block % p == 0]
    aligned = (f" that is a multiple of {min_page} (a gathered page's SMEM slice starts "
               f"128-byte aligned: fa4lab.limits.min_gather_page)" if min_page > 1 else "")
    raise PlanError(f"page_size={page_size} does not fit key blocks of {n_block} rows: the "
                    f"kernel reads a multiple of {n_block} (one TMA box per block) or a "
                    f"divisor of it{aligned} ({divisors}: a gather of pages per block); "
                    f"re-page the cache with one of those sizes")


def pages_per_block(page_size: int, n_block: int) -> int:
    """Pieces (pages) of one key block: n_block / page_size for a gather, else 1."""
    return n_block // page_size if page_size < n_block else 1


def page_groups(page_size: int, n_block: int) -> int:
    """Groups of WARP_LANES pieces in one key block: each lane of the load warp holds one
    page per group (`read_pages`)."""
    return -(-pages_per_block(page_size, n_block) // WARP_LANES)


def blocks_per_page(page_size: int, n_block: int) -> int:
    """Whole key blocks of one page: page_size / n_block, or 1 for a gather."""
    return page_size // n_block if page_size >= n_block else 1


def block_read(n, j, page_size: int, n_block: int) -> tuple:
    """Piece j of key block n: (slot, row_block, rows), meaning rows [row_block * rows,
    (row_block + 1) * rows) of the page in page-table slot `slot` fill rows [j * rows,
    (j + 1) * rows) of the block (Note [paged key blocks]). `n` and `j` are ints or DSL Int32
    (j < `pages_per_block`); page_size and n_block are compile-time ints. Slots are not clamped
    (`read_pages` does)."""
    if page_size >= n_block:
        per_page = blocks_per_page(page_size, n_block)
        return (n // per_page, n % per_page, n_block)
    return (n * pages_per_block(page_size, n_block) + j, 0, page_size)


def block_reads(n, page_size: int, n_block: int) -> list[tuple]:
    """Key block n's pieces in key order, `block_read` of each."""
    return [block_read(n, j, page_size, n_block)
            for j in range(pages_per_block(page_size, n_block))]


def launch_seqlen_k(page_size, mK: cute.Tensor, mPageTable):
    """The launch's keys per sequence: the rows of mK (as the kernel views it, keys first), or
    a paged launch's (`seqlen_k`); a tile's own count is its sequence's (seqused_k, which a
    paged launch always has)."""
    if const_expr(mPageTable is not None):
        return seqlen_k(mPageTable, page_size)
    return cute.size(mK.shape[0])


def seqlen_k(mPageTable: cute.Tensor, page_size: int):
    """The launch-level key count of a paged launch, pages_per_seq * page_size: what the
    tile scheduler and `fa4lab.kernels.device.seqlen.of_launch` start from; each tile's own
    count is its sequence's seqused_k (Note [paged key blocks])."""
    # Plus an opaque zero (Note [opaque zero]): a key count the compiler knows to be a multiple
    # of page_size let it version the sm100 MMA warp's block loop (two PTX loops for one loop
    # of the protocol table), which a key count from memory, like dense mK's, does not.
    return cute.size(mPageTable.shape[1]) * page_size + opaque_zero()


# ---------------------------------------------------------------- host side (inside __call__)
# A block's SMEM stage is (keys, cols) for K-like operands (keys_mode 0: keys are rows) and
# (cols, keys) for V on sm100 (keys_mode 1: V^T, head_dim contiguous); `plain` turns an MMA
# operand layout into that form.


def plain(mma_layout, n: int, k: int, stages: int | None = None):
    """An MMA B-operand SMEM layout ((N, K atom), 1, K blocks[, stages]) (sm100's
    `make_smem_layout_b`) as the plain (N, K[, stages]) layout of the same bytes: the operand's
    N is the fastest index of its domain, then K, then the stage."""
    if stages is None:
        return cute.composition(mma_layout, cute.make_layout((n, k), stride=(1, n)))
    return cute.composition(mma_layout, cute.make_layout((n, k, stages), stride=(1, n, n * k)))


def _piece_tile(rows: int, cols: int, page_size: int, keys_mode: int):
    piece = min(page_size, rows)
    return ((piece, cols), (1, rows)) if keys_mode == 0 else ((cols, piece), (1, cols))


def page_tma(op, mX: cute.Tensor, smem_layout, rows: int, cols: int, page_size: int,
             keys_mode: int = 0):
    """(TMA atom, coordinates) of one piece of a key block for the cache view `mX`
    ((page_size, cols, heads_kv, num_pages), or (cols, page_size, ...) with keys_mode 1): the
    block's box when page_size >= rows (the block's `rows` keys), else a box of page_size keys
    whose SMEM layout is the first page_size keys of the block's plain `smem_layout`, so
    consecutive pieces fill consecutive key slices."""
    tile, stride = _piece_tile(rows, cols, page_size, keys_mode)
    if page_size >= rows:
        return cpasync.make_tiled_tma_atom(op, mX, smem_layout, tile)
    # The block's SMEM layout restricted to its first page_size keys, same strides.
    piece = cute.composition(smem_layout, cute.make_layout(tile, stride=stride))
    return cpasync.make_tiled_tma_atom(op, mX, piece, tile)


def stage_pieces(sX: cute.Tensor, rows: int, cols: int, page_size: int,
                 keys_mode: int = 0) -> cute.Tensor:
    """Plain SMEM stages (keys, cols, stages) (or (cols, keys, stages)) -> ((piece), pieces,
    stages): the key slices of each stage that the pieces of a block fill, in key order."""
    tile, _ = _piece_tile(rows, cols, page_size, keys_mode)
    tiles = cute.group_modes(cute.flat_divide(sX, tile), 0, 2)
    return tiles[None, None, 0, None] if keys_mode == 0 else tiles[None, 0, None, None]


def page_coords(mX: cute.Tensor, head_kv, rows: int, cols: int, page_size: int,
                keys_mode: int = 0) -> cute.Tensor:
    """The cache's TMA coordinates of KV head `head_kv` as ((piece), row block, page): row
    block r of page p is its keys [r * piece, (r + 1) * piece)."""
    tile, _ = _piece_tile(rows, cols, page_size, keys_mode)
    where = (None, 0, None) if keys_mode == 0 else (0, None, None)
    return cute.local_tile(mX[None, None, head_kv, None], tile, where)


# ---------------------------------------------------------------- producer side


@cute.jit
def read_pages(mPageTable: cute.Tensor, batch, n, seqlen_k, page_size: cutlass.Constexpr[int],
               n_block: cutlass.Constexpr[int], group: cutlass.Constexpr[int] = 0) -> Int32:
    """This lane's page of key block n of sequence `batch` (its row of the page table), which
    has seqlen_k keys: lane j reads the page of piece 32 * group + j (lanes past the block's
    pieces read the last piece's; a block of more than 32 pieces is read 32 at a time,
    `page_groups`), its slot clamped to the sequence's last page and the row's last slot (Note
    [paged key blocks], Note [clamped indices]). A sequence with no key still loads block 0,
    fully masked: slot 0, read as page 0 if it holds a pad (-1). The row is clamped to the
    table's last: a varlen launch's padding tiles belong to a phantom sequence one past the
    last (Note [tile rows on the device] in fa4lab.varlen_tiles), which has no key and no row of its
    own. A negative page reads page 0 (Note [clamped indices]). Called by every lane of the
    load warp."""
    per_block = pages_per_block(page_size, n_block)
    piece = 0
    if const_expr(per_block > 1):
        piece = cutlass.min(cute.arch.lane_idx() + group * WARP_LANES, per_block - 1)
    slot, _, _ = block_read(n, piece, page_size, n_block)
    last = cutlass.max(cutlass.min((seqlen_k + (page_size - 1)) // page_size,
                                   cute.size(mPageTable, mode=[1])) - 1, 0)
    row = cutlass.min(batch, cute.size(mPageTable, mode=[0]) - 1)
    # Clamped at 0 here, at the cache's last page in `copy_block` (Note [clamped indices]).
    return cutlass.max(mPageTable[row, cutlass.min(slot, last)], 0)


@cute.jit
def copy_block(atom: cute.CopyAtom, tXgX: cute.Tensor, tXsX: cute.Tensor, n, page: Int32,
               stage, barrier, page_size: cutlass.Constexpr[int], n_block: cutlass.Constexpr[int],
               group_pages=None, unroll: cutlass.Constexpr[int] = GATHER_UNROLL):
    """TMA copies of key block n into SMEM stage `stage`, all on `barrier`: tXgX ((TMA),
    row block, page) and tXsX ((TMA), piece, stage) from `page_coords` / `stage_pieces`;
    `page` this lane's page of the block's first 32 pieces (`read_pages`), `group_pages(g)` its
    page of pieces [32 g, 32 g + 32) for a block of more (`page_groups`). A gather's pieces
    are a run-time loop per group, piece 32 g + j taking lane j's page by a shuffle (Note
    [paged key blocks]: what it costs), `unroll` pieces per iteration (`gather_unroll`); each
    page is clamped to the cache's last (Note [clamped indices])."""
    per_block = pages_per_block(page_size, n_block)
    last_page = cute.size(tXgX, mode=[2]) - 1
    for g in cutlass.range_constexpr(page_groups(page_size, n_block)):
        page_g = page if const_expr(g == 0) else group_pages(g)
        for j in cutlass.range(min(per_block - g * WARP_LANES, WARP_LANES), unroll=unroll):
            piece = j + g * WARP_LANES
            _, row_block, _ = block_read(n, piece, page_size, n_block)
            page_j = page_g if const_expr(per_block == 1) else cute.arch.shuffle_sync(page_g, j)
            cute.copy(atom, tXgX[None, row_block, cutlass.min(page_j, last_page)],
                      tXsX[None, piece, stage], tma_bar_ptr=barrier)
