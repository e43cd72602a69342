"""Every (head_dim, head_dim_v) pair the kernels build, planned and simulated (tier 0, CPU).

The pairs come from `fa4lab.limits.KERNEL_HEAD_DIMS`; compiling them for sm_90a / sm_100a is
tests/test_sm90_compile.py and tests/test_compile_sm100.py, running them on a GPU
tests/test_sm90.py and tests/test_sm100.py. Here: the plans' protocol runs clean in the
simulator, and what head_dim_v < head_dim changes on sm100 -- a K/V ring whose V phases bring
fewer bytes, O staged in Q's bytes -- is in the protocol the kernel and the simulator share.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fa4lab.errors import PlanError
from fa4lab.limits import KERNEL_HEAD_DIMS
from fa4lab.plan import plan_forward
from fa4lab.plan.barriers import BarrierGraph
from fa4lab.plan.simulate import Arrive, Issue, Work, programs_for, simulate
from fa4lab.plan.smem import SmemPlan, SmemRegion
from fa4lab.spec import AttentionSpec

BUILT = [(arch, dims) for arch, pairs in KERNEL_HEAD_DIMS.items() for dims in pairs]


def _spec(dims, causal=False, gqa=2):
    return AttentionSpec(2, 1000, 1000, 8, 8 // gqa, *dims, causal=causal)


def _id(case):
    arch, (d, dv) = case
    return f"{arch}-hd{d}" + ("" if d == dv else f"x{dv}")


@pytest.mark.parametrize("case", BUILT, ids=_id)
@pytest.mark.parametrize("causal", [False, True])
def test_every_built_pair_simulates_clean(case, causal):
    """No deadlock, no hazard, nothing left on a barrier, with one block and with several."""
    arch, dims = case
    plan = plan_forward(_spec(dims, causal), arch)
    assert (plan.tiles.head_dim, plan.tiles.head_dim_v) == dims
    for n in (1, 3):
        r = simulate(plan, n, masked_blocks=1 if causal else 0)
        assert r.ok and r.leftover == {}, r.summary()


def _split_pairs(arch):
    return [dims for dims in KERNEL_HEAD_DIMS[arch] if dims[1] != dims[0]]


@pytest.mark.parametrize("dims", _split_pairs("sm100"))
def test_sm100_ring_phases_expect_each_boxes_bytes(dims):
    """K and V share the ring's buffers (each as large as the wider K block); a V phase of
    kv_full expects V's bytes, and every TMA into the ring brings what its phase expects."""
    plan = plan_forward(_spec(dims), "sm100")
    t, eb = plan.tiles, plan.spec.element_bytes
    kv = plan.barriers.barrier("kv_full")
    k_bytes, v_bytes = t.n_block * t.head_dim * eb, t.n_block * t.head_dim_v * eb
    assert (kv.slot_tx_bytes("K+1"), kv.slot_tx_bytes("V")) == (k_bytes, v_bytes)
    assert plan.smem.region("kv").bytes_per_stage == max(k_bytes, v_bytes)
    load = programs_for(plan, 4)["load"]
    expected = [op.expect_tx for op in load if isinstance(op, Arrive) and op.barrier == "kv_full"]
    landed = [op.complete_tx[2] for op in load
              if isinstance(op, Issue) and op.complete_tx and op.complete_tx[0] == "kv_full"]
    assert expected == landed == [k_bytes, v_bytes] * 4


@pytest.mark.parametrize("dims", _split_pairs("sm100"))
def test_sm100_v_phases_with_k_bytes_deadlock(dims):
    """The V byte count has teeth: a table whose V phases expected K's bytes never completes
    them (the TMA of a V block brings fewer), and the simulator says where it stops."""
    plan = plan_forward(_spec(dims), "sm100")
    bars = BarrierGraph(tuple(dataclasses.replace(b, tx_bytes_v=0) if b.name == "kv_full" else b
                              for b in plan.barriers.barriers))
    wrong = dataclasses.replace(plan, protocol=plan.protocol.with_barriers(bars))
    r = simulate(wrong, 3)
    assert not r.ok and any("kv_full" in line for line in r.deadlock), r.summary()


def test_sm100_o_staged_in_q_is_in_the_protocol():
    """Where the plan stages O in Q's bytes, the simulator's correction writes Q_i's region and
    the epilogue's TMA store reads it: the hazard check covers the reuse."""
    staged = [dims for dims in KERNEL_HEAD_DIMS["sm100"]
              if plan_forward(_spec(dims), "sm100").smem.region("o").alias_of == "q"]
    assert staged, "no sm100 pair stages O in Q"
    for dims in staged:
        plan = plan_forward(_spec(dims), "sm100")
        assert plan.smem.region("o").bytes_per_stage <= plan.smem.region("q").bytes_per_stage
        progs = programs_for(plan, 2)
        writes = {(r.name, r.stage) for op in progs["correction"] if isinstance(op, Work)
                  and op.label.endswith("to SMEM") for r in op.writes}
        reads = {(r.name, r.stage) for op in progs["epilogue"] if isinstance(op, Issue)
                 and op.engine == "tma_store" for r in op.reads}
        assert writes == reads == {("q", i) for i in range(plan.tiles.q_stage)}


def test_an_alias_stage_must_fit_a_stage_of_its_target():
    """O stage i lives in Q stage i (the kernels give it Q's stage stride): a larger stage is
    refused even when the totals would fit."""
    q = SmemRegion("q", 4096, 2)
    with pytest.raises(PlanError, match="each of its stages must fit in a stage of q"):
        SmemPlan.build((q, SmemRegion("o", 6144, 1, alias_of="q")), 1 << 20)
    with pytest.raises(PlanError, match="each of its stages"):
        SmemPlan.build((q, SmemRegion("o", 1024, 3, alias_of="q")), 1 << 20)
    plan = SmemPlan.build((q, SmemRegion("o", 4096, 2, alias_of="q")), 1 << 20)
    assert plan.offsets()["o"] == plan.offsets()["q"] and plan.total_bytes == 8192


@pytest.mark.parametrize("case", BUILT, ids=_id)
def test_plans_fit_without_overrides_and_record_the_pair(case):
    """The default plan of a built pair fits every budget of its arch; the MMAs take K's width
    for the score product and V's for the value product."""
    arch, (d, dv) = case
    plan = plan_forward(_spec((d, dv), causal=True, gqa=4), arch)
    hw = plan.hardware
    assert plan.smem.total_bytes <= hw.smem_per_cta
    assert plan.registers_used <= hw.registers_per_sm
    if plan.tmem is not None:
        assert plan.tmem.total_cols <= hw.tmem_columns
        assert all(r.columns == dv for r in plan.tmem.regions if r.name == "O")
    assert plan.mma("score").k == d and plan.mma("value").n == dv
    assert plan.barriers.barrier("q_full").tx_bytes % (d * plan.spec.element_bytes) == 0


def test_sm100_hd96_plan_computes_attention():
    """The data-carrying simulator runs the head_dim 96 plan's programs on numpy TMEM/SMEM:
    causal, GQA, tails and rows that see no key, against the float64 reference. ((192, 128)
    stages O in Q's bytes, which the data simulator does not model.)"""
    from fa4lab.plan import datasim as ds
    from fa4lab.plan import datasim_check as dc
    from fa4lab.reference import attention_reference

    rng = np.random.default_rng(96)
    q = rng.standard_normal((1, 300, 4, 96)).astype(np.float32)
    k, v = (rng.standard_normal((1, 200, 2, 96)).astype(np.float32) for _ in range(2))
    run = ds.run_plan(ds.plan_for(q, k, v, causal=True), q, k, v)
    qb, kb, vb = (ds.round16(x, "bf16") for x in (q, k, v))
    ref, ref_lse = attention_reference(qb, kb, vb, causal=True, return_lse=True)
    assert np.isfinite(run.out).all()
    assert np.abs(run.out - ref).max() <= dc.tolerance(vb, "bf16")
    empty = np.isneginf(ref_lse)
    assert empty.any() and (np.isneginf(run.lse) == empty).all()
    assert np.abs(run.lse[~empty] - ref_lse[~empty]).max() <= 1e-3
