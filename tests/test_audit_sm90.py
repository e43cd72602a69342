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


@pytest.mark.slow
@pytest.mark.compile
def test_moved_epilogue_barrier_ids_are_named(tmp_path):
    """The kernel built from a table whose epilogue barriers start at id 2 (not 1): each
    consumer then syncs on the next consumer's id, and the audit against the real table names
    the epilogue barriers."""
    pytest.importorskip("fa4lab.kernels.fwd_sm90")
    import dataclasses

    from fa4lab.kernels import compile_forward
    from fa4lab.plan import plan_forward
    from fa4lab.plan.barriers import BarrierGraph

    spec = AttentionSpec(2, 300, 700, 8, 2, 128, causal=True, return_lse=True)
    plan = plan_forward(spec, "sm90")
    assert plan.tiles.q_stage == 2
    bars = tuple(dataclasses.replace(b, named_id=b.named_id + 1)
                 if b.name.startswith("epilogue") else b for b in plan.barriers.barriers)
    moved = dataclasses.replace(plan, protocol=plan.protocol.with_barriers(BarrierGraph(bars)))
    cf = compile_forward(moved, "sm90a", keep_dir=tmp_path)
    bad = {r.name: r for r in audit_mod.protocol_rows(plan, cf.ptx) if not r.ok}
    assert set(bad) == {"markers claim their barrier op", "named barrier ids"}, bad
    assert bad["named barrier ids"].found == {**bad["named barrier ids"].expected,
                                              "epilogue0": 2, "epilogue1": 3}
    assert "the table has epilogue0 1, epilogue1 2" in bad["markers claim their barrier op"].note
    assert all(r.ok for r in audit_mod.protocol_rows(moved, cf.ptx))   # against its own table
