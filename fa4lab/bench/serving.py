"""`fa4lab bench --serving`: the calls an LLM server makes, beside upstream FA4 and PyTorch.

A server does not run square batches: it prefills a batch of prompts of different lengths, and
decodes against a paged K/V cache, one new token per sequence, sometimes for a few sequences
with very long contexts, or prefills a prompt's next chunk against the pages its earlier chunks
left (chunked prefill). This mode measures four scenarios (bf16, head_dim 128), in one process:

    varlen-prefill   24 sequences of random length 200..6000, heads 32 / 8, causal per
                     sequence, packed (total, heads, d) with int32 cu_seqlens
    paged-decode     batch 32, one query each, random K/V lengths (seqused_k) 1024..16384 read
                     through a page table (pages of the cache in random order), heads 32 / 8,
                     page sizes 128 and 16 (two cases); each against the HBM floor
    splitkv-decode   batch 1, 2 and 4, one query each, seqlen_k 131072, heads 64 / 8 (three
                     cases): a grid too small for the GPU unless K/V is split
    paged-prefill    16 sequences, a chunk of random length 128..2048 queries each over a
                     cached context of random length 1024..16384 (its keys: the context and
                     the chunk), through a page table as in paged-decode, heads 32 / 8,
                     causal, pages of 128 and 16 (two cases): one call; no PyTorch peer

(`--quick`: smaller sizes, QUICK_SIZES). The lengths are drawn from a seeded generator and kept
in the record. Providers (SCENARIO_PROVIDERS, SERVING_LABELS): fa4lab's DEFAULT call first, the
headline row of every case (`attention_varlen` with no check_indices argument, `attention` with
no num_splits: Note [the headline row]), then its variants as secondary rows (check_indices=True
and False, num_splits=1), upstream FA4 (`flash_attn_varlen_func` / `flash_attn_func`) with the
same arguments and PyTorch SDPA in the nearest form it has. Each is checked against the
float64 reference before it is timed (Note [checking a serving case]); one that raises, for
instance because it does not take an argument yet, is an "error" row and the run goes on.
Reported per (case, provider): the median microseconds, the multiple of the HBM floor (Note
[HBM floor] in `fa4lab.bench.decode`, over the keys each sequence attends to: Note [a serving
case as one spec]), GB/s, TFLOP/s over the visible pairs (Note [visible FLOPs] in
`fa4lab.bench.features`) and fa4lab's speed over each provider's, then the bars (BARS).

    fa4lab bench --serving                  # table, record saved in benchmarks/
    fa4lab bench --serving --quick --out serving.json

`measure_case` takes any provider factory and a device string, so it runs (and is tested) on a
CPU; the command itself needs a CUDA GPU.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fa4lab.bench.check import ATOL, CHECK_HEADS, CheckSlice, reference_slice
from fa4lab.bench.decode import (
    CHECK_BATCHES,
    FLOOR_RULE,
    HEAD_DIM,
    CopyBandwidth,
    GqaShape,
    floor_us,
)
from fa4lab.bench.measure import (
    RunGuard,
    check_then_time,
    make_inputs,
    run_with_progress,
    time_limits,
)
from fa4lab.bench.providers import (
    Provider,
    fa4_function,
    fa4_runner,
    fa4lab_runner,
    resolve_providers,
    short_error,
)
from fa4lab.bench.records import OK, SERVING, ServingResult, make_floor_record
from fa4lab.bench.serving_peers import (
    SDPA_NESTED,
    SDPA_PADDED,
    VarlenArgs,
    sdpa_nested_provider,
    sdpa_padded_provider,
)
from fa4lab.bench.sweep import OURS
from fa4lab.bench.timing import REP_MS, WARMUP_MS, hbm_bytes, timing_config
from fa4lab.spec import AttentionSpec, normalize_dtype

VARLEN, PAGED, SPLITKV = "varlen-prefill", "paged-decode", "splitkv-decode"
PAGED_PREFILL = "paged-prefill"
SCENARIOS = (VARLEN, PAGED, SPLITKV, PAGED_PREFILL)
PAGED_SCENARIOS = (PAGED, PAGED_PREFILL)
SEED = 0

# ---- the sizes ---------------------------------------------------------------------------------
# Per scenario: batch(es), the range the lengths are drawn from (both ends included), heads
# (q, kv), and for paged-decode the page sizes; --quick keeps the shape of each and shrinks it.
SIZES = {
    VARLEN: {"batch": 24, "lengths": (200, 6000), "heads": (32, 8)},
    PAGED: {"batch": 32, "lengths": (1024, 16384), "heads": (32, 8), "page_sizes": (128, 16)},
    SPLITKV: {"batches": (1, 2, 4), "seqlen_k": 131072, "heads": (64, 8)},
    PAGED_PREFILL: {"batch": 16, "chunks": (128, 2048), "contexts": (1024, 16384),
                    "heads": (32, 8), "page_sizes": (128, 16)},
}
QUICK_SIZES = {
    VARLEN: {"batch": 8, "lengths": (200, 2048), "heads": (32, 8)},
    PAGED: {"batch": 16, "lengths": (1024, 8192), "heads": (32, 8), "page_sizes": (128, 16)},
    SPLITKV: {"batches": (1,), "seqlen_k": 32768, "heads": (64, 8)},
    PAGED_PREFILL: {"batch": 4, "chunks": (128, 512), "contexts": (256, 2048),
                    "heads": (32, 8), "page_sizes": (128, 16)},
}

NOSPLIT, FA4_NOSPLIT = "fa4lab-nosplit", "fa4-nosplit"
CHECKED, UNCHECKED = "fa4lab-checked", "fa4lab-unchecked"

# Note [the headline row]
# The call a user writes first is the one they run: fa4lab's row of a case (OURS, "fa4lab") is
# its call with the DEFAULT arguments, nothing tuned, nothing switched off -- for varlen and
# paged cases `attention_varlen(...)` with no check_indices argument at all (whatever the
# default is: `default_check_indices` reads it from the signature, and the table says it), for
# split-KV `attention(...)` with no num_splits. That row is the first of its case, the one the
# bars (BARS) judge and the one every "fa4lab/this" ratio divides by. Variants are secondary
# rows, named for what they change: check_indices=True (a synchronous check, one
# device-to-host copy per call), check_indices=False (no check: the caller vouches for the
# index values, as upstream FA4 always assumes), num_splits=1. So a default slower than its
# tuned variant shows as exactly that, and never hides behind it.
SCENARIO_PROVIDERS = {
    VARLEN: (OURS, CHECKED, UNCHECKED, "fa4", SDPA_NESTED),
    PAGED: (OURS, CHECKED, UNCHECKED, "fa4", SDPA_PADDED),
    SPLITKV: (OURS, NOSPLIT, "fa4", FA4_NOSPLIT, "sdpa-flash", "sdpa-cudnn"),
    PAGED_PREFILL: (OURS, CHECKED, UNCHECKED, "fa4"),
}
# fa4lab's variants per provider name: the keyword each passes beyond the default call.
VARIANT_KWARGS = {OURS: {}, CHECKED: {"check_indices": True}, UNCHECKED: {"check_indices": False},
                  NOSPLIT: {"num_splits": 1}}
_DEFAULT = ("the default call: no check_indices argument (check_indices={default}, its "
            "default; 'device' checks the index values on the device, no synchronisation)")
SERVING_LABELS = {
    f"{VARLEN}/{OURS}": "fa4lab.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, "
                        "max_seqlen_q, max_seqlen_k, causal=True), packed (total, heads, d): "
                        + _DEFAULT,
    f"{VARLEN}/{CHECKED}": "the same with check_indices=True: the index values are checked "
                           "before launch, one device-to-host copy (a synchronisation) per call",
    f"{VARLEN}/{UNCHECKED}": "the same with check_indices=False: the index values are not "
                             "checked (upstream does not check them either)",
    f"{VARLEN}/fa4": "upstream FA4 flash_attn_varlen_func, the same arguments",
    f"{VARLEN}/{SDPA_NESTED}": "PyTorch SDPA over nested jagged tensors (torch.nested, "
                               "layout=torch.jagged; its backend choice), is_causal=True, "
                               "enable_gqa=True, or K/V heads repeated to the query heads where "
                               "that is refused (the row's note says which)",
    f"{PAGED}/{OURS}": "fa4lab.attention_varlen(q (batch, heads, d), k_cache, v_cache, "
                       "cu_seqlens_q = arange(batch + 1), None, 1, max_seqlen_k, seqused_k, "
                       "page_table): " + _DEFAULT,
    f"{PAGED}/{CHECKED}": "the same with check_indices=True: the index values are checked "
                          "before launch, one device-to-host copy (a synchronisation) per call",
    f"{PAGED}/{UNCHECKED}": "the same with check_indices=False: no check",
    f"{PAGED}/fa4": "upstream FA4 flash_attn_varlen_func, the same arguments",
    f"{PAGED}/{SDPA_PADDED}": "PyTorch SDPA (cuDNN / efficient / flash, its choice) on K/V "
                              "gathered from the pages into a padded dense (batch, heads, "
                              "max_seqlen_k) layout with an additive key-padding mask, "
                              "enable_gqa=True (K/V heads repeated where refused: see the note); "
                              "the gather is NOT timed, the padding is",
    f"{SPLITKV}/{OURS}": "fa4lab.attention(q, k, v): the default call, no num_splits (None: "
                         "its own choice)",
    f"{SPLITKV}/{NOSPLIT}": "fa4lab.attention(q, k, v, num_splits=1): no split",
    f"{SPLITKV}/fa4": "upstream FA4 flash_attn_func(..., num_splits=0): its split heuristic",
    f"{SPLITKV}/{FA4_NOSPLIT}": "upstream FA4 flash_attn_func(..., num_splits=1): no split "
                                "(its default)",
    f"{SPLITKV}/sdpa-flash": "PyTorch SDPA (flash), enable_gqa=True, (b, h, s, d) inputs",
    f"{SPLITKV}/sdpa-cudnn": "PyTorch SDPA (cuDNN), enable_gqa=True, (b, h, s, d) inputs",
    f"{PAGED_PREFILL}/{OURS}": "fa4lab.attention_varlen(q (total_q, heads, d), k_cache, "
                               "v_cache, cu_seqlens_q, None, max_seqlen_q, max_seqlen_k, "
                               "seqused_k, page_table, causal=True), one call (one launch where "
                               "launch.PAGED_VARLEN_ARCHS has the GPU's arch, else one "
                               "attention call per sequence inside it): " + _DEFAULT,
    f"{PAGED_PREFILL}/{CHECKED}": "the same with check_indices=True (synchronous)",
    f"{PAGED_PREFILL}/{UNCHECKED}": "the same with check_indices=False: no check",
    f"{PAGED_PREFILL}/fa4": "upstream FA4 flash_attn_varlen_func, the same arguments",
}
# The table's "call" column: what each row's call changes from fa4lab's default call (a
# "scenario/provider" key before a provider's).
CALLS = {OURS: "default", CHECKED: "check_indices=True", UNCHECKED: "check_indices=False",
         NOSPLIT: "num_splits=1", "fa4": "same args", FA4_NOSPLIT: "num_splits=1",
         SDPA_NESTED: "nested jagged", SDPA_PADDED: "padded + mask",
         "sdpa-flash": "flash backend", "sdpa-cudnn": "cuDNN backend",
         f"{SPLITKV}/fa4": "num_splits=0"}


def default_check_indices() -> str:
    """check_indices's default in `fa4lab.attention_varlen`'s signature, as repr (what the
    headline row runs with), or "?" where fa4lab.api does not import."""
    import inspect

    try:
        from fa4lab.api import attention_varlen
    except Exception:
        return "?"
    default = inspect.signature(attention_varlen).parameters.get("check_indices")
    return "?" if default is None else repr(default.default)


def serving_labels() -> dict[str, str]:
    """SERVING_LABELS with the default of check_indices filled in (`default_check_indices`)."""
    default = default_check_indices()
    return {k: v.replace("{default}", default) for k, v in SERVING_LABELS.items()}


# The bars each scenario is read against: fa4lab's speed over a peer's (the peer's time /
# fa4lab's) at least `min_speed`, and fa4lab's time at most `max_x_floor` times the HBM floor.
# Split-KV and the paged prefill have no bar: their speed over a peer (unsplit FA4, FA4) is
# shown, not judged.
BARS = {VARLEN: {"peer": "fa4", "min_speed": 0.95},
        PAGED: {"peer": "fa4", "min_speed": 0.95, "max_x_floor": 1.15},
        SPLITKV: {"peer": FA4_NOSPLIT},
        PAGED_PREFILL: {"peer": "fa4"}}


def random_lengths(n: int, lo: int, hi: int, seed: int) -> tuple[int, ...]:
    """n lengths drawn uniformly from lo..hi (both included) by numpy's seeded generator."""
    import numpy as np

    if not 1 <= lo <= hi or n < 1:
        raise ValueError(f"lengths need 1 <= lo <= hi and n >= 1, got lo {lo}, hi {hi}, n {n}")
    return tuple(int(x) for x in np.random.default_rng(seed).integers(lo, hi + 1, size=n))


# Note [a serving case as one spec]
# The bench's loop (`check_then_time`) reads a shape's AttentionSpec for its causal flag, its
# softmax scale, the bytes that decide how many input copies the timed calls rotate through
# (Note [cold L2]) and the output's shape. A varlen or paged case is many attention problems,
# so `ServingCase.spec` describes the whole batch as ONE packed problem: batch 1, seqlen_q = the
# query rows of all sequences, seqlen_k = the keys all sequences attend to (seqused_k applied).
# Its `hbm_bytes` is then exactly the floor's count over the keys actually attended,
#     element_bytes x (sum of seqlen_k x heads_kv x (head_dim + head_dim_v)
#                      + sum of seqlen_q x heads_q x (head_dim + head_dim_v)),
# (a page's unused tail and the padding SDPA reads are not counted), and the runners return
# their (total_q, heads, d) output as its (1, total_q, heads, d) view. Its mask is NOT the
# batch's: the FLOPs are summed per sequence (`ServingCase.flops`) and the check is per sequence
# (Note [checking a serving case]). A split-KV case is one dense problem, and its spec is that.
@dataclass(frozen=True)
class ServingCase:
    """One case of the serving mode: `seqlens_q[b]` queries of sequence b attend to its
    `seqlens_k[b]` keys (causal: bottom-right, per sequence). `page_size` for the paged
    scenarios (PAGED_SCENARIOS)."""

    scenario: str
    seqlens_q: tuple[int, ...]
    seqlens_k: tuple[int, ...]
    heads_q: int
    heads_kv: int
    head_dim: int = HEAD_DIM
    causal: bool = False
    page_size: int | None = None
    seed: int = SEED
    dtype: str = "bf16"

    def __post_init__(self):
        if self.scenario not in SCENARIOS:
            raise ValueError(f"scenario {self.scenario!r} is not one of {SCENARIOS}")
        if len(self.seqlens_q) != len(self.seqlens_k) or not self.seqlens_q:
            raise ValueError("seqlens_q and seqlens_k need one length per sequence each")
        if self.scenario == SPLITKV and len(set(self.seqlens_k)) != 1:
            raise ValueError("a split-KV case is dense: every sequence has the same seqlen_k")
        if (self.page_size is not None) != (self.scenario in PAGED_SCENARIOS):
            raise ValueError(f"page_size is given for {' and '.join(PAGED_SCENARIOS)} cases, "
                             f"and only for them")

    @property
    def batch(self) -> int:
        return len(self.seqlens_q)

    @property
    def name(self) -> str:
        if self.scenario in PAGED_SCENARIOS:
            return f"{self.scenario} p{self.page_size}"
        return f"{SPLITKV} b{self.batch}" if self.scenario == SPLITKV else VARLEN

    @property
    def spec(self) -> AttentionSpec:
        """Note [a serving case as one spec]."""
        if self.scenario == SPLITKV:
            return AttentionSpec(self.batch, self.seqlens_q[0], self.seqlens_k[0], self.heads_q,
                                 self.heads_kv, self.head_dim, dtype=self.dtype,
                                 causal=self.causal)
        return AttentionSpec(1, sum(self.seqlens_q), sum(self.seqlens_k), self.heads_q,
                             self.heads_kv, self.head_dim, dtype=self.dtype, causal=self.causal)

    def sequence(self, b: int) -> GqaShape:
        """Sequence b as a dense batch-1 shape (its own reference and FLOPs)."""
        return GqaShape(self.scenario, 1, self.seqlens_q[b], self.seqlens_k[b], self.heads_q,
                        self.heads_kv, self.head_dim, self.causal, self.dtype)

    @property
    def hbm_bytes(self) -> int:
        return hbm_bytes(self.spec)

    @property
    def flops(self) -> float:
        """2 x (head_dim + head_dim_v) per visible pair, summed per sequence and head (Note
        [visible FLOPs] in `fa4lab.bench.features`)."""
        spec = self.spec
        pairs = sum(self.sequence(b).spec.visible_pairs() for b in range(self.batch))
        return 2.0 * (spec.head_dim + spec.head_dim_v) * self.heads_q * pairs

    def shape_label(self) -> str:
        """The table's shape column: e.g. "b24 sq200..6000 sk200..6000 h32/8 hd128 causal"
        (the page size is in the case's name)."""
        q, k = self.seqlens_q, self.seqlens_k
        span = lambda x: f"{min(x)}" if min(x) == max(x) else f"{min(x)}..{max(x)}"
        return (f"b{self.batch} sq{span(q)} sk{span(k)} h{self.heads_q}/{self.heads_kv} "
                f"hd{self.head_dim} {'causal' if self.causal else 'full'}")

    def label(self) -> str:
        page = f" p{self.page_size}" if self.page_size else ""
        return f"{self.scenario}{page} {self.shape_label()}"

    @classmethod
    def from_config(cls, d: dict) -> ServingCase:
        """The case of one entry of a record's config["cases"] (`serving_config`)."""
        return cls(d["scenario"], tuple(d["seqlens_q"]), tuple(d["seqlens_k"]), d["heads_q"],
                   d["heads_kv"], d["head_dim"], causal=d["causal"], page_size=d["page_size"],
                   seed=d.get("seed", SEED), dtype=d.get("dtype", "bf16"))


def serving_cases(*, quick: bool = False, dtype: str = "bf16",
                  seed: int = SEED) -> list[ServingCase]:
    """The mode's cases (SIZES, or QUICK_SIZES with quick): varlen-prefill, paged-decode per
    page size (the same lengths), splitkv-decode per batch, paged-prefill per page size (the
    same chunks and contexts)."""
    sizes, dtype = (QUICK_SIZES if quick else SIZES), normalize_dtype(dtype)
    v, p, s, c = sizes[VARLEN], sizes[PAGED], sizes[SPLITKV], sizes[PAGED_PREFILL]
    lengths = random_lengths(v["batch"], *v["lengths"], seed)
    cases = [ServingCase(VARLEN, lengths, lengths, *v["heads"], causal=True, seed=seed,
                         dtype=dtype)]
    lens_k = random_lengths(p["batch"], *p["lengths"], seed + 1)
    cases += [ServingCase(PAGED, (1,) * p["batch"], lens_k, *p["heads"], page_size=size,
                          seed=seed, dtype=dtype) for size in p["page_sizes"]]
    cases += [ServingCase(SPLITKV, (1,) * b, (s["seqlen_k"],) * b, *s["heads"], seed=seed,
                          dtype=dtype) for b in s["batches"]]
    chunks = random_lengths(c["batch"], *c["chunks"], seed + 2)
    contexts = random_lengths(c["batch"], *c["contexts"], seed + 3)
    keys = tuple(n + m for n, m in zip(chunks, contexts))
    cases += [ServingCase(PAGED_PREFILL, chunks, keys, *c["heads"], causal=True, page_size=size,
                          seed=seed, dtype=dtype) for size in c["page_sizes"]]
    return cases


# ---- inputs ------------------------------------------------------------------------------------
def serving_inputs(case: ServingCase, device: str, args: VarlenArgs) -> tuple:
    """(q, k, v) of the case, standard normal in its dtype, and `args` filled in. varlen: q
    (total_q, heads_q, d), k / v (total_k, heads_kv, d) packed. paged: q (batch, heads_q, d),
    k / v caches (num_pages, page_size, heads_kv, d), sequence b's pages taken in order from a
    seeded random permutation of all pages, so neighbours in a sequence are scattered in the
    cache (paged-prefill: q packed (total_q, heads_q, d) beside such a cache). splitkv: the
    dense (batch, seqlen, heads, d) tensors of `make_inputs`."""
    import torch

    if case.scenario == SPLITKV:
        return make_inputs(case, device, seed=case.seed)
    dt = torch.bfloat16 if case.dtype == "bf16" else torch.float16
    gen = torch.Generator(device=device).manual_seed(case.seed)
    randn = lambda *dims: torch.randn(dims, generator=gen, device=device,
                                      dtype=torch.float32).to(dt)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)
    cu = lambda lens: i32([0, *[sum(lens[:b + 1]) for b in range(len(lens))]])
    d, hq, hkv = case.head_dim, case.heads_q, case.heads_kv
    args.cu_seqlens_q = cu(case.seqlens_q)
    args.max_seqlen_q, args.max_seqlen_k = max(case.seqlens_q), max(case.seqlens_k)
    q = randn(sum(case.seqlens_q), hq, d)
    if case.scenario == VARLEN:
        args.cu_seqlens_k = cu(case.seqlens_k)
        return q, randn(sum(case.seqlens_k), hkv, d), randn(sum(case.seqlens_k), hkv, d)
    size = case.page_size
    pages = [math.ceil(n / size) for n in case.seqlens_k]
    perm = torch.randperm(sum(pages), generator=torch.Generator().manual_seed(case.seed))
    table = torch.zeros((case.batch, max(pages)), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[start:start + n]
        start += n
    args.page_table, args.seqused_k = table.to(device), i32(list(case.seqlens_k))
    return q, randn(sum(pages), size, hkv, d), randn(sum(pages), size, hkv, d)


# Note [checking a serving case]
# Before timing, each provider's output is compared with the float64 reference by the rule of
# Note [the check before timing] (`fa4lab.bench.check`), over KV heads 0..CHECK_HEADS-1 and the
# query heads that read them. A varlen or paged case checks EVERY sequence, on the GPU: each
# sequence's queries and the K/V it attends to (sliced from the packed tensors, or gathered
# from the pages with `fa4lab.varlen.sequence_kv`) go to `reference_slice` as a batch-1 dense
# problem; the slices are concatenated in packed order, and the tolerance is twice the largest
# same-dtype PyTorch error over them plus ATOL. So a kernel that reads a wrong page, an
# off-by-one cu_seqlens entry or keys past seqused_k fails, in whichever sequence it happens.
# A split-KV case is dense: its first and last batch elements are checked, as in the decode.
def case_reference(case: ServingCase, args: VarlenArgs, q, k, v) -> CheckSlice:
    """The float64 reference of the case's checked slice (Note [checking a serving case])."""
    import torch

    from fa4lab.varlen import check_varlen, sequence_kv, unpack

    if case.scenario == SPLITKV:
        return reference_slice(q, k, v, case, batches=CHECK_BATCHES)
    lengths = check_varlen(q, k, v, args.cu_seqlens_q, args.cu_seqlens_k, args.max_seqlen_q,
                           args.max_seqlen_k, args.seqused_k, args.page_table)
    slices = [reference_slice(q_b[None], k_b[None], v_b[None], case.sequence(b))
              for b, (q_b, (k_b, v_b)) in enumerate(zip(
                  unpack(q, lengths.cu_seqlens_q), sequence_kv(lengths, k, v, args.page_table)))]
    baseline = max(s.baseline_err for s in slices)
    return CheckSlice(torch.cat([s.ref for s in slices], dim=1),
                      2.0 * baseline + ATOL[case.dtype], baseline)


# ---- providers ---------------------------------------------------------------------------------
def _refusing_the_reference(call: Callable):
    """call() with fa4lab's float64 fallback (SlowReferenceWarning) an error: where no kernel
    runs, the reference must never be timed as fa4lab (as `providers.fa4lab_runner`)."""
    from fa4lab.api import SlowReferenceWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowReferenceWarning)
        return call()


def _varlen_runner(function, args: VarlenArgs, *, refuse_reference: bool = False):
    """runner(q, k, v, causal, scale) -> function(q, k, v, **args, ...) as (1, total_q, h, d)."""
    first = [refuse_reference]

    def run(q, k, v, causal, softmax_scale):
        call = lambda: function(q, k, v, **args.kwargs(), causal=causal,
                                softmax_scale=softmax_scale)
        out = _refusing_the_reference(call) if first[0] else call()
        first[0] = False
        return (out[0] if isinstance(out, tuple) else out)[None]

    return run


def serving_providers(case: ServingCase, args: VarlenArgs, how: dict) -> list[Provider]:
    """The case's providers (SCENARIO_PROVIDERS), each with a runner or why it is missing.
    Varlen and paged runners read `args` when called; how[name] is a provider's own state,
    whose "note", if any, goes to its row (what a PyTorch runner fell back to)."""
    out = []
    for name in SCENARIO_PROVIDERS[case.scenario]:
        try:
            out.append(_provider(name, case, args, how))
        except Exception as err:    # a peer that cannot be imported is reported, not dropped
            out.append(Provider(name, None, f"{type(err).__name__}: {short_error(err)}"))
    return out


def _provider(name: str, case: ServingCase, args: VarlenArgs, how: dict) -> Provider:
    if case.scenario == SPLITKV:
        if name.startswith("sdpa-"):
            return resolve_providers([name], include_ours=False)[0]
        if name in (OURS, NOSPLIT):
            return Provider(name, fa4lab_runner(**VARIANT_KWARGS[name]))
        return Provider(name, fa4_runner(num_splits=1 if name == FA4_NOSPLIT else 0))
    if name in (OURS, CHECKED, UNCHECKED):
        from fa4lab.api import attention_varlen

        # OURS passes no check_indices at all: Note [the headline row]
        function = functools.partial(attention_varlen, **VARIANT_KWARGS[name])
        return Provider(name, _varlen_runner(function, args, refuse_reference=True))
    if name == "fa4":
        fa4_function()                # says why upstream FA4 does not import, if it does not
        from flash_attn.cute.interface import flash_attn_varlen_func

        return Provider(name, _varlen_runner(flash_attn_varlen_func, args))
    make = sdpa_nested_provider if name == SDPA_NESTED else sdpa_padded_provider
    from fa4lab.environment import gpu

    if gpu() is None:
        raise RuntimeError("no CUDA GPU visible")
    return make(args, how)


# ---- measuring ---------------------------------------------------------------------------------
ProviderFactory = Callable[[ServingCase, VarlenArgs, dict], list]


def _result(provider: str, case: ServingCase, hbm_gbps: float | None, **kw) -> ServingResult:
    return ServingResult(provider, case.scenario, case.name, case.batch, case.heads_q,
                         case.heads_kv, case.head_dim, case.causal, sum(case.seqlens_q),
                         sum(case.seqlens_k), max(case.seqlens_k), case.page_size, case.dtype,
                         hbm_bytes=case.hbm_bytes, flops=case.flops,
                         floor_us=floor_us(case.hbm_bytes, hbm_gbps), **kw)


def measure_case(case: ServingCase, providers: ProviderFactory = serving_providers, *,
                 hbm_gbps: float | None = None, device: str = "cuda",
                 warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS,
                 on_result: Callable[[ServingResult], None] | None = None,
                 guard: RunGuard | None = None) -> list[ServingResult]:
    """Check, then time, every provider of one case (`check_then_time`; the check is Note
    [checking a serving case]). `providers(case, args, how)` makes them (default: the real
    ones). Never raises for a provider's failure: "failed", "error" and "missing" are rows."""
    args, how = VarlenArgs(), {}
    floor = floor_us(case.hbm_bytes, hbm_gbps)
    results = []
    for m in check_then_time(case, providers(case, args, how),
                             inputs=lambda: serving_inputs(case, device, args),
                             check=lambda q, k, v: case_reference(case, args, q, k, v),
                             device=device, warmup_ms=warmup_ms, rep_ms=rep_ms, guard=guard):
        timed = {}
        if m.status == OK:
            us = m.ms * 1e3
            timed = {"us": us, "x_floor": us / floor if floor else None,
                     "gbps": case.hbm_bytes / (us * 1e-6) / 1e9,
                     "tflops": case.flops / (us * 1e-6) / 1e12}
        checked = m.checked()
        if m.status == OK and how.get(m.provider, {}).get("note"):
            checked["note"] = how[m.provider]["note"]
        r = _result(m.provider, case, hbm_gbps, **timed, **checked)
        results.append(r)
        if on_result:
            on_result(r)
    return results


def run_serving(cases: Sequence[ServingCase], providers: ProviderFactory = serving_providers,
                *, hbm_gbps: float | None = None, device: str = "cuda",
                warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS, progress: bool = True,
                guard: RunGuard | None = None,
                on_result: Callable[[ServingResult], None] | None = None) -> list:
    """Every case, in one process, with a tqdm bar over (case, provider) per scenario."""
    results = []
    for scenario in SCENARIOS:
        group = [c for c in cases if c.scenario == scenario]
        if not group:
            continue

        def measure(case, tick):
            def both(r):
                tick(r)
                if on_result:
                    on_result(r)
            return measure_case(case, providers, hbm_gbps=hbm_gbps, device=device,
                                warmup_ms=warmup_ms, rep_ms=rep_ms, on_result=both,
                                guard=guard)

        results += run_with_progress(group, len(SCENARIO_PROVIDERS[scenario]), measure,
                                     desc=f"bench --serving {scenario}", device=device,
                                     progress=progress)
    return results


# ---- record and table --------------------------------------------------------------------------
def serving_config(cases: Sequence[ServingCase], *, copy: CopyBandwidth | None,
                   warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS,
                   wall_s: float | None = None, guard: RunGuard | None = None) -> dict:
    """The record's config: each case with its lengths, the rules, the providers, the bars."""
    gbps = copy.gbps if copy else None
    config = {
        "cases": [{"name": c.name, "scenario": c.scenario, "batch": c.batch,
                   "seqlens_q": list(c.seqlens_q), "seqlens_k": list(c.seqlens_k),
                   "heads_q": c.heads_q, "heads_kv": c.heads_kv, "head_dim": c.head_dim,
                   "causal": c.causal, "page_size": c.page_size, "dtype": c.dtype,
                   "seed": c.seed, "hbm_bytes": c.hbm_bytes, "flops": c.flops,
                   "floor_us": floor_us(c.hbm_bytes, gbps)} for c in cases],
        "hbm_copy": ({"bytes": copy.nbytes, "ms": copy.ms, "gbps": copy.gbps} if copy
                     else None),
        "hbm_rule": ("device-to-device torch.Tensor.copy_ of a uint8 tensor, timed like the "
                     "providers; hbm_gbps = 2 x bytes (read + write) / median time"),
        "floor": (f"{FLOOR_RULE}; for a varlen or paged case batch x seqlen_k is the sum of "
                  f"the keys each sequence attends to (seqused_k applied), batch x seqlen_q "
                  f"the sum of its query rows"),
        "flops_rule": "2 x (head_dim + head_dim_v) x heads_q x visible (query, key) pairs, "
                      "summed per sequence (causal: bottom-right per sequence)",
        "pages": "sequence b's pages are the next ceil(seqlen_k[b] / page_size) entries of a "
                 "seeded random permutation of all pages of the cache",
        "check": (f"varlen / paged: every sequence; split-KV: the first and the last batch "
                  f"element; KV heads 0..{CHECK_HEADS - 1} and the query heads that read "
                  f"them, float64 reference, tol = 2 x same-dtype PyTorch error + "
                  f"{ATOL[cases[0].dtype] if cases else ATOL['bf16']:.1e}"),
        **timing_config(warmup_ms, rep_ms),
        "providers": {k: v for k, v in serving_labels().items()
                      if k.split("/")[0] in {c.scenario for c in cases}},
        "headline": (f"the first provider of each case, {OURS}, is fa4lab's call with its "
                     f"default arguments (check_indices={default_check_indices()} for varlen "
                     f"and paged calls); the others are variants or peers (Note [the headline "
                     f"row])"),
        "bars": BARS,
    }
    if guard is not None:
        config["time_limits"] = time_limits(guard)
    if wall_s is not None:
        config["wall_s"] = round(wall_s, 1)
    return config


def make_serving_record(results: Sequence[ServingResult], *, hbm_gbps: float | None,
                        gpu_name: str, arch: str | None, command: str, config: dict,
                        label: str | None = None, notes: str = "") -> dict:
    """A validated "serving" record of `results` (`records.make_floor_record`)."""
    return make_floor_record(SERVING, results, hbm_gbps=hbm_gbps, gpu_name=gpu_name,
                             arch=arch, command=command, config=config,
                             label=label or f"fa4lab serving calls on {gpu_name}", notes=notes)
