"""`fa4lab bench --host-overhead`: the host time of one call, per provider, in one process.

At short shapes a call's GPU time is smaller than the host work that issues it, so that work
decides the throughput a model sees. This measures it on tiny shapes (`host_cases`), each
provider as its user calls it (See Note [host overhead]):

    dense         `HOST_SHAPE` (batch 1, seqlen 128, 1 head, head_dim 128, bf16): fa4lab.attention,
                  upstream FA4's flash_attn_func, PyTorch SDPA
    varlen b1/32/256  a packed varlen batch of HOST_BATCHES sequences of HOST_TOKENS tokens,
                  causal: fa4lab.attention_varlen (its default call first, then
                  check_indices=True and False) beside upstream FA4's flash_attn_varlen_func
    paged b1/32/256   a paged decode batch, one query per sequence over HOST_KEYS keys in
                  pages of HOST_PAGE_SIZE: the same four calls with seqused_k and page_table

    fa4lab bench --host-overhead                 # table, record saved in benchmarks/
    fa4lab bench --host-overhead --calls 1000 --repeats 7

`measure_host_overhead` takes any no-argument callables and a device string, so it runs (and
is tested) on a CPU; the command itself needs a CUDA GPU.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

from fa4lab.bench.check import check_output, reference_slice
from fa4lab.bench.providers import fa4_function, short_error, to_bhsd
from fa4lab.bench.records import (
    ERROR,
    FAILED,
    HOST_OVERHEAD,
    MISSING,
    OK,
    HostResult,
    record_header,
    validate_record,
)
from fa4lab.bench.sweep import OURS, BenchShape
from fa4lab.bench.timing import sync_for

HOST_SHAPE = BenchShape(head_dim=128, seqlen=128, causal=False, batch=1, heads=1)
HOST_PROVIDERS = (OURS, "fa4", "sdpa")
HOST_LABELS = {
    OURS: "fa4lab.attention",
    "fa4": "upstream FA4 flash_attn_func (flash-attn-4)",
    "sdpa": "torch SDPA, its own backend choice, (b, h, s, d) inputs",
}
DENSE, VARLEN_ENTRY, PAGED_ENTRY = "dense", "varlen", "paged"
HOST_BATCHES = (1, 32, 256)
HOST_TOKENS = 16       # a varlen sequence's tokens (queries and keys)
HOST_KEYS = 64         # a paged sequence's keys (seqused_k), one query each
HOST_PAGE_SIZE = 16
# fa4lab's default call first (Note [the headline row] in `fa4lab.bench.serving`).
VARLEN_HOST_PROVIDERS = (OURS, "fa4lab-checked", "fa4lab-unchecked", "fa4lab-metadata", "fa4")
VARLEN_HOST_LABELS = {
    OURS: "fa4lab.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, "
          "max_seqlen_k[, seqused_k, page_table], causal=...): the default call, no "
          "check_indices argument",
    "fa4lab-checked": "the same with check_indices=True (a device-to-host copy per call, so "
                      "the call waits for the GPU)",
    "fa4lab-unchecked": "the same with check_indices=False",
    "fa4lab-metadata": "the default call with scheduler_metadata (fa4lab.scheduler_metadata of "
                       "the same index tensors, made once outside the timed call: a layer "
                       "after the first)",
    "fa4": "upstream FA4 flash_attn_varlen_func, the same arguments",
}
_VARIANTS = {OURS: {}, "fa4lab-checked": {"check_indices": True},
             "fa4lab-unchecked": {"check_indices": False}}


@dataclass(frozen=True)
class HostCase:
    """One case of the host-overhead mode: the dense call on HOST_SHAPE, or a varlen / paged
    call of `batch` tiny sequences (`serving`: the same case as `fa4lab bench --serving`
    measures, at a size where the GPU is not the bottleneck)."""

    entry: str = DENSE
    batch: int = 1

    def __post_init__(self):
        if self.entry not in (DENSE, VARLEN_ENTRY, PAGED_ENTRY):
            raise ValueError(f"host case entry {self.entry!r}: {DENSE}, {VARLEN_ENTRY} or "
                             f"{PAGED_ENTRY}")

    @property
    def name(self) -> str:
        return DENSE if self.entry == DENSE else f"{self.entry} b{self.batch}"

    @property
    def providers(self) -> tuple[str, ...]:
        return HOST_PROVIDERS if self.entry == DENSE else VARLEN_HOST_PROVIDERS

    @property
    def serving(self):
        """The `fa4lab.bench.serving.ServingCase` of a varlen or paged case (None: dense)."""
        from fa4lab.bench import serving as sv

        b = self.batch
        if self.entry == VARLEN_ENTRY:
            return sv.ServingCase(sv.VARLEN, (HOST_TOKENS,) * b, (HOST_TOKENS,) * b, 1, 1,
                                  HOST_SHAPE.head_dim, causal=True)
        if self.entry == PAGED_ENTRY:
            return sv.ServingCase(sv.PAGED, (1,) * b, (HOST_KEYS,) * b, 1, 1,
                                  HOST_SHAPE.head_dim, page_size=HOST_PAGE_SIZE)
        return None

    def label(self) -> str:
        if self.entry == DENSE:
            s = HOST_SHAPE
            return f"b{s.batch} s{s.seqlen} h{s.heads} hd{s.head_dim} full"
        page = f" p{HOST_PAGE_SIZE}" if self.entry == PAGED_ENTRY else ""
        return self.serving.shape_label() + page


def host_cases(batches: Sequence[int] = HOST_BATCHES) -> list[HostCase]:
    """The mode's cases: the dense call, then varlen and paged at each batch."""
    return ([HostCase(DENSE)] + [HostCase(VARLEN_ENTRY, b) for b in batches]
            + [HostCase(PAGED_ENTRY, b) for b in batches])
CALLS = 500
REPEATS = 5
WARMUP_CALLS = 20

# Note [host overhead]
# Each provider first runs WARMUP_CALLS times (compiles, caches, allocator), then REPEATS
# times issues CALLS calls back to back. time.perf_counter brackets the Python calls only: the
# device is synchronized before each repeat, so its queue starts empty, and never inside one.
# The GPU work of one tiny call is shorter than the host work that issues it, so the queue does
# not fill and the loop measures the host: argument checks, layout conversions, dispatch,
# launch. Reported: the mean over all timed calls, and the median of the repeats' means
# (robust to one repeat disturbed by a GC pass or another process).


def measure_host_overhead(providers: Mapping[str, Callable[[], object]], device: str = "cuda",
                          *, calls: int = CALLS, repeats: int = REPEATS,
                          warmup: int = WARMUP_CALLS, case: str = DENSE,
                          shape: str = "") -> list[HostResult]:
    """Microseconds of host time per call of each no-argument callable, in the given order,
    each result stamped with `case` and `shape`. A callable that raises is reported as
    'error' and the others are still measured."""
    if calls < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"calls ({calls}) and repeats ({repeats}) must be >= 1, warmup "
                         f"({warmup}) >= 0")
    sync = sync_for(device)
    results = []
    for name, call in providers.items():
        try:
            for _ in range(warmup):
                call()
            per_call = []
            for _ in range(repeats):
                sync()
                t0 = time.perf_counter()
                for _ in range(calls):
                    call()
                per_call.append((time.perf_counter() - t0) / calls * 1e6)
            sync()
        except Exception as err:
            results.append(HostResult(name, ERROR, note=f"{type(err).__name__}: "
                                                        f"{short_error(err)}", case=case,
                                      shape=shape))
            continue
        results.append(HostResult(name, OK, mean_us=statistics.fmean(per_call),
                                  median_us=statistics.median(per_call),
                                  repeats_us=[round(x, 3) for x in per_call], case=case,
                                  shape=shape))
    return results


# ---- the providers' calls on HOST_SHAPE --------------------------------------------------------
def _fa4lab_call(q, k, v, scale):
    from fa4lab.api import SlowReferenceWarning, attention

    # Where no fa4lab kernel runs, attention() computes the float64 reference: never time it.
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowReferenceWarning)
        attention(q, k, v, softmax_scale=scale)
    return lambda: attention(q, k, v, softmax_scale=scale), _first


def _fa4_call(q, k, v, scale):
    flash_attn_func = fa4_function()
    return lambda: flash_attn_func(q, k, v, softmax_scale=scale, causal=False), _first


def _sdpa_call(q, k, v, scale):
    import torch

    sdpa = torch.nn.functional.scaled_dot_product_attention
    qb, kb, vb = to_bhsd(q, k, v)   # SDPA's own layout, made once (see Note [SDPA layout])
    return lambda: sdpa(qb, kb, vb, scale=scale), lambda o: o.transpose(1, 2)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


_CALLS = {OURS: _fa4lab_call, "fa4": _fa4_call, "sdpa": _sdpa_call}


def _refusing_the_reference(call):
    """call() once with fa4lab's float64 fallback (SlowReferenceWarning) an error: where no
    kernel runs, the reference must never be timed as fa4lab."""
    from fa4lab.api import SlowReferenceWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowReferenceWarning)
        call()
    return call


def _fa4lab_varlen_call(name: str):
    def make(q, k, v, args, case):
        from fa4lab.api import attention_varlen

        variant = dict(_VARIANTS.get(name, {}))
        if name == "fa4lab-metadata":
            from fa4lab.varlen_metadata import scheduler_metadata

            variant["scheduler_metadata"] = scheduler_metadata(q, k, v, **args.kwargs())
        return _refusing_the_reference(functools.partial(
            attention_varlen, q, k, v, **args.kwargs(), causal=case.causal,
            softmax_scale=case.spec.scale, **variant))

    return make


def _fa4_varlen_call(q, k, v, args, case):
    fa4_function()                  # says why upstream FA4 does not import, if it does not
    from flash_attn.cute.interface import flash_attn_varlen_func

    return functools.partial(flash_attn_varlen_func, q, k, v, **args.kwargs(),
                             causal=case.causal, softmax_scale=case.spec.scale)


# name -> make(q, k, v, args, serving_case): a no-argument call returning the packed output.
VARLEN_CALLS = {**{n: _fa4lab_varlen_call(n) for n in (*_VARIANTS, "fa4lab-metadata")},
                "fa4": _fa4_varlen_call}


def host_calls(device: str = "cuda", names: Sequence[str] | None = None,
               case: HostCase = HostCase(), makers: Mapping[str, Callable] | None = None
               ) -> tuple[dict[str, Callable[[], object]], list[HostResult]]:
    """({name: no-argument call on the case's inputs}, [results of the others]). `names`:
    the case's providers by default; `makers` (varlen / paged cases): {name: make(q, k, v,
    args, serving_case)} instead of VARLEN_CALLS (the CPU tests' stand-ins).

    Each call's output is checked against the float64 reference first, like the sweep's (a
    varlen / paged case every sequence, Note [checking a serving case]): a provider that
    cannot run here is 'missing', one that raises 'error', one whose output is wrong
    'failed'; none of those is timed."""
    from fa4lab.bench.measure import make_inputs

    names = case.providers if names is None else tuple(names)
    known = _CALLS if case.entry == DENSE else (makers or VARLEN_CALLS)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown host-overhead provider(s) {unknown} for {case.name}: choose "
                         f"from {list(known)}")
    sync = sync_for(device)
    if case.entry == DENSE:
        shape = HOST_SHAPE
        q, k, v = make_inputs(HOST_SHAPE, device)
        check = reference_slice(q, k, v, HOST_SHAPE)
        scale = HOST_SHAPE.spec.scale
        make = lambda name: _CALLS[name](q, k, v, scale)
    else:
        from fa4lab.bench.serving import VarlenArgs, case_reference, serving_inputs

        shape, args = case.serving, VarlenArgs()
        q, k, v = serving_inputs(shape, device, args)
        check = case_reference(shape, args, q, k, v)
        make = lambda name: (known[name](q, k, v, args, shape), lambda out: _first(out)[None])
    stamp = {"case": case.name, "shape": case.label()}
    ready, not_run = {}, []
    for name in names:
        try:
            call, to_bshd = make(name)
        except Exception as err:
            not_run.append(HostResult(name, MISSING, note=f"{type(err).__name__}: "
                                                          f"{short_error(err)}", **stamp))
            continue
        try:
            out = to_bshd(call())
            sync()
            passed, _, note = check_output(out, check, shape)
        except Exception as err:
            not_run.append(HostResult(name, ERROR, note=f"{type(err).__name__}: "
                                                        f"{short_error(err)}", **stamp))
            continue
        if not passed:
            not_run.append(HostResult(name, FAILED, note=note, **stamp))
            continue
        ready[name] = call
    return ready, not_run


def measure_host_cases(cases: Sequence[HostCase], device: str = "cuda", *,
                       calls: int = CALLS, repeats: int = REPEATS, warmup: int = WARMUP_CALLS,
                       calls_of: Callable | None = None) -> list[HostResult]:
    """Every case's providers, checked then measured (`host_calls`, `measure_host_overhead`),
    in the case's provider order. `calls_of(device, names, case)` replaces `host_calls`."""
    calls_of = calls_of or host_calls
    results = []
    for case in cases:
        ready, not_run = calls_of(device, case.providers, case)
        measured = measure_host_overhead(ready, device, calls=calls, repeats=repeats,
                                         warmup=warmup, case=case.name, shape=case.label())
        order = {name: i for i, name in enumerate(case.providers)}
        results += sorted(measured + not_run, key=lambda r: order.get(r.provider, len(order)))
    return results


# ---- the first call of a new process -----------------------------------------------------------
# Note [first call]
# What a notebook restart or a new test process pays before its first output: a child process
# imports fa4lab.attention, makes its inputs, then times its first call (synchronized), which
# finds no kernel in memory. The first child of a fresh, empty disk cache compiles; the second
# loads the kernel its sibling published. Imports are timed apart from the call.
_FIRST_CALL_CHILD = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    import torch
    from fa4lab import attention
    from fa4lab.kernels import launch
    import_s = time.perf_counter() - t0
    torch.manual_seed(0)
    q = torch.randn(1, 256, 4, 64, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = attention(q, q, q, causal=True, softmax_scale=0.123)
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - t0
    print(json.dumps({"import_s": import_s, "first_call_s": first_call_s, **launch.stats(),
                      "dsl_imported": "cutlass" in sys.modules,
                      "checksum": float(out.float().sum())}))
""")


def first_calls_in_new_processes(cache_dir: str | None = None, processes: int = 2
                                 ) -> list[dict]:
    """Run `processes` children one after another on one disk cache (a fresh temporary one by
    default) and return what each measured (Note [first call])."""
    with tempfile.TemporaryDirectory(prefix="fa4lab-cache-") as fresh:
        env = {**os.environ, "FA4LAB_CACHE_DIR": cache_dir or fresh, "FA4LAB_CACHE": "1"}
        runs = []
        for _ in range(processes):
            done = subprocess.run([sys.executable, "-c", _FIRST_CALL_CHILD], env=env,
                                  capture_output=True, text=True, timeout=900)
            if done.returncode:
                raise RuntimeError(f"the child process failed:\n{done.stderr[-3000:]}")
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return runs


def format_first_calls(runs: Sequence[dict]) -> str:
    lines = ["| process | imports s | first call s | kernel | CuTe DSL imported |",
             "|---|---|---|---|---|"]
    for i, r in enumerate(runs, 1):
        how = "compiled" if r["compiled"] else "loaded from disk"
        lines.append(f"| {i} | {r['import_s']:.2f} | {r['first_call_s']:.3f} | {how} | "
                     f"{'yes' if r['dsl_imported'] else 'no'} |")
    return "\n".join(lines)


# ---- record and table ------------------------------------------------------------------------
def host_config(calls: int = CALLS, repeats: int = REPEATS, warmup: int = WARMUP_CALLS,
                cases: Sequence[HostCase] | None = None) -> dict:
    s = HOST_SHAPE
    cases = host_cases() if cases is None else cases
    return {"shape": {"batch": s.batch, "seqlen": s.seqlen, "heads": s.heads,
                      "head_dim": s.head_dim, "dtype": s.dtype, "causal": s.causal},
            "cases": {c.name: c.label() for c in cases},
            "varlen_paged": {"tokens_per_sequence": HOST_TOKENS, "keys_per_sequence": HOST_KEYS,
                             "page_size": HOST_PAGE_SIZE, "heads": [1, 1],
                             "head_dim": s.head_dim, "dtype": s.dtype},
            "calls": calls, "repeats": repeats, "warmup_calls": warmup,
            "timer": "time.perf_counter around `calls` back-to-back calls; device synchronized "
                     "before each repeat, not inside it",
            "providers": dict(HOST_LABELS),
            "varlen_providers": dict(VARLEN_HOST_LABELS)}


def make_host_record(results: Sequence[HostResult], *, gpu_name: str, arch: str | None,
                     command: str, config: dict, label: str | None = None,
                     notes: str = "") -> dict:
    """A validated "host-overhead" record of `results`."""
    record = record_header(HOST_OVERHEAD, gpu_name=gpu_name, arch=arch, command=command,
                           config=config, label=label or f"fa4lab host overhead on {gpu_name}",
                           notes=notes)
    record["results"] = [asdict(r) for r in results]
    return validate_record(record)


def format_host_table(results: Sequence[HostResult]) -> str:
    """A markdown table: per case (fa4lab's default call first), the shape and dtype, µs of
    host time per call, and each provider's time over fa4lab's default call's in that case."""
    cases: dict[str, list[HostResult]] = {}
    for r in results:
        cases.setdefault(r.case, []).append(r)
    lines = ["| case | shape | dtype | provider | call | mean us/call | median of repeats | "
             "x fa4lab |", "|---|---|---|---|---|---|---|---|"]
    for case, rows in cases.items():
        ours = next((r for r in rows if r.provider == OURS and r.status == OK), None)
        order = {p: i for i, p in enumerate(HOST_PROVIDERS if case == DENSE
                                            else VARLEN_HOST_PROVIDERS)}
        for r in sorted(rows, key=lambda r: order.get(r.provider, len(order))):
            head = (f"| {case} | {r.shape or (HostCase().label() if case == DENSE else '-')} | "
                    f"{HOST_SHAPE.dtype} | {r.provider} | {HOST_CALL_COLUMN.get(r.provider, '')} |")
            if r.status != OK:
                lines.append(f"{head} {r.status} | - | - |")
                continue
            ratio = f"{r.mean_us / ours.mean_us:.2f}" if ours else "-"
            lines.append(f"{head} {r.mean_us:.1f} | {r.median_us:.1f} | {ratio} |")
    notes = [f"- {r.provider} {r.case}: {r.status}: {r.note}" for r in results
             if r.status != OK]
    if notes:
        lines += ["", "not measured:"] + notes
    return "\n".join(lines)


HOST_CALL_COLUMN = {OURS: "default", "fa4lab-checked": "check_indices=True",
                    "fa4lab-unchecked": "check_indices=False",
                    "fa4lab-metadata": "scheduler_metadata", "fa4": "same args",
                    "sdpa": "(b, h, s, d)"}
