"""The plan contract: names, numbers, budgets, errors and the JSON round trip."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fa4lab.errors import PlanError
from fa4lab.hardware import B200, H200
from fa4lab.limits import ALL_HEAD_DIMS, KERNEL_HEAD_DIMS
from fa4lab.plan import Plan, plan_forward
from fa4lab.spec import AttentionSpec


def spec(hd=128, causal=False, gqa=1, lse=False, seqlen=2048, batch=2, heads=8, hd_v=None):
    return AttentionSpec(batch, seqlen, seqlen, heads, heads // gqa, hd, hd_v, causal=causal,
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
    assert bars["o_empty"] == off["barriers"] + 8 * 24
    # Note [split P hand-off]: p_part (one per Q tile) after the pipelines' barriers.
    assert list(bars)[-1] == "p_part" and bars["p_part"] == bars["o_empty"] + 16
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


def test_head_dim_256_on_sm100_is_one_q_tile_with_two_s_buffers():
    p = plan_forward(spec(256), "sm100")
    t = p.tiles
    assert (t.q_stage, t.n_block, t.kv_stage) == (1, 128, 2)
    cols = {(r.name, r.stage): (r.col_offset, r.columns) for r in p.tmem.regions}
    assert cols == {("S", 0): (0, 128), ("P", 0): (64, 64), ("S", 1): (128, 128),
                    ("P", 1): (192, 64), ("O", 0): (256, 256)}
    assert p.tmem.total_cols == 512 and p.smem.total_bytes <= p.hardware.smem_per_cta
    assert p.barriers.barrier("kv_full").ring == "kv_ahead"
    # Two Q tiles do not fit, and the error says what does.
    with pytest.raises(PlanError) as err:
        plan_forward(spec(256), "sm100", q_stage=2)
    msg = str(err.value)
    assert "768" in msg and "512" in msg and "256 over" in msg
    assert "q_stage=1 fits (512 columns)" in msg


def test_over_budget_names_regions_and_a_fitting_override():
    with pytest.raises(PlanError, match="shared memory.*kv 3x65536.*kv_stage=2"):
        plan_forward(spec(256), "sm100", kv_stage=3)
    p = plan_forward(spec(256), "sm100", n_block=64)
    assert p.tmem.total_cols == 2 * 64 + 256


def test_unknown_and_bad_overrides():
    with pytest.raises(PlanError, match="unknown override.*n_blk.*known overrides"):
        plan_forward(spec(), "sm100", n_blk=64)
    with pytest.raises(PlanError, match="multiple of 16"):
        plan_forward(spec(), "sm90", n_block=72)
    with pytest.raises(PlanError, match="multiple of 32.*32 columns at a time"):
        plan_forward(spec(), "sm100", n_block=80)   # a tcgen05 N, but not the softmax's chunks
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
@given(arch=st.sampled_from(["sm100", "sm90"]), dims=st.sampled_from(ALL_HEAD_DIMS),
       n_block=st.sampled_from([None, 32, 64, 80, 96, 128, 144, 176, 256]),
       q_stage=st.sampled_from([None, 1, 2]), kv_stage=st.sampled_from([None, 2, 3, 4, 6]),
       causal=st.booleans(), gqa=st.sampled_from([1, 2, 4]))
def test_plan_invariants(arch, dims, n_block, q_stage, kv_stage, causal, gqa):
    ov = {k: v for k, v in dict(n_block=n_block, q_stage=q_stage, kv_stage=kv_stage).items()
          if v is not None}
    try:
        p = plan_forward(spec(dims[0], causal, gqa, hd_v=dims[1]), arch, **ov)
    except PlanError as err:
        assert "over" in str(err) or "must" in str(err) or "registers" in str(err)
        return
    _check_invariants(p)


@pytest.mark.parametrize("arch,dims", [(a, p) for a, pairs in KERNEL_HEAD_DIMS.items()
                                      for p in pairs])
@pytest.mark.parametrize("causal", [False, True])
def test_supported_defaults_fit(arch, dims, causal):
    _check_invariants(plan_forward(spec(dims[0], causal, gqa=4, hd_v=dims[1]), arch))


def test_the_plans_read_the_shared_limits():
    """Head dims, threshold and element sizes come from fa4lab.limits, not from copies."""
    from fa4lab.limits import ELEMENT_BYTES, RESCALE_THRESHOLDS, head_dims_text
    from fa4lab.plan.sm90 import SM90_TUNING
    from fa4lab.plan.sm100 import SM100_TUNING

    # One tuning row per (head_dim, head_dim_v) pair each kernel builds.
    assert sorted(SM90_TUNING) == sorted(KERNEL_HEAD_DIMS["sm90"])
    assert sorted(SM100_TUNING) == sorted(KERNEL_HEAD_DIMS["sm100"])
    for arch, pairs in KERNEL_HEAD_DIMS.items():
        for d, dv in pairs:
            p = plan_forward(spec(d, hd_v=dv), arch)
            assert p.rescale_threshold == RESCALE_THRESHOLDS[arch]
            assert p.spec.element_bytes == ELEMENT_BYTES[p.spec.dtype] == 2
            rows = p.tiles.m_block if arch == "sm100" else p.tiles.cta_m   # one Q load's rows
            assert p.barriers.barrier("q_full").tx_bytes == rows * d * p.spec.element_bytes
    with pytest.raises(PlanError, match=r"\(80, 80\) is not built by the sm90 kernel"):
        plan_forward(spec(80), "sm90")
    with pytest.raises(PlanError) as err:
        plan_forward(spec(256, hd_v=128), "sm100")
    assert head_dims_text("sm100") in str(err.value)


@pytest.mark.parametrize("arch", ["sm100", "sm90"])
@pytest.mark.parametrize("options", [
    dict(window_size=(256, 0)), dict(window_size=(None, 64)), dict(window_size=(0, 0)),
    dict(softcap=30.0), dict(learnable_sink=True),
    dict(causal=True, window_size=(100, None), softcap=5.0, learnable_sink=True, lse=True),
])
def test_plans_take_window_softcap_sink(arch, options):
    lse = options.pop("lse", False)
    s = spec(128, lse=lse).with_(**options)
    p = plan_forward(s, arch)
    assert p.spec == s
    _check_invariants(p)    # the JSON round trip keeps the window, softcap and sink


def _softmax_work(p) -> list[float]:
    """Cycles of every softmax step the simulator runs over a 4-block tile, 1 block masked."""
    from fa4lab.plan.simulate import Work, programs_for

    return [op.cycles for ops in programs_for(p, 4, masked_blocks=1).values() for op in ops
            if isinstance(op, Work) and op.unit == "mufu"]


@pytest.mark.parametrize("arch", ["sm100", "sm90"])
def test_softcap_adds_softmax_work_and_a_sink_none(arch):
    base = plan_forward(spec(128, causal=True), arch)
    plain = _softmax_work(base)
    capped = _softmax_work(plan_forward(base.spec.with_(softcap=30.0), arch))
    assert plain and len(capped) == len(plain)
    assert all(c > p for c, p in zip(capped, plain))
    assert _softmax_work(plan_forward(base.spec.with_(learnable_sink=True), arch)) == plain
