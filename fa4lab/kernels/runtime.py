"""Host side of the kernels: check CUDA inputs, torch -> CuTe tensors, the compile cache.

Used by `attention_sm90` and `attention_sm100`. One compiled kernel serves every batch size,
sequence length and head count: the tensors are passed with dynamic layouts
(`mark_layout_dynamic`, last dim stride 1), so only what the kernel bakes in at compile time keys
the cache -- head_dim, dtype, causal, softmax scale, GQA ratio, whether LSE is returned,
pack-GQA (`kernel_key`). `compile_count()` lets tests prove a second call does not recompile.

Also here: `fake_compile`, a CPU-only compile of any kernel class for its arch with fake tensors
(no GPU needed), used by the tests; `fa4lab.kernels.compile` is the full tool (artifacts, audit).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass

from fa4lab.spec import AttentionSpec, normalize_dtype

SUPPORTED_HEAD_DIMS = (64, 128, 256)

_lock = threading.Lock()
_cache: dict = {}
_compiles = 0


def compile_count() -> int:
    """How many kernels this process compiled through the cache (tests count recompiles)."""
    return _compiles


def clear_cache() -> None:
    global _compiles
    with _lock:
        _cache.clear()
        _compiles = 0


def kernel_key(spec: AttentionSpec, arch: str, pack_gqa: bool = False) -> tuple:
    """What a compiled kernel depends on; batch, seqlens and head counts are runtime values."""
    packed = bool(pack_gqa) and spec.qhead_per_kvhead > 1  # one query head per KV head: no-op
    return (arch, spec.head_dim, spec.head_dim_v, spec.dtype, spec.causal, spec.scale_log2,
            spec.qhead_per_kvhead, spec.return_lse, packed)


# ---------------------------------------------------------------- plans
def plan_for(spec: AttentionSpec, arch: str, pack_gqa: bool = False):
    """`plan_forward(spec, arch)` -- the one source of every number a kernel uses."""
    from fa4lab.plan import plan_forward

    if pack_gqa:
        return plan_forward(spec, arch=arch, pack_gqa=True)
    return plan_forward(spec, arch=arch)


# ---------------------------------------------------------------- inputs
def check_cuda_inputs(q, k, v, *, head_dims=SUPPORTED_HEAD_DIMS) -> None:
    """Raise with what is wrong and what to do for inputs a CUDA kernel cannot take."""
    import torch

    from fa4lab.spec import check_qkv_shapes

    check_qkv_shapes(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(
                f"{name} has dtype {t.dtype}: the GPU kernels take bfloat16 or float16 "
                f"(cast with {name}.to(torch.bfloat16))")
        if not t.is_cuda:
            raise ValueError(f"{name} is on {t.device}: move it to the GPU with {name}.cuda()")
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name} has stride {tuple(t.stride())}: the kernels need the last dim "
                f"contiguous (stride 1); pass {name}.contiguous()")
        if t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:-1]):
            raise ValueError(
                f"{name} is not 16-byte aligned (data_ptr or strides): TMA needs 16-byte "
                f"aligned rows; pass {name}.contiguous() (or clone it)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}; cast them to one")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}; "
            f"move them to one GPU")
    d, dv = q.shape[-1], v.shape[-1]
    if d not in head_dims:
        raise ValueError(f"head_dim {d} is not supported: the kernels take head_dim in {head_dims}")
    if dv != d:
        raise ValueError(f"head_dim_v {dv} != head_dim {d}: the kernels need them equal")


def to_cute(t, *, assumed_align: int = 16):
    """A torch CUDA tensor as a CuTe tensor whose shapes and strides are runtime values."""
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t.detach(), assumed_align=assumed_align).mark_layout_dynamic(
        leading_dim=t.ndim - 1)


def current_stream():
    import cuda.bindings.driver as cuda
    import torch

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


@dataclass
class Launch:
    """A compiled kernel and how to call it."""

    compiled: object
    plan: object


def get_compiled(spec: AttentionSpec, arch: str, kernel_cls, example_args,
                 pack_gqa: bool = False) -> Launch:
    """The compiled kernel for `spec` on `arch`, compiling (once) with `example_args`."""
    global _compiles
    key = kernel_key(spec, arch, pack_gqa)
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            return hit
        import cutlass.cute as cute

        plan = plan_for(spec, arch, pack_gqa)
        kernel = kernel_cls(plan)
        compiled = cute.compile(kernel, *example_args)
        _compiles += 1
        launch = _cache[key] = Launch(compiled, plan)
        return launch


def run_forward(arch: str, kernel_cls, q, k, v, *, causal=False, softmax_scale=None,
                return_lse=False, pack_gqa=False):
    """Allocate out (and lse), compile or fetch the kernel, launch it on the current stream.

    `pack_gqa` (sm90, sm100) plans the kernel with the query heads of a KV head packed into M.
    """
    import torch

    spec = AttentionSpec.from_tensors(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                      return_lse=return_lse, dtype=normalize_dtype(q.dtype))
    b, sq, hq, _ = q.shape
    out = torch.empty(b, sq, hq, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device) if return_lse else None
    with torch.cuda.device(q.device):
        args = [to_cute(x) for x in (q, k, v, out)]
        args.append(to_cute(lse, assumed_align=4) if lse is not None else None)
        args.append(current_stream())
        launch = get_compiled(spec, arch, kernel_cls, args, pack_gqa=pack_gqa)
        launch.compiled(*args)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------- CPU compile
@contextmanager
def target_arch(arch: str):
    """Compile for `arch` ("sm_90a", "sm_100a") whatever GPU (or none) this machine has.

    The DSL reads CUTE_DSL_ARCH once, at import; this sets both the variable and the DSL's
    cached value for the duration of the block.
    """
    from cutlass.cutlass_dsl import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    old_env, old_arch = os.environ.get("CUTE_DSL_ARCH"), envar._arch
    os.environ["CUTE_DSL_ARCH"] = arch
    envar.arch = arch
    try:
        yield
    finally:
        envar._arch = old_arch
        if old_env is None:
            os.environ.pop("CUTE_DSL_ARCH", None)
        else:
            os.environ["CUTE_DSL_ARCH"] = old_env


def fake_args(spec: AttentionSpec):
    """Fake q, k, v, out, lse, stream for a CPU compile: dynamic batch/seqlen/heads/strides."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    dtype = cutlass.BFloat16 if spec.dtype == "bf16" else cutlass.Float16
    b, sq, sk, hq, hkv = (cute.sym_int() for _ in range(5))

    def bshd(s, h, d):
        strides = tuple(cute.sym_int(divisibility=8) for _ in range(3))
        return make_fake_tensor(dtype, (b, s, h, d), (*strides, 1), assumed_align=16)

    q, k = bshd(sq, hq, spec.head_dim), bshd(sk, hkv, spec.head_dim)
    v, o = bshd(sk, hkv, spec.head_dim_v), bshd(sq, hq, spec.head_dim_v)
    lse = None
    if spec.return_lse:
        lse = make_fake_tensor(cutlass.Float32, (b, hq, sq),
                               (cute.sym_int(), cute.sym_int(), 1), assumed_align=4)
    return [q, k, v, o, lse, make_fake_stream()]


def fake_compile(spec: AttentionSpec, arch: str, kernel_cls, options: str | None = None):
    """Compile `kernel_cls(plan_for(spec, plan arch))` for `arch` ("sm90a"/"sm100a") on a CPU."""
    import cutlass.cute as cute

    plan = plan_for(spec, arch.rstrip("a"))
    kernel = kernel_cls(plan)
    with target_arch("sm_" + arch.removeprefix("sm")):
        if options:
            return cute.compile(kernel, *fake_args(spec), options=options)
        return cute.compile(kernel, *fake_args(spec))
