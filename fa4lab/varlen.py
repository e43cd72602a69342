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
  k_cache, v_cache, page_table=...)`); the index values checked now, on the device or not at
  all (`check_mode`, Note [reading the lengths]);
- `unpack` / `pack` (packed <-> per sequence), `pad` (packed -> (batch, max_seqlen, ...)),
  `gather_paged` and `sequence_kv` (each sequence's contiguous K and V, by torch indexing);
- `varlen_tiles`: the work tiles of a varlen launch (real tiles only, in LPT order by
  sequence) beside what a padded (batch, max_seqlen_q) grid would launch;
- `key_block_pages`: which pages each key block of a sequence reads.

    from fa4lab.varlen import check_varlen, varlen_tiles
    lengths = check_varlen(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k)
    varlen_tiles(lengths.seqlens_q, lengths.seqlens_k, heads=8, m_block_size=128,
                 n_block_size=128, causal=True).padded_tiles
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np

from fa4lab.errors import InputError, InputTypeError, check_same_device
from fa4lab.indexcheck import CheckContext, Rule, Verdict, message, poll
from fa4lab.tiling import CostModel, block_counts, ceil_div, num_m_blocks

__all__ = ["CHECK_MODES", "PageRead", "VarlenLengths", "VarlenTiles", "check_mode",
           "check_paged", "check_varlen", "check_varlen_shapes", "gather_paged",
           "key_block_pages", "launch_lengths", "max_tile_rows", "pack", "pad", "paged_seqlen_k",
           "reads_values", "sequence_kv", "tile_rows", "unpack", "varlen_tile_table",
           "varlen_tiles"]


# Note [reading the lengths]
# The lengths of a varlen call live in the index tensors, on the GPU in any real use. Reading
# them to the host synchronises: the host waits for every kernel queued before, then launches,
# so the GPU idles while the host builds the launch, and a CUDA graph cannot be captured at
# all. So nothing of the launch path reads them: the kernels take the tensors themselves, the
# tile table is built on the device (`tile_rows`), and the host sizes only what the shapes give
# (the batch, the packed totals, the caller's max_seqlen). The check's value rules (cu_seqlens
# start at 0, never decrease and end at the total; seqused_k within its sequence's keys; every
# page a sequence reads inside the cache; max_seqlen above every length: `fa4lab.indexcheck.
# Rule`) run in one of three ways, `check_indices`' values (`check_mode`):
# * "device" (the default of `fa4lab.attention_varlen`, and what `fa4lab.attention` with a page
#   table does): one check kernel queued before the launch writes a verdict that reaches the
#   host without a wait (Note [index check on the device] in fa4lab.indexcheck). A bad index
#   raises its InputError at the first varlen or paged call after the check has run on the GPU
#   (usually the very next call), or at `fa4lab.check_errors()`, which waits for it; the call
#   whose indices were bad has run by then, and its outputs are not meaningful (the kernels
#   clamp page ids into the cache, never a fault; bad cu_seqlens are not clamped yet, so pass
#   True where they are untrusted). On CPU tensors, and on
#   a GPU without the check kernel, this is the synchronous check below.
# * True: synchronous, before anything launches: the rules as device masks of broken entries,
#   ONE device-to-host copy of a flag per rule deciding whether to raise, and only then the
#   first broken rule's values read for its message (for debugging: it stalls every call).
# * False: no check (the caller vouches for the values, as upstream's varlen functions assume
#   without checking: a bad index is then a wrong answer, never a fault; nothing launches).
# Both checks name the first broken rule in `Rule` order at its first broken index, in the same
# words (`fa4lab.indexcheck.message`). A CUDA graph capture skips the check and the poll: its
# replays run on values the capture never sees. The host views of `VarlenLengths` read the
# values when asked (the float64 reference and the per-sequence paths, which are slow anyway).


@dataclass(frozen=True)
class VarlenLengths:
    """What `check_varlen` knows of a call without reading the device (Note [reading the
    lengths]): the index tensors on q's device and the sizes the shapes give.

    cu_q is the caller's cu_seqlens_q; keys (batch,) int32 the keys each sequence attends to
    (seqused_k applied); cu_k the packed keys' offsets (None with a page table); page_size None
    without one; max_seqlen_q / max_seqlen_k bound every length (the caller's max_seqlen, else
    the packed total or the page table's capacity). The host views `cu_seqlens_q`,
    `seqlens_q`, `seqlens_k` and `k_starts` read the values the first time they are asked."""

    cu_q: object
    keys: object
    cu_k: object
    page_size: int | None
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def batch(self) -> int:
        return int(self.cu_q.shape[0]) - 1

    @cached_property
    def cu_seqlens_q(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.cu_q.tolist())

    @property
    def seqlens_q(self) -> tuple[int, ...]:
        cu = self.cu_seqlens_q
        return tuple(cu[b + 1] - cu[b] for b in range(self.batch))

    @cached_property
    def seqlens_k(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.keys.tolist())

    @cached_property
    def k_starts(self) -> tuple[int, ...] | None:
        return None if self.cu_k is None else tuple(int(x) for x in self.cu_k[:-1].tolist())

    def same_query_count(self, total_q: int) -> bool:
        """Every sequence has the same number L >= 1 of queries (a decode batch): L times the
        batch is the packed total and no sequence exceeds max_seqlen_q = L, read from the
        shapes alone when the caller gave max_seqlen_q."""
        if total_q == 0:
            return False
        return self.max_seqlen_q * self.batch == total_q or len(set(self.seqlens_q)) == 1


# --------------------------------------------------------------------------- the check

CHECK_MODES = ("device", "sync", "off")


def check_mode(check_indices) -> str:
    """`check_indices` as one of CHECK_MODES (Note [reading the lengths]): "device", True or
    "sync", False or "off"."""
    if check_indices is True or check_indices == "sync":
        return "sync"
    if check_indices is False or check_indices == "off":
        return "off"
    if check_indices == "device":
        return "device"
    raise InputTypeError(f"check_indices must be \"device\" (check on the GPU, raise at the next "
                         f"call or at fa4lab.check_errors()), True (check now, synchronising) or "
                         f"False (no check), got {check_indices!r}")


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


class _Rule(NamedTuple):
    """A value rule of the synchronous check: `bad()` makes a bool tensor, True where `rule` is
    broken (only when the values are read: a call that skips them launches nothing for its
    rules), and `values(i)` reads the two values its message names at its first broken entry
    (the flat index i)."""

    rule: Rule
    bad: Callable[[], object]
    values: Callable[[int], tuple]


def _raise_first_broken(rules: list[_Rule], context: CheckContext) -> None:
    """Raise the first broken rule's InputError: one device-to-host copy of a flag per rule,
    then (on the error path only) the broken entry and its values (Note [reading the
    lengths])."""
    import torch

    if not rules:
        return
    bads = [r.bad() for r in rules]
    broken = torch.stack([bad.any() for bad in bads]).tolist()
    for rule, bad, is_broken in zip(rules, bads, broken):
        if is_broken:
            i = int(bad.flatten().nonzero()[0, 0])
            raise InputError(message(Verdict(rule.rule, i, *rule.values(i)), context))


def _capturing(q) -> bool:
    import torch

    return q.is_cuda and torch.cuda.is_current_stream_capturing()


def reads_values(q, check_indices) -> bool:
    """Whether the value rules run: asked for (`check_mode` not "off"), and not inside a CUDA
    graph capture (Note [reading the lengths])."""
    return check_mode(check_indices) != "off" and not _capturing(q)


def _run_check(q, mode: str, context: CheckContext, rules: Callable[[], list[_Rule]],
               cu_q=None, cu_k=None, used=None, table=None) -> None:
    """The value check of a call in `mode` (Note [reading the lengths]): first the verdicts of
    earlier device checks that have finished (`fa4lab.indexcheck.poll`, on CUDA tensors), then
    this call's rules on the device, synchronously (`rules()` builds them) or not at all."""
    if _capturing(q):
        return
    if q.is_cuda:
        poll()
        if mode == "device":
            from fa4lab.kernels.index_check import check_async

            if check_async(context, cu_q, cu_k, used, table):
                return
    if mode != "off":
        _raise_first_broken(rules(), context)


def _cu_rules(name: str, cu, total: int) -> list[_Rule]:
    """cu_seqlens start at 0, never decrease, and end at the packed total."""
    first = Rule.CU_Q_START if name == "cu_seqlens_q" else Rule.CU_K_START
    return [
        _Rule(first, lambda: cu[:1] != 0, lambda i: (int(cu[0]), 0)),
        _Rule(Rule(first + 1), lambda: cu[1:] < cu[:-1], lambda i: (int(cu[i]), int(cu[i + 1]))),
        _Rule(Rule(first + 2), lambda: cu[-1:] != total, lambda i: (int(cu[-1]), 0)),
    ]


def _cu_size(name: str, cu, what: str) -> None:
    if cu.shape[0] < 2:
        raise InputError(f"{name} has {cu.shape[0]} entries: it needs batch + 1 >= 2 (0, then "
                         f"the end of each sequence's {what})")


def _max_bound(name: str, value, total: int) -> int:
    """The caller's max_seqlen (an int), or `total` (a bound on every length) for None."""
    if value is None:
        return total
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InputTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _max_rule(rule: Rule, value, lengths: Callable[[], object]) -> list[_Rule]:
    """max_seqlen (when given) is at least every sequence's length (`lengths()`)."""
    if value is None:
        return []
    return [_Rule(rule, lambda: lengths() > int(value), lambda b: (int(lengths()[b]), 0))]


def _page_rule(table, keys, page_size: int, num_pages: int) -> _Rule:
    """Every slot a sequence reads (its first ceil(keys[b] / page_size)) holds a page of the
    cache; later slots are never read and may hold anything (serving stacks pad with -1)."""
    import torch

    def bad():
        needed = (keys.to(torch.int64) + page_size - 1) // page_size
        read = torch.arange(table.shape[1], device=table.device)[None, :] < needed[:, None]
        return read & ((table < 0) | (table >= num_pages))

    def values(i):
        b, slot = divmod(i, int(table.shape[1]))
        return int(table[b, slot]), int(keys[b])

    return _Rule(Rule.PAGE, bad, values)


def check_varlen_shapes(q, k, v, paged: bool) -> None:
    """Kinds, dims, dtypes, devices and the shapes q, k, v must share: the part of
    `check_varlen` that reads no index tensor (and no size that varies from call to call), so
    a fake tensor or a traced size passes through it (Note [the varlen op] in fa4lab.api)."""
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
                 seqused_k=None, page_table=None, *, check_indices=True) -> VarlenLengths:
    """The one check of a varlen call (layout: the module docstring); returns its lengths.

    Raises `InputTypeError` (a TypeError) for a wrong kind or dtype (int64 indices: convert
    with .to(torch.int32)) and `InputError` (a ValueError) for a tensor on another device than
    q, a bad shape (k/v not the packed keys or the paged cache, heads or head dims that
    disagree, cu_seqlens of different lengths); and, checking the values (Note [reading the
    lengths]: `check_indices` True, the default here, now, with one device-to-host copy;
    "device" on the GPU, raising at a later call or at `fa4lab.check_errors()`; False and a
    CUDA graph capture skip it), for cu_seqlens that do not start at 0, decrease (naming the
    first index where they do) or do not end at the packed total, a max_seqlen below a real
    length (None skips that rule), seqused_k above its sequence's keys, and a page table entry
    that a sequence reads but that is not a page of the cache (naming batch, slot and value;
    slots past the sequence's last page are never read and may hold anything, as serving stacks
    pad with -1).
    """
    import torch

    mode = check_mode(check_indices)
    paged = page_table is not None
    check_varlen_shapes(q, k, v, paged)
    cu_q = _checked_index("cu_seqlens_q", cu_seqlens_q, q, 1, "(batch + 1,)")
    _cu_size("cu_seqlens_q", cu_q, "q")
    batch = int(cu_q.shape[0]) - 1
    page_size, cu_k, table, used = None, None, None, None
    if paged:
        if cu_seqlens_k is not None:
            raise InputError("cu_seqlens_k must be None with a page_table: the keys live in the "
                             "paged cache, not on a packed axis; give each sequence's key "
                             "count as seqused_k (int32 (batch,))")
        table = _page_table(page_table, q, batch, "cu_seqlens_q describes")
        page_size = int(k.shape[1])
        capacity = paged_seqlen_k(k, table)
        have = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    else:
        if cu_seqlens_k is None:
            raise InputError("cu_seqlens_k is None without a page_table: pass int32 "
                             "(batch + 1,) offsets of each sequence's packed keys")
        cu_k = _checked_index("cu_seqlens_k", cu_seqlens_k, q, 1, "(batch + 1,)")
        if cu_k.shape[0] != cu_q.shape[0]:
            raise InputError(f"cu_seqlens_k has {cu_k.shape[0]} entries but cu_seqlens_q has "
                             f"{cu_q.shape[0]}: both have batch + 1 entries, one sequence of "
                             f"queries per sequence of keys")
        capacity = int(k.shape[0])
        have = cu_k[1:] - cu_k[:-1]
    keys = have
    if seqused_k is not None:
        used = _checked_index("seqused_k", seqused_k, q, 1, "(batch,)")
        if used.shape[0] != batch:
            raise InputError(f"seqused_k has {used.shape[0]} entries for {batch} sequences: one "
                             f"key count per sequence")
        keys = used
    lengths = VarlenLengths(cu_q, keys, cu_k, page_size,
                            _max_bound("max_seqlen_q", max_seqlen_q, int(q.shape[0])),
                            _max_bound("max_seqlen_k", max_seqlen_k, capacity))
    context = CheckContext(
        total_q=int(q.shape[0]), total_k=0 if paged else int(k.shape[0]),
        num_pages=int(k.shape[0]) if paged else 0, page_size=page_size or 0,
        pages_per_seq=int(table.shape[1]) if paged else 0,
        max_seqlen_q=None if max_seqlen_q is None else lengths.max_seqlen_q,
        max_seqlen_k=None if max_seqlen_k is None else lengths.max_seqlen_k)

    def rules() -> list[_Rule]:
        found = _cu_rules("cu_seqlens_q", cu_q, int(q.shape[0]))
        if cu_k is not None:
            found += _cu_rules("cu_seqlens_k", cu_k, int(k.shape[0]))
        if used is not None:
            found.append(_Rule(Rule.SEQUSED_K, lambda: (used < 0) | (used > have),
                               lambda b: (int(used[b]), int(have[b]))))
        if paged:
            found.append(_page_rule(table, keys, page_size, int(k.shape[0])))
        found += _max_rule(Rule.MAX_Q, max_seqlen_q, lambda: cu_q[1:] - cu_q[:-1])
        return found + _max_rule(Rule.MAX_K, max_seqlen_k, lambda: keys)

    _run_check(q, mode, context, rules, cu_q, cu_k, used, table)
    return lengths


def _page_table(page_table, q, batch: int, who: str):
    """The page table, checked: int32 (batch, pages_per_seq) on q's device."""
    table = _checked_index("page_table", page_table, q, 2, "(batch, pages_per_seq)")
    if table.shape[0] != batch:
        raise InputError(f"page_table has {table.shape[0]} rows but {who} {batch} sequences: "
                         f"one row of page indices per sequence")
    return table


def paged_seqlen_k(k_cache, page_table) -> int:
    """Keys of each sequence of a paged cache without seqused_k: pages_per_seq * page_size."""
    return int(page_table.shape[1]) * int(k_cache.shape[1])


def check_paged(q, k, v, page_table, *, check_indices="device") -> int:
    """The one check of a call with dense q (batch, seqlen_q, heads_q, head_dim) and a paged
    cache k, v (num_pages, page_size, heads_kv, head_dim[_v]) with an int32 (batch,
    pages_per_seq) page table (every sequence has pages_per_seq * page_size keys); returns
    that seqlen_k. Raises as `check_varlen` does (the same checks of the cache and the table;
    the table's values checked on the device by default, raising at a later call or at
    `fa4lab.check_errors()`, and skipped inside a CUDA graph capture: Note [reading the
    lengths])."""
    import torch

    mode = check_mode(check_indices)
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise InputError(f"q has shape {tuple(getattr(q, 'shape', ()))}: with a page_table and "
                         f"no cu_seqlens q is (batch, seqlen_q, heads_q, head_dim) (packed "
                         f"sequences go to fa4lab.attention_varlen)")
    check_varlen_shapes(q.flatten(0, 1), k, v, paged=True)
    table = _page_table(page_table, q, int(q.shape[0]), "q has")
    seqlen_k = paged_seqlen_k(k, table)
    if seqlen_k < 1 or q.numel() == 0:     # nothing to read: Note [empty calls] in fa4lab.api
        return seqlen_k
    context = CheckContext(num_pages=int(k.shape[0]), page_size=int(k.shape[1]),
                           pages_per_seq=int(table.shape[1]), entry="fa4lab.attention")

    def rules() -> list[_Rule]:
        keys = torch.full((table.shape[0],), seqlen_k, dtype=torch.int32, device=q.device)
        return [_page_rule(table, keys, int(k.shape[1]), int(k.shape[0]))]

    _run_check(q, mode, context, rules, table=table)
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
    sequences or slots). Page ids are clamped into the cache, as the kernels clamp them (Note
    [clamped indices] in fa4lab.kernels.device.paged): a bad table checked on the device after
    the call is a wrong answer here too, not a device-side assert."""
    page_size = int(cache.shape[1])
    out = []
    for b, n in enumerate(seqlens_k):
        pages = page_table[b, :ceil_div(int(n), page_size)].long().clamp(0, cache.shape[0] - 1)
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
# and head (with pack-GQA the M extent is len_q[b] * qhead_per_kvhead, `tiling.num_m_blocks`).
# The cost of a tile is `tiling.CostModel`'s, from the key blocks `tiling`'s block-range
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
# are the shortest sequence's. In `tiling`'s model the order loses nothing with one CTA per
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
# * m_block_size cannot overflow int32). The kernels do not clamp a sequence's own offsets and
# lengths (a first clamp of them gave wrong answers on the H200 and was withdrawn): bad cu_seqlens
# under the default check can still make a varlen launch read or store outside its tensors before
# the error is raised; pass check_indices=True where they are untrusted. On good lengths the clamp
# changes nothing.


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


def launch_tile_rows(lens_q, lens_k, rows: int, *, m_block_size: int, causal: bool = False,
                     window_size=(None, None)):
    """(rows, 2) int32 (batch, m_block) table of a varlen launch from int64 tensors of each
    sequence's query and key counts on the GPU, without a device-to-host copy (Note [launch
    tile table]; padding rows (batch, 0) last, Note [tile rows on the device])."""
    import torch

    batch = int(lens_q.shape[0])
    per_seq = torch.clamp((lens_q + (m_block_size - 1)) // m_block_size, 0, rows)
    left, right = window_size
    if causal:
        right = 0
    seen = lens_k
    if left is not None and right is not None:
        seen = torch.clamp(lens_k, max=max(left + right + m_block_size, 0))
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
