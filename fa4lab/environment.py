"""Where are we running, and how big should the examples be?

The tiers (README): 0 = CPU plans/references/simulations/plots, 1 = CPU compile of the CuTe DSL
kernels for sm_100a and sm_90a, 2 = a GPU runs a kernel (sm90 on Hopper, sm100 on B200).
Notebooks and tests read `problem_size()` so one switch, FA4LAB_SIZE=full, selects realistic
sizes on a GPU while CI stays small.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from dataclasses import dataclass
from functools import lru_cache

from fa4lab.limits import arch_of_capability


def problem_size() -> str:
    """'small' (default, CPU-friendly) or 'full' (FA4LAB_SIZE=full, realistic GPU sizes)."""
    size = os.environ.get("FA4LAB_SIZE", "small").strip().lower()
    if size not in ("small", "full"):
        raise ValueError(f"FA4LAB_SIZE={size!r}: use 'small' (default) or 'full'")
    return size


@dataclass(frozen=True)
class GpuInfo:
    name: str
    capability: tuple[int, int]

    @property
    def arch(self) -> str | None:
        """"sm100" (B200), "sm90" (H100/H200) or None: which of fa4lab's kernels runs here."""
        return arch_of_capability(self.capability)


@lru_cache(maxsize=1)
def gpu() -> GpuInfo | None:
    """The first visible CUDA GPU, or None (never raises)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return GpuInfo(torch.cuda.get_device_name(0), tuple(torch.cuda.get_device_capability(0)))
    except Exception:
        return None


def has_cute_dsl() -> bool:
    return importlib.util.find_spec("cutlass") is not None


def tiers() -> dict[str, tuple[bool, str]]:
    """Each tier: (can run here, why)."""
    g = gpu()
    dsl = has_cute_dsl()
    return {
        "0 cpu: plans, references, simulations, plots": (True, "always"),
        "1 cpu: compile kernels for sm_100a / sm_90a": (
            dsl,
            "nvidia-cutlass-dsl installed" if dsl else "nvidia-cutlass-dsl missing: make install",
        ),
        "2 gpu: sm90 kernel runs (Hopper)": (
            bool(g and g.arch == "sm90" and dsl),
            f"{g.name} cc {g.capability}" if g else "no CUDA GPU visible"),
        "2 gpu: sm100 kernel runs (B200)": (
            bool(g and g.arch == "sm100" and dsl),
            f"{g.name} cc {g.capability}" if g else "no CUDA GPU visible"),
    }


def _version(mod: str) -> str:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return "not installed"


def summary() -> str:
    """One line for a notebook's first cell."""
    g = gpu()
    where = f"{g.name} (cc {g.capability[0]}.{g.capability[1]})" if g else "CPU only"
    return (f"fa4lab on python {platform.python_version()}, torch {_version('torch')}, "
            f"cutlass-dsl {_version('nvidia-cutlass-dsl')}; {where}; sizes={problem_size()}")


def _gpu_line(g: GpuInfo | None) -> str:
    if g is None:
        return 'none visible'
    return f'{g.name}, compute capability {g.capability[0]}.{g.capability[1]}'


CUDA_TOOLS = ("ptxas", "cuobjdump", "nvdisasm")


def _tool_line(name: str) -> str:
    """Where pip's CUDA tool `name` is, or why it is not (what the audit tier needs)."""
    from fa4lab.kernels.binary import cuda_tool

    try:
        return str(cuda_tool(name))
    except FileNotFoundError:
        return "missing (pip install nvidia-cuda-nvcc nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)"


def doctor_report() -> str:
    import fa4lab

    g = gpu()
    lines = [
        f"fa4lab        {fa4lab.__version__}",
        f"python        {sys.version.split()[0]} ({sys.executable})",
        f"torch         {_version('torch')}",
        f"cutlass-dsl   {_version('nvidia-cutlass-dsl')}",
        f"jupyterlab    {_version('jupyterlab')}",
        f"ipywidgets    {_version('ipywidgets')}",
        f"flash-attn-4  {_version('flash-attn-4')} (peer, optional)",
        f"CUDA GPU      {_gpu_line(g)}",
        *(f"{name:<13} {_tool_line(name)}" for name in CUDA_TOOLS),
        "tiers:",
    ]
    for tier, (ok, why) in tiers().items():
        lines.append(f"  [{'x' if ok else ' '}] {tier}  ({why})")
    return "\n".join(lines)
