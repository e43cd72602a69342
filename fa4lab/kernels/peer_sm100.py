"""Upstream FA4's sm100 forward (flash-attn-4), compiled the way fa4lab's is, for the audit.

Optional: fa4lab never depends on flash-attn-4. Where it is installed (`pip install
flash-attn-4 --no-deps` plus quack-kernels, einops, apache-tvm-ffi), `compile_flash_attn4(spec)`
compiles `flash_attn.cute.flash_fwd_sm100.FlashAttentionForwardSm100` for sm_100a with fake
tensors and `audit_flash_attn4(spec)` reads its binary with the same tools, so
`fa4lab audit --peer` prints the two tables side by side.

Two things make it import and compile on a CPU machine:
  * flash_attn.cute imports quack, whose autotuner imports triton at module level (for its
    benchmarking helpers, unused here). Without triton, a placeholder module stands in for the
    duration of the import only; anything that really calls triton would fail loudly.
  * the static persistent scheduler asks the driver for the SM count; the non-persistent
    schedulers (single tile, LPT for causal) need nothing from a GPU, so they are used.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import time
import types
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fa4lab.kernels import binary


class PeerUnavailable(RuntimeError):
    """flash-attn-4 (or what it needs) is not importable here."""


@contextmanager
def _triton_placeholder():
    if importlib.util.find_spec("triton") is not None:
        yield
        return
    # torch asks "is triton installed?" once and caches the answer; ask it before the
    # placeholder exists so torch keeps its no-triton code paths.
    import torch._dynamo.utils  # noqa: F401
    from torch.utils._triton import has_triton

    has_triton()

    def _unavailable(*args, **kwargs):
        raise RuntimeError("triton is not installed: a placeholder stood in for quack's import")

    triton = types.ModuleType("triton")
    runtime = types.ModuleType("triton.runtime")
    cache = types.ModuleType("triton.runtime.cache")
    testing = types.ModuleType("triton.testing")
    cache.FileCacheManager = type("FileCacheManager", (), {"__init__": _unavailable})
    testing.do_bench = _unavailable
    runtime.cache = cache
    triton.runtime, triton.testing = runtime, testing
    added = {"triton": triton, "triton.runtime": runtime, "triton.runtime.cache": cache,
             "triton.testing": testing}
    sys.modules.update(added)
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


def _import_fa4():
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("flash-attn-4")
    except PackageNotFoundError:
        raise PeerUnavailable("flash-attn-4 not installed (optional peer: pip install "
                              "flash-attn-4 quack-kernels einops apache-tvm-ffi)") from None
    try:
        with _triton_placeholder():
            return importlib.import_module("flash_attn.cute.flash_fwd_sm100")
    except Exception as exc:  # a missing dependency of flash_attn.cute or quack
        raise PeerUnavailable(f"flash-attn-4 {installed} is installed but its sm100 forward "
                              f"does not import here ({type(exc).__name__}: {exc})") from exc


@dataclass(frozen=True)
class PeerCompiled:
    """The same fields the audit reads from fa4lab's CompiledForward."""

    arch: str
    kernel: object
    seconds: float
    ptx_path: Path
    cubin_path: Path
    smem_bytes: int
    version: str

    @property
    def ptx(self) -> str:
        return self.ptx_path.read_text()


def compile_flash_attn4(spec, keep_dir=None) -> PeerCompiled:
    """Compile upstream FA4's sm100 forward for `spec` on any machine (fake tensors)."""
    import tempfile
    from importlib.metadata import version

    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from fa4lab.kernels.compile import newest_artifact, target_arch
    from fa4lab.kernels.device.arguments import KernelArgs
    from fa4lab.plan.key import config_name

    fa4 = _import_fa4()
    root = Path(keep_dir) if keep_dir else Path(tempfile.mkdtemp(prefix="fa4lab-peer-"))
    keep = root / ("flash-attn-4-" + config_name(spec, "sm100a"))
    keep.mkdir(parents=True, exist_ok=True)
    with target_arch("sm_100a"):
        kernel = fa4.FlashAttentionForwardSm100(
            spec.head_dim, spec.head_dim_v, qhead_per_kvhead=spec.qhead_per_kvhead,
            is_causal=spec.causal, is_static_persistent=False)
        args = KernelArgs.fake(spec)   # fa4lab's contract: upstream takes its first five
        q, k, v, o, lse = args[:5]
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        start = time.time()
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            # its aux_data default is not a JIT argument type; harmless, and not ours to fix
            warnings.simplefilter("ignore", UserWarning)
            # TVM-FFI, as upstream FA4 compiles it and as fa4lab's compile path does
            compiled = cute.compile(kernel, q, k, v, o, lse, cutlass.Float32(spec.scale),
                                    stream=stream,
                                    options=f"--enable-tvm-ffi --keep-ptx --keep-cubin "
                                            f"--dump-dir={keep}")
        seconds = time.perf_counter() - t0
    del compiled
    storage = getattr(kernel, "shared_storage", None)
    return PeerCompiled(
        arch="sm100a", kernel=kernel, seconds=seconds,
        ptx_path=newest_artifact(keep, ".ptx", start),
        cubin_path=newest_artifact(keep, ".cubin", start),
        smem_bytes=int(storage.size_in_bytes()) if storage is not None else -1,
        version=version("flash-attn-4"))


def audit_flash_attn4(spec, keep_dir=None):
    """The audit rows that need no plan, for upstream FA4 compiled like fa4lab's kernel."""
    pc = compile_flash_attn4(spec, keep_dir=keep_dir)
    res = binary.resource_usage(pc.cubin_path)
    ops = binary.sass_opcodes(binary.sass(pc.cubin_path))
    ptx = pc.ptx
    show = lambda name, found, note="": binary.AuditRow(name, "-", found, True, note)
    rows = (
        show("compile seconds", round(pc.seconds, 1)),
        show("registers per thread (launch)", res["registers"]),
        show("spill instructions (STL/LDL)", binary.count_prefix(ops, "STL")
             + binary.count_prefix(ops, "LDL")),
        show("stack frame bytes", res["stack"]),
        show("dynamic SMEM bytes", pc.smem_bytes, "SharedStorage struct size"),
        show("setmaxnreg values", binary.setmaxnreg_values(ptx)),
        show("mbarrier.init", binary.ptx_count(ptx, r"\bmbarrier\.init\.")),
        show("TMEM columns (tcgen05.alloc)", binary.tmem_alloc_columns(ptx)),
        show("tcgen05.mma (PTX)", binary.ptx_count(ptx, r"\btcgen05\.mma\.")),
        show("UTCHMMA (SASS)", binary.count_prefix(ops, "UTCHMMA")),
        show("tcgen05.ld (PTX)", binary.ptx_count(ptx, r"\btcgen05\.ld\.")),
        show("tcgen05.st (PTX)", binary.ptx_count(ptx, r"\btcgen05\.st\.")),
        show("tcgen05.commit (PTX)", binary.ptx_count(ptx, r"\btcgen05\.commit\.")),
        show("MUFU.EX2", binary.count_prefix(ops, "MUFU.EX2")),
        show("FFMA2 (SASS)", ops["FFMA2"], "packed FMAs: scale/sub and its exp2 polynomial"),
    )
    return binary.Audit(f"upstream flash-attn-4 {pc.version} sm100 forward: "
                        f"{binary.describe(spec)} (non-persistent scheduler)", rows)
