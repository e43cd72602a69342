"""The sm90 backward's host side: what it does not build, its compile on any machine, its launch.

    from fa4lab.call import check_call
    from fa4lab.kernels.launch_backward import backward, saved_forward
    call = check_call(q, k, v, causal=True, arch="sm90")      # CUDA tensors, H100/H200
    out, lse = saved_forward(call, "sm90")
    dq, dk, dv, dsink = backward(call, out, dout, lse)

`backward` is what `fa4lab.attention`'s autograd runs on a Hopper GPU (`fa4lab.backward`): it
takes the checked `Call` of the forward's options (`fa4lab.call.check_call`, the one input
check; its key is `Call.backward_key`), prepares the kernel's inputs with torch ops (D =
rowsum(dO * O) - dLSE and the LSE in log2 units, padded to whole query blocks), launches
`FlashBackwardSm90` (fa4lab.kernels.bwd_sm90) once, and turns its float32 dQ accumulator into
dQ; the sink's gradient is a torch sum (Note [sink backward] in fa4lab.reference_backward).
Note [sm90 backward, first version] says what is torch here and will be kernels later.

`unbuilt(call, arch)` names what the backward kernel does not build for a checked call (an
arch without one, mods, varlen, paged K/V, then the key's own limits:
`fa4lab.plan.key.backward_unbuilt`), so that the autograd path raises
GradientNotSupportedError naming it; `compile_backward(key)` compiles a configuration with fake
tensors on any machine and keeps its PTX and cubin (`fa4lab.kernels.binary` reads them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace

from fa4lab.plan.key import BackwardKey, backward_unbuilt
from fa4lab.spec import LOG2E

# The archs whose GPU runs a backward kernel behind fa4lab.attention's autograd (the sm100
# kernel is compiled and audited, not yet run on a B200: `backward(..., arch="sm100")` alone).
ARCHS = ("sm90",)


def unbuilt(call, arch: str | None, deterministic: bool = False) -> str | None:
    """What the backward kernel does not build for the checked `call` (`fa4lab.call.Call`), in
    words, or None when it runs it (`arch`: the GPU's kernel arch,
    `fa4lab.limits.arch_of_capability`; None where none runs). The call's inputs were checked
    once by `check_call`; these are the backward's own limits, each said once."""
    if arch not in ARCHS:
        return (f"a backward kernel for {arch or 'this GPU'} (the backward kernel runs on "
                f"Hopper, sm90, so far)")
    if call.mods:
        return "score_mod / mask_mod in the backward kernel"
    s = call.spec
    if s.varlen:
        return "variable-length batches (attention_varlen) in the backward kernel"
    if call.page_table is not None:
        return "a paged K/V cache in the backward kernel"
    left, right = s.window_size
    return backward_unbuilt(arch, s.head_dim, s.head_dim_v, s.qhead_per_kvhead,
                            bool(s.softcap), (left is not None, right is not None),
                            deterministic)


# ------------------------------------------------------------------ compile
def compile_kernel(key: BackwardKey, options: str = "", mutation=None):
    """(kernel object, compiled function, seconds) of `key`'s kernel for sm_90a or sm_100a (no
    GPU needed: fake tensors, Note [TVM-FFI launch] in fa4lab.kernels.compile); `mutation` (a
    `fa4lab.kernels.protocol.Mutation`, sm100 only) breaks its barrier protocol on purpose."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from fa4lab.kernels.compile import target_arch
    from fa4lab.kernels.device.arguments import BackwardArgs

    if key.arch == "sm100":
        from fa4lab.kernels.bwd_sm100 import FlashBackwardSm100

        kernel = FlashBackwardSm100(key.plan(), mutation=mutation)
    else:
        from fa4lab.kernels.bwd_sm90 import FlashBackwardSm90

        kernel = FlashBackwardSm90(key)
    with target_arch(f"sm_{key.arch.removeprefix('sm')}a"):
        t0 = time.perf_counter()
        compiled = cute.compile(kernel, *BackwardArgs.fake(key),
                                make_fake_stream(use_tvm_ffi_env_stream=True),
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
def check_backward(call, out, dout, lse, dlse=None) -> None:
    """ValueError naming the tensor the backward adds to the checked `call` whose shape or
    dtype does not fit it: out and dout (batch, seqlen_q, heads_q, head_dim_v) in q's dtype,
    lse and dlse (batch, heads_q, seqlen_q). q, k, v are the call's (`check_call`)."""
    q = call.q
    b, sq, hq = q.shape[:3]
    want = (b, sq, hq, call.v.shape[-1])
    for name, t in (("out", out), ("dout", dout)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {want}")
    if dout.dtype != q.dtype:
        raise ValueError(f"dout is {dout.dtype}, q is {q.dtype}: one dtype for all")
    for name, t in (("lse", lse), ("dlse", dlse)):
        if t is not None and tuple(t.shape) != (b, hq, sq):
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {(b, hq, sq)}")


def saved_forward(call, arch: str):
    """(out, lse) of the forward kernel of `arch` on the checked `call` (in that kernel's form:
    `check_call(..., arch=arch)`): what the backward reads (the forward's output and its
    log-sum-exp). For the kernel's own tests and benchmark, which call `backward` directly;
    `fa4lab.attention`'s autograd reads its forward op's saved out and lse instead (Note [the
    backward on the GPU] in fa4lab.backward)."""
    from fa4lab.kernels.launch import forward

    return forward(replace(call, spec=call.spec.with_(return_lse=True)), arch)


def kernel_layout(t):
    """t itself when TMA-free cp.async can read it (last dim contiguous, other strides
    multiples of 8 elements, 16-byte aligned), else a contiguous copy."""
    ok = (t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1])
          and t.data_ptr() % 16 == 0)
    return t if ok else t.contiguous()


def backward(call, out, dout, lse, *, dlse=None, deterministic: bool = False,
             arch: str = "sm90"):
    """(dq, dk, dv, dsink) of the checked `call` (`fa4lab.call.check_call` with the forward's
    options, in the kernel's form: `arch=arch` or `Call.for_kernel`) on CUDA tensors of a
    Hopper GPU (`arch` "sm100": of a B200, with fa4lab.kernels.bwd_sm100; not yet run on one),
    from the forward's out and lse (natural log, (batch, heads_q, seqlen_q) float32, -inf on
    rows that see no key) and the gradient dout of out (dlse: of the lse, or None). dq, dk, dv
    in q's dtype; dsink float32 like the call's learnable sink, None without one.
    `deterministic` orders dQ's float32 additions (Note [deterministic dQ]): two runs give the
    same bits."""
    import torch

    from fa4lab.kernels.device.arguments import BackwardArgs, scale_args, window_args

    check_backward(call, out, dout, lse, dlse)
    key = call.backward_key(arch, deterministic)
    q, k, v, spec = call.q, call.k, call.v, call.spec
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    softmax_scale, scale = spec.softmax_scale, spec.scale
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
        kernel_for(key)(*BackwardArgs(q_, k_, v_, do_, lse_log2, d_rows, dq_accum, dk_, dv_,
                                      *scale_args(softmax_scale, d, spec.softcap), scale,
                                      *window_args(spec.window_size, sq, sk), sem))
        dk, dv = dk_, dv_
    else:
        dk.zero_()
        dv.zero_()
    # Postprocess: dQ = scale * dQ_accum (the softcap's factor is in dS), as a contiguous
    # (b, sq, hq, d) tensor: what the op's fake says it returns (fa4lab.backward).
    dq = torch.empty((b, sq, hq, d), dtype=q.dtype, device=dev)
    dq.copy_((dq_accum[:, :, :sq] * scale).transpose(1, 2))
    dsink, learnable_sink = None, call.sink
    if learnable_sink is not None:    # Note [sink backward]: sum P_sink * (dLSE - D)
        p_sink = torch.exp(learnable_sink.float()[None, :, None] - lse32)
        dsink = -(p_sink * d_rows[..., :sq]).sum(dim=(0, 2)).to(learnable_sink.dtype)
    return dq, dk, dv, dsink


def fields_of(key: BackwardKey) -> dict:
    """The key's fields by name (what a test or a report prints)."""
    return {f.name: getattr(key, f.name) for f in fields(key)}
