"""The errors fa4lab raises. Each message says what is wrong and what to do about it."""


class Fa4labError(Exception):
    """Base class for fa4lab's own errors."""


class PlanError(Fa4labError, ValueError):
    """A tile plan that does not fit the hardware (TMEM, SMEM, registers) or the spec."""


class UnsupportedArchError(Fa4labError, RuntimeError):
    """A kernel was asked to run on a GPU (or no GPU) it was not built for."""


class InputError(Fa4labError, ValueError):
    """An input that cannot describe the call (a length, index or shape that disagrees),
    raised before anything runs."""


def check_same_device(name: str, device, other_name: str, other_device) -> None:
    """The one rule for a tensor `name` on another device than the tensor it goes with: an
    InputError naming both devices and the fix (`{name}.to({other_name}.device)`)."""
    if device != other_device:
        raise InputError(f"{name} is on {device} but {other_name} is on {other_device}; move "
                         f"it with {name}.to({other_name}.device)")


class InputTypeError(Fa4labError, TypeError):
    """An input of the wrong kind or dtype (e.g. int64 where the kernels read int32), raised
    before anything runs."""


def check_qkv_kinds(q, k, v) -> None:
    """The one rule for the kinds of q, k, v: q floating point, k and v of q's dtype and on
    q's device (InputTypeError / InputError saying the fix)."""
    if not q.is_floating_point():
        raise InputTypeError(f"q has dtype {q.dtype}: attention needs floating point inputs; "
                             f"cast with q.to(torch.bfloat16)")
    if not (q.dtype == k.dtype == v.dtype):
        raise InputTypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, "
                             f"{v.dtype}; cast them, e.g. k.to(q.dtype)")
    for name, t in (("k", k), ("v", v)):
        check_same_device(name, t.device, "q", q.device)


class GradientNotSupportedError(Fa4labError, RuntimeError):
    """An input requires grad where no backward runs (CUDA tensors: no backward kernel yet), so
    the gradient would silently be lost (Note [backward on CPU, not yet on the GPU] in
    fa4lab.backward)."""
