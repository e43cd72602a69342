"""The sm90 backward's host side: the kernel's key, its compile on any machine, its launch.

    from fa4lab.kernels.launch_backward import backward
    dq, dk, dv, dsink = backward(q, k, v, out, dout, lse, causal=True)   # CUDA tensors, H100/H200

`backward` is what `fa4lab.attention`'s autograd runs on a Hopper GPU (`fa4lab.backward`): it
prepares the kernel's inputs with torch ops (D = rowsum(dO * O) - dLSE and the LSE in log2
units, padded to whole query blocks), launches `FlashBackwardSm90` (fa4lab.kernels.bwd_sm90)
once, and turns its float32 dQ accumulator into dQ; the sink's gradient is a torch sum (Note
[sink backward] in fa4lab.reference_backward). Note [sm90 backward, first version] says what
is torch here and will be kernels later.

`missing(...)` names what the kernel does not build for a call (paged K/V, varlen, mods, an
arch other than sm90, head dims off the list), so that the autograd path raises
GradientNotSupportedError naming it; `compile_backward(key)` compiles a configuration with fake
tensors on any machine and keeps its PTX and cubin (`fa4lab.kernels.binary` reads them).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, fields

from fa4lab.limits import KERNEL_DTYPES, KERNEL_HEAD_DIMS
from fa4lab.spec import LOG2E, normalize_dtype, normalize_mask, resolve_scale

ARCHS = ("sm90",)
# What the sm100 kernel (fa4lab.kernels.bwd_sm100) builds: its plan's 1-CTA head dims whose
# column halves split evenly between its two compute warpgroups.
SM100_HEAD_DIMS = ((64, 64), (128, 128))


@dataclass(frozen=True)
class BackwardKey:
    """What one compiled backward kernel bakes in; every size, the scale, the cap's value and
    the window's sizes are runtime values (Note [runtime scale], Note [runtime window] in
    fa4lab.kernels.compile). The tiles are this class's table, the same for every key so far
    (Note [sm90 backward, first version])."""

    head_dim: int
    head_dim_v: int
    dtype: str                          # "bf16" | "fp16"
    causal: bool
    qhead_per_kvhead: int
    softcap: bool = False               # capped scores (the cap is a runtime value)
    window: tuple[bool, bool] = (False, False)   # which sides of a window exist
    deterministic: bool = False         # Note [deterministic dQ] in fa4lab.kernels.bwd_sm90
    arch: str = "sm90"                  # "sm90" (bwd_sm90) | "sm100" (bwd_sm100, from its plan)

    # The sm90 kernel's tiles and threads (one table, read by the kernel and the host): query
    # rows per block, keys per block, threads per CTA, warps along M of each MMA. The sm100
    # kernel's come from its plan (`plan`).
    num_threads = 256
    warps_m = 4

    @property
    def m_block(self) -> int:
        return self.plan().tiles.m_block if self.arch == "sm100" else 64

    @property
    def n_block(self) -> int:
        return self.plan().tiles.n_block if self.arch == "sm100" else 64

    def plan(self):
        """The sm100 kernel's `BackwardPlan` (fa4lab.plan.backward.plan_backward): every number
        of its kernel; the sizes in its spec are placeholders (the kernel's are runtime). Made
        once per key: every launch reads its tiles."""
        return _plan_of(self)

    @property
    def name(self) -> str:
        side = "".join("lr"[i] for i, on in enumerate(self.window) if on)
        return (f"bwd-{self.arch}a-hd{self.head_dim}x{self.head_dim_v}-{self.dtype}"
                f"{'-causal' if self.causal else ''}-g{self.qhead_per_kvhead}"
                f"{'-softcap' if self.softcap else ''}{'-window' + side if side else ''}"
                f"{'-det' if self.deterministic else ''}")

    def __post_init__(self):
        if self.arch == "sm100":
            if self.unbuilt_sm100():
                raise ValueError(f"the sm100 backward does not build {self.unbuilt_sm100()}")
        elif self.arch != "sm90":
            raise ValueError(f"arch {self.arch!r}: the backward builds {ARCHS}")
        if self.arch == "sm90" and (self.head_dim, self.head_dim_v) not in KERNEL_HEAD_DIMS["sm90"]:
            raise ValueError(f"(head_dim, head_dim_v) = {(self.head_dim, self.head_dim_v)}: the "
                             f"sm90 backward builds {KERNEL_HEAD_DIMS['sm90']}")
        if self.dtype not in KERNEL_DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: the backward builds {KERNEL_DTYPES}")
        if self.qhead_per_kvhead < 1:
            raise ValueError(f"qhead_per_kvhead must be >= 1, got {self.qhead_per_kvhead}")

    def unbuilt_sm100(self) -> str | None:
        """What of this key the sm100 kernel does not build (Note [sm100 backward, first
        version] in fa4lab.kernels.bwd_sm100), in words, or None."""
        dims = (self.head_dim, self.head_dim_v)
        if dims not in SM100_HEAD_DIMS:
            return f"head dims {dims} (it builds {SM100_HEAD_DIMS})"
        for what, on in (("GQA", self.qhead_per_kvhead != 1), ("softcap", self.softcap),
                         ("a sliding window", any(self.window)),
                         ("deterministic dQ", self.deterministic)):
            if on:
                return what
        return None


@functools.cache
def _plan_of(key: BackwardKey):
    from fa4lab.plan.backward import plan_backward
    from fa4lab.spec import AttentionSpec

    return plan_backward(AttentionSpec(1, 1024, 1024, 1, 1, key.head_dim, key.head_dim_v,
                                       dtype=key.dtype, causal=key.causal))


def key_of(q, k, v, causal: bool, softcap: float = 0.0, window_size=(None, None),
           deterministic: bool = False, arch: str = "sm90") -> BackwardKey:
    """The `BackwardKey` of a call; causal and window_size in `fa4lab.spec.normalize_mask`'s
    stored form."""
    return BackwardKey(int(q.shape[-1]), int(v.shape[-1]), normalize_dtype(q.dtype),
                       bool(causal), int(q.shape[-2]) // int(k.shape[-2]), bool(softcap),
                       (window_size[0] is not None, window_size[1] is not None),
                       bool(deterministic), arch)


def missing(q, k, v, *, arch: str | None, page_table=None, varlen: bool = False,
            mods: bool = False) -> str | None:
    """What the sm90 backward kernel does not build for this call, in words, or None when it
    runs it (`arch`: the GPU's kernel arch, `fa4lab.limits.arch_of_capability`)."""
    if arch not in ARCHS:
        return (f"a backward kernel for {arch or 'this GPU'} (the backward kernel runs on "
                f"Hopper, sm90, so far)")
    if mods:
        return "score_mod / mask_mod in the backward kernel"
    if varlen:
        return "variable-length batches (attention_varlen) in the backward kernel"
    if page_table is not None:
        return "a paged K/V cache in the backward kernel"
    dims = (int(q.shape[-1]), int(v.shape[-1]))
    if dims not in KERNEL_HEAD_DIMS["sm90"]:
        return (f"head dims {dims} in the backward kernel (it builds "
                f"{KERNEL_HEAD_DIMS['sm90']})")
    try:
        normalize_dtype(q.dtype)
    except Exception:
        return f"dtype {q.dtype} in the backward kernel (bf16 and fp16)"
    return None


# ------------------------------------------------------------------ compile
def fake_args(key: BackwardKey):
    """Fake tensors and scalars of the kernel's contract (`FlashBackwardSm90.__call__`, then
    the stream): symbolic batch, sequence lengths and head counts; 64-bit strides divisible by
    8 elements and 16-byte alignment for the 16-bit tensors (last dim contiguous); LSE and D
    (batch, heads_q, padded seqlen_q) float32, dQ_accum (batch, heads_q, padded seqlen_q,
    head_dim) float32, contiguous in the last dim; the semaphore (batch, heads_q, query
    blocks) int32 with deterministic=True, else None."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    dtype = cutlass.BFloat16 if key.dtype == "bf16" else cutlass.Float16
    b, sq, sk, hq, hkv, sq_pad = (cute.sym_int() for _ in range(6))

    def bshd(s, h, d):
        strides = tuple(cute.sym_int64(divisibility=8) for _ in range(3))
        return make_fake_tensor(dtype, (b, s, h, d), (*strides, 1), assumed_align=16)

    def rows(*shape, dt=cutlass.Float32, align=4, div=1):
        strides = tuple(cute.sym_int64(divisibility=div) for _ in range(len(shape) - 1))
        return make_fake_tensor(dt, shape, (*strides, 1), assumed_align=align)

    d, dv = key.head_dim, key.head_dim_v
    if key.arch == "sm100":    # MHA: one head count; LSE and D rows 16-byte aligned (TMA)
        q, do, k, v = bshd(sq, hq, d), bshd(sq, hq, dv), bshd(sk, hq, d), bshd(sk, hq, dv)
        return [q, k, v, do, rows(b, hq, sq_pad, align=16, div=4),
                rows(b, hq, sq_pad, align=16, div=4), rows(b, hq, sq_pad, d, align=16, div=4),
                bshd(sk, hq, d), bshd(sk, hq, dv), cutlass.Float32(1.0), cutlass.Float32(1.0),
                make_fake_stream(use_tvm_ffi_env_stream=True)]
    q, do = bshd(sq, hq, d), bshd(sq, hq, dv)
    k, v, dk, dvv = bshd(sk, hkv, d), bshd(sk, hkv, dv), bshd(sk, hkv, d), bshd(sk, hkv, dv)
    lse, dsum = rows(b, hq, sq_pad), rows(b, hq, sq_pad)
    dq_accum = rows(b, hq, sq_pad, d, align=16, div=4)
    sem = rows(b, hq, cute.sym_int(), dt=cutlass.Int32) if key.deterministic else None
    return [q, k, v, do, lse, dsum, dq_accum, dk, dvv, cutlass.Float32(1.0),
            cutlass.Float32(1.0), cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0), sem,
            make_fake_stream(use_tvm_ffi_env_stream=True)]


def compile_kernel(key: BackwardKey, options: str = "", mutation=None):
    """(kernel object, compiled function, seconds) of `key`'s kernel for sm_90a or sm_100a (no
    GPU needed: fake tensors, Note [TVM-FFI launch] in fa4lab.kernels.compile); `mutation` (a
    `fa4lab.kernels.protocol.Mutation`, sm100 only) breaks its barrier protocol on purpose."""
    import cutlass.cute as cute

    from fa4lab.kernels.compile import target_arch

    if key.arch == "sm100":
        from fa4lab.kernels.bwd_sm100 import FlashBackwardSm100

        kernel = FlashBackwardSm100(key.plan(), mutation=mutation)
    else:
        from fa4lab.kernels.bwd_sm90 import FlashBackwardSm90

        kernel = FlashBackwardSm90(key)
    with target_arch(f"sm_{key.arch.removeprefix('sm')}a"):
        t0 = time.perf_counter()
        compiled = cute.compile(kernel, *fake_args(key),
                                options=" ".join(("--enable-tvm-ffi", options)))
    return kernel, compiled, time.perf_counter() - t0


@dataclass(frozen=True)
class CompiledBackward:
    """One compiled backward kernel and where its artifacts are; for sm100 also what the
    audit reads (`fa4lab.kernels.audit.audit_backward`): the kernel object, its plan and its
    shared-storage bytes."""

    key: BackwardKey
    compiled: object
    seconds: float
    ptx_path: object
    cubin_path: object
    kernel: object = None
    plan: object = None
    smem_bytes: int = -1

    @property
    def arch(self) -> str:
        return self.key.arch + "a"

    @property
    def ptx(self) -> str:
        return self.ptx_path.read_text()


def compile_backward(key: BackwardKey, keep_dir=None, mutation=None) -> CompiledBackward:
    """Compile `key`'s kernel for its arch and keep its PTX and cubin in keep_dir/<name>/ (a
    fresh temporary directory by default); `mutation` as `compile_kernel`'s."""
    from fa4lab.kernels.compile import compile_kept

    built = {}

    def compile_fn(options):
        built["kernel"], compiled, seconds = compile_kernel(key, options, mutation)
        return compiled, seconds

    name = key.name + ("-mutated" if mutation is not None else "")
    compiled, seconds, _, ptx, cubin = compile_kept(name, compile_fn, keep_dir)
    kernel = built["kernel"]
    storage = getattr(kernel, "shared_storage", None)
    return CompiledBackward(key, compiled, seconds, ptx, cubin, kernel,
                            getattr(kernel, "plan", None),
                            int(storage.size_in_bytes()) if storage is not None else -1)


def kernel_for(key: BackwardKey):
    """The compiled function of `key`: this process's, the disk cache's, or compiled now."""
    from fa4lab.kernels import cache

    return cache.memo_kernel("bwd", key.name, lambda: compile_kernel(key)[1])


# ------------------------------------------------------------------ launch
def check_backward(q, k, v, out, dout, lse, dlse=None) -> None:
    """ValueError naming the tensor whose shape or dtype does not fit the call: q (batch,
    seqlen_q, heads_q, d), k (batch, seqlen_k, heads_kv, d), v (batch, seqlen_k, heads_kv,
    dv), out and dout like (batch, seqlen_q, heads_q, dv) in q's dtype, lse and dlse (batch,
    heads_q, seqlen_q)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-d (batch, seqlen, heads, head_dim); got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, sq, hq, _ = q.shape
    if k.shape[0] != b or v.shape[:3] != k.shape[:3] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} do not fit q "
                         f"{tuple(q.shape)}")
    if hq % k.shape[2]:
        raise ValueError(f"heads_q={hq} is not a multiple of heads_kv={k.shape[2]}")
    want = (b, sq, hq, v.shape[3])
    for name, t in (("out", out), ("dout", dout)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {want}")
    for name, t in (("k", k), ("v", v), ("dout", dout)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} is {t.dtype}, q is {q.dtype}: one dtype for all")
    for name, t in (("lse", lse), ("dlse", dlse)):
        if t is not None and tuple(t.shape) != (b, hq, sq):
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {(b, hq, sq)}")


def saved_forward(q, k, v, arch: str, *, causal=False, softmax_scale=None, softcap=0.0,
                  window_size=(None, None), learnable_sink=None):
    """(out, lse) of the forward kernel of `arch` on q, k, v: what the backward reads (the
    forward's output and its log-sum-exp), through the one call check (`fa4lab.call`). For the
    kernel's own tests and benchmark, which call `backward` directly; `fa4lab.attention`'s
    autograd reads its forward op's saved out and lse instead (Note [the backward on the GPU]
    in fa4lab.backward)."""
    from fa4lab.call import check_call
    from fa4lab.kernels.launch import forward

    call = check_call(q, k, v, causal=causal, softmax_scale=softmax_scale, softcap=softcap,
                      window_size=window_size, learnable_sink=learnable_sink, return_lse=True,
                      arch=arch)
    return forward(call, arch)


def kernel_layout(t):
    """t itself when TMA-free cp.async can read it (last dim contiguous, other strides
    multiples of 8 elements, 16-byte aligned), else a contiguous copy."""
    ok = (t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1])
          and t.data_ptr() % 16 == 0)
    return t if ok else t.contiguous()


def backward(q, k, v, out, dout, lse, *, causal: bool = False, softmax_scale=None,
             softcap: float = 0.0, window_size=(None, None), learnable_sink=None, dlse=None,
             deterministic: bool = False, arch: str = "sm90"):
    """(dq, dk, dv, dsink) of attention on CUDA tensors of a Hopper GPU (`arch` "sm100": of a
    B200, with fa4lab.kernels.bwd_sm100; not yet run on one), from the forward's
    out and lse (natural log, (batch, heads_q, seqlen_q) float32, -inf on rows that see no
    key) and the gradient dout of out (dlse: of the lse, or None). dq, dk, dv in q's dtype;
    dsink float32 like learnable_sink, None without one. `deterministic` orders dQ's float32
    additions (Note [deterministic dQ]): two runs give the same bits."""
    import torch

    from fa4lab.kernels.device.arguments import scale_args, window_args

    check_backward(q, k, v, out, dout, lse, dlse)
    causal, window_size = normalize_mask(causal, window_size)
    key = key_of(q, k, v, causal, softcap, window_size, deterministic, arch)
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    scale = resolve_scale(softmax_scale, d)
    m = key.m_block
    sq_pad = -(-sq // m) * m
    dev = q.device
    # Preprocess (Note [sm90 backward, first version]): D and the LSE in log2 units, padded.
    lse32 = lse.detach().float()
    row_dot = (dout.float() * out.float()).sum(-1).transpose(1, 2)       # (b, hq, sq)
    d_rows = torch.zeros((b, hq, sq_pad), dtype=torch.float32, device=dev)
    d_rows[..., :sq] = row_dot if dlse is None else row_dot - dlse.float()
    lse_log2 = torch.full((b, hq, sq_pad), float("inf"), dtype=torch.float32, device=dev)
    lse_log2[..., :sq] = torch.where(lse32 == float("-inf"), float("inf"), lse32 * LOG2E)
    dq_accum = torch.zeros((b, hq, sq_pad, d), dtype=torch.float32, device=dev)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    sem = (torch.zeros((b, hq, sq_pad // m), dtype=torch.int32, device=dev)
           if deterministic else None)
    if b * sq * sk:
        q_, k_, v_, do_ = (kernel_layout(t) for t in (q, k, v, dout))
        dk_, dv_ = kernel_layout(dk), kernel_layout(dv)
        if key.arch == "sm100":   # the same inputs; MHA, no cap, window or semaphore
            kernel_for(key)(q_, k_, v_, do_, lse_log2, d_rows, dq_accum, dk_, dv_,
                            scale_args(softmax_scale, d)[0], scale)
        else:
            kernel_for(key)(q_, k_, v_, do_, lse_log2, d_rows, dq_accum, dk_, dv_,
                            *scale_args(softmax_scale, d, softcap), scale,
                            *window_args(window_size, sq, sk), sem)
        dk, dv = dk_, dv_
    else:
        dk.zero_()
        dv.zero_()
    # Postprocess: dQ = scale * dQ_accum (the softcap's factor is in dS), as a contiguous
    # (b, sq, hq, d) tensor: what the op's fake says it returns (fa4lab.backward).
    dq = torch.empty((b, sq, hq, d), dtype=q.dtype, device=dev)
    dq.copy_((dq_accum[:, :, :sq] * scale).transpose(1, 2))
    dsink = None
    if learnable_sink is not None:    # Note [sink backward]: sum P_sink * (dLSE - D)
        p_sink = torch.exp(learnable_sink.float()[None, :, None] - lse32)
        dsink = -(p_sink * d_rows[..., :sq]).sum(dim=(0, 2)).to(learnable_sink.dtype)
    return dq, dk, dv, dsink


def fields_of(key: BackwardKey) -> dict:
    """The key's fields by name (what a test or a report prints)."""
    return {f.name: getattr(key, f.name) for f in fields(key)}
