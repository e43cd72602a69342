"""The sm90 kernel compiles for sm_90a on a CPU (fake tensors), and its block ranges match
`fa4lab.tiling`. Tier 1: no GPU needed, nvidia-cutlass-dsl required."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fa4lab import tiling
from fa4lab.kernels.device import scheduler
from fa4lab.limits import KERNEL_HEAD_DIMS
from fa4lab.spec import AttentionSpec


@given(sq=st.integers(1, 3000), sk=st.integers(1, 3000), cta_m=st.sampled_from([64, 128]),
       n=st.sampled_from([80, 128, 176]), causal=st.booleans(), data=st.data())
@settings(max_examples=300, deadline=None)
def test_block_ranges_match_tiling(sq, sk, cta_m, n, causal, data):
    m = data.draw(st.integers(0, tiling.num_m_blocks(sq, cta_m) - 1))
    kw = dict(seqlen_q=sq, seqlen_k=sk, m_block_size=cta_m, n_block_size=n, causal=causal)
    lo, hi = tiling.n_block_range(m, **kw)
    mask_lo, _ = tiling.n_block_masked_range(m, **kw)
    assert lo == 0
    assert scheduler.n_block_max(m, cta_m, n, sq, sk, causal) == hi
    full = min(scheduler.n_block_full_end(m, cta_m, n, sq, sk, causal), hi)
    assert full == mask_lo


@given(batch=st.integers(1, 6), heads=st.integers(1, 40), sq=st.integers(1, 5000),
       sk=st.sampled_from([1, 100, 4096, 50_000, 400_000, 3_000_000]),
       cta_m=st.sampled_from([64, 128, 192]), head_dim=st.sampled_from([64, 128, 256]))
@settings(max_examples=150, deadline=None)
def test_lpt_coords_follow_tiling_lpt_order(batch, heads, sq, sk, cta_m, head_dim):
    # The kernel's device formula (run here on Python ints) against the numpy order notebook 02
    # teaches: same tile at every linear index, so every tile exactly once.
    work = tiling.Workload(batch=batch, heads=heads, seqlen_q=sq, seqlen_k=sk,
                           m_block_size=cta_m, n_block_size=128, causal=True, head_dim=head_dim)
    swizzle = scheduler.l2_swizzle(sk, 4 * head_dim, tiling.L2_KV_BUDGET_BYTES)
    assert swizzle == work.l2_swizzle
    n_m = scheduler.num_m_blocks(sq, cta_m)
    grid = scheduler.grid_shape(sq, heads, batch, cta_m, "lpt")
    assert grid == (work.num_tiles, 1, 1)
    got = [scheduler.lpt_coords(t, n_m, heads, batch, swizzle) for t in range(grid[0])]
    want = [(m, h, b) for b, h, m in tiling.lpt_order(work).tolist()]
    assert got == want


def test_pow2_floor_and_orders():
    assert [scheduler.pow2_floor(x) for x in (1, 2, 3, 4, 5, 1023, 1024, 2**31 - 1)] == [
        1, 2, 2, 4, 4, 512, 1024, 2**30]
    assert scheduler.grid_shape(1000, 8, 2, 128, "grid") == (8, 8, 2)
    assert scheduler.grid_shape(1000, 8, 2, 128, "grid_reversed") == (8, 8, 2)
    with pytest.raises(ValueError, match="unknown tile order"):
        scheduler.grid_shape(1000, 8, 2, 128, "spiral")


@pytest.mark.parametrize("causal", [False, True])
def test_plans_name_their_tile_order(causal):
    from fa4lab.plan import plan_forward

    spec = AttentionSpec(2, 1000, 1000, 8, 8, 128, causal=causal)
    assert plan_forward(spec, "sm90").tiles.order == ("lpt" if causal else "grid")
    assert plan_forward(spec, "sm100").tiles.order == ("grid_reversed" if causal else "grid")
    assert plan_forward(spec, "sm90").tiles.order in tiling.SCHEDULERS


@pytest.mark.compile
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS["sm90"])
def test_compiles_for_sm90a(head_dim, causal, tmp_path):
    """Every sm90 kernel configuration compiles and its binary holds to the plan: resources,
    no spills, and the barrier protocol (inits, per-path op sequence, loops, named barriers,
    SMEM offsets) against `plan.protocol`."""
    from audit_checks import compile_and_audit

    from fa4lab.kernels.fwd_sm90 import FlashForwardSm90
    from fa4lab.plan import plan_forward

    spec = AttentionSpec(2, 300, 700, 8, 2, head_dim, causal=causal, return_lse=causal)
    cf = compile_and_audit(plan_forward(spec, "sm90"), "sm90a", tmp_path)
    assert isinstance(cf.kernel, FlashForwardSm90) and cf.seconds > 0


@pytest.mark.compile
@pytest.mark.parametrize("head_dim,causal", [(64, True), (128, False)])
def test_softcap_compiles_for_sm90a(head_dim, causal, tmp_path):
    """With softcap (Note [softcap]): the same audit, the cap's tanh included."""
    from audit_checks import compile_and_audit

    from fa4lab.plan import plan_forward

    spec = AttentionSpec(2, 300, 700, 8, 2, head_dim, causal=causal, return_lse=True,
                         softcap=30.0)
    cf = compile_and_audit(plan_forward(spec, "sm90"), "sm90a", tmp_path)
    assert "tanh.approx.f32" in cf.ptx_path.read_text()


def test_port_table_reads_the_plans():
    pytest.importorskip("cutlass")
    from fa4lab.kernels.fwd_sm90 import port_table
    from fa4lab.plan import plan_forward

    spec = AttentionSpec(1, 2048, 2048, 8, 8, 128, causal=True)
    rows = {what: (b, h) for what, b, h in port_table(spec)}
    b, h = plan_forward(spec, arch="sm100"), plan_forward(spec, arch="sm90")
    assert rows["mbarriers"] == (str(b.barriers.mbarrier_count), str(h.barriers.mbarrier_count))
    assert rows["TMEM allocation"][0] == f"{b.tmem.alloc_cols} columns"
    assert f"{h.tiles.m_block * h.tiles.n_block // 128} fp32" in rows["S = Q K^T"][1]
    assert str(h.role("consumer0").registers) in rows["softmax"][1]


@pytest.mark.compile
@pytest.mark.parametrize("q_stage", [1, 2])
def test_audit_against_plan(q_stage):
    """The binary has what the plan says: barriers, setmaxnreg budgets, no spills, wgmma."""
    pytest.importorskip("cutlass")
    audit = pytest.importorskip("fa4lab.kernels.audit")
    from fa4lab.plan import plan_forward

    plan = plan_forward(AttentionSpec(1, 512, 512, 4, 4, 128, causal=True, return_lse=True),
                        arch="sm90", q_stage=q_stage)
    try:
        result = audit.audit(plan, arch="sm90a")
    except FileNotFoundError as e:
        pytest.skip(f"CUDA binary tools missing: {e}")
    assert result.row("mbarrier.init").found == plan.barriers.mbarrier_count
    if q_stage == 2:  # the shipped configuration: every row of the audit holds
        assert result.ok, result.failures()
    else:  # one consumer: compiles and keeps the plan's barriers and MMAs (registers untuned)
        rows = [r for r in result.rows if r.name.startswith(("setmaxnreg", "wgmma", "HGMMA"))]
        assert len(rows) >= 3 and all(r.ok for r in rows), rows
