"""`fa4lab bench --host-overhead`: the host time of one call, per provider, in one process.

At short shapes a call's GPU time is smaller than the host work that issues it, so that work
decides the throughput a model sees. This measures it on a tiny shape (`HOST_SHAPE`: batch 1,
seqlen 128, 1 head, head_dim 128, bf16) for fa4lab, upstream FA4 and PyTorch SDPA, each as its
user calls it. See Note [host overhead].

    fa4lab bench --host-overhead                 # table, record saved in benchmarks/
    fa4lab bench --host-overhead --calls 1000 --repeats 7

`measure_host_overhead` takes any no-argument callables and a device string, so it runs (and
is tested) on a CPU; the command itself needs a CUDA GPU.
"""

from __future__ import annotations

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
from dataclasses import asdict

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
                          warmup: int = WARMUP_CALLS) -> list[HostResult]:
    """Microseconds of host time per call of each no-argument callable, in the given order.
    A callable that raises is reported as 'error' and the others are still measured."""
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
                                                        f"{short_error(err)}"))
            continue
        results.append(HostResult(name, OK, mean_us=statistics.fmean(per_call),
                                  median_us=statistics.median(per_call),
                                  repeats_us=[round(x, 3) for x in per_call]))
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


def host_calls(device: str = "cuda", names: Sequence[str] = HOST_PROVIDERS
               ) -> tuple[dict[str, Callable[[], object]], list[HostResult]]:
    """({name: no-argument call on HOST_SHAPE inputs}, [results of the others]).

    Each call's output is checked against the float64 reference first, like the sweep's: a
    provider that cannot run here is 'missing', one that raises 'error', one whose output is
    wrong 'failed'; none of those is timed."""
    from fa4lab.bench.measure import make_inputs

    unknown = [n for n in names if n not in _CALLS]
    if unknown:
        raise ValueError(f"unknown host-overhead provider(s) {unknown}: choose from "
                         f"{list(HOST_PROVIDERS)}")
    q, k, v = make_inputs(HOST_SHAPE, device)
    check = reference_slice(q, k, v, HOST_SHAPE)
    scale = HOST_SHAPE.spec.scale
    sync = sync_for(device)
    ready, not_run = {}, []
    for name in names:
        try:
            call, to_bshd = _CALLS[name](q, k, v, scale)
        except Exception as err:
            not_run.append(HostResult(name, MISSING, note=f"{type(err).__name__}: "
                                                          f"{short_error(err)}"))
            continue
        try:
            out = to_bshd(call())
            sync()
            passed, _, note = check_output(out, check, HOST_SHAPE)
        except Exception as err:
            not_run.append(HostResult(name, ERROR, note=f"{type(err).__name__}: "
                                                        f"{short_error(err)}"))
            continue
        if not passed:
            not_run.append(HostResult(name, FAILED, note=note))
            continue
        ready[name] = call
    return ready, not_run


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
def host_config(calls: int = CALLS, repeats: int = REPEATS, warmup: int = WARMUP_CALLS) -> dict:
    s = HOST_SHAPE
    return {"shape": {"batch": s.batch, "seqlen": s.seqlen, "heads": s.heads,
                      "head_dim": s.head_dim, "dtype": s.dtype, "causal": s.causal},
            "calls": calls, "repeats": repeats, "warmup_calls": warmup,
            "timer": "time.perf_counter around `calls` back-to-back calls; device synchronized "
                     "before each repeat, not inside it",
            "providers": dict(HOST_LABELS)}


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
    """A markdown table: µs of host time per call, and each provider's time over fa4lab's."""
    ours = next((r for r in results if r.provider == OURS and r.status == OK), None)
    lines = ["| provider | mean us/call | median of repeats | x fa4lab |", "|---|---|---|---|"]
    for r in results:
        if r.status != OK:
            lines.append(f"| {r.provider} | {r.status} | - | - |")
            continue
        ratio = f"{r.mean_us / ours.mean_us:.2f}" if ours else "-"
        lines.append(f"| {r.provider} | {r.mean_us:.1f} | {r.median_us:.1f} | {ratio} |")
    notes = [f"- {r.provider}: {r.status}: {r.note}" for r in results if r.status != OK]
    if notes:
        lines += ["", "not measured:"] + notes
    return "\n".join(lines)
