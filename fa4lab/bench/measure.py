"""Measuring: every provider on every shape, checked then timed, in one process.

`check_then_time` is the one loop every mode runs (the sweep's `measure_shape`, the decode
mode's `measure_gqa_shape`, the features mode): it never raises for a provider's failure, it
reports "failed", "error", "missing" or "skipped" and goes on, and each mode turns its
`Measurement`s into its own record rows. `run_with_progress` walks the shapes with a progress
bar; `RunGuard` bounds a run in time (Note [run time limits]). `measure_plan` times one
`Plan`'s tiles beside the peers (notebook 07); the kernel is built by
`fa4lab.kernels.launch.compile_plan`, never here.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from fa4lab.bench.check import CheckSlice, check_output, reference_slice
from fa4lab.bench.providers import Provider, resolve_providers, short_error
from fa4lab.bench.records import ERROR, FAILED, MISSING, OK, SKIPPED, Result
from fa4lab.bench.sweep import OURS, PEERS, UNPACKED, BenchShape
from fa4lab.bench.timing import (
    REP_MS,
    WARMUP_MS,
    rotating_call,
    rotation_copies,
    spin_up,
    sync_for,
    time_ms,
)


def make_inputs(shape, device: str, seed: int = 0):
    """q (batch, seqlen_q, heads_q, head_dim), k (batch, seqlen_k, heads_kv, head_dim) and v
    (batch, seqlen_k, heads_kv, head_dim_v), standard normal, in the shape's dtype, for any
    shape with a `.spec` (a `BenchShape`, a `GqaShape`, a features case). The seed depends on
    seqlen_k and head_dim, as it always has."""
    import torch

    spec = shape.spec
    dt = torch.bfloat16 if spec.dtype == "bf16" else torch.float16
    gen = torch.Generator(device=device).manual_seed(seed + spec.seqlen_k + spec.head_dim)
    q_dims = (spec.batch, spec.seqlen_q, spec.heads_q, spec.head_dim)
    k_dims = (spec.batch, spec.seqlen_k, spec.heads_kv, spec.head_dim)
    v_dims = (spec.batch, spec.seqlen_k, spec.heads_kv, spec.head_dim_v)
    return tuple(torch.randn(d, generator=gen, device=device, dtype=torch.float32).to(dt)
                 for d in (q_dims, k_dims, v_dims))


# Note [run time limits]
# A bench run must end, whatever a provider does: a GPU run is often given a fixed slot. Two
# limits, both optional (`RunGuard`): a budget for the whole run, after which no provider step
# starts (the rows left are recorded as "skipped", with the budget in their note), and a
# watchdog over each step (one provider on one shape: prepare, first call with its compile,
# check, timing). A step cannot be interrupted from Python (a kernel that never finishes holds
# the main thread inside a CUDA synchronize), so when a step outlives its limit the watchdog
# thread reports which step it was, calls `on_timeout` (the command saves the record of what
# was measured so far, with the stuck step as an error) and ends the process with exit code
# TIMEOUT_EXIT. So a run takes at most budget + one step's limit, plus the start-up.
TIMEOUT_EXIT = 3


class RunGuard:
    """The time limits of a run (Note [run time limits]). budget_s: seconds from the guard's
    creation after which no step starts (None: no budget); step_s: seconds one step may take
    before the watchdog ends the process (None: no watchdog). on_timeout(label, seconds) runs
    on the watchdog thread before the exit; `exit` is `os._exit` (tests pass their own)."""

    def __init__(self, *, budget_s: float | None = None, step_s: float | None = None,
                 on_timeout: Callable[[str, float], None] | None = None,
                 exit: Callable[[int], None] = os._exit, poll_s: float = 0.5):
        self.budget_s, self.step_s, self.poll_s = budget_s, step_s, poll_s
        self.on_timeout, self._exit = on_timeout, exit
        self.started = time.monotonic()
        self._step: tuple[str, float] | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def spent(self) -> bool:
        """True once the run's budget is spent: no further step starts."""
        return self.budget_s is not None and time.monotonic() - self.started >= self.budget_s

    def skip_note(self) -> str:
        return (f"not run: the run's time budget of {self.budget_s:g} s was spent "
                f"(Note [run time limits])")

    @contextmanager
    def step(self, label: str):
        """Watch one step: if it lasts longer than step_s, report it and end the process."""
        if self.step_s is None:
            yield
            return
        with self._lock:
            self._step = (label, time.monotonic())
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="bench-watchdog",
                                                daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._step = None

    def _watch(self) -> None:
        while True:
            time.sleep(self.poll_s)
            with self._lock:
                step = self._step
            if step is None or time.monotonic() - step[1] < self.step_s:
                continue
            label, seconds = step[0], time.monotonic() - step[1]
            print(f"\nfa4lab bench: {label} is still running after {seconds:.0f} s (limit "
                  f"{self.step_s:g} s per step): ending the run (Note [run time limits]).",
                  file=sys.stderr, flush=True)
            try:
                if self.on_timeout:
                    self.on_timeout(label, seconds)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                self._exit(TIMEOUT_EXIT)
            return


def time_limits(guard: RunGuard | None) -> dict:
    """A record's "time_limits": the guard's budget and step limit (None: no such limit)."""
    return {"budget_s": guard.budget_s if guard else None,
            "step_timeout_s": guard.step_s if guard else None}


@dataclass(frozen=True)
class Measurement:
    """What `check_then_time` learns about one provider on one shape. Each mode turns it into
    its own row (`Result`, `DecodeResult`, `FeatureResult`): `checked()` gives the fields they
    share, `ms` the median time (None unless status is ok)."""

    provider: str
    status: str
    ms: float | None = None
    max_err: float | None = None      # max |out - reference| on the checked slice
    tol: float | None = None          # the tolerance it was held to
    first_call_s: float | None = None  # wall time of the first call (compile included)
    note: str = ""

    def checked(self) -> dict:
        """status, max_err, tol, first_call_s and note: the fields every result row has."""
        return {"status": self.status, "max_err": self.max_err, "tol": self.tol,
                "first_call_s": self.first_call_s, "note": self.note}


def check_then_time(shape, providers: Sequence[Provider], *,
                    inputs: Callable[[], tuple] | None = None,
                    check: Callable[..., CheckSlice] | None = None,
                    device: str = "cuda", warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS,
                    guard: RunGuard | None = None) -> Iterator[Measurement]:
    """Check, then time, every provider on one shape (anything with `.spec` and `.dtype`);
    yields one `Measurement` per provider as it is done. Never raises for a provider's failure.

    inputs() makes (q, k, v) (default: `make_inputs(shape, device)`); check(q, k, v) makes the
    reference of the checked slice (default: `reference_slice(q, k, v, shape)`). Each runner is
    called as runner(q, k, v, causal, softmax_scale) with the provider's prepared copies; its
    first call is the check (and any compile), then it is timed on rotating copies (Note [cold
    L2]). fa4lab's providers run last: if a kernel ever poisons the CUDA context, the peers of
    this shape are already measured (everything after it reports the error, the run ends)."""
    sync = sync_for(device)
    label = shape.label() if hasattr(shape, "label") else str(shape)
    if guard and guard.spent():               # not even the inputs and the reference
        for p in providers:
            yield (Measurement(p.name, MISSING, note=p.why_missing) if p.missing else
                   Measurement(p.name, SKIPPED, note=guard.skip_note()))
        return
    try:
        with guard.step(f"inputs and reference of {label}") if guard else _nothing():
            q, k, v = inputs() if inputs else make_inputs(shape, device)
            ref = check(q, k, v) if check else reference_slice(q, k, v, shape)
    except Exception as err:
        for p in providers:
            yield (Measurement(p.name, MISSING, note=p.why_missing) if p.missing else
                   Measurement(p.name, ERROR, note=f"inputs/reference: {type(err).__name__}: "
                                                   f"{short_error(err)}"))
        return
    copies = [(q, k, v)] + [tuple(t.clone() for t in (q, k, v))
                            for _ in range(rotation_copies(shape) - 1)]
    spec = shape.spec
    causal, scale = spec.causal, spec.scale
    for p in sorted(providers, key=lambda p: p.name in (OURS, UNPACKED)):
        if p.missing:
            yield Measurement(p.name, MISSING, note=p.why_missing)
            continue
        if guard and guard.spent():
            yield Measurement(p.name, SKIPPED, note=guard.skip_note())
            continue
        try:
            with guard.step(f"{p.name} on {label}") if guard else _nothing():
                yield _check_then_time_one(p, copies, ref, shape, causal, scale, sync, device,
                                           warmup_ms, rep_ms)
        except Exception as err:
            yield Measurement(p.name, ERROR, note=f"{type(err).__name__}: {short_error(err)}")
    del copies, q, k, v


@contextmanager
def _nothing():
    yield


def _check_then_time_one(p: Provider, copies, ref: CheckSlice, shape, causal, scale, sync,
                         device, warmup_ms, rep_ms) -> Measurement:
    mine = [p.prepare(*c) for c in copies] if p.prepare else copies
    sync()
    t0 = time.perf_counter()
    out = p.runner(*mine[0], causal, scale)
    sync()
    first = time.perf_counter() - t0
    passed, err, note = check_output(out, ref, shape)
    del out
    if not passed:
        return Measurement(p.name, FAILED, max_err=_finite(err), tol=ref.tol,
                           first_call_s=first, note=note)
    call = rotating_call(p.runner, mine, causal, scale)
    if device == "cuda":
        spin_up(call, sync)
    ms = time_ms(call, warmup_ms=warmup_ms, rep_ms=rep_ms, device=device)
    return Measurement(p.name, OK, ms=ms, max_err=err, tol=ref.tol, first_call_s=first)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def measure_shape(shape: BenchShape, providers: Sequence[Provider], *, device: str = "cuda",
                  warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS,
                  on_result: Callable[[Result], None] | None = None,
                  guard: RunGuard | None = None) -> list[Result]:
    """Check, then time, every provider on one sweep shape (`check_then_time`)."""
    results = []
    for m in check_then_time(shape, providers, device=device, warmup_ms=warmup_ms,
                             rep_ms=rep_ms, guard=guard):
        ok = m.status == OK
        r = Result.for_shape(m.provider, shape, ms=m.ms,
                             tflops=shape.flops / (m.ms * 1e-3) / 1e12 if ok else None,
                             **m.checked())
        results.append(r)
        if on_result:
            on_result(r)
    return results


def run_with_progress(shapes: Sequence, n_providers: int,
                      measure: Callable[[object, Callable], list], *, desc: str = "bench",
                      device: str = "cuda", progress: bool = True) -> list:
    """measure(shape, on_result) for every shape, in one process, with a tqdm bar over
    (shape, provider) on stderr; a row that is not ok (nor missing) is printed as it comes."""
    from tqdm.auto import tqdm

    results: list = []
    with tqdm(total=len(shapes) * n_providers, desc=desc, unit="run", disable=not progress,
              file=sys.stderr, dynamic_ncols=True) as bar:
        for shape in shapes:
            label = shape.label()
            bar.set_postfix_str(label)

            def tick(r, label=label):
                bar.update(1)
                if r.status not in (OK, MISSING):
                    bar.write(f"{r.provider} {label}: {r.status}: {r.note}", file=sys.stderr)

            results += measure(shape, tick)
            if device == "cuda":
                import torch

                torch.cuda.empty_cache()
    return results


def run_sweep(shapes: Sequence[BenchShape], providers: Sequence[Provider], *,
              device: str = "cuda", warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS,
              progress: bool = True, guard: RunGuard | None = None) -> list[Result]:
    """Every provider on every shape, in one process, with a tqdm bar over (shape, provider)."""
    return run_with_progress(
        shapes, len(providers),
        lambda shape, tick: measure_shape(shape, providers, device=device, warmup_ms=warmup_ms,
                                          rep_ms=rep_ms, on_result=tick, guard=guard),
        desc="bench", device=device, progress=progress)


# ---- one plan: simulated (any machine) and measured (GPU) -------------------------------------
def simulated_tflops(shapes: Iterable[BenchShape], arch: str = "sm90",
                     **overrides) -> dict[tuple[int, bool, int], float]:
    """The planner's predicted TFLOP/s for each shape (`fa4lab.plan.throughput.predict` of
    `plan_forward(shape.spec, arch, **overrides)`), keyed like Result.key."""
    from fa4lab.plan import plan_forward
    from fa4lab.plan.throughput import predict

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
