"""Measuring: every provider on every shape, checked then timed, in one process.

`measure_shape` never raises for a provider's failure: it reports "failed", "error" or
"missing" and goes on. `measure_plan` times one `Plan`'s tiles beside the peers (notebook 07);
the kernel is built by `fa4lab.kernels.launch.compile_plan`, never here.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from fa4lab.bench.check import check_output, reference_slice
from fa4lab.bench.providers import Provider, resolve_providers, short_error
from fa4lab.bench.records import ERROR, FAILED, MISSING, OK, Result
from fa4lab.bench.sweep import OURS, PEERS, BenchShape
from fa4lab.bench.timing import (
    REP_MS,
    WARMUP_MS,
    rotating_call,
    rotation_copies,
    spin_up,
    sync_for,
    time_ms,
)


def make_inputs(shape: BenchShape, device: str, seed: int = 0):
    """q, k, v (batch, seqlen, heads, head_dim), standard normal, in the shape's dtype."""
    import torch

    dt = torch.bfloat16 if shape.dtype == "bf16" else torch.float16
    gen = torch.Generator(device=device).manual_seed(seed + shape.seqlen + shape.head_dim)
    dims = (shape.batch, shape.seqlen, shape.heads, shape.head_dim)
    return tuple(torch.randn(dims, generator=gen, device=device, dtype=torch.float32).to(dt)
                 for _ in range(3))


def measure_shape(shape: BenchShape, providers: Sequence[Provider], *, device: str = "cuda",
                  warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS,
                  on_result: Callable[[Result], None] | None = None) -> list[Result]:
    """Check, then time, every provider on one shape. Never raises for a provider's failure."""
    results = []

    def done(r: Result):
        results.append(r)
        if on_result:
            on_result(r)

    sync = sync_for(device)
    try:
        q, k, v = make_inputs(shape, device)
        check = reference_slice(q, k, v, shape)
    except Exception as err:
        for p in providers:
            if p.missing:
                done(Result.for_shape(p.name, shape, status=MISSING, note=p.why_missing))
            else:
                done(Result.for_shape(p.name, shape, status=ERROR,
                                      note=f"inputs/reference: {type(err).__name__}: "
                                           f"{short_error(err)}"))
        return results
    copies = [(q, k, v)] + [tuple(t.clone() for t in (q, k, v))
                            for _ in range(rotation_copies(shape) - 1)]
    scale = shape.spec.scale
    # fa4lab last: if its kernel ever poisons the CUDA context, the peers of this shape are
    # already measured (everything after it then reports the error and the sweep still ends).
    for p in sorted(providers, key=lambda p: p.name == OURS):
        if p.missing:
            done(Result.for_shape(p.name, shape, status=MISSING, note=p.why_missing))
            continue
        try:
            mine = [p.prepare(*c) for c in copies] if p.prepare else copies
            sync()
            t0 = time.perf_counter()
            out = p.runner(*mine[0], shape.causal, scale)
            sync()
            first = time.perf_counter() - t0
            passed, err, note = check_output(out, check, shape)
            del out
            if not passed:
                done(Result.for_shape(p.name, shape, status=FAILED, max_err=_finite(err),
                                      tol=check.tol, first_call_s=first, note=note))
                continue
            call = rotating_call(p.runner, mine, shape.causal, scale)
            if device == "cuda":
                spin_up(call, sync)
            ms = time_ms(call, warmup_ms=warmup_ms, rep_ms=rep_ms, device=device)
            done(Result.for_shape(p.name, shape, status=OK, ms=ms,
                                  tflops=shape.flops / (ms * 1e-3) / 1e12, max_err=err,
                                  tol=check.tol, first_call_s=first))
        except Exception as err:
            done(Result.for_shape(p.name, shape, status=ERROR,
                                  note=f"{type(err).__name__}: {short_error(err)}"))
    return results


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _tick(bar, r: Result) -> None:
    bar.update(1)
    if r.status not in (OK, MISSING):
        mask = "causal" if r.causal else "full"
        bar.write(f"{r.provider} hd{r.head_dim} {mask} s{r.seqlen}: {r.status}: {r.note}",
                  file=sys.stderr)


def run_sweep(shapes: Sequence[BenchShape], providers: Sequence[Provider], *,
              device: str = "cuda", warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS,
              progress: bool = True) -> list[Result]:
    """Every provider on every shape, in one process, with a tqdm bar over (shape, provider)."""
    from tqdm.auto import tqdm

    results: list[Result] = []
    with tqdm(total=len(shapes) * len(providers), desc="bench", unit="run",
              disable=not progress, file=sys.stderr, dynamic_ncols=True) as bar:
        for shape in shapes:
            bar.set_postfix_str(shape.label())
            results += measure_shape(shape, providers, device=device, warmup_ms=warmup_ms,
                                     rep_ms=rep_ms, on_result=lambda r: _tick(bar, r))
            if device == "cuda":
                import torch

                torch.cuda.empty_cache()
    return results


# ---- one plan: simulated (any machine) and measured (GPU) -------------------------------------
def simulated_tflops(shapes: Iterable[BenchShape], arch: str = "sm90",
                     **overrides) -> dict[tuple[int, bool, int], float]:
    """The planner's predicted TFLOP/s for each shape (`fa4lab.plan.simulate.predict` of
    `plan_forward(shape.spec, arch, **overrides)`), keyed like Result.key."""
    from fa4lab.plan import plan_forward
    from fa4lab.plan.simulate import predict

    return {s.key: predict(plan_forward(s.spec, arch, **overrides)).tflops for s in shapes}


@dataclass
class PlanMeasurement:
    """What notebook 07's GPU widget shows: compile time, and every provider on one shape."""

    shape: BenchShape
    compile_s: float | None
    results: list[Result]
    error: str = ""


def measure_plan(plan, peers: Sequence[str] = PEERS, *, warmup_ms: float = WARMUP_MS,
                 rep_ms: float = REP_MS) -> PlanMeasurement:
    """Compile `plan` (an sm90/sm100 Plan of a standard-sweep spec), check it against the
    reference and time it beside `peers` on the plan's shape. Needs a CUDA GPU of the plan's
    arch; a compile failure is reported in `.error` with fa4lab's result as 'error'."""
    spec = plan.spec
    shape = BenchShape(spec.head_dim, spec.seqlen_q, spec.causal, spec.batch, spec.heads_q,
                       spec.dtype)
    if spec.seqlen_q != spec.seqlen_k or spec.heads_q != spec.heads_kv:
        raise ValueError("measure_plan takes the sweep's shapes: seqlen_q == seqlen_k, no GQA")
    others = resolve_providers(peers, include_ours=False)
    try:
        from fa4lab.kernels.launch import compile_plan

        example = make_inputs(shape, "cuda")
        runner, compile_s = compile_plan(plan, example)
        del example
        ours = Provider(OURS, runner)
    except Exception as err:
        note = f"compile: {type(err).__name__}: {short_error(err)}"
        results = measure_shape(shape, others, warmup_ms=warmup_ms, rep_ms=rep_ms)
        return PlanMeasurement(shape, None,
                               [Result.for_shape(OURS, shape, status=ERROR, note=note)] + results,
                               note)
    results = measure_shape(shape, [ours] + others, warmup_ms=warmup_ms, rep_ms=rep_ms)
    return PlanMeasurement(shape, compile_s, results)
