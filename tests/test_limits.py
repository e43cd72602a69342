"""fa4lab.limits: the constants every layer shares, and the layers that read them."""

from __future__ import annotations

import pytest

from fa4lab import limits
from fa4lab.environment import GpuInfo
from fa4lab.spec import AttentionSpec


@pytest.mark.parametrize("capability, arch", [
    ((10, 0), "sm100"), ((10, 3), "sm100"), ((9, 0), "sm90"), ((8, 9), None), ((12, 0), None),
    ((9, 1), None),
])
def test_capability_to_arch(capability, arch):
    assert limits.arch_of_capability(capability) == arch
    assert GpuInfo("some GPU", capability).arch == arch     # the environment asks limits


def test_head_dims_per_arch():
    assert limits.head_dims_for("sm100a") == limits.head_dims_for("sm_100") == (64, 128)
    assert limits.head_dims_for("SM90") == (64, 128, 256)
    assert limits.ALL_HEAD_DIMS == (64, 128, 256)
    with pytest.raises(ValueError, match="sm100"):
        limits.head_dims_for("sm80")


def test_element_bytes_follow_the_dtype():
    assert all(limits.ELEMENT_BYTES[d] == 2 for d in limits.KERNEL_DTYPES)
    for dtype in limits.KERNEL_DTYPES:
        assert AttentionSpec(1, 8, 8, 1, 1, 64, dtype=dtype).element_bytes == 2


def test_exp2_coefficients_and_threshold():
    c0, c1, c2, c3 = limits.EXP2_POLY3
    # p(1) ~ 2 within the quoted error: continuous across integers
    assert c0 == 1.0
    assert c0 + c1 + c2 + c3 == pytest.approx(2.0, rel=limits.EXP2_POLY3_MAX_REL_ERROR)
    assert limits.RESCALE_THRESHOLD == 8.0
    assert 0 < limits.EXP2_POLY3_MAX_REL_ERROR < 2.0**-13
