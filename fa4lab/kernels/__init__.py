"""The CuTe DSL kernels (sm100 / sm90), their compile tool and the binary audit.

Importing this package imports no DSL: `compile_forward` loads `fa4lab.kernels.compile` (and
the CuTe DSL) on first use.
"""

__all__ = ["compile_forward"]


def __getattr__(name):
    if name == "compile_forward":
        from fa4lab.kernels.compile import compile_forward

        return compile_forward
    raise AttributeError(f"module 'fa4lab.kernels' has no attribute {name!r}")
