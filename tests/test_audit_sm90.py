"""The sm90 kernel compiled for sm_90a on a CPU passes the same binary audit (tier 1)."""

from __future__ import annotations

import pytest

pytest.importorskip("cutlass")

from fa4lab.kernels import audit as audit_mod  # noqa: E402
from fa4lab.spec import AttentionSpec  # noqa: E402


@pytest.mark.slow
@pytest.mark.compile
def test_sm90a_audit(tmp_path):
    pytest.importorskip("fa4lab.kernels.fwd_sm90")
    spec = AttentionSpec(2, 300, 700, 8, 2, 128, causal=True, return_lse=True)
    result = audit_mod.audit(spec, arch="sm90a", keep_dir=tmp_path)
    failures = [f"{r.name}: expected {r.expected}, found {r.found}" for r in result.failures()]
    assert result.ok, "\n".join(failures)
    assert result.row("wgmma.mma_async (PTX)").found > 0
    assert result.row("spill instructions (STL/LDL)").found == 0
