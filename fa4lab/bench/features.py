"""`fa4lab bench --features`: each attention option of fa4lab beside upstream FA4 and PyTorch.

The options at one shape, the standard sweep's hd128 seqlen 8192 point (batch 2, heads 16,
bf16, no GQA), and one row per (feature, provider):

    none            full attention                  causal          causal
    window-1024-0   window (1024, 0), causal        window-512-512  window (512, 512)
    softcap         softcap 30                      softcap-causal  softcap 30, causal
    sink-causal     learnable sink, causal          alibi           ALiBi score_mod, causal
    relative-bias   relative-bias score_mod         document        4 documents mask_mod, causal
    prefix-lm       prefix-LM mask_mod, 1024-token prefix (causal after it)

then the attention of served models, each at its own shape (MODEL_FEATURES, causal, bf16):

    gpt-oss-sink-window  sink + window (128, 0), hd64, heads 64 / 8, s4096 (batch 4)
    gpt-oss-sink         sink, full causal, the same shape
    mla-prefill          head dims (192, 128), heads 16, s4096 (batch 4)
    mistral-window       window (4096, 0) over s16384, heads 32 / 8, hd128 (batch 1)
    gqa16-hd64           hd64, heads 32 / 2 (GQA 16:1), s2048 (batch 8)
    gemma2-softcap       softcap 50 and window (4096, 0), hd256, heads 16 / 8, s8192 (batch 2)

(`--feature models` or `--feature options`: one group), for fa4lab (`fa4lab.attention` with
the option and nothing else: its default call, the first row of each feature), upstream FA4
(`flash_attn_func`, where it has the option: window_size, softcap, learnable_sink; the same
q, k, v, so the same GQA and head dims), PyTorch SDPA with materialized
masks and biases, and FlexAttention under torch.compile (Note [the same computation in
PyTorch] in `fa4lab.bench.pytorch_peers`). A provider that cannot express a feature is a
"skipped" row with the reason (`why_not`). Every row that runs is checked against the float64
reference with the same options before it is timed (Note [the check before timing]); a row
that fails is recorded as failed, not timed. TFLOP/s counts only the visible (query, key) pairs
(Note [visible FLOPs]); the table adds fa4lab's ratio to FA4 and to the faster PyTorch peer.
The run is bounded in time (Note [run time limits] in `fa4lab.bench.measure`).

    fa4lab bench --features --json out.json --plot out.png
    fa4lab bench --features --feature alibi document --peers flex
    fa4lab bench --features --feature models --peers fa4     # the model shapes beside FA4
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from fa4lab.bench import records
from fa4lab.bench.check import ATOL, CHECK_HEADS, reference_slice
from fa4lab.bench.measure import RunGuard, check_then_time, make_inputs, time_limits
from fa4lab.bench.providers import Provider, fa4_runner, fa4lab_runner, short_error
from fa4lab.bench.pytorch_peers import FLEX, SDPA, pytorch_provider
from fa4lab.bench.records import (
    ERROR,
    MISSING,
    OK,
    SKIPPED,
    FeatureResult,
    record_header,
    validate_record,
)
from fa4lab.bench.sweep import OURS, shape_for
from fa4lab.bench.timing import REP_MS, WARMUP_MS, timer_name, timing_config
from fa4lab.spec import AttentionSpec

# ---- the features ------------------------------------------------------------------------------
FEATURE_HEAD_DIM = 128
FEATURE_SEQLEN = 8192
SOFTCAP = 30.0
GEMMA_SOFTCAP = 50.0
DOCUMENTS = 4              # equal documents packed in each sequence
PREFIX = 1024              # prefix-LM: keys every query sees
RELATIVE_RADIUS = 128      # relative bias: offsets -R..R, the edges saturate beyond
# The run's time limits by default (Note [run time limits]): everything fits one 10-minute slot.
BUDGET_S = 400.0
STEP_TIMEOUT_S = 150.0

# The ready-made mods of `fa4lab.mods` that are mask_mods (the others are score_mods).
MASK_MODS = ("document_mask", "prefix_lm")

FA4 = "fa4"
FEATURE_PROVIDERS = (OURS, FA4, SDPA, FLEX)
FEATURE_PEERS = FEATURE_PROVIDERS[1:]
PYTORCH = (SDPA, FLEX)
FEATURE_LABELS = {
    OURS: "fa4lab.attention with the option: the default call, no tuning argument (pack_gqa, "
          "num_splits: their defaults choose)",
    FA4: "upstream FA4 flash_attn_func with the same option, the same q, k, v (GQA, head dims)",
    SDPA: "PyTorch SDPA (its backend choice), masks and biases materialized",
    FLEX: "PyTorch FlexAttention under torch.compile, block mask from the mask_mod",
}
# The table's "call" column. fa4lab's row is its default call, the first of each feature's rows
# (Note [the headline row] in `fa4lab.bench.serving`).
FEATURE_CALLS = {OURS: "default", FA4: "same options", SDPA: "masks materialized",
                 FLEX: "torch.compile"}


@dataclass(frozen=True)
class FeatureShape:
    """A model's own shape for a feature (MODEL_FEATURES): q (batch, seqlen, heads_q,
    head_dim), k (batch, seqlen, heads_kv, head_dim), v (batch, seqlen, heads_kv, head_dim_v)."""

    batch: int
    seqlen: int
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int

    def label(self) -> str:
        hd = (f"hd{self.head_dim}" if self.head_dim == self.head_dim_v
              else f"hd({self.head_dim}, {self.head_dim_v})")
        return f"b{self.batch} s{self.seqlen} h{self.heads_q}/{self.heads_kv} {hd}"


@dataclass(frozen=True)
class Feature:
    """One attention option of fa4lab, as the bench runs it. `mod` names a ready-made mod of
    `fa4lab.mods` (alibi, relative_bias, document_mask, prefix_lm) and `mod_size` its size: the
    relative bias's radius, the number of documents, the prefix length (alibi has none).
    `shape`: the model shape it runs at (MODEL_FEATURES), else None: the mode's one shape."""

    name: str
    label: str
    causal: bool = False
    window_size: tuple[int | None, int | None] = (None, None)
    softcap: float = 0.0
    sink: bool = False
    mod: str | None = None
    mod_size: int = 0
    shape: FeatureShape | None = None

    @property
    def is_mod(self) -> bool:
        return self.mod is not None


ALL_FEATURES = (
    Feature("none", "full attention"),
    Feature("causal", "causal", causal=True),
    Feature("window-1024-0", "window (1024, 0), causal", window_size=(1024, 0)),
    Feature("window-512-512", "window (512, 512)", window_size=(512, 512)),
    Feature("softcap", f"softcap {SOFTCAP:g}", softcap=SOFTCAP),
    Feature("softcap-causal", f"softcap {SOFTCAP:g}, causal", causal=True, softcap=SOFTCAP),
    Feature("sink-causal", "learnable sink, causal", causal=True, sink=True),
    Feature("alibi", "ALiBi (score_mod), causal", causal=True, mod="alibi"),
    Feature("relative-bias", f"relative bias +-{RELATIVE_RADIUS} (score_mod)",
            mod="relative_bias", mod_size=RELATIVE_RADIUS),
    Feature("document", f"{DOCUMENTS} documents (mask_mod), causal", causal=True,
            mod="document_mask", mod_size=DOCUMENTS),
    Feature("prefix-lm", f"prefix LM, {PREFIX}-token prefix (mask_mod)", mod="prefix_lm",
            mod_size=PREFIX),
)
OPTION_FEATURES = ALL_FEATURES
# The attention of models people serve, each at its own shape (bf16, causal; about 16k tokens
# a call): fa4lab's default call with the model's options beside upstream FA4's with the same
# options (sink, window, softcap, GQA, head dims) and the PyTorch peers.
GPT_OSS = FeatureShape(4, 4096, 64, 8, 64, 64)
MODEL_FEATURES = (
    Feature("gpt-oss-sink-window", "GPT-OSS: sink + window (128, 0), causal", causal=True,
            window_size=(128, 0), sink=True, shape=GPT_OSS),
    Feature("gpt-oss-sink", "GPT-OSS: sink, full causal", causal=True, sink=True,
            shape=GPT_OSS),
    Feature("mla-prefill", "MLA prefill hd (192, 128), causal", causal=True,
            shape=FeatureShape(4, 4096, 16, 16, 192, 128)),
    Feature("mistral-window", "Mistral: window (4096, 0) over 16k, causal", causal=True,
            window_size=(4096, 0), shape=FeatureShape(1, 16384, 32, 8, 128, 128)),
    Feature("gqa16-hd64", "hd64, GQA 16:1, causal", causal=True,
            shape=FeatureShape(8, 2048, 32, 2, 64, 64)),
    Feature("gemma2-softcap", f"Gemma-2: softcap {GEMMA_SOFTCAP:g}, window (4096, 0), causal",
            causal=True, softcap=GEMMA_SOFTCAP, window_size=(4096, 0),
            shape=FeatureShape(2, 8192, 16, 8, 256, 256)),
)
ALL_FEATURES = OPTION_FEATURES + MODEL_FEATURES
FEATURE_NAMES = tuple(f.name for f in ALL_FEATURES)
# Names `--feature` takes for a group: the options at the mode's shape, the model shapes.
FEATURE_GROUPS = {"options": tuple(f.name for f in OPTION_FEATURES),
                  "models": tuple(f.name for f in MODEL_FEATURES)}


def features_named(names: Sequence[str] | None = None) -> list[Feature]:
    """The features of `names` (None: all; a FEATURE_GROUPS name: its features), in the
    table's order; unknown names are an error."""
    if names is None:
        return list(ALL_FEATURES)
    names = [m for n in names for m in FEATURE_GROUPS.get(n, (n,))]
    unknown = [n for n in names if n not in FEATURE_NAMES]
    if unknown:
        raise ValueError(f"--feature: unknown {unknown}; choose from {', '.join(FEATURE_NAMES)} "
                         f"or a group: {', '.join(FEATURE_GROUPS)}")
    return [f for f in ALL_FEATURES if f.name in names]


def why_not(provider: str, feature: Feature) -> str:
    """Why `provider` cannot compute `feature` ('' when it can): the plan's skipped rows."""
    if provider == FA4 and feature.is_mod:
        return ("upstream flash_attn_func takes score_mod / mask_mod as CuTe-DSL functions "
                "of its own signature (with seqlen_info, in-kernel aux views); fa4lab's mods "
                "are not ported to it")
    if provider == SDPA and feature.softcap:
        return "SDPA cannot apply softcap's tanh to the scores inside its kernel"
    return ""


@dataclass(frozen=True)
class FeatureCase:
    """One feature at its shape: q (batch, seqlen, heads, head_dim), k (batch, seqlen,
    heads_kv, head_dim), v (batch, seqlen, heads_kv, head_dim_v); heads_kv and head_dim_v None:
    heads and head_dim (the mode's one shape has neither GQA nor a second head dim)."""

    feature: Feature
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    dtype: str = "bf16"
    heads_kv: int | None = None
    head_dim_v: int | None = None

    @property
    def spec(self) -> AttentionSpec:
        f = self.feature
        return AttentionSpec(self.batch, self.seqlen, self.seqlen, self.heads,
                             self.heads_kv or self.heads, self.head_dim, self.head_dim_v,
                             dtype=self.dtype, causal=f.causal, window_size=f.window_size,
                             softcap=f.softcap, learnable_sink=f.sink)

    def shape_label(self) -> str:
        """The table's shape column, e.g. "b4 s4096 h64/8 hd64"."""
        return FeatureShape(self.batch, self.seqlen, self.heads, self.heads_kv or self.heads,
                            self.head_dim, self.head_dim_v or self.head_dim).label()

    def label(self) -> str:
        return f"{self.feature.name} {self.shape_label()}"


def feature_cases(features: Sequence[Feature] = ALL_FEATURES, *, head_dim: int = FEATURE_HEAD_DIM,
                  seqlen: int = FEATURE_SEQLEN, dtype: str = "bf16", **shape_kw
                  ) -> list[FeatureCase]:
    """Each feature at the sweep's shape for (head_dim, seqlen) (`shape_for`: batch and heads
    from the total tokens and hidden size), a model feature at its own shape (whatever
    head_dim, seqlen and the shape options say); bad values are the sweep's errors."""
    base = shape_for(head_dim, seqlen, False, dtype=dtype, **shape_kw)
    for f in features:
        if f.mod in ("prefix_lm", "document_mask") and not 0 < f.mod_size < base.seqlen:
            raise ValueError(f"--seqlen {seqlen}: feature {f.name} needs seqlen > {f.mod_size} "
                             f"({'its prefix' if f.mod == 'prefix_lm' else 'documents'})")
    cases = [FeatureCase(f, base.batch, base.seqlen, base.heads, base.head_dim, base.dtype)
             if f.shape is None else
             FeatureCase(f, f.shape.batch, f.shape.seqlen, f.shape.heads_q, f.shape.head_dim,
                         base.dtype, f.shape.heads_kv, f.shape.head_dim_v)
             for f in features]
    for c in cases:
        _ = c.spec            # AttentionSpec's own checks
    return cases


# ---- the tensors of a call ---------------------------------------------------------------------
@dataclass
class FeatureCall:
    """What a case's call takes besides q, k, v, made once on one device: the sink (float32
    (heads,), values exact in bf16 so upstream FA4's bf16 sink is the same number), the mod of
    `fa4lab.mods` and its aux tensors, and `mods` (`fa4lab.mods.KernelMods`) to call them."""

    spec: AttentionSpec
    device: Any = "cpu"
    sink: Any = None
    score_mod: Callable | None = None
    mask_mod: Callable | None = None
    aux: tuple = ()
    mods: Any = None

    def options(self, *, sink_dtype=None) -> dict:
        """The keyword options of `fa4lab.attention` (and the reference) beyond causal and the
        scale; the sink cast to `sink_dtype` when given (upstream FA4 takes a bf16 sink)."""
        spec, opts = self.spec, {}
        if spec.window_size != (None, None):
            opts["window_size"] = spec.window_size
        if spec.softcap:
            opts["softcap"] = spec.softcap
        if self.sink is not None:
            opts["learnable_sink"] = self.sink if sink_dtype is None else self.sink.to(sink_dtype)
        if self.score_mod is not None:
            opts["score_mod"] = self.score_mod
        if self.mask_mod is not None:
            opts["mask_mod"] = self.mask_mod
        if self.aux:
            opts["aux_tensors"] = self.aux
        return opts


def feature_call(case: FeatureCase, device: str, seed: int = 0) -> FeatureCall:
    """The case's sink and mod on `device`, the same numbers on every run (seeded)."""
    import torch

    from fa4lab import mods

    spec, f = case.spec, case.feature
    gen = torch.Generator(device="cpu").manual_seed(seed + case.seqlen + case.head_dim)
    call = FeatureCall(spec, torch.device(device))
    if f.sink:
        sink = 2.0 * torch.randn(spec.heads_q, generator=gen)
        call.sink = sink.to(torch.bfloat16).float().to(device)
    bound = None
    if f.mod == "alibi":
        h = torch.arange(spec.heads_q, dtype=torch.float32)
        bound = mods.alibi((2.0 ** (-8.0 * (h + 1) / spec.heads_q)).to(device))
    elif f.mod == "relative_bias":
        table = 0.5 * torch.randn(spec.heads_q, 2 * f.mod_size + 1, generator=gen)
        bound = mods.relative_bias(table.to(device))
    elif f.mod == "document_mask":
        ids = torch.arange(case.seqlen, dtype=torch.int64) * f.mod_size // case.seqlen
        bound = mods.document_mask(ids.to(torch.int32).to(device))
    elif f.mod == "prefix_lm":
        bound = mods.prefix_lm(f.mod_size)
    elif f.mod is not None:
        raise ValueError(f"feature {f.name}: unknown mod {f.mod!r}")
    if bound is not None:
        call.score_mod, call.mask_mod = ((None, bound.mod) if f.mod in MASK_MODS
                                         else (bound.mod, None))
        if bound.aux_tensors:               # "cuda" names the tensors' device, cuda:0
            call.device = bound.aux_tensors[0].device
        call.mods, call.aux = mods.check_mods(call.score_mod, call.mask_mod,
                                              bound.aux_tensors or None, call.device)
    return call


# ---- FLOPs -------------------------------------------------------------------------------------
# Note [visible FLOPs]
# A feature's FLOPs are those of the (query, key) pairs it lets through: 2 * (head_dim +
# head_dim_v) per visible pair (one multiply-add each for QK^T and PV), summed over batch and
# heads. The visible pairs are counted exactly: the causal / window rule per row
# (`fa4lab.spec.visible_key_counts`, via AttentionSpec.visible_pairs), and for a mask_mod the
# reference's own mask (`fa4lab.reference.visible_mask` AND the mod on the whole grid). So the
# causal row counts seqlen * (seqlen + 1) / 2 pairs, 1 / seqlen more than the sweep's "halved"
# convention (AttentionSpec.flops); a score_mod, softcap or sink changes no count.
def visible_pairs(case: FeatureCase, call: FeatureCall | None = None) -> int:
    """The visible (query, key) pairs of the case, over all batches and heads (Note [visible
    FLOPs]). A mask_mod is evaluated on the CPU unless `call` (with its device) is given."""
    spec = case.spec
    if case.feature.mod not in MASK_MODS:
        return spec.batch * spec.heads_q * spec.visible_pairs()
    from fa4lab.bench.pytorch_peers import dense_visible

    call = call or feature_call(case, "cpu")
    mask = dense_visible(call, call.device)
    per_grid = int(mask.sum())
    copies = spec.batch * spec.heads_q // (mask.shape[0] * mask.shape[1])
    return per_grid * copies


def feature_flops(case: FeatureCase, call: FeatureCall | None = None) -> float:
    """2 * (head_dim + head_dim_v) FLOPs per visible pair (Note [visible FLOPs])."""
    spec = case.spec
    return 2.0 * (spec.head_dim + spec.head_dim_v) * visible_pairs(case, call)


# ---- the plan of a run -------------------------------------------------------------------------
@dataclass(frozen=True)
class PlannedRow:
    """One (feature, provider) row of a run, and why it is skipped ('' when it runs)."""

    feature: str
    provider: str
    skip: str = ""


def plan_features(features: Sequence[Feature], providers: Sequence[str]) -> list[PlannedRow]:
    """Every (feature, provider) row, providers in FEATURE_PROVIDERS order, fa4lab always."""
    unknown = [p for p in providers if p not in FEATURE_PROVIDERS]
    if unknown:
        raise ValueError(f"--peers: unknown {unknown} for --features; choose from "
                         f"{','.join(FEATURE_PEERS)}")
    names = [p for p in FEATURE_PROVIDERS if p == OURS or p in providers]
    return [PlannedRow(f.name, p, why_not(p, f)) for f in features for p in names]


def feature_provider(name: str, call: FeatureCall, *, flex_compile: bool = True) -> Provider:
    """The runner of `name` for one call: a thin call with the call's options."""
    if name == OURS:
        return Provider(OURS, fa4lab_runner(**call.options()))
    if name == FA4:
        import torch

        return Provider(FA4, fa4_runner(**call.options(sink_dtype=torch.bfloat16)))
    return pytorch_provider(name, call, flex_compile=flex_compile)


def available(names: Sequence[str], *, has_gpu: bool) -> dict[str, str]:
    """{provider: why it is missing} for the providers that cannot run here at all."""
    from fa4lab.bench.providers import fa4_function

    out = {}
    for name in names:
        try:
            if name in PYTORCH and not has_gpu:
                raise RuntimeError("no CUDA GPU visible")
            if name == FA4:
                fa4_function()
            if name == FLEX:
                from torch.nn.attention.flex_attention import create_block_mask  # noqa: F401
        except Exception as err:
            out[name] = f"{type(err).__name__}: {short_error(err)}"
    return out


# ---- measuring ---------------------------------------------------------------------------------
def _row(case: FeatureCase, provider: str, flops: float | None, **kw) -> FeatureResult:
    spec = case.spec
    return FeatureResult(provider, case.feature.name, case.batch, case.seqlen, case.heads,
                         case.head_dim, spec.causal, case.dtype, flops=flops,
                         heads_kv=spec.heads_kv, head_dim_v=spec.head_dim_v, **kw)


def measure_feature(case: FeatureCase, providers: Sequence[str], *, device: str = "cuda",
                    missing: dict[str, str] | None = None, warmup_ms: float = WARMUP_MS,
                    rep_ms: float = REP_MS, guard: RunGuard | None = None,
                    on_result: Callable[[FeatureResult], None] | None = None,
                    flex_compile: bool = True) -> list[FeatureResult]:
    """Every planned row of one case: skipped rows as such, missing providers as missing, the
    others checked against the reference with the case's options, then timed
    (`check_then_time`). Never raises for a provider's failure."""
    missing = missing or {}
    results: list[FeatureResult] = []

    def done(r: FeatureResult):
        results.append(r)
        if on_result:
            on_result(r)

    rows = plan_features([case.feature], providers)
    try:
        call = feature_call(case, device)
        flops = feature_flops(case, call)
    except Exception as err:
        for row in rows:
            done(_row(case, row.provider, None, status=SKIPPED if row.skip else ERROR,
                      note=row.skip or f"inputs: {type(err).__name__}: {short_error(err)}"))
        return results
    runnable = []
    for row in rows:
        if row.skip:
            done(_row(case, row.provider, flops, status=SKIPPED, note=row.skip))
        elif row.provider in missing:
            done(_row(case, row.provider, flops, status=MISSING, note=missing[row.provider]))
        else:
            try:
                runnable.append(feature_provider(row.provider, call, flex_compile=flex_compile))
            except Exception as err:
                done(_row(case, row.provider, flops, status=ERROR,
                          note=f"{type(err).__name__}: {short_error(err)}"))
    options = call.options()
    for m in check_then_time(case, runnable, inputs=lambda: make_inputs(case, device),
                             check=lambda q, k, v: reference_slice(q, k, v, case,
                                                                   options=options),
                             device=device, warmup_ms=warmup_ms, rep_ms=rep_ms, guard=guard):
        timed = {}
        if m.status == OK:
            timed = {"us": m.ms * 1e3, "tflops": flops / (m.ms * 1e-3) / 1e12}
        done(_row(case, m.provider, flops, **timed, **m.checked()))
    return results


def run_features(cases: Sequence[FeatureCase], providers: Sequence[str], *,
                 device: str = "cuda", missing: dict[str, str] | None = None,
                 warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS, progress: bool = True,
                 guard: RunGuard | None = None, flex_compile: bool = True,
                 on_result: Callable[[FeatureResult], None] | None = None
                 ) -> list[FeatureResult]:
    """Every planned row of every case, in one process, with a tqdm bar over the rows."""
    from fa4lab.bench.measure import run_with_progress

    n = len(plan_features([ALL_FEATURES[0]], providers))

    def measure(case, tick):
        def both(r):
            tick(r)
            if on_result:
                on_result(r)
        return measure_feature(case, providers, device=device, missing=missing,
                               warmup_ms=warmup_ms, rep_ms=rep_ms, guard=guard,
                               on_result=both, flex_compile=flex_compile)

    return run_with_progress(cases, n, measure, desc="bench --features", device=device,
                             progress=progress)


# ---- record, table, description ----------------------------------------------------------------
def features_config(cases: Sequence[FeatureCase], providers: Sequence[str], *,
                    guard: RunGuard | None = None, warmup_ms: float = WARMUP_MS,
                    rep_ms: float = REP_MS, wall_s: float | None = None,
                    flops: dict[str, float] | None = None) -> dict:
    """The record's config: the shape, each feature's options and FLOPs, the providers, the
    skip rules, the check, the timer and the time limits."""
    first = next((c for c in cases if c.feature.shape is None), cases[0] if cases else None)
    config = {
        "shape": ({"batch": first.batch, "seqlen": first.seqlen, "heads": first.heads,
                   "head_dim": first.head_dim, "dtype": first.dtype} if first else {}),
        "features": {c.feature.name: {**_describe_options(c.feature),
                                      "flops": (flops or {}).get(c.feature.name),
                                      **({"shape": _shape_of(c)} if c.feature.shape else {})}
                     for c in cases},
        "providers": {p: FEATURE_LABELS[p] for p in FEATURE_PROVIDERS
                      if p == OURS or p in providers},
        "headline": (f"the first row of each feature, {OURS}, is fa4lab.attention with the "
                     f"feature's options and nothing else (its default call); {FA4} gets the "
                     f"same options and the same q, k, v"),
        "skipped": {f"{r.feature}/{r.provider}": r.skip
                    for r in plan_features([c.feature for c in cases], providers) if r.skip},
        "flops_rule": ("2 x (head_dim + head_dim_v) per visible (query, key) pair, summed over "
                       "batch and heads; the causal / window / mask_mod mask counted exactly"),
        "outside_timed_region": ("mask and bias materialization (SDPA), block masks and "
                                 "torch.compile (Flex), kernel compiles: all in the first call "
                                 "(first_call_s), before timing"),
        "check": (f"batch 0, heads 0..{CHECK_HEADS - 1}, float64 reference with the feature's "
                  f"options, tol = 2 x same-dtype PyTorch error + "
                  f"{ATOL[first.dtype if first else 'bf16']:.1e}"),
        **timing_config(warmup_ms, rep_ms),
        "time_limits": time_limits(guard),
    }
    if wall_s is not None:
        config["wall_s"] = round(wall_s, 1)
    return config


def _shape_of(c: FeatureCase) -> dict:
    spec = c.spec
    return {"batch": spec.batch, "seqlen": spec.seqlen_q, "heads_q": spec.heads_q,
            "heads_kv": spec.heads_kv, "head_dim": spec.head_dim, "head_dim_v": spec.head_dim_v,
            "dtype": spec.dtype}


def _describe_options(f: Feature) -> dict:
    d = {"label": f.label, "causal": f.causal}
    if f.window_size != (None, None):
        d["window_size"] = list(f.window_size)
    if f.softcap:
        d["softcap"] = f.softcap
    if f.sink:
        d["learnable_sink"] = "float32 (heads,), 2 x standard normal rounded to bf16"
    if f.mod:
        d["mod"] = {"alibi": "fa4lab.mods.alibi(slopes = 2^(-8 (h + 1) / heads))",
                    "relative_bias": f"fa4lab.mods.relative_bias(0.5 x standard normal "
                                     f"(heads, {2 * f.mod_size + 1}))",
                    "document_mask": f"fa4lab.mods.document_mask({f.mod_size} equal documents)",
                    "prefix_lm": f"fa4lab.mods.prefix_lm({f.mod_size})"}[f.mod]
    return d


def make_features_record(results: Sequence[FeatureResult], *, gpu_name: str, arch: str | None,
                         command: str, config: dict, label: str | None = None,
                         notes: str = "") -> dict:
    """A validated "features" record of `results`."""
    record = record_header(records.FEATURES, gpu_name=gpu_name, arch=arch, command=command,
                           config=config, label=label or f"fa4lab features on {gpu_name}",
                           notes=notes)
    record["results"] = [asdict(r) for r in results]
    return validate_record(record)


def describe_features_run(cases: Sequence[FeatureCase], providers: Sequence[str], *,
                          missing: dict[str, str] | None = None,
                          flops: dict[str, float] | None = None) -> str:
    """What the mode runs: the shape, each feature with its FLOPs, the providers, the rows
    skipped and why."""
    missing = missing or {}
    c = next((x for x in cases if x.feature.shape is None), cases[0])
    models = [x for x in cases if x.feature.shape is not None]
    at = (f"at hd{c.head_dim} s{c.seqlen} (batch {c.batch}, heads {c.heads}, {c.dtype})"
          if len(models) < len(cases) else f"({c.dtype})")
    lines = [f"{len(cases)} features x {len(plan_features([c.feature], providers))} providers "
             f"{at}" + (f", {len(models)} of them at a model's own shape" if models and
                        len(models) < len(cases) else "") + ":"]
    for case in cases:
        f = (flops or {}).get(case.feature.name)
        shape = f"  [{case.shape_label()}]" if case.feature.shape else ""
        lines.append(f"  {case.feature.name:<19} {case.feature.label:<48}"
                     + (f"{f / 1e12:6.3f} TFLOP (visible pairs)" if f else "") + shape)
    lines.append("providers:")
    for p in FEATURE_PROVIDERS:
        if p == OURS or p in providers:
            state = f"missing ({missing[p]})" if p in missing else "available"
            lines.append(f"  {p:<7} {FEATURE_LABELS[p]}: {state}")
    skipped = [r for r in plan_features([x.feature for x in cases], providers) if r.skip]
    if skipped:
        lines.append("skipped (the provider cannot express the feature):")
        for reason in dict.fromkeys(r.skip for r in skipped):
            which = ", ".join(f"{r.provider} {r.feature}" for r in skipped if r.skip == reason)
            lines.append(f"  {which}: {reason}")
    lines.append(f"timer: {timer_name()}")
    return "\n".join(lines)
