"""Every constant the lesson, the planner, the kernels and the checks share, said once.

What each kernel builds (head dims per arch), which GPU runs which kernel (capability -> arch),
the conditional-rescale threshold and the software exp2 coefficients. Modules import these
names; none keeps a copy.
"""

from __future__ import annotations

# ---- which kernel runs where ------------------------------------------------------------------
# Head dims each arch's kernel builds (head_dim_v == head_dim). The sm100 planner plans any
# head dim whose S + O fit TMEM; the kernel of this lab builds these.
KERNEL_HEAD_DIMS = {"sm90": (64, 128, 256), "sm100": (64, 128)}
ALL_HEAD_DIMS = tuple(sorted({d for dims in KERNEL_HEAD_DIMS.values() for d in dims}))
KERNEL_DTYPES = ("bf16", "fp16")
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def arch_of_capability(capability: tuple[int, int]) -> str | None:
    """"sm100" for compute capability 10.x (B200), "sm90" for 9.0 (H100/H200), else None."""
    major, minor = capability
    if major == 10:
        return "sm100"
    if (major, minor) == (9, 0):
        return "sm90"
    return None


def head_dims_for(arch: str) -> tuple[int, ...]:
    """The head dims the kernel of `arch` ("sm90"/"sm100", with or without the "a") builds."""
    key = arch.lower().replace("_", "").removesuffix("a")
    if key not in KERNEL_HEAD_DIMS:
        raise ValueError(f"unknown arch {arch!r}: fa4lab has kernels for 'sm100' (B200) and "
                         f"'sm90' (H100/H200)")
    return KERNEL_HEAD_DIMS[key]


# ---- the online softmax ---------------------------------------------------------------------
# FA4's threshold for conditional rescaling, in log2 units: the stale max is kept until the
# true max exceeds it by more than 2**8 = 256x (see notebook 01 and Note [conditional rescale]).
RESCALE_THRESHOLD = 8.0
