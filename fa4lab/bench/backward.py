"""`fa4lab bench --backward`: the attention backward of fa4lab beside upstream FA4 and PyTorch.

The cases are the backward's anchor: bf16, 16k tokens and hidden 2048 at every point (batch =
16384 / seqlen, heads = 2048 / head_dim, the sweep's rule: `fa4lab.bench.sweep.sweep`), head_dim
64 and 128, seqlen 2048, 8192 and 16384, causal and not (`--quick`: hd128, seqlen 2048 and
8192). Providers (BACKWARD_LABELS), in one process:

    fa4lab         fa4lab.attention's autograd: what model code gets (the headline row)
    fa4lab-kernel  fa4lab.kernels.launch_backward.backward from the forward's saved out and lse
    fa4            upstream FA4's autograd (flash_attn.cute.interface.flash_attn_func)
    sdpa-cudnn     PyTorch SDPA's autograd, forward under sdpa_kernel(CUDNN_ATTENTION)
    sdpa-flash     the same under sdpa_kernel(FLASH_ATTENTION)

Only the backward is timed (Note [what the backward bench times]). Each provider's gradients are
checked once per case against the float64 reference before it is timed, by FA4's rule per
gradient (`fa4lab.acceptance.gradient_violations`; Note [checking the gradients]); a provider
that fails is "failed" and not timed, one that raises is "error", one that cannot run here is
"missing" with the reason. TFLOP/s counts the backward as 2.5 x the forward's FLOPs
(`backward_flops`). The table adds fa4lab's ratio to each peer (`format_backward_table`).

    fa4lab bench --backward                 # record saved in benchmarks/
    fa4lab bench --backward --quick --peers fa4
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any

from fa4lab.bench.check import CHECK_HEADS
from fa4lab.bench.measure import (
    Measurement,
    RunGuard,
    make_inputs,
    run_with_progress,
    time_limits,
)
from fa4lab.bench.providers import provider_lines, resolve_providers, short_error
from fa4lab.bench.records import (
    BACKWARD,
    ERROR,
    FAILED,
    MISSING,
    OK,
    SKIPPED,
    Result,
    record_header,
    validate_record,
)
from fa4lab.bench.sweep import OURS, BenchShape, sweep
from fa4lab.bench.table import format_table, geomean_ratios, ratio_table
from fa4lab.bench.timing import (
    REP_MS,
    WARMUP_MS,
    rotation_copies,
    spin_up,
    sync_for,
    time_ms,
    timer_name,
    timing_config,
)

# ---- the cases ---------------------------------------------------------------------------------
BACKWARD_HEAD_DIMS = (64, 128)
BACKWARD_SEQLENS = (2048, 8192, 16384)
QUICK_HEAD_DIMS = (128,)
QUICK_SEQLENS = (2048, 8192)
# A backward computes five matmuls of the forward's size where the forward computes two (dQ,
# dK, dV, dP and the recomputed S): 2.5 x its FLOPs, upstream's count and this lab's.
BACKWARD_FLOPS_FACTOR = 2.5
FLOPS_RULE = (f"{BACKWARD_FLOPS_FACTOR:g} x the forward's FLOPs (AttentionSpec.flops: 4 x "
              f"batch x heads x seqlen^2 x head_dim, halved for causal)")

# ---- the providers -----------------------------------------------------------------------------
KERNEL = "fa4lab-kernel"
FA4 = "fa4"
BACKWARD_PEERS = (KERNEL, FA4, "sdpa-cudnn", "sdpa-flash")
BACKWARD_PROVIDERS = (OURS,) + BACKWARD_PEERS
BACKWARD_LABELS = {
    OURS: "fa4lab.attention's autograd: torch.autograd.grad of its out (the backward op "
          "reads the forward's saved out and lse and runs the backward kernel: Note [the "
          "backward on the GPU] in fa4lab.backward)",
    KERNEL: "fa4lab.kernels.launch_backward.backward from the forward's saved out and lse "
            "(its torch pre- and postprocessing included, no forward)",
    FA4: "upstream FA4: torch.autograd.grad of flash_attn_func's out (flash-attn-4)",
    "sdpa-cudnn": "PyTorch SDPA's autograd, forward under sdpa_kernel(CUDNN_ATTENTION)",
    "sdpa-flash": "PyTorch SDPA's autograd, forward under sdpa_kernel(FLASH_ATTENTION)",
}


def backward_cases(head_dims: Sequence[int] = BACKWARD_HEAD_DIMS,
                   seqlens: Sequence[int] = BACKWARD_SEQLENS,
                   causal: Sequence[bool] = (False, True), **shape_kw) -> list[BenchShape]:
    """The sweep's shapes at these points (`sweep`: batch and heads from the total tokens and
    the hidden size; its errors for values that do not divide them)."""
    return sweep(head_dims, seqlens, causal, **shape_kw)


def backward_flops(shape: BenchShape) -> float:
    """The backward's FLOPs: BACKWARD_FLOPS_FACTOR x the forward's (`BenchShape.flops`)."""
    return BACKWARD_FLOPS_FACTOR * shape.flops


# Note [what the backward bench times]
# Per case and provider, outside the timed region: the inputs q, k, v and dout (standard normal,
# seeded), then the provider's forward, once, on its own copies that require grad (SDPA's in its
# (batch, heads, seqlen, head_dim) layout, Note [SDPA layout] in fa4lab.bench.providers), its out
# kept with the autograd graph, and dout laid out as out is (so no provider copies it into the
# layout it wants). Timed: the backward alone, `torch.autograd.grad(out, leaves, dout,
# retain_graph=True)` (fa4lab, fa4, sdpa-*), or `launch_backward.backward(q, k, v, out, dout,
# lse)` from the forward kernel's saved out and lse (fa4lab-kernel), with the bench's timer
# (`fa4lab.bench.timing.time_ms`) after the spin-up. fa4lab's headline row is what model code
# gets from `fa4lab.attention`, whose backward op reads the forward's saved out and lse and
# runs the kernel; fa4lab-kernel is the kernel and its torch pre- and postprocessing alone,
# called directly (the two differ by the autograd machinery's own cost).
Setup = Callable[..., tuple[Callable[[], Any], Callable]]


@dataclass(frozen=True)
class BackwardProvider:
    """A name and its setup, or why it is missing. setup(q, k, v, dout, causal, scale) runs the
    forward once (q, k, v, dout (batch, seqlen, heads, head_dim)) and gives (call, to_bshd):
    call() runs the backward and returns (dq, dk, dv); to_bshd(g) lays one of them out as
    (batch, seqlen, heads, head_dim) (a view) for the check, outside the timed region."""

    name: str
    setup: Setup | None
    why_missing: str = ""

    @property
    def missing(self) -> bool:
        return self.setup is None


def _same(g):
    return g


def _to_bshd(g):
    return g.transpose(1, 2)


def autograd_setup(forward, prepare: Callable | None = None) -> Setup:
    """The backward of a forward bench runner (`fa4lab.bench.providers`: runner(q, k, v,
    causal, scale) -> out (batch, seqlen, heads, head_dim), maybe a view) through autograd;
    `prepare` (the runner's layout, `to_bhsd`) makes the leaves, once."""
    def setup(q, k, v, dout, causal, scale):
        import torch

        leaves = prepare(q, k, v) if prepare else tuple(t.clone() for t in (q, k, v))
        leaves = tuple(t.detach().requires_grad_() for t in leaves)
        out = forward(*leaves, causal, scale)
        grad_out = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype,
                                       device=out.device).copy_(dout)

        def call():
            return torch.autograd.grad(out, leaves, grad_out, retain_graph=True)

        return call, _to_bshd if prepare else _same

    return setup


def kernel_setup(arch: str) -> Setup:
    """fa4lab's backward kernel from its forward kernel's saved out and lse (fa4lab-kernel)."""
    def setup(q, k, v, dout, causal, scale):
        from fa4lab.call import check_call
        from fa4lab.kernels.launch_backward import backward, saved_forward

        checked = check_call(q, k, v, causal=causal, softmax_scale=scale, arch=arch)
        out, lse = saved_forward(checked, arch)

        def call():
            return backward(checked, out, dout, lse, arch=arch)[:3]

        return call, _same

    return setup


def backward_providers(names: Sequence[str], *, arch: str | None) -> list[BackwardProvider]:
    """The providers of `names` (fa4lab always, first), each with its setup or why it is
    missing: the forward bench's runners (`resolve_providers`: FA4 not installed, no GPU, no
    cuDNN) under `autograd_setup`; fa4lab's two rows where `arch` has a backward kernel (None:
    not known here, as on a CPU describing a GPU run: they are listed as available)."""
    unknown = [n for n in names if n not in BACKWARD_PROVIDERS]
    if unknown:
        raise ValueError(f"--peers: unknown {unknown} for --backward; choose from "
                         f"{','.join(BACKWARD_PEERS)}")
    names = [n for n in BACKWARD_PROVIDERS if n == OURS or n in names]
    forward = {p.name: p for p in resolve_providers([n for n in names if n not in (OURS, KERNEL)],
                                                    include_ours=True, arch=arch)}
    lacks = "" if arch is None else no_backward_kernel(arch)
    out = []
    for name in names:
        if name in (OURS, KERNEL) and lacks:
            out.append(BackwardProvider(name, None, lacks))
        elif name == KERNEL:
            out.append(BackwardProvider(name, kernel_setup(arch or "sm90")))
        elif forward[name].missing:
            out.append(BackwardProvider(name, None, forward[name].why_missing))
        else:
            p = forward[name]
            out.append(BackwardProvider(name, autograd_setup(p.runner, p.prepare)))
    return out


def no_backward_kernel(arch: str | None) -> str:
    """Why fa4lab has no backward kernel for `arch` ('' where it has one)."""
    from fa4lab.kernels.launch_backward import ARCHS

    if arch in ARCHS:
        return ""
    return (f"no fa4lab backward kernel for {arch or 'this GPU'} (it runs on "
            f"{', '.join(ARCHS)} so far)")


# ---- the check ---------------------------------------------------------------------------------
# Note [checking the gradients]
# Once per case, before any provider runs, the float64 gradients of the checked slice (batch 0,
# KV heads 0..1 and the query heads that read them, every row: the slice of Note [the check
# before timing] in fa4lab.bench.check) come from `fa4lab.reference_backward` and the yardstick
# from `fa4lab.acceptance.same_dtype_gradients` (autograd of PyTorch's attention in the inputs'
# dtype), both on that slice alone: a slice's dQ, dK and dV depend on its own q, k, v and dout
# only. Each provider's first backward is then held to FA4's rule per gradient,
# `gradient_violations`: finite, and a max error at most 2 x the yardstick's + the gradient's
# floor. The row records the gradient nearest its tolerance (max_err, tol).
@dataclass
class GradientCheck:
    """The checked slice's float64 gradients (`Gradients`) and the yardstick's."""

    ref: Any
    yardstick: Any
    heads_q: int
    heads_kv: int


def gradient_reference(q, k, v, dout, shape) -> GradientCheck:
    """The reference and the yardstick of the checked slice (Note [checking the gradients])."""
    from fa4lab.acceptance import same_dtype_gradients
    from fa4lab.reference_backward import attention_backward_reference

    spec = shape.spec
    n_kv = min(CHECK_HEADS, spec.heads_kv)
    n_q = n_kv * (spec.heads_q // spec.heads_kv)
    qs, ks, vs, dos = q[:1, :, :n_q], k[:1, :, :n_kv], v[:1, :, :n_kv], dout[:1, :, :n_q]
    opts = dict(causal=spec.causal, softmax_scale=spec.scale)
    ref = attention_backward_reference(qs, ks, vs, dos, finite=False, **opts)
    pt = same_dtype_gradients(qs, ks, vs, dos, **opts)
    return GradientCheck(ref, pt, n_q, n_kv)


def check_gradients(grads, check: GradientCheck) -> tuple[bool, float | None, float | None, str]:
    """(passed, max_err, tol, note) of a provider's (dq, dk, dv), full size, (batch, seqlen,
    heads, head_dim): `gradient_violations` on the checked slice."""
    from fa4lab.acceptance import gradient_error, gradient_violations

    heads = (check.heads_q, check.heads_kv, check.heads_kv)
    sliced = tuple(g[:1, :, :h] for g, h in zip(grads, heads))
    problems = gradient_violations(sliced, check.ref, check.yardstick)
    worst = None
    for name, g, r, p in zip(("dq", "dk", "dv"), sliced, check.ref, check.yardstick):
        if g.shape == p.shape and bool(g.isfinite().all()):
            e = gradient_error(name, g, r, p)
            if worst is None or e.err / e.tol > worst.err / worst.tol:
                worst = e
    err, tol = (worst.err, worst.tol) if worst else (None, None)
    return not problems, err, tol, "; ".join(problems)


# ---- measuring ---------------------------------------------------------------------------------
def backward_inputs(shape, device: str, seed: int = 0):
    """q, k, v (`make_inputs`) and dout (batch, seqlen_q, heads_q, head_dim_v), standard normal
    in the shape's dtype, its own seed."""
    import torch

    q, k, v = make_inputs(shape, device, seed)
    gen = torch.Generator(device=device).manual_seed(seed + 1 + shape.spec.seqlen_q)
    dout = torch.randn(q.shape[:3] + v.shape[3:], generator=gen, device=device,
                       dtype=torch.float32).to(q.dtype)
    return q, k, v, dout


def measure_case(shape: BenchShape, providers: Sequence[BackwardProvider], *,
                 device: str = "cuda", warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS,
                 guard: RunGuard | None = None,
                 on_result: Callable[[Result], None] | None = None) -> list[Result]:
    """Every provider on one case: missing as missing, the others set up, checked, then timed
    (Note [what the backward bench times]); fa4lab's rows last (if a kernel ever poisons the
    CUDA context, the peers are measured). Never raises for a provider's failure."""
    flops = backward_flops(shape)
    results: list[Result] = []

    def done(m: Measurement):
        ok = m.status == OK
        r = Result.for_shape(m.provider, shape, ms=m.ms,
                             tflops=flops / (m.ms * 1e-3) / 1e12 if ok else None, **m.checked())
        results.append(r)
        if on_result:
            on_result(r)

    def step(what: str):
        return guard.step(f"{what} on {shape.label()} (backward)") if guard else nullcontext()

    order = sorted(providers, key=lambda p: p.name.startswith(OURS))
    if guard and guard.spent():
        for p in order:
            done(Measurement(p.name, MISSING, note=p.why_missing) if p.missing else
                 Measurement(p.name, SKIPPED, note=guard.skip_note()))
        return results
    try:
        with step("inputs and reference"):
            copies = [backward_inputs(shape, device)]
            check = gradient_reference(*copies[0], shape)
            copies += [tuple(t.clone() for t in copies[0])
                       for _ in range(rotation_copies(shape) - 1)]
    except Exception as err:
        for p in order:
            done(Measurement(p.name, MISSING, note=p.why_missing) if p.missing else
                 Measurement(p.name, ERROR, note=f"inputs/reference: {type(err).__name__}: "
                                                 f"{short_error(err)}"))
        return results
    for p in order:
        if p.missing:
            done(Measurement(p.name, MISSING, note=p.why_missing))
        elif guard and guard.spent():
            done(Measurement(p.name, SKIPPED, note=guard.skip_note()))
        else:
            try:
                with step(p.name):
                    done(_check_then_time(p, copies, check, shape, device, warmup_ms, rep_ms))
            except Exception as err:
                done(Measurement(p.name, ERROR, note=f"{type(err).__name__}: "
                                                     f"{short_error(err)}"))
    return results


def _check_then_time(p: BackwardProvider, copies, check: GradientCheck, shape, device,
                     warmup_ms, rep_ms) -> Measurement:
    sync = sync_for(device)
    spec = shape.spec
    sync()
    t0 = time.perf_counter()
    call, to_bshd = p.setup(*copies[0], spec.causal, spec.scale)
    grads = call()
    sync()
    first = time.perf_counter() - t0
    passed, err, tol, note = check_gradients(tuple(to_bshd(g) for g in grads), check)
    del grads
    if not passed:
        return Measurement(p.name, FAILED, max_err=_finite(err), tol=tol, first_call_s=first,
                           note=note)
    calls = [call] + [p.setup(*c, spec.causal, spec.scale)[0] for c in copies[1:]]
    turns = itertools.cycle(calls)

    def timed():
        return next(turns)()

    if device == "cuda":
        spin_up(timed, sync)
    ms = time_ms(timed, warmup_ms=warmup_ms, rep_ms=rep_ms, device=device)
    return Measurement(p.name, OK, ms=ms, max_err=err, tol=tol, first_call_s=first)


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def run_backward(shapes: Sequence[BenchShape], providers: Sequence[BackwardProvider], *,
                 device: str = "cuda", warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS,
                 progress: bool = True, guard: RunGuard | None = None,
                 on_result: Callable[[Result], None] | None = None) -> list[Result]:
    """Every provider on every case, in one process, with a tqdm bar over (case, provider)."""
    def measure(shape, tick):
        def both(r):
            tick(r)
            if on_result:
                on_result(r)
        return measure_case(shape, providers, device=device, warmup_ms=warmup_ms,
                            rep_ms=rep_ms, guard=guard, on_result=both)

    return run_with_progress(shapes, len(providers), measure, desc="bench --backward",
                             device=device, progress=progress)


# ---- record, table, description ----------------------------------------------------------------
def backward_config(shapes: Sequence[BenchShape], providers: Sequence[str], *,
                    guard: RunGuard | None = None, warmup_ms: float = WARMUP_MS,
                    rep_ms: float = REP_MS, wall_s: float | None = None) -> dict:
    """The record's config: the sizes, each case's FLOPs, the providers, the rules."""
    first = shapes[0] if shapes else None
    config = {
        "total_tokens": first.batch * first.seqlen if first else None,
        "hidden": first.heads * first.head_dim if first else None,
        "dtype": first.dtype if first else None,
        "cases": {s.label(): {"flops": backward_flops(s)} for s in shapes},
        "providers": {p: BACKWARD_LABELS[p] for p in BACKWARD_PROVIDERS if p in providers},
        "headline": (f"{OURS} is fa4lab.attention's autograd, what model code gets; "
                     f"{KERNEL} is the backward kernel alone"),
        "flops_rule": FLOPS_RULE,
        "timed": ("the backward only: the forward runs once before timing, its out (and the "
                  "autograd graph) kept; each timed call is torch.autograd.grad(out, (q, k, v), "
                  f"dout, retain_graph=True), or launch_backward.backward for {KERNEL}"),
        "check": (f"batch 0, heads 0..{CHECK_HEADS - 1}, every row: dq, dk, dv against "
                  f"the float64 fa4lab.reference_backward, tol = 2 x the error of "
                  f"same_dtype_gradients + gradient_atol (fa4lab.acceptance."
                  f"gradient_violations)"),
        **timing_config(warmup_ms, rep_ms),
        "time_limits": time_limits(guard),
    }
    if wall_s is not None:
        config["wall_s"] = round(wall_s, 1)
    return config


def make_backward_record(results: Sequence[Result], *, gpu_name: str, arch: str | None,
                         command: str, config: dict, label: str | None = None,
                         notes: str = "") -> dict:
    """A validated "backward" record of `results`; its notes say how TFLOP/s are counted."""
    said = f"TFLOP/s counts the backward as {FLOPS_RULE}."
    record = record_header(BACKWARD, gpu_name=gpu_name, arch=arch, command=command,
                           config=config, label=label or f"fa4lab backward on {gpu_name}",
                           notes=" ".join(x for x in (said, notes) if x))
    record["results"] = [asdict(r) for r in results]
    return validate_record(record)


def format_backward_table(results: Sequence[Result]) -> str:
    """The forward's table (`format_table`: TFLOP/s per provider, fa4lab/peer ratios and their
    geometric means) of the backward's rows, then fa4lab-kernel's geometric means."""
    lines = [format_table(results), "",
             f"TFLOP/s: the backward as {FLOPS_RULE}. {OURS}: fa4lab.attention's autograd "
             f"(its backward op reads the forward's saved out and lse); {KERNEL}: the "
             f"backward kernel called directly, from the saved out and lse."]
    rows = ratio_table(results, ours=KERNEL)
    means = {p: m for p, m in geomean_ratios(rows).items() if p != OURS}
    if any(means.values()):
        lines.append(f"{KERNEL}: geometric mean over shapes measured by both: " + ", ".join(
            f"{KERNEL}/{p} {m:.2f}" for p, m in means.items() if m))
    return "\n".join(lines)


def describe_backward_run(shapes: Sequence[BenchShape],
                          providers: Sequence[BackwardProvider]) -> str:
    """What the mode runs: each case with its backward FLOPs, the providers and their state."""
    s = shapes[0]
    lines = [f"{len(shapes)} cases x {len(providers)} providers, the backward only ({s.dtype}; "
             f"batch * seqlen = {s.batch * s.seqlen}, heads * head_dim = "
             f"{s.heads * s.head_dim}):"]
    lines += [f"  {x.label()}  {backward_flops(x) / 1e12:.2f} TFLOP" for x in shapes]
    lines += provider_lines(providers, BACKWARD_LABELS, 13)
    lines.append(f"TFLOP/s: {FLOPS_RULE}; timer: {timer_name()}")
    return "\n".join(lines)
