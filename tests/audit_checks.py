"""Compile a plan's kernel on the CPU and hold the binary to the plan (shared by the tests)."""

from __future__ import annotations

import pytest


def compile_and_audit(plan, arch: str, keep_dir, mods=None, seqused_k=None):
    """compile_forward + audit_compiled; every audit row must pass. Returns the compiled kernel.
    `mods` (`fa4lab.mods.KernelMods`) compiles a score_mod / mask_mod in.

    Skips (with the reason) where the CuTe DSL or pip's CUDA binary tools are missing.
    """
    pytest.importorskip("cutlass")
    audit = pytest.importorskip("fa4lab.kernels.audit")
    from fa4lab.kernels import compile_forward

    cf = compile_forward(plan, arch=arch, keep_dir=keep_dir, mods=mods, seqused_k=seqused_k)
    assert cf.smem_bytes == plan.smem.total_bytes
    try:
        result = audit.audit_compiled(cf)
    except FileNotFoundError as e:
        pytest.skip(f"CUDA binary tools missing: {e}")
    assert result.ok, [f"{r.name}: expected {r.expected}, found {r.found}"
                       for r in result.failures()]
    assert result.row("mbarrier.init").found == plan.barriers.mbarrier_count
    # The barrier protocol rows are there, one sequence row per code path of the table.
    names = {r.name for r in result.rows}
    assert {f"protocol: {p}" for p in plan.protocol.paths()} <= names
    assert {"markers claim their barrier op", "unclaimed barrier instructions"} <= names
    return cf
