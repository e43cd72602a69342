"""Variable-length batches and paged K/V caches: the layout and its one check.

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
- the work tiles of a varlen launch and the pages its key blocks read are
  `fa4lab.varlen_tiles`'s.

    from fa4lab.varlen import check_varlen
    from fa4lab.varlen_tiles import varlen_tiles
    lengths = check_varlen(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k)
    varlen_tiles(lengths.seqlens_q, lengths.seqlens_k, heads=8, m_block_size=128,
                 n_block_size=128, causal=True).padded_tiles
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from fa4lab.errors import InputError, InputTypeError, check_qkv_kinds, check_same_device
from fa4lab.indexcheck import CheckContext, Rule, Verdict, message, poll, queue_check
from fa4lab.spec import check_tensors
from fa4lab.tiling import ceil_div

__all__ = ["CHECK_MODES", "VarlenLengths", "check_mode", "check_paged", "check_varlen",
           "check_varlen_shapes", "gather_paged", "pack", "pad", "paged_seqlen_k", "reads_values",
           "sequence_kv", "unpack"]


# Note [reading the lengths]
# The lengths of a varlen call live in the index tensors, on the GPU in any real use. Reading
# them to the host synchronises: the host waits for every kernel queued before, then launches,
# so the GPU idles while the host builds the launch, and a CUDA graph cannot be captured at
# all. So nothing of the launch path reads them: the kernels take the tensors themselves, the
# tile table is built on the device (`fa4lab.varlen_tiles.tile_rows`), and the host sizes only
# what the shapes give (the batch, the packed totals, the caller's max_seqlen). The check's
# value rules (cu_seqlens start at 0, never decrease and end at the total; seqused_k within its
# sequence's keys; every page a sequence reads inside the cache; max_seqlen above every length:
# `fa4lab.indexcheck.Rule`) run in one of three ways, `check_indices`' values (`check_mode`):
# * "device" (the default of `fa4lab.attention_varlen`, and what `fa4lab.attention` with a page
#   table does): one check kernel queued before the launch writes a verdict that reaches the
#   host without a wait (Note [index check on the device] in fa4lab.indexcheck). A bad index
#   raises its InputError at the first varlen or paged call after the check has run on the GPU
#   (usually the very next call), or at `fa4lab.check_errors()`, which waits for it; the call
#   whose indices were bad has run by then, and its outputs are not meaningful (the kernels
#   clamp page ids and sequences into their tensors, so a bad index never faults: Note [index
#   check on the device] in fa4lab.indexcheck). On CPU tensors, and on
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

    def same_query_count(self, total_q: int, read: bool = False) -> bool:
        """Every sequence has the same number L >= 1 of queries (a decode batch), from the
        shapes alone: max_seqlen_q times the batch is the packed total (no sequence exceeds
        max_seqlen_q, so each has exactly max_seqlen_q). Otherwise False, unless `read`: then
        the values are read (a device-to-host copy: only where the alternative reads them
        anyway, Note [reading the lengths])."""
        if total_q == 0:
            return False
        if self.max_seqlen_q * self.batch == total_q:
            return True
        return read and len(set(self.seqlens_q)) == 1


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
        if mode == "device" and queue_check(context, cu_q, cu_k, used, table):
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
    a fake tensor or a traced size passes through it (Note [the varlen op] in
    fa4lab.api.varlen)."""
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
    check_qkv_kinds(q, k, v)
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
        have = None      # every sequence's capacity: made below only where something reads it
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
    elif paged:
        keys = have = _capacities(batch, capacity, q.device)
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
            cap = have if have is not None else _capacities(batch, capacity, q.device)
            found.append(_Rule(Rule.SEQUSED_K, lambda: (used < 0) | (used > cap),
                               lambda b: (int(used[b]), int(cap[b]))))
        if paged:
            found.append(_page_rule(table, keys, page_size, int(k.shape[0])))
        found += _max_rule(Rule.MAX_Q, max_seqlen_q, lambda: cu_q[1:] - cu_q[:-1])
        return found + _max_rule(Rule.MAX_K, max_seqlen_k, lambda: keys)

    _run_check(q, mode, context, rules, cu_q, cu_k, used, table)
    return lengths


def _capacities(batch: int, capacity: int, device):
    """Every paged sequence's key capacity, pages_per_seq * page_size, as int32 (batch,)."""
    import torch

    return torch.full((batch,), capacity, dtype=torch.int32, device=device)


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
    lengths]). `fa4lab.call.check_call` calls it for a call with a page table, and checks the
    rest of such a call."""
    import torch

    check_tensors(q, k, v)
    mode = check_mode(check_indices)
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise InputError(f"q has shape {tuple(getattr(q, 'shape', ()))}: with a page_table and "
                         f"no cu_seqlens q is (batch, seqlen_q, heads_q, head_dim) (packed "
                         f"sequences go to fa4lab.attention_varlen)")
    check_varlen_shapes(q.flatten(0, 1), k, v, paged=True)
    table = _page_table(page_table, q, int(q.shape[0]), "q has")
    seqlen_k = paged_seqlen_k(k, table)
    if seqlen_k < 1 or q.numel() == 0:     # nothing to read: Note [empty calls] in fa4lab.canonical
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
