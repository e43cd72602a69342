"""Compile a forward kernel for sm_100a or sm_90a on any machine, keeping its PTX and cubin.

    from fa4lab.kernels import compile_forward
    cf = compile_forward(AttentionSpec(1, 4096, 4096, 16, 16, 128, causal=True), arch="sm100a")
    cf.ptx_path, cf.cubin_path, cf.seconds, cf.plan, cf.smem_bytes

No GPU is needed: the tensors are `cute.runtime.make_fake_tensor`s with symbolic batch, sequence
lengths, head counts and strides (one compile serves every problem size, as on the GPU), and the
stream is `make_fake_stream()`. The DSL's target comes from CUTE_DSL_ARCH, set for the duration of
the compile. The artifacts (PTX, cubin) land in `keep_dir/<configuration>/` (under a fresh
temporary directory by default) for `fa4lab.kernels.audit` to read back.

sm100a compiles `FlashForwardSm100` (fwd_sm100.py); sm90a compiles `FlashForwardSm90`
(fwd_sm90.py), imported only when asked for.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fa4lab.spec import AttentionSpec

ARCHS = {"sm100a": "sm100", "sm90a": "sm90"}


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


def _normalize_arch(arch: str) -> str:
    key = arch.lower().replace("_", "")
    if key in ("sm100", "sm100a"):
        return "sm100a"
    if key in ("sm90", "sm90a"):
        return "sm90a"
    raise ValueError(f"arch {arch!r} is not supported: compile for 'sm100a' (B200) or 'sm90a' "
                     f"(H100/H200)")


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


def config_name(spec: AttentionSpec, arch: str) -> str:
    """e.g. "sm100a-hd128-causal-gqa4-lse-bf16": what a compiled kernel bakes in."""
    s = spec
    return (f"{arch}-hd{s.head_dim}-{'causal' if s.causal else 'full'}-gqa{s.qhead_per_kvhead}-"
            f"{'lse' if s.return_lse else 'nolse'}-{s.dtype}")


def kernel_class(arch: str):
    """The kernel class for "sm100a" / "sm90a" (imports the DSL)."""
    arch = _normalize_arch(arch)
    if arch == "sm100a":
        from fa4lab.kernels.fwd_sm100 import FlashForwardSm100

        return FlashForwardSm100
    try:
        from fa4lab.kernels.fwd_sm90 import FlashForwardSm90
    except ImportError as exc:
        raise ImportError(f"the sm90 kernel (fa4lab.kernels.fwd_sm90) is not available: {exc}"
                          ) from exc
    return FlashForwardSm90


def _newest(keep_dir: Path, suffix: str, since: float) -> Path:
    found = [p for p in keep_dir.glob(f"*{suffix}") if p.stat().st_mtime >= since - 1]
    if not found:
        raise RuntimeError(f"the compile left no *{suffix} in {keep_dir}; the DSL's keep options "
                           f"(--keep-ptx --keep-cubin) did not take effect")
    return max(found, key=lambda p: p.stat().st_mtime)


def compile_forward(spec_or_plan, arch: str = "sm100a", keep_dir=None) -> CompiledForward:
    """Compile the forward kernel for `arch` with fake tensors; keep PTX and cubin in keep_dir."""
    import cutlass.cute as cute

    from fa4lab.kernels import runtime

    arch = _normalize_arch(arch)
    plan = _plan_of(spec_or_plan, ARCHS[arch])
    # One folder per configuration: the DSL names artifacts after the kernel class and the
    # fake tensors' types, so two configurations would overwrite each other in one folder.
    root = Path(keep_dir) if keep_dir is not None else Path(tempfile.mkdtemp(prefix="fa4lab-"))
    keep = root / (config_name(plan.spec, arch)
                   + ("-packgqa" if getattr(plan.tiles, "pack_gqa", False) else ""))
    keep.mkdir(parents=True, exist_ok=True)
    kernel = kernel_class(arch)(plan)
    args = runtime.fake_args(plan.spec)
    options = f"--keep-ptx --keep-cubin --dump-dir={keep}"
    start_wall = time.time()
    with runtime.target_arch("sm_" + arch.removeprefix("sm")):
        t0 = time.perf_counter()
        compiled = cute.compile(kernel, *args, options=options)
        seconds = time.perf_counter() - t0
    storage = getattr(kernel, "shared_storage", None)
    smem = int(storage.size_in_bytes()) if storage is not None else -1
    return CompiledForward(
        arch=arch, plan=plan, kernel=kernel, compiled=compiled, seconds=seconds,
        keep_dir=keep, ptx_path=_newest(keep, ".ptx", start_wall),
        cubin_path=_newest(keep, ".cubin", start_wall), smem_bytes=smem)

