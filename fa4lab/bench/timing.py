"""How the bench times a call: median milliseconds with a cold L2, after a spin-up.

`time_ms` uses `triton.testing.do_bench` on a CUDA GPU (CUDA events with the same cold-L2 rule
when triton is missing) and a wall-clock median elsewhere. `gemm_tflops` is the dense bf16
GEMM ceiling the attention numbers are read against.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from fa4lab.hardware import H200_L2_BYTES

# Timing knobs (triton's defaults; the standard sweep finishes in a few minutes with them).
WARMUP_MS = 25
REP_MS = 100
SPIN_UP_S = 0.3  # see Note [clock ramp]
GEMM_SIZE = 8192
# The L2 the rotation rule (see Note [cold L2]) plans for: the H200's, as the device reports it
# (`fa4lab.hardware.H200_L2_BYTES`; Note [H200 L2] there has both figures and their sources).
L2_BYTES = H200_L2_BYTES


# Note [cold L2]
# One call of the standard sweep reads q, k, v and writes o: 4 x 64 MiB = 256 MiB, more than
# four times the L2 (L2_BYTES), so the inputs are not rotated among copies: nothing a
# call leaves in L2 is a meaningful head start for the next. On top of that
# `triton.testing.do_bench` writes a 256 MB buffer before every timed call (outside the timed
# region), so every call starts with a cold L2; the CUDA-event fallback below does the same.
# For custom shapes smaller than 2 x L2 (--total-tokens/--hidden), `measure_shape` makes enough
# copies (`rotation_copies`) and each timed call takes the next one.
def timer_name() -> str:
    try:
        import triton  # noqa: F401

        return "triton.testing.do_bench (median, warm-up excluded, L2 flushed per call)"
    except ImportError:
        return "cuda events (median, warm-up excluded, L2 flushed per call; triton missing)"


def timing_config(warmup_ms: float, rep_ms: float) -> dict:
    """A record's config entries on how each provider was timed: the timer, its warm-up and
    repetition milliseconds, the GPU's spin-up seconds before the first timing."""
    return {"timer": timer_name(), "warmup_ms": warmup_ms, "rep_ms": rep_ms,
            "spin_up_s": SPIN_UP_S}


def time_ms(fn: Callable[[], Any], *, warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS,
            device: str = "cuda") -> float:
    """Median milliseconds of fn() (warm-up excluded)."""
    if device != "cuda":
        return _time_cpu(fn, rep_ms)
    try:
        from triton.testing import do_bench
    except ImportError:
        return _time_cuda_events(fn, warmup_ms, rep_ms)
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def _time_cuda_events(fn, warmup_ms, rep_ms) -> float:
    import torch

    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = max((time.perf_counter() - t0) * 1e3, 1e-3)
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    n = max(5, int(rep_ms / est))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _time_cpu(fn, rep_ms) -> float:
    fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(times) < 3 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def gemm_tflops(*, size: int = GEMM_SIZE, warmup_ms: float = WARMUP_MS,
                rep_ms: float = REP_MS) -> float:
    """Dense bf16 matmul rate (size^3), the ceiling the attention numbers are read against."""
    import torch

    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda: torch.matmul(a, b), warmup_ms=warmup_ms, rep_ms=rep_ms)
    return 2.0 * size**3 / (ms * 1e-3) / 1e12


def hbm_bytes(spec) -> int:
    """The bytes a forward call of an `AttentionSpec` must move: K and V read once, q read and
    out written once (Note [HBM floor] in `fa4lab.bench.decode`)."""
    kv = spec.batch * spec.seqlen_k * spec.heads_kv * (spec.head_dim + spec.head_dim_v)
    qo = spec.batch * spec.seqlen_q * spec.heads_q * (spec.head_dim + spec.head_dim_v)
    return spec.element_bytes * (kv + qo)


def rotation_copies(shape) -> int:
    """How many copies of a shape's inputs (anything with a `.spec`) the timed calls rotate
    through: one when a call moves more than twice the L2 (`hbm_bytes`). See Note [cold L2]."""
    return max(1, min(8, math.ceil(2 * L2_BYTES / hbm_bytes(shape.spec))))


def rotating_call(runner: Callable[..., Any], copies: list, causal: bool, scale: float):
    """A no-argument call that takes the next (q, k, v) copy each time. See Note [cold L2]."""
    turns = itertools.cycle(copies)

    def call():
        q, k, v = next(turns)
        return runner(q, k, v, causal, scale)

    return call


# Note [clock ramp]
# A provider's first call on a shape may compile for seconds (fa4lab, upstream FA4), with the
# GPU idle; its clocks fall meanwhile, and do_bench's 25 ms warm-up does not bring them back:
# in the records before this note, the first shape of a (head_dim, causal) group, where
# fa4lab compiled, measured as low as 57 % of a repeat run. Every provider therefore runs
# back to back for SPIN_UP_S before its timing starts, compiled or not, so all are treated
# alike. It has not removed every dip: short shapes right after a compile still measured low
# in both sweeps since, and at parity when timed again (benchmarks/README.md).
def spin_up(call: Callable[[], Any], sync: Callable[[], None], seconds: float = SPIN_UP_S):
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(4):
            call()
        sync()


def sync_for(device: str) -> Callable[[], None]:
    """Waits for the device's queued work: torch.cuda.synchronize on "cuda", nothing elsewhere."""
    if device == "cuda":
        import torch

        return torch.cuda.synchronize
    return lambda: None
