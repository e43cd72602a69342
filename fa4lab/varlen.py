"""Variable-length batches and paged K/V caches: the layout, its one check, and its tiles.

What it describes (upstream FA4's `flash_attn_varlen_func` layout):

    q  (total_q, heads_q, head_dim)       the batch's queries packed one sequence after another;
    k  (total_k, heads_kv, head_dim)      likewise the keys (v: head_dim_v), or, with a page
                                          table, a paged cache (num_pages, page_size, heads_kv,
                                          head_dim) shared by all sequences;
    cu_seqlens_q / cu_seqlens_k           int32 (batch + 1,): sequence b's tokens are
                                          [cu[b], cu[b + 1]) of the packed axis;
    seqused_k                             int32 (batch,), optional: sequence b attends to the
                                          first seqused_k[b] of its keys only;
    page_table                            int32 (batch, pages_per_seq): key t of sequence b is
                                          cache[page_table[b, t // page_size], t % page_size].

With a page table there is no packed key axis, so cu_seqlens_k is None (as upstream); each
sequence has seqused_k[b] keys, or pages_per_seq * page_size without seqused_k. Each sequence
is one attention problem with the usual semantics (`fa4lab.spec`: bottom-right causal per
sequence, seqlen_q > seqlen_k allowed); an empty sequence has no rows.

What is here, in plain Python and torch (CPU or GPU tensors):
- `check_varlen`: the ONE input check of every varlen entry point (`fa4lab.attention_varlen`,
  `fa4lab.reference.attention_varlen_reference`), raising `fa4lab.errors.InputError` /
  `InputTypeError` with what is wrong and what to do; it returns the batch's lengths;
  `check_paged` the same checks of a paged cache beside a dense q (`fa4lab.attention(q,
  k_cache, v_cache, page_table=...)`);
- `unpack` / `pack` (packed <-> per sequence), `pad` (packed -> (batch, max_seqlen, ...)),
  `gather_paged` and `sequence_kv` (each sequence's contiguous K and V, by torch indexing);
- `varlen_tiles`: the work tiles of a varlen launch (real tiles only, longest first) beside
  what a padded (batch, max_seqlen_q) grid would launch;
- `key_block_pages`: which pages each key block of a sequence reads.

    from fa4lab.varlen import check_varlen, varlen_tiles
    lengths = check_varlen(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k)
    varlen_tiles(lengths.seqlens_q, lengths.seqlens_k, heads=8, m_block_size=128,
                 n_block_size=128, causal=True).padded_tiles
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from fa4lab.errors import InputError, InputTypeError, check_same_device
from fa4lab.tiling import CostModel, block_counts, ceil_div, num_m_blocks

__all__ = ["PageRead", "VarlenLengths", "VarlenTiles", "check_paged", "check_varlen",
           "gather_paged", "key_block_pages", "pack", "pad", "paged_seqlen_k", "sequence_kv",
           "unpack", "varlen_tiles"]


@dataclass(frozen=True)
class VarlenLengths:
    """The lengths `check_varlen` read: per sequence, its query rows and the keys it attends to
    (seqused_k applied), where its queries (and packed keys) start, and the page size (None
    without a page table)."""

    cu_seqlens_q: tuple[int, ...]
    seqlens_k: tuple[int, ...]
    k_starts: tuple[int, ...] | None      # packed keys only; None with a page table
    page_size: int | None

    @property
    def batch(self) -> int:
        return len(self.cu_seqlens_q) - 1

    @property
    def seqlens_q(self) -> tuple[int, ...]:
        cu = self.cu_seqlens_q
        return tuple(cu[b + 1] - cu[b] for b in range(self.batch))


# --------------------------------------------------------------------------- the check


def _index_tensor(name: str, t, q, ndim: int, shape_hint: str) -> list:
    """An int32 index tensor on q's device with `ndim` dims, as a (nested) Python list."""
    return _checked_index(name, t, q, ndim, shape_hint).tolist()


def _checked_index(name: str, t, q, ndim: int, shape_hint: str):
    """`t`, checked to be an int32 index tensor on q's device with `ndim` dims."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name} must be an int32 torch tensor {shape_hint}, got "
                             f"{type(t).__name__}; build it with torch.tensor(..., "
                             f"dtype=torch.int32, device=q.device)")
    if t.dtype != torch.int32:
        raise InputTypeError(f"{name} has dtype {t.dtype}: the kernels read int32 indices; "
                             f"convert with {name}.to(torch.int32)")
    check_same_device(name, t.device, "q", q.device)
    if t.dim() != ndim:
        raise InputError(f"{name} has shape {tuple(t.shape)}: expected {shape_hint}")
    return t


def _check_cu_seqlens(name: str, cu: list, total: int, what: str) -> None:
    if len(cu) < 2:
        raise InputError(f"{name} has {len(cu)} entries: it needs batch + 1 >= 2 (0, then the "
                         f"end of each sequence's {what})")
    if cu[0] != 0:
        raise InputError(f"{name} must start at 0, got {name}[0] = {cu[0]}; it is the "
                         f"cumulative sum of the lengths with a leading 0, e.g. "
                         f"torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)")
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            raise InputError(f"{name} decreases at index {i} ({name}[{i - 1}] = {cu[i - 1]}, "
                             f"{name}[{i}] = {cu[i]}): it must be non-decreasing (sequence "
                             f"{i - 1} cannot have a negative length)")
    if cu[-1] != total:
        raise InputError(f"{name}'s last entry is {cu[-1]} but the packed {what} have {total} "
                         f"tokens: the last entry must equal the total ({what}.shape[0])")


def _check_max(name: str, value, lengths, which: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InputTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    longest = max(lengths, default=0)
    if int(value) < longest:
        b = list(lengths).index(longest)
        raise InputError(f"{name}={int(value)} is smaller than sequence {b}'s {which} length "
                         f"{longest}: pass at least the longest length (max_seqlen sizes the "
                         f"launch grid)")


def _check_tensors(q, k, v, paged: bool) -> None:
    """Kinds, dims, dtypes, devices and the shapes q, k, v must share."""
    import torch

    kv_dims = ("(num_pages, page_size, heads_kv, head_dim)" if paged
               else "(total_k, heads_kv, head_dim)")
    for name, t, dims in (("q", q, "(total_q, heads_q, head_dim)"), ("k", k, kv_dims),
                          ("v", v, kv_dims.replace("head_dim)", "head_dim_v)"))):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch tensor {dims}, got "
                                 f"{type(t).__name__}")
        if t.dim() != len(dims.split(",")):
            extra = (" (a page_table was given, so k and v are the paged cache)" if paged
                     and name != "q" else "; pack the batch along dim 0 (fa4lab.varlen.pack)")
            raise InputError(f"{name} has shape {tuple(t.shape)}: expected {dims}{extra}")
    if not q.is_floating_point():
        raise InputTypeError(f"q has dtype {q.dtype}: attention needs floating point inputs; "
                             f"cast with q.to(torch.bfloat16)")
    if not (q.dtype == k.dtype == v.dtype):
        raise InputTypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, "
                             f"{v.dtype}; cast them, e.g. k.to(q.dtype)")
    for name, t in (("k", k), ("v", v)):
        check_same_device(name, t.device, "q", q.device)
    lead = 2 if paged else 1          # (num_pages, page_size) or (total_k,)
    what = "num_pages, page_size" if paged else "total_k"
    if tuple(k.shape[:lead + 1]) != tuple(v.shape[:lead + 1]):
        raise InputError(f"k {tuple(k.shape)} and v {tuple(v.shape)} disagree on ({what}, "
                         f"heads_kv): they must describe the same "
                         f"{'cache pages' if paged else 'keys'}")
    heads_q, heads_kv = q.shape[1], k.shape[lead]
    if q.shape[-1] != k.shape[-1]:
        raise InputError(f"q and k must have the same head_dim: q {q.shape[-1]}, k "
                         f"{k.shape[-1]}")
    if min(heads_q, heads_kv, q.shape[-1], v.shape[-1]) < 1 or (paged and k.shape[1] < 1):
        raise InputError(f"empty heads, head_dim or page_size in q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}")
    if heads_q % heads_kv:
        raise InputError(f"heads_q={heads_q} is not a multiple of heads_kv={heads_kv}: with "
                         f"GQA query head h reads kv head h // (heads_q // heads_kv)")


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 seqused_k=None, page_table=None) -> VarlenLengths:
    """The one check of a varlen call (layout: the module docstring); returns its lengths.

    Raises `InputTypeError` (a TypeError) for a wrong kind or dtype (int64 indices: convert
    with .to(torch.int32)) and `InputError` (a ValueError) for a tensor on another device than
    q, a bad shape (k/v not the packed keys or the paged cache, heads or head dims that
    disagree), cu_seqlens that do not start at 0, decrease (naming the first index where they
    do), do not end at the packed total or whose lengths disagree (batch + 1 entries for q and
    k alike), a max_seqlen below a real length (None skips that check), seqused_k above its
    sequence's keys, and a page table entry that a sequence reads but that is not a page of
    the cache (naming batch, slot and value; slots past the sequence's last page are never
    read and may hold anything, as serving stacks pad with -1).

    It reads the index tensors' values: one device-to-host copy each on CUDA.
    """
    paged = page_table is not None
    _check_tensors(q, k, v, paged)
    cu_q = _index_tensor("cu_seqlens_q", cu_seqlens_q, q, 1, "(batch + 1,)")
    _check_cu_seqlens("cu_seqlens_q", cu_q, q.shape[0], "q")
    batch = len(cu_q) - 1
    page_size, k_starts = None, None
    if paged:
        if cu_seqlens_k is not None:
            raise InputError("cu_seqlens_k must be None with a page_table: the keys live in the "
                             "paged cache, not on a packed axis; give each sequence's key "
                             "count as seqused_k (int32 (batch,))")
        table = _page_table(page_table, q, batch, "cu_seqlens_q describes")
        page_size = int(k.shape[1])
        seqlens_k = [paged_seqlen_k(k, table)] * batch
    else:
        if cu_seqlens_k is None:
            raise InputError("cu_seqlens_k is None without a page_table: pass int32 "
                             "(batch + 1,) offsets of each sequence's packed keys")
        cu_k = _index_tensor("cu_seqlens_k", cu_seqlens_k, q, 1, "(batch + 1,)")
        if len(cu_k) != len(cu_q):
            raise InputError(f"cu_seqlens_k has {len(cu_k)} entries but cu_seqlens_q has "
                             f"{len(cu_q)}: both have batch + 1 entries, one sequence of "
                             f"queries per sequence of keys")
        _check_cu_seqlens("cu_seqlens_k", cu_k, k.shape[0], "k")
        seqlens_k = [cu_k[b + 1] - cu_k[b] for b in range(batch)]
        k_starts = tuple(cu_k[:-1])
    if seqused_k is not None:
        used = _index_tensor("seqused_k", seqused_k, q, 1, "(batch,)")
        if len(used) != batch:
            raise InputError(f"seqused_k has {len(used)} entries for {batch} sequences: one "
                             f"key count per sequence")
        for b, (n, have) in enumerate(zip(used, seqlens_k)):
            if not 0 <= n <= have:
                where = (f"its {table.shape[1]} pages of {page_size} hold" if paged
                         else "cu_seqlens_k gives it")
                raise InputError(f"seqused_k[{b}] = {n} but {where} {have} keys: seqused_k "
                                 f"counts the keys a sequence uses, 0 <= seqused_k[b] <= {have}")
        seqlens_k = used
    if paged:
        _check_pages(table, seqlens_k, page_size, int(k.shape[0]))
    lengths = VarlenLengths(tuple(cu_q), tuple(int(n) for n in seqlens_k), k_starts, page_size)
    _check_max("max_seqlen_q", max_seqlen_q, lengths.seqlens_q, "query")
    _check_max("max_seqlen_k", max_seqlen_k, lengths.seqlens_k, "key")
    return lengths


def _page_table(page_table, q, batch: int, who: str):
    """The page table, checked: int32 (batch, pages_per_seq) on q's device."""
    table = _checked_index("page_table", page_table, q, 2, "(batch, pages_per_seq)")
    if table.shape[0] != batch:
        raise InputError(f"page_table has {table.shape[0]} rows but {who} {batch} sequences: "
                         f"one row of page indices per sequence")
    return table


def _check_pages(table, seqlens_k, page_size: int, num_pages: int) -> None:
    """Every slot a sequence reads (its first ceil(seqlens_k[b] / page_size)) holds a page of
    the cache; later slots are never read and may hold anything (serving stacks pad with -1).
    One vectorised test (a single device-to-host copy on CUDA)."""
    import torch

    needed = torch.tensor([ceil_div(int(n), page_size) for n in seqlens_k],
                          device=table.device)
    read = torch.arange(table.shape[1], device=table.device)[None, :] < needed[:, None]
    bad = read & ((table < 0) | (table >= num_pages))
    if bool(bad.any()):
        b, slot = (int(x) for x in bad.nonzero()[0])
        n = int(seqlens_k[b])
        raise InputError(f"page_table[{b}, {slot}] = {int(table[b, slot])} is not a page of the "
                         f"cache (num_pages = {num_pages}): sequence {b} reads {n} keys, so "
                         f"its slots 0..{ceil_div(n, page_size) - 1} must hold page indices in "
                         f"[0, {num_pages})")


def paged_seqlen_k(k_cache, page_table) -> int:
    """Keys of each sequence of a paged cache without seqused_k: pages_per_seq * page_size."""
    return int(page_table.shape[1]) * int(k_cache.shape[1])


def check_paged(q, k, v, page_table) -> int:
    """The one check of a call with dense q (batch, seqlen_q, heads_q, head_dim) and a paged
    cache k, v (num_pages, page_size, heads_kv, head_dim[_v]) with an int32 (batch,
    pages_per_seq) page table (every sequence has pages_per_seq * page_size keys); returns
    that seqlen_k. Raises as `check_varlen` does (the same checks of the cache and the table)."""
    import torch

    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise InputError(f"q has shape {tuple(getattr(q, 'shape', ()))}: with a page_table and "
                         f"no cu_seqlens q is (batch, seqlen_q, heads_q, head_dim) (packed "
                         f"sequences go to fa4lab.attention_varlen)")
    if min(q.shape) < 1:
        raise InputError(f"empty dimension in q {tuple(q.shape)}")
    _check_tensors(q[0], k, v, paged=True)
    table = _page_table(page_table, q, int(q.shape[0]), "q has")
    seqlen_k = paged_seqlen_k(k, table)
    if seqlen_k < 1:
        raise InputError(f"page_table has shape {tuple(table.shape)}: each sequence needs at "
                         f"least one page")
    _check_pages(table, [seqlen_k] * int(q.shape[0]), int(k.shape[1]), int(k.shape[0]))
    return seqlen_k


# --------------------------------------------------------------------------- layouts


def unpack(x, cu_seqlens) -> list:
    """The sequences of packed `x` (total, ...): views x[cu[b]:cu[b + 1]], one per sequence.
    `cu_seqlens` is a tensor or a sequence of ints."""
    cu = cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else list(cu_seqlens)
    return [x[cu[b]:cu[b + 1]] for b in range(len(cu) - 1)]


def pack(sequences) -> tuple:
    """(packed, cu_seqlens): the sequences (each (len_b, ...), len_b may be 0) concatenated
    along dim 0, and their int32 (batch + 1,) offsets on the same device."""
    import torch

    if not sequences:
        raise InputError("pack needs at least one sequence")
    lengths = torch.tensor([0] + [int(s.shape[0]) for s in sequences], dtype=torch.int64)
    cu = lengths.cumsum(0).to(torch.int32).to(sequences[0].device)
    return torch.cat(list(sequences), dim=0), cu


def pad(x, cu_seqlens, max_seqlen: int):
    """Packed x (total, ...) as a zero-padded (batch, max_seqlen, ...) tensor: the dense
    layout a padded launch would read (rows past a sequence's length are padding)."""
    seqs = unpack(x, cu_seqlens)
    out = x.new_zeros((len(seqs), int(max_seqlen), *x.shape[1:]))
    for b, s in enumerate(seqs):
        out[b, :s.shape[0]] = s
    return out


def gather_paged(cache, page_table, seqlens_k) -> list:
    """Each sequence's keys (or values) from a paged cache (num_pages, page_size, heads, d):
    sequence b's first seqlens_k[b] tokens of pages page_table[b, 0], page_table[b, 1], ...,
    as a contiguous (seqlens_k[b], heads, d) tensor (torch indexing; a page may serve several
    sequences or slots)."""
    page_size = int(cache.shape[1])
    out = []
    for b, n in enumerate(seqlens_k):
        pages = page_table[b, :ceil_div(int(n), page_size)].long()
        out.append(cache[pages].flatten(0, 1)[:int(n)])
    return out


def sequence_kv(lengths: VarlenLengths, k, v, page_table=None) -> list[tuple]:
    """[(k_b, v_b), ...]: the keys and values sequence b attends to (seqused_k applied),
    sliced from the packed k / v or gathered from the paged cache."""
    if lengths.page_size is not None:
        return list(zip(gather_paged(k, page_table, lengths.seqlens_k),
                        gather_paged(v, page_table, lengths.seqlens_k)))
    return [(k[s:s + n], v[s:s + n]) for s, n in zip(lengths.k_starts, lengths.seqlens_k)]


# --------------------------------------------------------------------------- work tiles

# Note [varlen tiles]
# A padded launch of a varlen batch runs a (batch, heads, ceil(max_seqlen_q / m_block)) grid:
# short sequences leave tiles with no query row at all, which still start, find nothing to do
# and exit. A varlen launch enumerates only real tiles, ceil(len_q[b] / m_block) per sequence
# and head (with pack-GQA the M extent is len_q[b] * qhead_per_kvhead, `tiling.num_m_blocks`),
# and orders them longest first (LPT) over the whole batch, not per sequence: the cost of a
# tile is `tiling.CostModel`'s, from the key blocks `tiling`'s block-range functions give it
# on its own sequence's (len_q, len_k) (Note [tile cost model]), so a long prefill's tiles
# start before a batch of decodes' one-block tiles fill the gaps. A tile's cost does not depend
# on its head, so the order is one of (batch, m_block) rows (`varlen_tile_table`, ties in
# (batch, m_block) order) with the heads expanded innermost: the heads of one row run side by
# side (they read the same sequence's K/V). The kernels launch from that table (Note [varlen
# tile table] in fa4lab.kernels.device.scheduler); `varlen_tiles` lists the same tiles.


@dataclass(frozen=True)
class VarlenTileTable:
    """The real tiles of a varlen launch as (batch, m_block) rows, LPT order (Note [varlen
    tiles]): table (rows, 2) int32, the kernels' mTileTable; costs (rows,) each row's tile
    cost (one head's), non-increasing; key_blocks (rows,) the key blocks each tile visits."""

    table: np.ndarray
    costs: np.ndarray
    key_blocks: np.ndarray


def varlen_tile_table(seqlens_q, seqlens_k, *, m_block_size: int, n_block_size: int,
                      causal: bool = False, window_size=(None, None), qhead_per_kvhead: int = 1,
                      cost: CostModel | None = None) -> VarlenTileTable:
    """The (batch, m_block) rows of a varlen launch's real tiles, longest first (Note [varlen
    tiles]); `m_block_size` is the rows of one work tile (a CTA's)."""
    if len(seqlens_q) != len(seqlens_k):
        raise InputError(f"{len(seqlens_q)} query lengths but {len(seqlens_k)} key lengths: "
                         f"one of each per sequence")
    cost = cost or CostModel()
    lq = np.asarray([int(n) for n in seqlens_q], dtype=np.int64)
    lk = np.asarray([int(n) for n in seqlens_k], dtype=np.int64)
    per_seq = -(-lq * qhead_per_kvhead // m_block_size)        # num_m_blocks, vectorised
    if not per_seq.sum():
        empty = np.zeros(0, dtype=np.int64)
        return VarlenTileTable(np.zeros((0, 2), dtype=np.int32), empty.astype(np.float64), empty)
    bs = np.repeat(np.arange(len(lq), dtype=np.int64), per_seq)
    ms = np.arange(len(bs), dtype=np.int64) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    # All the batch's tiles at once (`fa4lab.tiling.block_counts`); a sequence with no key
    # visits no block: its tiles only write O = 0 and their LSE.
    unmasked, masked = block_counts(ms, lq[bs], lk[bs], m_block_size=m_block_size,
                                    n_block_size=n_block_size, causal=causal,
                                    qhead_per_kvhead=qhead_per_kvhead, window_size=window_size)
    no_key = lk[bs] == 0
    unmasked, masked = np.where(no_key, 0, unmasked), np.where(no_key, 0, masked)
    costs = np.asarray(cost.tile_cost(unmasked, masked), dtype=np.float64)
    order = np.lexsort((ms, bs, -costs))
    table = np.stack([bs[order], ms[order]], axis=1).astype(np.int32)
    return VarlenTileTable(table, costs[order], (unmasked + masked)[order])


@dataclass(frozen=True)
class VarlenTiles:
    """The work tiles of a varlen launch, in LPT order (Note [varlen tiles]).

    tiles (num_tiles, 3) int64 rows (batch, head, m_block); costs (num_tiles,) their
    `CostModel` cost, non-increasing; key_blocks (num_tiles,) the key blocks each visits;
    padded_tiles the tiles a padded (batch, heads, max_seqlen_q) grid would launch."""

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
    """The real tiles of a varlen launch, longest first (Note [varlen tiles]): the rows of
    `varlen_tile_table` with each row's `heads` tiles next to each other, as a kernel runs
    them (linear tile t is row t // heads, head t % heads).

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


# --------------------------------------------------------------------------- pages and blocks


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
