"""attention_sm100 off a B200: a clear UnsupportedArchError naming the alternatives (CPU test)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_cpu_tensors_raise_unsupported_arch_with_alternatives():
    from fa4lab.errors import UnsupportedArchError
    from fa4lab.kernels.launch import attention_sm100

    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedArchError) as info:
        attention_sm100(q, q, q)
    msg = str(info.value)
    for name in ("compute-capability-10", "attention_sm90", "fa4lab.attention",
                 "attention_reference"):
        assert name in msg, f"{name!r} missing from: {msg}"
