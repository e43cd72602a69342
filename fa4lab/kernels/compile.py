"""The one compile path of the forward kernels: a plan in, a callable kernel (and artifacts) out.

    from fa4lab.kernels.compile import compile_forward
    cf = compile_forward(AttentionSpec(1, 4096, 4096, 16, 16, 128, causal=True), arch="sm100a")
    cf.ptx_path, cf.cubin_path, cf.seconds, cf.plan, cf.smem_bytes

Every compile -- the audit's on a CPU, the GPU launch's, the bench's plan measurement -- goes
through `compile_plan`: the kernel class of the plan's arch, built from the plan, compiled with fake
tensors (`KernelArgs.fake` of fa4lab.kernels.device.arguments: symbolic batch, sequence lengths,
head counts and 64-bit strides, so one compile serves every problem size) through the CuTe DSL's
TVM-FFI path (Note [TVM-FFI launch]). No GPU is needed to compile: the DSL's target comes from
CUTE_DSL_ARCH, set for the duration of the compile (`target_arch`). `compile_forward` also keeps the
PTX and cubin in `keep_dir/<configuration>/` (a fresh temporary directory by default) for
`fa4lab.kernels.audit`.

sm100a compiles `FlashForwardSm100` (fwd_sm100.py); sm90a compiles `FlashForwardSm90`
(fwd_sm90.py); each is imported only when asked for.
"""

from __future__ import annotations

import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from fa4lab.kernels.device.arguments import KernelArgs
from fa4lab.limits import arch_key, arch_of_capability
from fa4lab.plan.key import config_name, switches_suffix
from fa4lab.spec import AttentionSpec

ARCHS = {"sm100a": "sm100", "sm90a": "sm90"}

# Note [TVM-FFI launch]
# The kernels are compiled with `--enable-tvm-ffi` and a stream placeholder that reads the
# caller's current stream (`make_fake_stream(use_tvm_ffi_env_stream=True)`). The compiled
# function then takes torch tensors as they are: TVM-FFI reads each tensor's data pointer,
# shape and strides through DLPack's C exchange API and checks them against the fake tensors'
# contract (dtype, rank, stride 1 in the last dim, 16-byte alignment, strides divisible by 8
# elements) in C, and the launch goes to torch's current stream -- so CUDA-graph capture and
# side streams work, and no per-call conversion happens in Python. The same object can be
# exported to an object file and loaded by another process (`fa4lab.kernels.cache`).

# Note [runtime scale]
# The softmax scale is an argument of the compiled function, not a constant of the kernel: callers
# pass scale_log2 = softmax_scale * log2(e) and pre_scale (1, or softmax_scale / softcap with a
# softcap: Note [softcap] in fa4lab.kernels.device.softmax) after lse
# (`fa4lab.kernels.device.arguments.scale_args`). A new scale or cap value costs no compile (the
# launch key and the disk cache key hold neither, and the plans are built with the default scale).
# The kernel parameter is loaded once into a uniform register (no per-thread register), which the
# FFMA that scales a score reads instead of an immediate; on the H200 that measured 3-5% slower at
# head_dim 256, non-causal (716 -> 691 TFLOP/s at seqlen 8192, 667 -> 621 at 16384, old and new
# kernels in one session), and no different at head_dim 128.

# Note [runtime window]
# A sliding window's sizes are arguments of the compiled function too
# (`fa4lab.kernels.device.arguments.window_args`: Int32 window_left, window_right after pre_scale),
# so a new window costs no compile; which sides exist is compile-time (the spec's window_size with
# None for a missing side, in the launch key and the disk cache key): a missing side costs no
# instruction, and causal keeps right = 0 as a constant. A missing side's argument is passed as 0
# and never read. Each side is clamped to what can hide a key (left <= seqlen_k, right <= seqlen_q:
# a wider side hides nothing either) and, for a negative side, what can show one (left >= -seqlen_q,
# right >= -seqlen_k: beyond, every row sees no key either), so i + d + right and i + d - left stay
# far from the Int32 range's ends. Under pack_gqa=None a window's width can still pick the packed
# kernel over the unpacked one (Note [narrow windows pack] in fa4lab.limits): two kernels at most.
# The learnable sink is a (heads_q,) float32 tensor argument after lse, None when the spec has none
# (Note [sinks] in fa4lab.kernels.device.softmax).

def normalize_arch(arch: str) -> str:
    """"sm100a" or "sm90a" from any spelling ("sm100", "sm_90a", ...)."""
    return arch_key(arch) + "a"


@cache
def device_arch(index: int) -> str | None:
    """The kernel arch ("sm90"/"sm100") of CUDA device `index`, or None: asked once per device."""
    import torch

    return arch_of_capability(torch.cuda.get_device_capability(index))


def kernel_class(arch: str):
    """The kernel class for "sm100a" / "sm90a" (imports the DSL)."""
    if normalize_arch(arch) == "sm100a":
        from fa4lab.kernels.fwd_sm100 import FlashForwardSm100

        return FlashForwardSm100
    from fa4lab.kernels.fwd_sm90 import FlashForwardSm90

    return FlashForwardSm90


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


def contract_mismatches(fake: list, real: list) -> list[str]:
    """Where launch arguments `real` (torch tensors, scalars, None) break the kernel's contract
    `fake` (`KernelArgs.fake`): a tensor where the contract has None or the reverse, another
    rank, a static size or stride that differs, one symbolic size bound to two values (shared
    symbols are the contract's "these dims are equal"), a stride off its divisibility, data off
    its alignment. The compiled function checks the same at launch, on the GPU; this runs
    anywhere, so a CPU test can hold every launch path to the contract. Empty when it holds."""
    import torch

    bound: dict[int, tuple[int, str]] = {}
    problems = []
    for name, f, r in zip(KernelArgs._fields, fake, real):
        if not hasattr(f, "shape") or f is None:
            if f is None and r is not None:
                problems.append(f"{name}: the kernel takes None, the launch passes "
                                f"{type(r).__name__}")
            continue
        if not isinstance(r, torch.Tensor):
            problems.append(f"{name}: the kernel takes a tensor, the launch passes {r!r}")
            continue
        if len(f.shape) != r.dim():
            problems.append(f"{name}: rank {len(f.shape)} expected, shape {tuple(r.shape)}")
            continue
        for i, (fs, rs, fd, rd) in enumerate(zip(f.shape, r.shape, f.stride, r.stride())):
            if isinstance(fs, int):
                if fs != rs:
                    problems.append(f"{name}.shape[{i}] is {rs}, the kernel has {fs}")
            else:
                first = bound.setdefault(id(fs), (rs, f"{name}.shape[{i}]"))
                if first[0] != rs:
                    problems.append(f"{name}.shape[{i}] = {rs} but {first[1]} = {first[0]}: the "
                                    f"kernel declares them one size")
            if isinstance(fd, int):
                if fd != rd and rs != 1:
                    problems.append(f"{name}.stride[{i}] is {rd}, the kernel has {fd}")
            elif rd % fd.divisibility:
                problems.append(f"{name}.stride[{i}] = {rd} is not a multiple of "
                                f"{fd.divisibility}")
        align = f._assumed_align
        if align and r.data_ptr() % align:
            problems.append(f"{name}: data not {align}-byte aligned")
    return problems


def compile_plan(plan, *, options: str = "", mutation=None, mods=None,
                 seqused_k: bool | None = None):
    """Compile `plan`'s kernel for its arch. Returns (kernel object, compiled function, seconds).

    The compiled function takes torch tensors (q, k, v, out, lse or None, sink or None),
    scale_log2 and pre_scale (Note [runtime scale]), window_left and window_right (Note [runtime
    window]), the aux tensors (a tuple, or None), a mask_mod's block table (or None:
    `fa4lab.mods_blocks.block_table`), then cu_seqlens_q, cu_seqlens_k, seqused_k and the
    varlen tile table (None each unless the spec is varlen: `KernelArgs.fake`), a paged cache's page
    table (or None), num_splits and the split-KV partials (1, None, None without split-KV), and
    launches on the current stream (Note [TVM-FFI launch]); it can be exported with
    `export_to_c`. `mods` (`fa4lab.mods.KernelMods`) compiles a score_mod / mask_mod into the
    kernel; `seqused_k` True a seqused_k argument without varlen (`KernelArgs.fake`).
    """
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    arch = normalize_arch(plan.arch)
    # A mutation (fa4lab.kernels.protocol.Mutation: tests of the audit) breaks the barrier
    # protocol on purpose; only compile_forward passes one, and it never writes the disk cache.
    kernel = kernel_class(arch)(plan, mutation=mutation, mods=mods)
    args = KernelArgs.fake(plan.spec, mods, seqused_k)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    with target_arch("sm_" + arch.removeprefix("sm")):
        t0 = time.perf_counter()
        compiled = cute.compile(kernel, *args, stream,
                                options=" ".join(("--enable-tvm-ffi", options)))
        seconds = time.perf_counter() - t0
    return kernel, compiled, seconds


@dataclass(frozen=True)
class CompiledForward:
    """One compiled kernel and where its artifacts are."""

    arch: str             # "sm100a" | "sm90a"
    plan: object          # the fa4lab.plan.Plan it was built from
    kernel: object        # the kernel object (FlashForwardSm100 / FlashForwardSm90)
    compiled: object      # what cute.compile returned (callable on a GPU of that arch)
    seconds: float        # wall time of cute.compile
    keep_dir: Path
    ptx_path: Path
    cubin_path: Path
    smem_bytes: int       # dynamic shared memory: the kernel's SharedStorage struct size

    @property
    def ptx(self) -> str:
        return self.ptx_path.read_text()


def _tiles_suffix(plan, arch: str) -> str:
    """"" for the spec's own plan; "-m128n64q1kv2" for a plan with overridden tiles, so that
    two plans of one spec (q_stage 1 and 2, say) keep their artifacts apart."""
    from fa4lab.errors import PlanError

    t = plan.tiles
    shape = (t.m_block, t.n_block, t.q_stage, t.kv_stage)
    try:
        own = _plan_of(plan.spec, ARCHS[arch]).tiles
    except PlanError:       # the spec plans only with overrides
        own = None
    if own is not None and shape == (own.m_block, own.n_block, own.q_stage, own.kv_stage):
        return ""
    return "-m{}n{}q{}kv{}".format(*shape)


def _plan_of(spec_or_plan, plan_arch: str):
    if isinstance(spec_or_plan, AttentionSpec):
        from fa4lab.plan import plan_forward

        return plan_forward(spec_or_plan, arch=plan_arch)
    plan = spec_or_plan
    if not hasattr(plan, "spec") or not hasattr(plan, "arch"):
        raise TypeError(f"compile_forward takes an AttentionSpec or a Plan, got "
                        f"{type(spec_or_plan).__name__}")
    if plan.arch != plan_arch:
        raise ValueError(f"the plan is for {plan.arch} but arch={plan_arch}a was asked for; "
                         f"plan with plan_forward(spec, arch={plan_arch!r})")
    return plan


def newest_artifact(keep_dir: Path, suffix: str, since: float) -> Path:
    """The newest `*suffix` file the DSL wrote into keep_dir at or after `since`."""
    found = [p for p in keep_dir.glob(f"*{suffix}") if p.stat().st_mtime >= since - 1]
    if not found:
        raise RuntimeError(f"the compile left no *{suffix} in {keep_dir}; the DSL's keep options "
                           f"(--keep-ptx --keep-cubin) did not take effect")
    return max(found, key=lambda p: p.stat().st_mtime)


def compile_kept(name: str, compile_fn, keep_dir=None) -> tuple:
    """(compiled, seconds, keep, ptx path, cubin path) of `compile_fn(options)` (-> (compiled,
    seconds)) with the DSL told to keep its PTX and cubin in keep_dir/<name>/ (a fresh
    temporary directory by default), for `fa4lab.kernels.binary` and the audits."""
    root = Path(keep_dir) if keep_dir is not None else Path(tempfile.mkdtemp(prefix="fa4lab-"))
    keep = root / name
    keep.mkdir(parents=True, exist_ok=True)
    start_wall = time.time()
    compiled, seconds = compile_fn(f"--keep-ptx --keep-cubin --dump-dir={keep}")
    return (compiled, seconds, keep, newest_artifact(keep, ".ptx", start_wall),
            newest_artifact(keep, ".cubin", start_wall))


def compile_forward(spec_or_plan, arch: str = "sm100a", keep_dir=None,
                    mutation=None, mods=None, seqused_k: bool | None = None) -> CompiledForward:
    """Compile the forward kernel for `arch` with fake tensors; keep PTX and cubin in keep_dir.

    `mutation` (a `fa4lab.kernels.protocol.Mutation`) compiles a deliberately broken barrier
    protocol for the audit's tests; `mods` (`fa4lab.mods.KernelMods`) a score_mod / mask_mod;
    `seqused_k` True a seqused_k argument without varlen (ragged keys, `KernelArgs.fake`)."""
    arch = normalize_arch(arch)
    plan = _plan_of(spec_or_plan, ARCHS[arch])
    # One folder per configuration: the DSL names artifacts after the kernel class and the
    # fake tensors' types, so two configurations would overwrite each other in one folder.
    name = (config_name(plan.spec, arch) + _tiles_suffix(plan, arch)
            + switches_suffix(getattr(plan.tiles, "pack_gqa", False), None)
            + ("-mutated" if mutation is not None else "")
            + ("-mods" if mods else "")
            + ("-seqused" if seqused_k and not plan.spec.varlen
               and plan.spec.page_size is None else ""))
    built = {}

    def compile_fn(options):
        built["kernel"], compiled, seconds = compile_plan(plan, options=options,
                                                          mutation=mutation, mods=mods,
                                                          seqused_k=seqused_k)
        return compiled, seconds

    compiled, seconds, keep, ptx, cubin = compile_kept(name, compile_fn, keep_dir)
    storage = getattr(built["kernel"], "shared_storage", None)
    smem = int(storage.size_in_bytes()) if storage is not None else -1
    return CompiledForward(
        arch=arch, plan=plan, kernel=built["kernel"], compiled=compiled, seconds=seconds,
        keep_dir=keep, ptx_path=ptx, cubin_path=cubin, smem_bytes=smem)


def compile_report(plan) -> tuple[float | None, str]:
    """Compile `plan`'s kernel for its arch on any machine. Returns (seconds, a one-line report);
    a failure is reported, not raised, so a widget can show it beside the plan."""
    try:
        cf = compile_forward(plan, plan.arch + "a")
    except Exception as err:
        text = " ".join(str(err).split())
        text = text if len(text) <= 300 else text[:297] + "..."
        return None, f"compile for {getattr(plan, 'arch', '?')}a failed: " \
                     f"{type(err).__name__}: {text}"
    return cf.seconds, (f"compiled for {plan.arch}a in {cf.seconds:.1f} s; the kernel's "
                        f"dynamic SMEM {cf.smem_bytes} B")
