"""Notebook 08's attention variants, each taken from its spec to a verdict through the lab's hooks.

A variant is an `AttentionSpec` (and, for the document mask, the `mask_mod` of `fa4lab bench
--features`) at two sizes: "small" for a CPU, "full" for the shapes `fa4lab bench` records.
For one variant this module gives, in order:

  plan       `plan_forward(spec, arch)` (pack-GQA for decode) and the `fa4lab plan` report
             (`fa4lab.plan.report`) split into its sections;
  kernel     the kernel compiled for sm_90a or sm_100a with fake tensors (`compile_forward`,
             cached per variant, arch and size) and its audit against the plan;
  validation on a GPU, `fa4lab.attention` against the float64 reference (`fa4lab.bench.check`:
             FA4's tolerance); on a CPU, the data-carrying simulator where it models the
             variant (sm100, no window, softcap or mask_mod), and always the block simulation
             below, which walks the plan's own key blocks;
  experiment the report's falsifiable experiment: on a GPU both plans are compiled and timed,
             and `judge` says whether the prediction held; on a CPU, what would run and the
             recorded result of the variant in benchmarks/, if any.

    from fa4lab import variants
    v = variants.get("sliding window")
    plan = variants.plan_of(v, "sm90")
    sections = variants.report_sections(plan)        # {"Conclusion": markdown, ...}
    print(variants.validate_cpu(v, plan)[-1].summary())
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from fa4lab import blockwalk
from fa4lab.bench.features import SOFTCAP
from fa4lab.limits import RESCALE_THRESHOLD
from fa4lab.spec import AttentionSpec

SIZES = ("small", "full")
BLOCK_SIM_TOL = blockwalk.TOLERANCE     # the block simulation against the float64 reference
# The data-carrying simulator's LSE against the reference of the same 16-bit inputs (its row
# sums add P before P is rounded, so only fp32 sums and the exp2 differ): tests/test_datasim.py's.
DATASIM_LSE_TOL = 1e-3


@dataclass(frozen=True)
class Variant:
    """One variant: what it is, the hooks it goes through, and its spec at the small size.

    feature: its row in `fa4lab bench --features` (the full-size shape and the recorded result);
    documents: a document mask_mod (the feature's `fa4lab.mods.document_mask`); decode: the GQA
    decode of `fa4lab bench --decode`, run with pack-GQA."""

    name: str
    what: str
    hooks: str
    small: AttentionSpec
    feature: str | None = None
    documents: bool = False
    decode: bool = False


VARIANTS = (
    Variant("sliding window", "each query sees a window of the keys before it and itself "
            "(Mistral, Gemma 2's local layers); the full size is the bench's window feature",
            "AttentionSpec(window_size=...) -> fa4lab.tiling's window-aware block ranges; the "
            "kernel's window_left / window_right arguments",
            AttentionSpec(1, 512, 512, 2, 2, 128, window_size=(128, 0)),
            feature="window-1024-0"),
    Variant("softcap", "scores capped by softcap * tanh(s / softcap) before the softmax "
            "(Gemma 2), causal",
            "AttentionSpec(softcap=...) -> the kernel's scale_log2 / pre_scale arguments and "
            "one tanh per score",
            AttentionSpec(1, 512, 512, 2, 2, 128, causal=True, softcap=SOFTCAP),
            feature="softcap-causal"),
    Variant("document mask", "equal documents packed in each sequence, causal inside each: a "
            "mask_mod (FlexAttention's form), the bench's document feature",
            "fa4lab.mods.document_mask -> compiled into the kernel (mods=KernelMods) and its "
            "block table (fa4lab.mods_blocks) skips the blocks it hides",
            AttentionSpec(1, 512, 512, 2, 2, 128, causal=True),
            feature="document", documents=True),
    Variant("head_dim (192, 128)", "Q and K wider than V (DeepSeek's split), causal",
            "AttentionSpec(head_dim=192, head_dim_v=128) -> the planner's MMA shapes, TMEM/SMEM "
            "budgets (fa4lab.limits.KERNEL_HEAD_DIMS)",
            AttentionSpec(1, 512, 512, 2, 2, 192, head_dim_v=128, causal=True)),
    Variant("decode, pack-GQA", "one new token against a long K/V cache, the query heads of a "
            "KV head packed into one tile's rows",
            "plan_forward(..., pack_gqa=True) -> fa4lab.tiling's packed rows; "
            "fa4lab.attention(pack_gqa=True)",
            AttentionSpec(2, 1, 512, 8, 2, 128), decode=True),
)
NAMES = tuple(v.name for v in VARIANTS)
DEFAULT = NAMES[0]


def get(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    raise ValueError(f"unknown variant {name!r}; choose one of {', '.join(NAMES)}")


def _check_size(size: str) -> None:
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES} (fa4lab.environment.problem_size()), "
                         f"got {size!r}")


def spec_of(variant: Variant, size: str = "small") -> AttentionSpec:
    """The variant's spec: the small one, or at "full" the shape of its recorded benchmark (the
    feature's, the decode's, else the sweep's hd128 causal seqlen 8192 with this head_dim)."""
    _check_size(size)
    if size == "small":
        return variant.small
    from fa4lab import bench
    from fa4lab.bench.features import FEATURE_SEQLEN

    if variant.feature:
        (feature,) = bench.features_named([variant.feature])
        return bench.feature_cases([feature])[0].spec
    if variant.decode:
        return bench.gqa_shapes(prefill_seqlen=0)[0].spec
    s = variant.small
    base = bench.shape_for(s.head_dim_v, FEATURE_SEQLEN, s.causal).spec
    return base.with_(head_dim=s.head_dim)


def call_of(variant: Variant, spec: AttentionSpec, device="cpu"):
    """The call's options (`fa4lab.bench.features.FeatureCall`): window and softcap from the
    spec; for the document mask, the bench's mask_mod and doc ids at this spec's shape."""
    from fa4lab.bench.features import FeatureCall, FeatureCase, feature_call, features_named

    if not variant.documents:
        return FeatureCall(spec, device)
    (feature,) = features_named([variant.feature])
    return feature_call(FeatureCase(feature, spec.batch, spec.seqlen_q, spec.heads_q,
                                    spec.head_dim, spec.dtype), device)


# ---- plan and report ---------------------------------------------------------------------------
def plan_of(variant: Variant, arch: str = "sm90", size: str = "small", **overrides):
    """The variant's plan on `arch` ("sm90" or "sm100"); overrides as `plan_forward`'s."""
    from fa4lab.plan import plan_forward

    if variant.decode:
        overrides.setdefault("pack_gqa", True)
    return plan_forward(spec_of(variant, size), arch, **overrides)


@functools.lru_cache(maxsize=32)
def report_of(plan) -> tuple[dict, str]:
    """(the report as data, its markdown): `fa4lab plan`'s `build_report` and
    `render_markdown`, computed once per plan."""
    from fa4lab.bench.records import sweep_figures
    from fa4lab.plan.report import build_report, render_markdown

    rep = build_report(plan, recorded=sweep_figures(plan))
    return rep, render_markdown(plan, rep)


def report_sections(plan) -> dict[str, str]:
    """The report's markdown by section ("Conclusion", "Evidence and assumptions", "Contract",
    "Simulated timeline", "Minimal validation", "Risks and fallbacks"), each without its
    heading; the key "" holds the title and the spec line."""
    _, text = report_of(plan)
    head, *parts = text.split("\n## ")
    out = {"": head.strip()}
    for part in parts:
        title, _, body = part.partition("\n")
        out[title.strip()] = body.strip()
    return out


def mod_blocks(variant: Variant, plan) -> dict | None:
    """For a mask_mod variant, the key blocks its CTAs visit in all, with the mod's block table
    and with the causal / window ranges alone (`fa4lab.blockwalk.tile_blocks`), over one
    (batch, head); None without a mask_mod. The plan and its report do not model a mod: this is
    the work it removes from their causal plan."""
    call = call_of(variant, plan.spec)
    if call.mask_mod is None:
        return None
    spec, t = plan.spec, plan.tiles
    table = blockwalk.block_table_of(spec, t, call.mods, call.aux)
    plain = narrowed = 0
    for m, row in enumerate(table):
        plain += len(blockwalk.tile_blocks(spec, t, m).blocks)
        narrowed += len(blockwalk.tile_blocks(spec, t, m, row).blocks)
    return {"ctas": int(table.shape[0]), "blocks_without_mod": plain, "blocks_with_mod": narrowed}


# ---- the kernel ----------------------------------------------------------------------------------
# Audit rows a variant is known to fail, by (variant, arch): the document mask's per-score
# document-id reads spill registers in the sm100 softmax warps (tests/test_compile_sm100.py's
# mods test names it and bounds the mask_mod spills it audits). 0 is the goal.
KNOWN_AUDIT_FINDINGS = {("document mask", "sm100"): ("spill instructions (STL/LDL)",
                                                     "stack frame bytes")}


@functools.lru_cache(maxsize=16)
def compile_variant(name: str, arch: str = "sm90", size: str = "small"):
    """`compile_forward` of the variant's plan for `arch` + "a" with fake tensors (any machine),
    the document mask's mod compiled in; cached, so a notebook compiles each choice once."""
    from fa4lab.kernels.compile import compile_forward

    variant = get(name)
    plan = plan_of(variant, arch, size)
    call = call_of(variant, plan.spec)
    return compile_forward(plan, arch + "a", mods=call.mods if call.mask_mod else None)


def audit_variant(name: str, arch: str = "sm90", size: str = "small"):
    """The audit (`fa4lab.kernels.audit.audit_compiled`) of `compile_variant`'s binary."""
    from fa4lab.kernels.audit import audit_compiled

    return audit_compiled(compile_variant(name, arch, size))


# ---- validation ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Validation:
    """One check of the variant against the float64 reference."""

    path: str          # what computed the output
    why: str           # why this path (and not another)
    max_err: float
    tol: float
    seed: int | None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return math.isfinite(self.max_err) and self.max_err <= self.tol

    def summary(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        seed = f", seed {self.seed}" if self.seed is not None else ""
        return (f"{verdict} {self.path}: max |out - reference| {self.max_err:.2e} (tolerance "
                f"{self.tol:.1e}{seed}). {self.why}" + (f" {self.detail}" if self.detail else ""))


def inputs(spec: AttentionSpec, seed: int, *, extreme: float = 4.0):
    """float64 numpy q, k, v of `spec`, standard normal with q scaled by `extreme` (large
    logits: the running max jumps, rows rescale)."""
    rng = np.random.default_rng(seed)
    q = extreme * rng.standard_normal((spec.batch, spec.seqlen_q, spec.heads_q, spec.head_dim))
    k = rng.standard_normal((spec.batch, spec.seqlen_k, spec.heads_kv, spec.head_dim))
    v = rng.standard_normal((spec.batch, spec.seqlen_k, spec.heads_kv, spec.head_dim_v))
    return q, k, v


def reference_of(q, k, v, spec: AttentionSpec, call):
    """The float64 reference (out, lse) with the variant's options."""
    from fa4lab.reference import attention_reference

    return attention_reference(q, k, v, causal=spec.causal, softmax_scale=spec.scale,
                               return_lse=True, **call.options())


def block_simulation(q, k, v, plan, call=None, *, rescale_threshold: float = RESCALE_THRESHOLD):
    """The plan's CTAs in float64 (`fa4lab.blockwalk.walk`): each visits only the key blocks
    the kernel visits (window-aware ranges, packed rows with pack-GQA, narrowed by a mask_mod's
    block table), in the kernels' order, with FA4's conditional rescale, the softcap and the
    call's mods, the element mask and the mask_mod in the masked runs only. Returns (out, lse,
    blocks visited).

    What it checks: that skipping the blocks the plan skips, and the variant's score
    transforms, leave the answer exact. Not the binary: the GPU check does that."""
    mods = None if call is None or not call.mods else call.mods
    return blockwalk.walk(q, k, v, plan.spec, plan.tiles, mods, () if call is None else call.aux,
                          rescale_threshold=rescale_threshold)


def _lse_error(lse, ref_lse) -> float:
    """max |lse - ref|: equal infinities count as 0, NaN as inf."""
    same_inf = np.isinf(lse) & (lse == ref_lse)
    with np.errstate(invalid="ignore"):
        err = np.where(same_inf, 0.0, np.abs(lse - ref_lse))
    return float(np.nan_to_num(err, nan=np.inf).max())


def _error(out, lse, ref_out, ref_lse) -> float:
    """The larger of max |out - ref| and `_lse_error`."""
    return max(float(np.abs(out - ref_out).max()), _lse_error(lse, ref_lse))


def dense_blocks(plan) -> int:
    """K/V blocks a plan without any mask would visit: every CTA sees every block."""
    from fa4lab import tiling

    s, t = plan.spec, plan.tiles
    return (tiling.num_m_blocks(s.seqlen_q, t.cta_m, blockwalk.packed(s, t))
            * tiling.num_n_blocks(s.seqlen_k, t.n_block))


def validate_cpu(variant: Variant, plan, seed: int | None = None) -> list[Validation]:
    """The CPU checks of the variant on fresh random inputs (large logits): the data-carrying
    simulator when it models the variant, and the block simulation of `plan` always. Each
    names its path and why it was taken; the seed replays them."""
    from fa4lab.plan import plan_forward
    from fa4lab.plan.datasim import DataSimError, round16, run_plan
    from fa4lab.plan.datasim_check import tolerance

    if seed is None:
        seed = int(np.random.SeedSequence().entropy % 2**31)
    spec = plan.spec
    call = call_of(variant, spec)
    q, k, v = inputs(spec, seed)
    ref_out, ref_lse = reference_of(q, k, v, spec, call)
    checks = []
    why_not = _datasim_refuses(variant, spec)
    if not why_not:
        sm100 = plan if plan.arch == "sm100" else plan_forward(
            spec, "sm100", **({"pack_gqa": True} if variant.decode else {}))
        try:
            run = run_plan(sm100, q, k, v)
        except (ValueError, DataSimError) as err:
            why_not = f"refused this plan ({type(err).__name__}: {err})"
        else:
            # its inputs are rounded to the dtype, as the kernel's: so is the reference's
            qb, kb, vb = (round16(np.asarray(x, np.float32), spec.dtype) for x in (q, k, v))
            rb_out, rb_lse = reference_of(qb, kb, vb, spec, call)
            err = float(np.abs(run.out - rb_out).max())
            if _lse_error(run.lse, rb_lse) > DATASIM_LSE_TOL:
                err = math.inf
            checks.append(Validation(
                "data-carrying simulation (sm100 role programs on numpy TMEM/SMEM)",
                "It models this variant, so the protocol's own data path is checked against "
                "the reference of the same 16-bit inputs; P and O rounding allowed.", err,
                tolerance(vb, spec.dtype), seed, f"LSE within {DATASIM_LSE_TOL:g}."))
    out, lse, visits = block_simulation(q, k, v, plan, call)
    checks.append(Validation(
        f"block simulation of the {plan.arch} plan (float64 online softmax, FA4's threshold "
        f"{RESCALE_THRESHOLD:g})",
        (f"The data-carrying simulator {why_not}, so the plan's block walk is checked in "
         f"float64 instead." if why_not else "The plan's block walk, in float64."),
        _error(out, lse, ref_out, ref_lse), BLOCK_SIM_TOL, seed,
        f"{visits} of {dense_blocks(plan)} K/V blocks visited."))
    return checks


def _datasim_refuses(variant: Variant, spec: AttentionSpec) -> str:
    """Why `fa4lab.plan.datasim.run_plan` cannot compute this variant ('' when it can): its own
    refusals (window, softcap, sink) and the mask_mod it does not model."""
    if variant.documents:
        return ("has no mask_mod (it would compute causal attention across the documents)")
    missing = [n for n, on in (("a window", spec.window_size != (None, None)),
                               ("a softcap", bool(spec.softcap)),
                               ("a learnable sink", spec.learnable_sink)) if on]
    if missing:
        return f"computes unmasked or causal attention, without {' or '.join(missing)}"
    return ""


def validate_gpu(variant: Variant, size: str = "small", seed: int = 0) -> Validation:
    """`fa4lab.attention` on this GPU against the float64 reference of the checked slice
    (`fa4lab.bench.check`: at most twice PyTorch's same-dtype error plus a small atol)."""
    import torch

    import fa4lab
    from fa4lab.bench.check import check_output, reference_slice

    spec = spec_of(variant, size)
    call = call_of(variant, spec, "cuda")
    q, k, v = _cuda_inputs(spec, seed)
    opts = call.options()
    out = fa4lab.attention(q, k, v, causal=spec.causal, softmax_scale=spec.scale,
                           pack_gqa=True if variant.decode else None, **opts)
    shape = _Shape(spec)
    check = reference_slice(q, k, v, shape, options=opts)
    _, err, note = check_output(out, check, shape)
    return Validation(f"fa4lab.attention on {torch.cuda.get_device_name()}",
                      "The compiled kernel itself, on the checked slice (batch 0, KV heads 0-1).",
                      err, check.tol, seed, note)


def _cuda_inputs(spec: AttentionSpec, seed: int):
    """Standard normal q, k, v of `spec` on the GPU, in its dtype (v with head_dim_v)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = torch.bfloat16 if spec.dtype == "bf16" else torch.float16
    return tuple(torch.randn(d, generator=gen, device="cuda").to(dt) for d in (
        (spec.batch, spec.seqlen_q, spec.heads_q, spec.head_dim),
        (spec.batch, spec.seqlen_k, spec.heads_kv, spec.head_dim),
        (spec.batch, spec.seqlen_k, spec.heads_kv, spec.head_dim_v)))


@dataclass(frozen=True)
class _Shape:
    """What `fa4lab.bench.check` reads of a shape: its spec and dtype."""

    spec: AttentionSpec

    @property
    def dtype(self) -> str:
        return self.spec.dtype


# ---- the falsifiable experiment --------------------------------------------------------------
def experiment_plans(plan):
    """(the chosen plan, the experiment's plan, predicted relative change of TFLOP/s) of the
    report's falsifiable experiment; None when no neighbouring plan fits."""
    from fa4lab.plan import plan_forward
    from fa4lab.plan.report import _overrides_of

    rep, _ = report_of(plan)
    exp = rep["experiment"]
    if not exp:
        return None
    other = plan_forward(plan.spec, plan.arch, **{**_overrides_of(plan), **exp["change"]})
    return plan, other, exp["tflops"] / rep["prediction"]["tflops"] - 1


def judge(predicted: float, measured: float) -> tuple[bool, str]:
    """The report's rule: the prediction (a relative change of TFLOP/s) fails when the
    measured change has the other sign or is under half the predicted one."""
    if predicted == 0:
        return False, (f"predicted no change, measured {measured:+.1%}: a prediction of no "
                       f"change cannot fail by this rule, so it is not an experiment")
    held = math.copysign(1, measured) == math.copysign(1, predicted) and \
        abs(measured) >= abs(predicted) / 2
    why = (f"predicted {predicted:+.1%}, measured {measured:+.1%}: "
           + ("same sign and at least half the size, the prediction held" if held else
              "the other sign or under half the size, the cost model is wrong here (its TMA/L2 "
              "latency and bandwidth assumptions first)"))
    return held, why


def run_experiment(variant: Variant, plan, seed: int = 0) -> dict:
    """On this GPU: compile both plans of `experiment_plans` with their own tiles
    (`fa4lab.kernels.launch.compile_plan`), time each (`fa4lab.bench.time_ms`, cold L2) and
    judge. The path that compiles a plan's own tiles takes no mask_mod: the document mask's
    experiment runs its causal plan without the documents (said in the result)."""
    from fa4lab.bench import time_ms
    from fa4lab.kernels.launch import compile_plan

    found = experiment_plans(plan)
    if found is None:
        return {"held": None, "text": "no neighbouring plan fits: nothing to measure"}
    spec = plan.spec
    q, k, v = _cuda_inputs(spec, seed)
    tflops = []
    for p in found[:2]:
        runner, _ = compile_plan(p, (q, k, v))
        ms = time_ms(lambda runner=runner: runner(q, k, v, spec.causal, spec.scale))
        tflops.append(spec.flops() / (ms * 1e-3) / 1e12)
    measured = tflops[1] / tflops[0] - 1
    held, why = judge(found[2], measured)
    note = (" (without the mask_mod: the plan's own tiles compile through a path that takes "
            "none)" if variant.documents else "")
    return {"held": held, "tflops": tflops, "predicted": found[2], "measured": measured,
            "text": why + note}


def recorded_result(variant: Variant, directory=None) -> str:
    """The variant's newest recorded measurement in benchmarks/ (the newest `--features` record
    with its feature's rows, or the newest `--decode` record's decode shape), or why none."""
    from pathlib import Path

    from fa4lab.bench import records

    if variant.feature:
        kind, rows_of = records.FEATURES, records.feature_results_of
    elif variant.decode:
        kind, rows_of = records.DECODE, records.decode_results_of
    else:
        return ("no recorded result for this variant: `fa4lab bench` records head dims 64, 128 "
                "and 256; `--features` and `--decode` record head_dim 128")

    def mine(r) -> bool:
        return r.feature == variant.feature if variant.feature else r.shape == "decode"

    found = [(rec, rows) for rec in records.load_records(directory, kinds=(kind,))
             for rows in [[r for r in rows_of(rec) if mine(r)]] if rows]
    if not found:
        return f"no {kind} record of {variant.feature or 'the decode shape'} in benchmarks/"
    rec, rows = found[-1]
    lines = [f"recorded on {rec['gpu']} ({rec['date']}, commit {rec['commit']}, "
             f"{Path(rec['path']).name}):"]
    for r in rows:
        if r.status != records.OK:
            lines.append(f"- {r.provider}: {r.status} ({r.note})")
        elif variant.feature:
            lines.append(f"- {r.provider}: {r.tflops:.0f} TFLOP/s ({r.us:.0f} us), {r.feature} "
                         f"hd{r.head_dim} s{r.seqlen} b{r.batch} h{r.heads}")
        else:
            floor = f", {r.x_floor:.2f}x the HBM floor" if r.x_floor else ""
            lines.append(f"- {r.provider}: {r.us:.0f} us{floor}, batch {r.batch}, seqlen_k "
                         f"{r.seqlen_k}, heads {r.heads_q}/{r.heads_kv}, hd{r.head_dim}")
    return "\n".join(lines)
