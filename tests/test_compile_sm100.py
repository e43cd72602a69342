"""The sm100 kernel compiles for sm_100a on a CPU (fake tensors) and passes the binary audit.

Tier 1: no GPU needed, nvidia-cutlass-dsl and pip's CUDA binary tools required.

The full matrix is head_dim {64, 128} x causal x GQA {1, 4} x LSE x {bf16, fp16} = 32 compiles
of 3-10 s each on a 2-core machine; CI compiles and audits all of them. FA4LAB_QUICK_MATRIX=1
compiles a covering subset instead (every level of every factor at least once, and the
head_dim 128 causal pair with LSE both ways) for a quick local loop.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import pytest

pytest.importorskip("cutlass")

from fa4lab.kernels import audit as audit_mod  # noqa: E402
from fa4lab.limits import KERNEL_HEAD_DIMS  # noqa: E402
from fa4lab.plan import plan_forward  # noqa: E402
from fa4lab.spec import AttentionSpec  # noqa: E402

FULL = list(itertools.product(KERNEL_HEAD_DIMS["sm100"], (False, True), (1, 4), (False, True),
                              ("bf16", "fp16")))
SUBSET = [
    (128, True, 1, True, "bf16"),
    (128, False, 4, False, "bf16"),
    (64, True, 4, False, "fp16"),
    (64, False, 1, True, "fp16"),
]
MATRIX = SUBSET if os.environ.get("FA4LAB_QUICK_MATRIX") == "1" else FULL
# The options beyond the matrix, each on two configurations: softcap (a cap value; its value is
# a runtime argument, so one compile serves every cap).
OPTIONS = [(128, True, 4, True, "bf16", 30.0), (64, False, 1, False, "fp16", 5.0)]

_compiled = {}


def _spec(head_dim, causal, gqa, lse, dtype, softcap=0.0):
    return AttentionSpec(2, 300, 700, 8, 8 // gqa, head_dim, dtype=dtype, causal=causal,
                         return_lse=lse, softcap=softcap)


def _compile(config, tmp_path_factory):
    from fa4lab.kernels import compile_forward

    if config not in _compiled:
        keep = tmp_path_factory.mktemp("sm100")
        _compiled[config] = compile_forward(_spec(*config), arch="sm100a", keep_dir=keep)
    return _compiled[config]


def _config_id(c):
    return "hd{}-{}-gqa{}-{}-{}".format(c[0], "causal" if c[1] else "full", c[2],
                                        "lse" if c[3] else "nolse", c[4]) + (
        f"-softcap{c[5]:g}" if len(c) > 5 else "")


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize("config", MATRIX + OPTIONS, ids=_config_id)
def test_compiles_and_passes_audit(config, tmp_path_factory):
    cf = _compile(config, tmp_path_factory)
    assert cf.ptx_path.stat().st_size > 0 and cf.cubin_path.stat().st_size > 0
    result = audit_mod.audit_compiled(cf)
    failures = "\n".join(f"{r.name}: expected {r.expected}, found {r.found}"
                         for r in result.failures())
    assert result.ok, f"audit failed for {config}:\n{failures}"
    assert result.row("spill instructions (STL/LDL)").found == 0
    assert result.row("dynamic SMEM bytes").found == cf.plan.smem.total_bytes
    assert result.row("tcgen05.mma (PTX)").found > 0


@pytest.mark.slow
@pytest.mark.compile
def test_audit_catches_a_plan_that_does_not_match(tmp_path_factory):
    """Audit the same binary against a different plan: the mismatches must show, with numbers."""
    cf = _compile(SUBSET[0], tmp_path_factory)
    other = plan_forward(cf.plan.spec, arch="sm100", kv_stage=2)
    result = audit_mod.audit_compiled(dataclasses.replace(cf, plan=other))
    smem = result.row("dynamic SMEM bytes")
    assert not smem.ok and smem.expected == other.smem.total_bytes and smem.found == cf.smem_bytes
    assert not result.ok


@pytest.mark.slow
@pytest.mark.compile
def test_lse_off_passes_none(tmp_path_factory):
    """return_lse=False compiles with mLSE=None: no global store of LSE in the PTX."""
    with_lse = _compile(SUBSET[0], tmp_path_factory).ptx
    without = _compile(SUBSET[1], tmp_path_factory).ptx
    assert with_lse.count("st.global.b32") >= 2 > without.count("st.global.b32")
    assert "lg2.approx" in with_lse and "lg2.approx" not in without


def test_unsupported_head_dim_is_a_clear_error():
    from fa4lab.kernels.fwd_sm100 import FlashForwardSm100

    plan = plan_forward(AttentionSpec(1, 128, 128, 1, 1, 128), arch="sm100")
    bad = dataclasses.replace(plan, spec=AttentionSpec(1, 128, 128, 1, 1, 96))
    with pytest.raises(ValueError, match="head_dim"):
        FlashForwardSm100(bad)


def test_compile_forward_rejects_unknown_arch():
    from fa4lab.kernels import compile_forward

    with pytest.raises(ValueError, match="sm100a"):
        compile_forward(AttentionSpec(1, 128, 128, 1, 1, 128), arch="sm80")


def test_kernels_package_imports_no_dsl():
    import subprocess
    import sys

    code = "import sys, fa4lab.kernels; assert 'cutlass' not in sys.modules, 'imported cutlass'"
    subprocess.run([sys.executable, "-c", code], check=True)
