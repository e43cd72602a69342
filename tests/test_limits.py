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
    """(head_dim, head_dim_v) pairs are the table's entries; every reading of it agrees."""
    table = limits.KERNEL_HEAD_DIMS
    assert limits.head_dims_for("sm100a") == limits.head_dims_for("sm_100") == table["sm100"]
    assert limits.head_dims_for("SM90") == table["sm90"]
    assert set(limits.ALL_HEAD_DIMS) == {p for pairs in table.values() for p in pairs}
    assert list(limits.ALL_HEAD_DIMS) == sorted(limits.ALL_HEAD_DIMS)
    for arch, pairs in table.items():
        assert all(isinstance(d, int) and isinstance(dv, int) for d, dv in pairs)
        assert {(96, 96), (192, 128)} <= set(pairs)         # both kernels build these
        for d, dv in pairs:
            assert limits.kernel_builds(arch, d, dv)
            assert limits.kernel_builds(arch, d) == (d == dv or (d, d) in pairs)
        assert limits.equal_head_dims(arch) == tuple(d for d, dv in pairs if d == dv)
        text = limits.head_dims_text(arch)
        assert all(str(d) in text for d, dv in pairs)
        assert all(f"({d}, {dv})" in text for d, dv in pairs if d != dv)
    assert limits.kernel_builds("sm100", 256, 256) and limits.kernel_builds("sm90", 256)
    assert not limits.kernel_builds("sm100", 256, 128)
    with pytest.raises(ValueError, match="sm100"):
        limits.head_dims_for("sm80")


@pytest.mark.parametrize("arch", sorted(limits.KERNEL_HEAD_DIMS))
@pytest.mark.parametrize("d, dv", [(80, 80), (32, 32), (160, 128), (192, 192), (256, 256),
                                   (64, 32), (512, 512), (128, 64)])
def test_unsupported_head_dims_error(arch, d, dv):
    """The error says what the kernel builds and what the API does instead: run the pair
    zero-padded to the smallest built pair that holds it (`covering_head_dims`), or, wider than
    every pair, what to do."""
    if limits.kernel_builds(arch, d, dv):
        assert limits.covering_head_dims(arch, d, dv) == (d, dv)
        return
    msg = limits.unsupported_head_dims(arch, d, dv)
    assert f"({d}, {dv})" in msg
    covers = [p for p in limits.head_dims_for(arch) if p[0] >= d and p[1] >= dv]
    cover = limits.covering_head_dims(arch, d, dv)
    if covers:
        assert f"not built by the {arch} kernel, which builds {limits.head_dims_text(arch)}" in msg
        assert cover in covers and sum(cover) == min(a + b for a, b in covers)
        assert f"zero-padded to {cover}" in msg
    else:
        assert cover is None and f"wider than any pair the {arch} kernel builds" in msg
        for other in limits.KERNEL_HEAD_DIMS:
            assert f"{other} ({limits.ARCH_GPUS[other]}): {limits.head_dims_text(other)}" in msg
        assert "fa4lab.reference.attention_reference" in msg


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


def test_readme_lists_the_table():
    """The README's list of head dims is the table's, word for word."""
    from pathlib import Path

    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    assert f"B200 kernel builds {limits.head_dims_text('sm100')}" in readme
    assert f"Hopper kernel {limits.head_dims_text('sm90')}" in readme
