"""The plan contract: names, numbers, budgets, errors and the JSON round trip."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fa4lab.errors import PlanError
from fa4lab.hardware import B200, H200
from fa4lab.plan import Plan, plan_forward
from fa4lab.spec import AttentionSpec


def spec(hd=128, causal=False, gqa=1, lse=False, seqlen=2048, batch=2, heads=8):
    return AttentionSpec(batch, seqlen, seqlen, heads, heads // gqa, hd, causal=causal,
                         return_lse=lse)


def test_sm100_defaults_are_fa4():
    p = plan_forward(spec(128), "sm100")
    t = p.tiles
    assert (t.m_block, t.n_block, t.q_stage, t.kv_stage, t.cta_m) == (128, 128, 2, 3, 256)
    assert p.threads_per_cta == 512
    assert {r.name: r.warps for r in p.roles}["softmax1"] == (4, 5, 6, 7)
    assert p.role("mma").warps == (12,) and p.role("load").warps == (13,)
    tm = p.tmem
    assert [tm.s_offset(i) for i in (0, 1)] == [0, 128]
    assert [tm.p_offset(i) for i in (0, 1)] == [64, 192]
    assert [tm.o_offset(i) for i in (0, 1)] == [256, 384]
    assert tm.total_cols == 512 and tm.alloc_cols == 512
    assert p.rescale_threshold == 8.0
    assert 0 < p.exp2_emulation_fraction < 1
    assert p.smem.total_bytes <= B200.smem_per_cta
    # SMEM as the kernel's SharedStorage declares it: tiles, mailbox, mbarriers, TMEM address.
    off = p.smem.offsets()
    assert [r.name for r in p.smem.regions] == ["q", "kv", "o", "stats", "barriers", "tmem_ptr"]
    assert (off["q"], off["kv"], off["o"]) == (0, 2 * 32768, 5 * 32768)
    bars = p.barrier_offsets()
    assert bars["q_full"] == off["barriers"] and bars["q_empty"] == off["barriers"] + 16
    assert list(bars)[-1] == "o_empty" and bars["o_empty"] == off["barriers"] + 8 * 24
    # What the compiled kernel's mbarrier.init addresses read (hd128, bf16): q_full at 231424.
    assert off["barriers"] == 231424 and bars["o_empty"] == 231616
    assert p.barriers.barrier("tmem").arrive_count == 416   # bar.sync 1, 416: 13 warps
    score, value = p.mma("score"), p.mma("value")
    assert (score.m, score.n, score.k, score.out) == (128, 128, 128, "tmem")
    assert (value.m, value.n, value.k, value.a_source) == (128, 128, 128, "tmem")


def test_sm90_defaults_are_fa3_style():
    p = plan_forward(spec(128), "sm90")
    assert p.tmem is None
    assert (p.tiles.m_block, p.tiles.q_stage, p.tiles.n_block, p.tiles.kv_stage) == (64, 2, 128, 2)
    assert p.threads_per_cta == 384
    assert p.role("load").registers <= 40 and p.role("consumer0").registers >= 232
    assert p.mma("value").a_source == "rmem"
    assert plan_forward(spec(256), "sm90").tiles.n_block == 80
    assert plan_forward(spec(64), "sm90").smem.total_bytes <= H200.smem_per_cta
    named = {b.name: b.named_id for b in p.barriers.barriers if b.kind == "named"}
    # The kernel's ids: each consumer's epilogue (1, 2), the ping-pong turns (4, 5).
    assert named == {"epilogue0": 1, "epilogue1": 2, "mma_turn0": 4, "mma_turn1": 5}
    assert p.barriers.mbarrier_count == sum(b.stages for b in p.barriers.barriers
                                            if b.kind == "mbarrier")


def test_head_dim_256_on_sm100_explains_the_fallback():
    with pytest.raises(PlanError) as err:
        plan_forward(spec(256), "sm100")
    msg = str(err.value)
    assert "768" in msg and "512" in msg and "256 over" in msg
    assert "q_stage=1" in msg and "sm90" in msg


def test_over_budget_names_regions_and_a_fitting_override():
    with pytest.raises(PlanError, match="shared memory.*kv 3x65536.*n_block=64"):
        plan_forward(spec(256), "sm100", q_stage=1)
    p = plan_forward(spec(256), "sm100", q_stage=1, n_block=64)
    assert p.tmem.total_cols == 64 + 256


def test_unknown_and_bad_overrides():
    with pytest.raises(PlanError, match="unknown override.*n_blk.*known overrides"):
        plan_forward(spec(), "sm100", n_blk=64)
    with pytest.raises(PlanError, match="multiple of 16"):
        plan_forward(spec(), "sm100", n_block=72)
    with pytest.raises(PlanError, match="unknown arch"):
        plan_forward(spec(), "sm80")
    with pytest.raises(PlanError, match="q_stage"):
        plan_forward(spec(), "sm90", q_stage=3)


def _check_invariants(p: Plan):
    hw = p.hardware
    assert p.smem.total_bytes <= hw.smem_per_cta
    offsets = p.smem.offsets()
    for r in p.smem.regions:
        assert offsets[r.name] % r.align == 0
    assert p.registers_used <= hw.registers_per_sm
    for r in p.roles:
        assert r.registers % 8 == 0 and 24 <= r.registers <= 256
    assert p.threads_per_cta == 32 * len({w for r in p.roles for w in r.warps})
    if p.tmem is not None:
        assert p.tmem.overlaps() == []
        assert p.tmem.total_cols <= hw.tmem_columns
        assert p.tmem.alloc_cols >= p.tmem.total_cols
        for r in p.tmem.regions:
            if r.name == "P":
                s = p.tmem.region("S", r.stage)
                assert s.col_offset <= r.col_offset and r.col_end <= s.col_end
                assert r.columns * 2 == p.tiles.n_block   # two 16-bit values per column
    roles = {r.name: r for r in p.roles}
    for b in p.barriers.barriers:
        for name in b.producers + b.consumers:
            assert name in roles, (b.name, name)
        # Arrivals per phase match who arrives: one elected thread (TMA, tcgen05.commit) or
        # every thread of one producer role (one role per stage); named barriers count both
        # warpgroups.
        if b.kind == "named":   # every thread of every role that syncs or arrives
            assert b.arrive_count == sum(roles[n].threads for n in {*b.producers, *b.consumers})
        elif b.arrive_count != 1:
            expected = (roles[b.producers[0]].threads if b.per_role_stage
                        else sum(roles[n].threads for n in b.producers))
            assert b.arrive_count == expected, b.name
        assert (b.tx_bytes > 0) == (b.producer == "load"), b.name
    assert Plan.from_dict(json.loads(p.to_json())) == p


@settings(max_examples=60, deadline=None)
@given(arch=st.sampled_from(["sm100", "sm90"]), hd=st.sampled_from([64, 128, 256]),
       n_block=st.sampled_from([None, 32, 64, 80, 96, 128, 144, 176, 256]),
       q_stage=st.sampled_from([None, 1, 2]), kv_stage=st.sampled_from([None, 2, 3, 4, 6]),
       causal=st.booleans(), gqa=st.sampled_from([1, 2, 4]))
def test_plan_invariants(arch, hd, n_block, q_stage, kv_stage, causal, gqa):
    ov = {k: v for k, v in dict(n_block=n_block, q_stage=q_stage, kv_stage=kv_stage).items()
          if v is not None}
    try:
        p = plan_forward(spec(hd, causal, gqa), arch, **ov)
    except PlanError as err:
        assert "over" in str(err) or "must" in str(err) or "registers" in str(err)
        return
    _check_invariants(p)


@pytest.mark.parametrize("arch,hd", [("sm100", 64), ("sm100", 128), ("sm90", 64),
                                     ("sm90", 128), ("sm90", 256)])
def test_supported_defaults_fit(arch, hd):
    _check_invariants(plan_forward(spec(hd), arch))


def test_the_plans_read_the_shared_limits():
    """Head dims, threshold and element sizes come from fa4lab.limits, not from copies."""
    from fa4lab.limits import ELEMENT_BYTES, KERNEL_HEAD_DIMS, RESCALE_THRESHOLD
    from fa4lab.plan.sm90 import SM90_TUNING

    assert sorted(SM90_TUNING) == sorted(KERNEL_HEAD_DIMS["sm90"])   # one tuning row per dim
    for arch, dims in KERNEL_HEAD_DIMS.items():
        for d in dims:
            p = plan_forward(spec(d), arch)
            assert p.rescale_threshold == RESCALE_THRESHOLD
            assert p.spec.element_bytes == ELEMENT_BYTES[p.spec.dtype] == 2
            rows = p.tiles.m_block if arch == "sm100" else p.tiles.cta_m   # one Q load's rows
            assert p.barriers.barrier("q_full").tx_bytes == rows * d * p.spec.element_bytes
    with pytest.raises(PlanError, match="64, 128 or 256"):
        plan_forward(spec(96), "sm90")
    with pytest.raises(PlanError, match="builds head_dim 64, 128"):
        plan_forward(spec(256), "sm100")
