"""fa4lab: a lab and workbook for FlashAttention-4 on NVIDIA B200, with a Hopper port.

    from fa4lab import AttentionSpec, attention_reference, plan_forward, attention
"""

from fa4lab.errors import Fa4labError, PlanError, UnsupportedArchError
from fa4lab.spec import AttentionSpec

__version__ = "0.1.0"

__all__ = ["AttentionSpec", "Fa4labError", "PlanError", "UnsupportedArchError", "__version__"]


def __getattr__(name):
    # Lazy so `import fa4lab` stays light (no cutlass import until a kernel is needed).
    lazy = {
        "attention_reference": ("fa4lab.reference", "attention_reference"),
        "attention_backward_reference": ("fa4lab.reference_backward",
                                         "attention_backward_reference"),
        "online_attention": ("fa4lab.online_softmax", "online_attention"),
        "plan_forward": ("fa4lab.plan", "plan_forward"),
        "attention": ("fa4lab.api", "attention"),
        "attention_varlen": ("fa4lab.api", "attention_varlen"),
        "check_errors": ("fa4lab.indexcheck", "check_errors"),
        "scheduler_metadata": ("fa4lab.varlen_metadata", "scheduler_metadata"),
        "ring_attention": ("fa4lab.distributed", "ring_attention"),
    }
    if name in lazy:
        import importlib

        if name == "scheduler_metadata":
            # Its device check comes with the launch path (Note [who launches the device
            # check] in fa4lab.indexcheck).
            importlib.import_module("fa4lab.kernels.launch")
        module, attr = lazy[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'fa4lab' has no attribute {name!r}")
