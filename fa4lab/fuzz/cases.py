"""The fuzzer's cases: one random configuration of a call, drawn from (seed, index) alone.

A `Case` is plain data (JSON round trip: `to_json` / `from_json`, `parse_replay`): which entry
point, the shapes and lengths, every option, the layout of the tensors and the seed of their
values. `draw_case(seed, i)` is a pure function of (seed, i) and the pool size: its draws come
from `numpy.random.default_rng((seed, i))`, so case i replays without cases 0..i-1.

Note [a bounded pool of kernels]
    Each kernel configuration (what `fa4lab.call.Call.key` keys: head dims, dtype,
    causal, window sides, softcap, sink, LSE, GQA ratio, pack-GQA, split-KV, page size; a
    mod) is a compile of seconds, so a run that drew every option per case would do nothing
    but compile. A case therefore takes those options from one of `configs` pool slots
    (POOL_SIZE by default), each drawn once from (seed, slot); the shapes, lengths, option
    values (window sizes, scale, cap, sink logits, split count), layout and values are the
    case's own. Slot j has the head-dim pair j % len(ALL_HEAD_DIMS) and the entry point
    j // len(ALL_HEAD_DIMS) % len(ENTRIES), so a pool of POOL_SIZE slots holds every pair at
    every entry point. `configs=0` draws every case's configuration afresh (unbounded).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from fa4lab.limits import ALL_HEAD_DIMS, KERNEL_HEAD_DIMS, covering_head_dims

__all__ = ["ENTRIES", "LAYOUTS", "MODS", "PAGE_SIZES", "POOL_SIZE", "Case", "draw_case",
           "from_json", "parse_replay", "to_json"]

# dense: fa4lab.attention; varlen: attention_varlen over packed K/V; paged: attention with a
# page_table; paged_split: the same at decode shapes with num_splits > 1 or None; paged_varlen:
# attention_varlen over a paged cache with the same query count per sequence (decode);
# chunked_prefill: attention_varlen over a paged cache with ragged query counts.
ENTRIES = ("dense", "varlen", "paged", "paged_split", "paged_varlen", "chunked_prefill")
PAGED = ("paged", "paged_split", "paged_varlen", "chunked_prefill")
VARLEN = ("varlen", "paged_varlen", "chunked_prefill")
# contiguous; packed: slices of one qkv (or kv) tensor; transposed: (.., heads, seqlen, d)
# storage viewed as (.., seqlen, heads, d); padded: a slice of a wider tensor (last dim or
# heads); misaligned: data_ptr one element off (the kernels refuse it); strided_last: a last
# dim of stride 2 (refused too).
LAYOUTS = ("contiguous", "packed", "transposed", "padded", "misaligned", "strided_last")
# The page sizes the kernels take (Note [paged key blocks] in fa4lab.kernels.device.paged: any
# divisor or multiple of the key block, pages of 1 to 4 inside a swizzle atom) and a few that
# only a smaller key block fits (48) or none does (12, 100: the sm90 kernel reads them by
# cp.async, Note [cp.async pages] in fa4lab.limits; the sm100 kernel refuses them).
PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ODD_PAGE_SIZES = (12, 48, 100)
# score_mod / mask_mod of a dense case (`fa4lab.fuzz.inputs.case_mods`).
MODS = ("alibi", "relative_bias", "document", "prefix_lm", "distance", "head_position",
        "alibi+document")
GQA_RATIOS = (1, 2, 4, 8)
# How often an option is drawn: the fuzzer's knobs, together (categorical weights sit beside
# their options below).
ODDS = {
    "causal": 0.4, "softcap": 0.2, "learnable_sink": 0.2, "return_lse": 0.75,
    "softmax_scale": 0.3,       # a scale other than 1/sqrt(head_dim)
    "mod": 0.4,                 # a score_mod / mask_mod, of a dense call
    "mod_probe": 0.04,          # ... of a paged call (refused: mods take no paged cache)
    "odd_page_size": 0.05,      # a page size no TMA read fits (cp.async on sm90)
    "seqused_k": 0.3,           # of a packed varlen call (chunked prefill: 0.8)
    "q_longer": 0.2,            # dense seqlen_q > seqlen_k: causal leaves rows with no key
    "extreme_logits": 0.15,     # q scaled by 30..100
    "no_check_indices": 0.15,   # attention_varlen(check_indices=False)
    "shared_pages": 0.2,        # a page table that repeats pages across slots and sequences
    "padded_table": 0.3,        # slots past a sequence's last used page hold -1
    "special_sinks": 0.4,       # sink logits of +-30, +-1e3 and -inf among normal ones
    "layout_on": 0.6,           # each of q, k, v takes the case's layout
    "negative_side": 0.15,      # a window side below 0 (upstream's reading: Note [window and
                                # causal] in fa4lab.spec)
    "narrow_head_dims": 0.12,   # head dims below the pool's pair that run zero-padded to it
                                # (Note [padded head dims] in fa4lab.canonical)
    "seqused_q": 0.2,           # of a varlen call: rows each sequence uses (Note [seqused_q as
                                # phantom sequences] in fa4lab.varlen_forms)
}
POOL_SIZE = len(ALL_HEAD_DIMS) * len(ENTRIES)
# Sizes: lengths up to 5000 on a GPU (long ones rare), tiny ones (<= 64) for a CPU run.
SIZES = ("full", "tiny")
MAX_LENGTH = {"full": 5000, "tiny": 64}
# At most this many query-key products times heads_q * (head_dim + head_dim_v) per case, and
# this many elements of q, k, v: the float64 reference stays well under a second on a GPU.
MAX_WORK = {"full": 1e10, "tiny": 2e7}
MAX_ELEMENTS = {"full": 3e7, "tiny": 3e5}


@dataclass(frozen=True)
class Case:
    """One fuzzer case; every field is JSON. Lengths are per sequence: dense and paged cases
    have `batch` equal ones; seqlens_k are the keys a sequence has (its packed keys, or its
    pages' capacity), seqused_k the keys it attends to (None: all)."""

    seed: int
    index: int
    entry: str
    dtype: str
    head_dim: int
    head_dim_v: int
    heads_q: int
    heads_kv: int
    seqlens_q: tuple[int, ...]
    seqlens_k: tuple[int, ...]
    seqused_k: tuple[int, ...] | None = None
    seqused_q: tuple[int, ...] | None = None
    page_size: int | None = None
    pages_per_seq: int | None = None
    causal: bool = False
    window_size: tuple[int | None, int | None] = (None, None)
    softcap: float = 0.0
    learnable_sink: bool = False
    softmax_scale: float | None = None
    return_lse: bool = True
    pack_gqa: bool | None = None
    num_splits: int | None = None
    mod: str | None = None
    layout: str = "contiguous"
    layout_on: tuple[str, ...] = ("q", "k", "v")
    q_scale: float = 1.0
    max_seqlen: str = "exact"       # what attention_varlen gets: "exact", "none" or "larger"
    check_indices: bool = True
    data_seed: int = 0
    size: str = "full"

    @property
    def batch(self) -> int:
        return len(self.seqlens_q)

    @property
    def keys(self) -> tuple[int, ...]:
        """The keys each sequence attends to."""
        return self.seqlens_k if self.seqused_k is None else self.seqused_k

    def describe(self) -> str:
        """One line: the entry point, dtype, head dims, lengths and the options that are set."""
        def lens(x):
            return str(x[0]) if len(set(x)) == 1 else "[" + ",".join(map(str, x)) + "]"

        parts = [self.entry, self.dtype, f"hd{self.head_dim}/{self.head_dim_v}",
                 f"b{self.batch}", f"sq{lens(self.seqlens_q)}", f"sk{lens(self.seqlens_k)}",
                 f"h{self.heads_q}/{self.heads_kv}"]
        if self.seqused_k is not None:
            parts.append(f"used{lens(self.seqused_k)}")
        if self.seqused_q is not None:
            parts.append(f"used_q{lens(self.seqused_q)}")
        if self.page_size is not None:
            parts.append(f"page{self.page_size}x{self.pages_per_seq}")
        parts += [name for name, on in (("causal", self.causal), ("sink", self.learnable_sink),
                                        ("lse", self.return_lse)) if on]
        if tuple(self.window_size) != (None, None):
            parts.append(f"window{tuple(self.window_size)}")
        for name, value, unset in (("softcap", self.softcap, 0.0),
                                   ("scale", self.softmax_scale, None),
                                   ("pack_gqa", self.pack_gqa, None),
                                   ("splits", self.num_splits, None), ("mod", self.mod, None),
                                   ("q_scale", self.q_scale, 1.0)):
            if value != unset:
                parts.append(f"{name}={value:.3g}" if isinstance(value, float)
                             else f"{name}={value}")
        if self.layout != "contiguous":
            parts.append(f"{self.layout}({','.join(self.layout_on)})")
        return " ".join(parts)


# ---- drawing ---------------------------------------------------------------------------------

def _pick(rng, options, weights=None):
    """One of `options` (any values), with optional weights (normalised here)."""
    if weights is not None:
        weights = np.asarray(weights, dtype=float)
        weights = weights / weights.sum()
    return options[int(rng.choice(len(options), p=weights))]


def _length(rng, size: str, *, zero: bool = False, lowest: int = 1) -> int:
    """A sequence length: mostly short, long ones rare; 0 only where `zero`."""
    if size == "tiny":
        ranges = [(0, 0), (1, 1), (2, 16), (17, 64)]
        weights = [0.1, 0.15, 0.35, 0.4]
    else:
        ranges = [(0, 0), (1, 1), (2, 16), (17, 128), (129, 512), (513, 2048), (2049, 5000)]
        weights = [0.06, 0.1, 0.14, 0.3, 0.25, 0.1, 0.05]
    if not zero:
        ranges, weights = ranges[1:], weights[1:]
    lo, hi = _pick(rng, ranges, weights)
    return max(lowest, int(rng.integers(lo, hi + 1)))


def draw_config(rng, entry: str, pair: tuple[int, int], page_index: int | None = None) -> dict:
    """The kernel-configuration fields of a case (Note [a bounded pool of kernels]): the
    options that pick a compiled kernel, drawn for one entry point and head-dim pair;
    `page_index` picks a paged entry's page size from PAGE_SIZES (a pool's consecutive paged
    slots then take every size), None draws it."""
    dense_call = entry in ("dense", "paged", "paged_split")
    causal = bool(rng.random() < ODDS["causal"])
    # Which sides the window has; causal takes a left side only (right > 0 with causal is a
    # contradiction the API refuses: drawn now and then as a probe).
    if causal:
        sides = _pick(rng, [(False, False), (True, False), (False, True)], [0.6, 0.37, 0.03])
    else:
        sides = _pick(rng, [(False, False), (True, False), (False, True), (True, True)],
                      [0.45, 0.2, 0.15, 0.2])
    mod = None
    if entry == "dense" and rng.random() < ODDS["mod"]:
        mod = _pick(rng, MODS)
    elif entry in ("paged", "paged_split") and rng.random() < ODDS["mod_probe"]:
        mod = _pick(rng, MODS)           # a probe: mods do not take a paged cache
    if entry == "paged_split":
        splits = _pick(rng, ["auto", "many"], [0.4, 0.6])
    elif dense_call:
        splits = _pick(rng, ["auto", "one", "many"], [0.7, 0.1, 0.2])
    else:
        splits = "auto"
    page_size = None
    if entry in PAGED:
        odd = ODDS["odd_page_size"]
        page_size = int(_pick(rng, PAGE_SIZES + ODD_PAGE_SIZES,
                              [(1 - odd) / len(PAGE_SIZES)] * len(PAGE_SIZES)
                              + [odd / len(ODD_PAGE_SIZES)] * len(ODD_PAGE_SIZES)))
        if page_index is not None and page_size in PAGE_SIZES:
            page_size = PAGE_SIZES[page_index % len(PAGE_SIZES)]
    return dict(entry=entry, head_dim=pair[0], head_dim_v=pair[1],
                dtype=_pick(rng, ["bf16", "fp16"]), causal=causal, sides=sides,
                softcap=bool(rng.random() < ODDS["softcap"]),
                learnable_sink=bool(rng.random() < ODDS["learnable_sink"]),
                return_lse=bool(rng.random() < ODDS["return_lse"]),
                gqa=int(_pick(rng, GQA_RATIOS)),
                pack_gqa=_pick(rng, [None, True, False], [0.6, 0.2, 0.2]) if dense_call
                else None, splits=splits, page_size=page_size, mod=mod)


def pool_config(seed: int, slot: int) -> dict:
    """The configuration of pool slot `slot` of `seed` (Note [a bounded pool of kernels])."""
    rng = np.random.default_rng((seed, 2**31 - 1, slot))
    pair = ALL_HEAD_DIMS[slot % len(ALL_HEAD_DIMS)]
    entry = ENTRIES[slot // len(ALL_HEAD_DIMS) % len(ENTRIES)]
    return draw_config(rng, entry, pair, page_index=seed + slot)


def _lengths(rng, entry: str, size: str, batch: int, page_size: int | None):
    """(seqlens_q, seqlens_k, seqused_k, pages_per_seq) of a case."""
    if entry == "dense":
        sk = _length(rng, size)
        sq = sk + _length(rng, size) if rng.random() < ODDS["q_longer"] else _length(rng, size)
        sq = min(sq, MAX_LENGTH[size])
        return [sq] * batch, [sk] * batch, None, None
    if entry == "varlen":
        lq = [_length(rng, size, zero=True) for _ in range(batch)]
        lk = [_length(rng, size, zero=True) for _ in range(batch)]
        used = None
        if rng.random() < ODDS["seqused_k"]:
            used = [int(rng.integers(0, n + 1)) for n in lk]
        return lq, lk, used, None
    # Paged: each sequence has pages_per_seq * page_size keys; decode shapes query a few rows.
    capacity = _length(rng, size, lowest=2 if size == "tiny" else 64) \
        if entry in ("paged_split", "paged_varlen") else _length(rng, size)
    pages = max(1, min(-(-capacity // page_size), MAX_LENGTH[size] // page_size))
    full = pages * page_size
    if entry in ("paged", "paged_split"):
        sq = _length(rng, size) if entry == "paged" else int(_pick(rng, [1, 1, 1, 2, 4]))
        return [sq] * batch, [full] * batch, None, pages
    if entry == "paged_varlen":
        n = int(_pick(rng, [1, 1, 1, 2, 4]))
        used = [int(_pick(rng, [0, 1, full, int(rng.integers(0, full + 1))],
                          [0.1, 0.1, 0.15, 0.65])) for _ in range(batch)]
        return [n] * batch, [full] * batch, used, pages
    # chunked prefill: each sequence's new queries are the last of its keys (or none).
    used = [int(rng.integers(0, full + 1)) for _ in range(batch)]
    lq = [int(_pick(rng, [0, 1, min(u, _length(rng, size)), _length(rng, size)],
                    [0.15, 0.15, 0.55, 0.15])) for u in used]
    return lq, [full] * batch, (used if rng.random() < 0.8 else None), pages


def _shrink(case: dict, size: str) -> dict:
    """Halve the lengths (and pages) until the case fits MAX_WORK and MAX_ELEMENTS."""
    def cost(c):
        keys = c["seqused_k"] or c["seqlens_k"]
        work = sum(a * b for a, b in zip(c["seqlens_q"], keys)) * c["heads_q"] * (
            c["head_dim"] + c["head_dim_v"])
        elements = (sum(c["seqlens_q"]) * c["heads_q"] * c["head_dim"]
                    + sum(c["seqlens_k"]) * c["heads_kv"] * (c["head_dim"] + c["head_dim_v"]))
        return work, elements

    def half(xs):
        return None if xs is None else [(x + 1) // 2 for x in xs]

    while True:
        work, elements = cost(case)
        if work <= MAX_WORK[size] and elements <= MAX_ELEMENTS[size]:
            return case
        case["seqlens_q"] = half(case["seqlens_q"])
        if case["page_size"] is None:
            case["seqlens_k"], case["seqused_k"] = half(case["seqlens_k"]), half(
                case["seqused_k"])
            continue
        if case["pages_per_seq"] == 1 and max(case["seqlens_q"]) <= 1:
            return case                  # one page per sequence is the least a cache holds
        case["pages_per_seq"] = max(1, case["pages_per_seq"] // 2)
        full = case["pages_per_seq"] * case["page_size"]
        case["seqlens_k"] = [full] * len(case["seqlens_k"])
        if case["seqused_k"] is not None:
            case["seqused_k"] = [min(u, full) for u in case["seqused_k"]]
        if case["entry"] == "chunked_prefill":
            keys = case["seqused_k"] or case["seqlens_k"]
            case["seqlens_q"] = [min(n, k) for n, k in zip(case["seqlens_q"], keys)]


def _window_side(rng, longest: int) -> int:
    """One side of a window: 0, a few keys, about the sequence, or more than it; now and then
    below 0 (a shift of the band past the diagonal)."""
    if rng.random() < ODDS["negative_side"]:
        return -int(rng.integers(1, max(2, longest // 2) + 1))
    lo, hi = _pick(rng, [(0, 0), (1, 16), (17, max(17, longest)), (longest, 2 * longest + 1)],
                   [0.15, 0.35, 0.35, 0.15])
    return int(rng.integers(lo, hi + 1))


def _narrow(rng, d: int, dv: int) -> tuple[int, int]:
    """Head dims at most (d, dv), multiples of 8 (the 16-byte rows TMA needs), that run padded
    to (d, dv) itself on both kernels (`fa4lab.limits.covering_head_dims`), so the case keeps
    its pool slot's kernel; (d, dv) when a few draws find none."""
    for _ in range(8):
        pair = (int(8 * rng.integers(1, d // 8 + 1)), int(8 * rng.integers(1, dv // 8 + 1)))
        if all(covering_head_dims(arch, *pair) == (d, dv) for arch in KERNEL_HEAD_DIMS):
            return pair
    return d, dv


def draw_case(seed: int, index: int, *, configs: int = POOL_SIZE, size: str = "full") -> Case:
    """Case `index` of `seed`: a pure function of (seed, index, configs, size)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    rng = np.random.default_rng((seed, index))
    if configs:
        config = pool_config(seed, int(rng.integers(configs)))
    else:
        config = draw_config(rng, _pick(rng, ENTRIES), _pick(rng, ALL_HEAD_DIMS))
    entry, d = config["entry"], config["head_dim"]
    heads_kv = int(rng.integers(1, 5))
    top = 3 if size == "tiny" else {"paged_split": 8, "paged_varlen": 8, "varlen": 8,
                                    "chunked_prefill": 6}.get(entry, 4)
    batch = int(rng.integers(1, top + 1))
    page_size = config["page_size"]
    if size == "tiny" and page_size is not None and page_size > 16:
        page_size = 16 if page_size in PAGE_SIZES else 8
    lq, lk, used, pages = _lengths(rng, entry, size, batch, page_size)
    shape = dict(entry=entry, seqlens_q=lq, seqlens_k=lk, seqused_k=used, page_size=page_size,
                 pages_per_seq=pages, heads_q=heads_kv * config["gqa"], heads_kv=heads_kv,
                 head_dim=d, head_dim_v=config["head_dim_v"])
    fields_ = _shrink(shape, size)
    longest = max(fields_["seqlens_k"] + fields_["seqlens_q"] + [1])
    left, right = config["sides"]
    window = (_window_side(rng, longest) if left else None,
              _window_side(rng, longest) if right else None)
    if config["causal"] and window[1] == 0:
        window = (window[0], 1)          # the probe's point is right > 0 under causal
    d, dv = fields_["head_dim"], fields_["head_dim_v"]
    if rng.random() < ODDS["narrow_head_dims"]:
        d, dv = _narrow(rng, d, dv)
    fields_.update(head_dim=d, head_dim_v=dv)
    seqused_q = None
    if entry in VARLEN and rng.random() < ODDS["seqused_q"]:
        seqused_q = tuple(int(rng.integers(-2, n + 4)) for n in fields_["seqlens_q"])
    num_splits = {"auto": None, "one": 1}.get(config["splits"])
    if config["splits"] == "many":
        num_splits = int(_pick(rng, [2, 3, 7, 40]))
    layout = _pick(rng, LAYOUTS, [0.5, 0.12, 0.12, 0.12, 0.07, 0.07])
    layout_on = ("q", "k", "v")
    if layout != "packed":
        layout_on = tuple(n for n in ("q", "k", "v") if rng.random() < ODDS["layout_on"]) \
            or ("q",)
    scale = None
    if rng.random() < ODDS["softmax_scale"]:
        scale = float(d ** -0.5 * rng.uniform(0.3, 3.0))
    return Case(
        seed=int(seed), index=int(index), dtype=config["dtype"], causal=config["causal"],
        window_size=window, learnable_sink=config["learnable_sink"],
        softcap=float(_pick(rng, [5.0, 20.0, 30.0, 50.0])) if config["softcap"] else 0.0,
        softmax_scale=scale, return_lse=config["return_lse"], pack_gqa=config["pack_gqa"],
        seqused_q=seqused_q,
        num_splits=num_splits, mod=config["mod"], layout=layout, layout_on=layout_on,
        q_scale=float(rng.uniform(30.0, 100.0)) if rng.random() < ODDS["extreme_logits"]
        else 1.0,
        max_seqlen=_pick(rng, ["exact", "none", "larger"], [0.6, 0.2, 0.2]),
        check_indices=bool(rng.random() >= ODDS["no_check_indices"]),
        data_seed=int(rng.integers(2**31)),
        size=size, **{k: (tuple(v) if isinstance(v, list) else v) for k, v in fields_.items()})


# ---- JSON ------------------------------------------------------------------------------------

_TUPLES = ("seqlens_q", "seqlens_k", "seqused_k", "seqused_q", "window_size", "layout_on")


def to_json(case: Case) -> str:
    """The case as one line of JSON (`from_json` reads it back)."""
    return json.dumps(asdict(case), separators=(",", ":"))


def from_json(text_or_dict) -> Case:
    """A Case from `to_json`'s text (or its dict); a failure record's {"case": ...} too."""
    data = json.loads(text_or_dict) if isinstance(text_or_dict, str) else dict(text_or_dict)
    if "case" in data and isinstance(data["case"], dict):
        data = data["case"]
    known = {f.name for f in fields(Case)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"not fields of a fuzz case: {unknown}; a case has {sorted(known)}")
    for name in _TUPLES:
        if data.get(name) is not None:
            data[name] = tuple(data[name])
    try:
        case = Case(**data)
    except TypeError as err:
        raise ValueError(f"not a fuzz case: {err}") from None
    if case.entry not in ENTRIES or case.layout not in LAYOUTS:
        raise ValueError(f"entry {case.entry!r} / layout {case.layout!r}: the entries are "
                         f"{ENTRIES}, the layouts {LAYOUTS}")
    return case


def parse_replay(value: str) -> Case:
    """`--replay`'s argument: a case's JSON text, or the path of a JSON file holding one (or
    a failure record the fuzzer saved)."""
    text = value.strip()
    if not text.startswith("{"):
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"--replay {value!r}: neither JSON (it starts with '{{') nor a "
                             f"file")
        text = path.read_text()
    try:
        return from_json(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--replay: not valid JSON ({err})") from None
