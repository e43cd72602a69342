"""The protocol simulator: clean runs, every single-edge removal caught, the engine itself."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fa4lab.errors import PlanError
from fa4lab.plan import plan_forward
from fa4lab.plan.barriers import BarrierGraph
from fa4lab.plan.simulate import (
    Arrive,
    Issue,
    Ref,
    Simulator,
    Wait,
    WaitEngine,
    Work,
    edge_check,
    mutation_check,
    programs_for,
    simulate,
    unobservable,
)
from fa4lab.plan.throughput import block_cycles, predict, predict_with, tile_classes, useful_flops
from fa4lab.spec import AttentionSpec

# sm100 head_dim 256 plans one Q tile with the S ping-pong (Note [S ping-pong]).
SUPPORTED = [("sm100", 64), ("sm100", 128), ("sm100", 256), ("sm90", 64), ("sm90", 128),
             ("sm90", 256)]


def spec(hd, causal=False, gqa=1):
    return AttentionSpec(2, 4096, 4096, 8, 8 // gqa, hd, causal=causal)


def plan(arch, hd, **kw):
    return plan_forward(spec(hd), arch, **kw)


def unguarded(p) -> set[str]:
    """Barriers whose removal a one-tile simulation cannot notice, read off the table: those
    only ever waited on their released first phase (they order successive work tiles; the
    kernels run one per CTA), and those a role syncs with itself (its warps' order, while the
    simulator runs a role as one agent)."""
    own = {b.name for b in p.barriers.barriers if set(b.producers) == set(b.consumers)}
    return p.protocol.first_use_only(p.tiles.q_stage) | own


@pytest.mark.parametrize("arch,hd", SUPPORTED)
@pytest.mark.parametrize("n_blocks,masked", [(1, 1), (2, 0), (5, 2), (9, 1)])
def test_unmutated_graph_runs_clean(arch, hd, n_blocks, masked):
    p = plan(arch, hd)
    r = simulate(p, n_blocks, masked_blocks=masked)
    assert r.ok, r.summary()
    # Every phase that was started was finished (arrivals match arrive_count exactly): no
    # arrival is left on any barrier at exit.
    assert r.leftover == {}, r.leftover
    assert r.cycles > 0


def test_unguarded_barriers_are_the_tile_boundary_and_intra_role_ones():
    # Persistent (Note [persistent CTAs]): q_empty and o_empty order a CTA's work tiles, and
    # the simulator runs two, so every edge shows. One tile per CTA (O staged in Q's bytes):
    # they are only ever waited on their released first phase.
    assert plan("sm100", 128).protocol.persistent
    assert unguarded(plan("sm100", 128)) == set()
    assert not plan("sm100", 128, persistent=False).protocol.persistent
    assert unguarded(plan("sm100", 128, persistent=False)) == {"q_empty", "o_empty"}
    assert unguarded(plan("sm100", 256)) == {"q_empty", "o_empty"}
    assert unguarded(plan("sm90", 64)) == {"epilogue0", "epilogue1", "epilogue2"}


@pytest.mark.parametrize("arch,hd", [("sm100", 128), ("sm90", 128)])
@pytest.mark.parametrize("causal,gqa", [(True, 1), (False, 4), (True, 4)])
def test_spec_variants_run_clean(arch, hd, causal, gqa):
    p = plan_forward(spec(hd, causal, gqa), arch)
    assert simulate(p, 4, 2, masked_blocks=2 if causal else 0).ok


@pytest.mark.parametrize("arch,hd,overrides", [
    ("sm100", 128, {"n_block": 64}), ("sm100", 64, {"kv_stage": 4}),
    ("sm100", 128, {"q_stage": 1}), ("sm90", 64, {"kv_stage": 3}), ("sm90", 64, {"q_stage": 1}),
])
def test_overridden_plans_run_clean(arch, hd, overrides):
    assert simulate(plan(arch, hd, **overrides), 5, 2).ok


def _edges(arch, hd):
    return [(arch, hd, b.name) for b in plan(arch, hd).barriers.barriers]


ALL_EDGES = [e for a, h in SUPPORTED for e in _edges(a, h)]


@pytest.mark.parametrize("arch,hd,barrier", ALL_EDGES)
def test_removing_any_edge_is_caught(arch, hd, barrier):
    """Drop the barrier (its waits and arrivals): the simulator must see a hazard or deadlock,
    unless the table says no one-tile run can (`unguarded`): then it must see nothing."""
    p = plan(arch, hd)
    if barrier in unguarded(p):
        assert edge_check(p, barrier) == ""
    else:
        assert edge_check(p, barrier), f"removing {barrier} went unnoticed"


@settings(max_examples=12, deadline=None)
@given(arch=st.sampled_from(["sm100", "sm90"]), hd=st.sampled_from([64, 128, 256]),
       n_block=st.sampled_from([32, 64, 80, 128]), q_stage=st.sampled_from([1, 2]),
       kv_stage=st.sampled_from([2, 3, 4]), causal=st.booleans())
def test_every_plan_variant_is_clean_and_minimal(arch, hd, n_block, q_stage, kv_stage, causal):
    try:
        p = plan_forward(spec(hd, causal), arch, n_block=n_block, q_stage=q_stage,
                         kv_stage=kv_stage)
    except PlanError:
        return
    for n in (1, 4):
        r = simulate(p, n, masked_blocks=1 if causal else 0)
        assert r.ok and r.leftover == {}, r.summary()
    checks = mutation_check(p)
    assert {k for k, v in checks.items() if not v} == unguarded(p), checks


@pytest.mark.parametrize("arch,hd,barrier", ALL_EDGES)
def test_missing_arrivals_deadlock(arch, hd, barrier):
    p = plan(arch, hd)
    r = simulate(p, 4, drop=barrier, mutation="drop_arrive")
    if barrier in p.protocol.first_use_only(p.tiles.q_stage):
        assert r.ok, r.summary()   # no wait ever needs an arrival on it
    else:
        assert r.deadlock and any(barrier in line for line in r.deadlock), r.summary()


@pytest.mark.parametrize("name,factor", [("p_ready", 2), ("kv_full", 2), ("stats_full", 2)])
def test_wrong_arrive_count_is_caught(name, factor):
    p = plan("sm100", 128)
    bars = tuple(dataclasses.replace(b, arrive_count=b.arrive_count * factor)
                 if b.name == name else b for b in p.barriers.barriers)
    r = simulate(dataclasses.replace(p, protocol=p.protocol.with_barriers(BarrierGraph(bars))), 4)
    assert r.deadlock


def test_too_few_arrivals_expected_is_caught():
    p = plan("sm100", 128)
    bars = tuple(dataclasses.replace(b, arrive_count=b.arrive_count // 2)
                 if b.name == "p_ready" else b for b in p.barriers.barriers)
    r = simulate(dataclasses.replace(p, protocol=p.protocol.with_barriers(BarrierGraph(bars))), 4)
    assert not r.ok


def test_unknown_barrier_and_mutation():
    with pytest.raises(KeyError, match="kv_empty"):
        simulate(plan("sm100", 128), drop="nope")
    with pytest.raises(ValueError, match="mutation"):
        simulate(plan("sm100", 128), drop="s_full", mutation="shuffle")


# ---- the engine on hand-written programs ----
BUF = Ref("smem", "buf", 0)


def _run(programs, needed):
    from fa4lab.plan.costs import DEFAULT_COSTS

    return Simulator(programs, needed, DEFAULT_COSTS).run()


def test_engine_orders_through_a_barrier():
    progs = {"w": [Work("write", 10, writes=(BUF,)), Arrive("full", 0, 1)],
             "r": [Wait("full", 0, 0), Work("read", 5, reads=(BUF,))]}
    r = _run(progs, {("full", 0): 1})
    assert r.ok and r.cycles >= 15


def test_engine_flags_unordered_read_even_when_timing_is_benign():
    # The reader starts late enough to see the data, but nothing orders it: still a hazard.
    progs = {"w": [Work("write", 10, writes=(BUF,)), Arrive("other", 0, 1)],
             "r": [Work("idle", 100), Work("read", 5, reads=(BUF,))]}
    r = _run(progs, {("other", 0): 1})
    assert [h.kind for h in r.hazards] == ["read unordered with write"]


def test_engine_flags_read_before_any_write_and_deadlock():
    r = _run({"r": [Work("read", 5, reads=(BUF,))]}, {})
    assert r.hazards[0].kind == "read before written"
    r = _run({"r": [Wait("full", 0, 0)]}, {("full", 0): 1})
    assert r.deadlock and "full[0]" in r.deadlock[0]


def test_engine_tma_transaction_bytes_complete_the_phase():
    progs = {"load": [Arrive("full", 0, 1, expect_tx=4096),
                      Issue("tma", "copy", 64, writes=(BUF,), complete_tx=("full", 0, 4096))],
             "use": [Wait("full", 0, 0), Work("read", 5, reads=(BUF,))]}
    r = _run(progs, {("full", 0): 1})
    assert r.ok
    progs["load"][1] = Issue("tma", "copy", 64, writes=(BUF,), complete_tx=("full", 0, 2048))
    assert _run(progs, {("full", 0): 1}).deadlock   # bytes missing: phase never completes


def test_tmem_alias_cells_overlap():
    s = Ref("tmem", "S", 0, 0, 128)
    p = Ref("tmem", "P", 0, 64, 128)
    o = Ref("tmem", "O", 0, 256, 384)
    assert set(p.cells()) < set(s.cells())
    assert not set(o.cells()) & set(s.cells())


def test_prediction_is_bounded_and_counts_causal_work():
    for arch in ("sm100", "sm90"):
        full = predict(plan_forward(spec(128), arch))
        causal = predict(plan_forward(spec(128, causal=True), arch))
        assert 0.3 < full.utilization < 1.0
        assert 0.2 < causal.utilization < 1.0
        # Causal skips about half the blocks: it takes less time, not more.
        assert causal.seconds < full.seconds


@pytest.mark.parametrize("sq,sk", [(7, 3), (3, 7), (5, 5), (1, 9)])
def test_useful_flops_counts_visible_scores(sq, sk):
    import numpy as np

    s = AttentionSpec(2, sq, sk, 3, 3, 16, causal=True)
    i, j = np.meshgrid(np.arange(sq), np.arange(sk), indexing="ij")
    visible = int((j <= i + sk - sq).sum())   # bottom-right causal, as in fa4lab.spec
    expected = 2.0 * 2 * 3 * visible * 32
    got = useful_flops(s)
    if sq == sk:   # the benchmark convention (halved) is used: within one diagonal
        assert abs(got - expected) <= 2.0 * 2 * 3 * sq * 32
    else:
        assert got == expected


def test_prediction_never_beats_peak_on_lopsided_causal():
    p = plan_forward(AttentionSpec(1, 5000, 100, 16, 16, 128, causal=True), "sm100")
    assert 0 < predict(p).utilization < 1


# ---- window-aware throughput (fa4lab.plan.throughput) ----
def _work_cycles(p, s, b):
    """(total, longest) cycles of every work tile of spec `s` on plan `p`, counted from
    `fa4lab.tiling.classify_tiles` (a tile's masked blocks are those needing the element mask)
    and the plan's simulated block costs `b` (`block_cycles(p)`)."""
    import numpy as np

    tc = tile_classes(dataclasses.replace(p, spec=s))
    visible = tc.kinds != 0
    masked = (visible & tc.needs_element_mask).sum(axis=1)
    unmasked = (visible & ~tc.needs_element_mask).sum(axis=1)
    per_tile = (max(b.fixed, 0.0) + b.unmasked * unmasked
                + max(b.masked, b.unmasked) * masked)
    heads = s.heads_kv if p.tiles.pack_gqa else s.heads_q
    return float(np.sum(per_tile)) * s.batch * heads, float(per_tile.max())


WINDOWS = [   # (causal, window_size, seqlen_q, seqlen_k)
    (False, (None, None), 4096, 4096), (True, (None, None), 4096, 4096),
    (True, (1024, None), 4096, 4096), (False, (512, 512), 4096, 4096),
    (False, (0, 0), 3000, 3000), (True, (300, None), 1000, 5000), (False, (None, 700), 5000, 1000),
]


@pytest.mark.parametrize("arch", ["sm100", "sm90"])
@pytest.mark.parametrize("causal,window,sq,sk", WINDOWS)
def test_prediction_follows_the_visible_blocks(arch, causal, window, sq, sk):
    """Greedy dispatch (each tile to the first free SM) ends between total work / SMs and that
    plus the longest tile; a persistent plan's round-robin CTAs (scheduling.schedule_persistent)
    between total work / SMs and their tile count times the longest tile. The work is the
    visible blocks of classify_tiles, so a window's prediction shrinks with the blocks it
    skips."""
    s = AttentionSpec(4, sq, sk, 16, 4, 128, causal=causal, window_size=window)
    p = plan_forward(s, arch)
    hw = p.hardware
    b = block_cycles(p)
    total, longest = _work_cycles(p, s, b)
    pred = predict(p)
    assert pred.block_cycles == b
    cycles = pred.seconds * hw.clock_ghz * 1e9
    upper = (math.ceil(pred.tiles / hw.num_sms) * longest if p.protocol.persistent
             else total / hw.num_sms + longest)
    assert total / hw.num_sms * (1 - 1e-9) <= cycles <= upper * (1 + 1e-9)
    dense = s.with_(causal=False, window_size=(None, None))
    # predict(p, spec=dense), its block cycles simulated once above, not again (3-4 tiles)
    dense_pred = predict_with(p, b, spec=dense)
    if s.has_mask:
        assert pred.seconds < dense_pred.seconds
    if p.protocol.persistent:
        return   # a static assignment's imbalance is not bounded by one tile per SM
    dense_total, dense_longest = _work_cycles(p, dense, b)
    ratio = pred.seconds / dense_pred.seconds
    # So the ratio of the times is the ratio of the work, up to the longest tile per SM.
    slack = hw.num_sms * max(longest, dense_longest) / dense_total
    assert abs(ratio - total / dense_total) <= slack * (1 + 1e-9)


@pytest.mark.parametrize("arch", ["sm100", "sm90"])
def test_block_cycles_match_simulated_tiles(arch):
    """The fitted tile time (Note [tile time]) is the simulated one within a few percent, for
    tile lengths and masked counts outside the fit's three points."""
    from fa4lab.plan.calibration import costs_for

    p = plan(arch, 128)
    costs = costs_for(p.hardware)
    b = block_cycles(p, costs)
    for n, m in [(2, 0), (4, 1), (6, 3), (12, 2), (16, 16), (30, 0)]:
        one = simulate(p, n, 1, costs, masked_blocks=m).cycles
        # A CTA of its own (and its start), or a persistent CTA's further tile (its time
        # after the first).
        if p.protocol.persistent:
            simulated = simulate(p, n, 2, costs, masked_blocks=m).cycles - one
        else:
            simulated = one + costs.cta_start_cycles
        assert b.tile(n - m, m) == pytest.approx(simulated, rel=0.07), (n, m)


def test_softcap_costs_a_tanh_and_a_multiply_per_score():
    from fa4lab.hardware import B200
    from fa4lab.plan.costs import DEFAULT_COSTS as C

    scores = 128 * 128
    for f in (0.0, 0.25, 1.0):
        for masked in (False, True):
            plain = C.softmax_cycles(B200, scores, f, masked)
            capped = C.softmax_cycles(B200, scores, f, masked, softcap=True)
            assert capped > plain
            free = C.with_(mufu_ops_per_softcap_score=0.0, fma_ops_per_softcap_score=0.0)
            assert free.softmax_cycles(B200, scores, f, masked, softcap=True) == plain
    # All exp2 on MUFU (f = 0) is MUFU-bound: the tanh doubles its MUFU work.
    assert C.softmax_cycles(B200, scores, 0.0, softcap=True) == pytest.approx(
        2 * C.softmax_cycles(B200, scores, 0.0))


@pytest.mark.parametrize("arch", ["sm100", "sm90"])
def test_softcap_and_sink_in_the_prediction(arch):
    """sm100 is bound by exp2 already at half its MMA time, so a tanh per score slows it; the
    sm90 ping-pong hides the softmax behind the other consumer's MMAs, all of it with no
    stall (the uncalibrated model) and all but the share that stalls them with the H200's
    calibrated CostModel.sm90_softmax_stall. A sink costs nothing per block."""
    from fa4lab.plan.costs import DEFAULT_COSTS

    base = AttentionSpec(2, 4096, 4096, 16, 16, 128, causal=True)
    plain = predict(plan_forward(base, arch))
    capped = predict(plan_forward(base.with_(softcap=30.0), arch))
    sunk = predict(plan_forward(base.with_(learnable_sink=True), arch))
    assert sunk.seconds == plain.seconds
    if arch == "sm100":
        assert capped.seconds > 1.2 * plain.seconds
    else:
        hidden = predict(plan_forward(base.with_(softcap=30.0), arch), DEFAULT_COSTS)
        assert hidden.seconds == pytest.approx(
            predict(plan_forward(base, arch), DEFAULT_COSTS).seconds, rel=0.05)
        assert plain.seconds < capped.seconds < 1.2 * plain.seconds


@pytest.mark.parametrize("window,sq,sk", [((2, 0), 7, 7), ((None, 1), 5, 9), ((3, 2), 9, 4),
                                          ((0, None), 6, 6), ((1, 1), 1, 1)])
def test_useful_flops_counts_windowed_scores(window, sq, sk):
    import numpy as np

    s = AttentionSpec(2, sq, sk, 3, 3, 16, window_size=window)
    left, right = s.effective_window
    i, j = np.meshgrid(np.arange(sq), np.arange(sk), indexing="ij")
    d = sk - sq
    seen = np.ones_like(i, dtype=bool)
    if left is not None:
        seen &= j >= i + d - left
    if right is not None:
        seen &= j <= i + d + right
    expected = 2.0 * 2 * 3 * int(seen.sum()) * 32
    if s.causal and sq == sk and (left is None or left >= sk - 1):
        assert abs(useful_flops(s) - expected) <= 2.0 * 2 * 3 * sq * 32   # halved convention
    else:
        assert useful_flops(s) == expected


# ---- store drains: cp.async.bulk.wait_group.read N (Note [store drains]) ----
def test_engine_drain_waits_for_the_older_stores_only():
    from fa4lab.plan.costs import DEFAULT_COSTS as C

    progs = {"e": [Issue("tma_store", "fast", 10), Issue("tma_store", "slow", 1000),
                   WaitEngine("tma_store", pending=1), Arrive("first", 0, 1),
                   WaitEngine("tma_store"), Arrive("both", 0, 1)]}
    r = _run(progs, {("first", 0): 1, ("both", 0): 1})
    assert r.ok
    # The fast store runs 0..10 on the engine, the slow one 10..1010; each lands a latency later.
    assert r.phase_times["first[0]"] == [10 + C.tma_latency]
    assert r.phase_times["both[0]"] == [1010 + C.tma_latency]


@pytest.mark.parametrize("q_stage", [1, 2])
def test_sm100_epilogue_drains_as_the_kernel(q_stage):
    # fwd_sm100's epilogue: cp_async_bulk_wait_group(q_stage - 1 - stage, read=True)
    progs = programs_for(plan("sm100", 128, q_stage=q_stage), 3)
    drains = [op.pending for op in progs["epilogue"] if isinstance(op, WaitEngine)]
    assert drains == [q_stage - 1 - i for i in range(q_stage)]


def _slow_store_1(p, drain=None):
    """The sm100 plan over 3 blocks with store O1 50x slower (and, given `drain`, every drain
    replaced by it): (result, when store O0 and store O1 completed)."""
    from fa4lab.plan.costs import DEFAULT_COSTS as C

    progs = programs_for(p, 3)
    progs["epilogue"] = [
        dataclasses.replace(op, cycles=op.cycles * 50)
        if isinstance(op, Issue) and op.label == "store O1"
        else drain if drain is not None and isinstance(op, WaitEngine) else op
        for op in progs["epilogue"]]
    needed = {(b.name, s): b.arrive_count for b in p.barriers.barriers for s in range(b.stages)}
    r = Simulator(progs, needed, C, p.arch).run()
    done = {s.label: s.end + C.tma_latency for s in r.spans if s.lane == "tma_store"}
    return r, done["store O0"], done["store O1"]


def test_o_empty_0_is_released_while_a_slow_store_1_is_in_flight():
    p = plan("sm100", 128)
    r, store0, store1 = _slow_store_1(p)
    assert r.ok, r.summary()
    assert store0 < store1
    assert r.phase_times["o_empty[0]"] == [store0]     # wait_group.read 1: store 0 only
    assert r.phase_times["o_empty[1]"] == [store1]     # wait_group.read 0: both
    # Draining with wait-all (wait_group 0 both times) would hold o_empty[0] until store 1.
    r, _, store1 = _slow_store_1(p, drain=WaitEngine("tma_store"))
    assert r.phase_times["o_empty[0]"] == [store1]


@pytest.mark.parametrize("options", [dict(window_size=(8, 0)), dict(softcap=5.0),
                                     dict(learnable_sink=True)])
def test_data_simulator_refuses_what_it_does_not_model(options):
    """The data-carrying simulator computes plain or causal attention; a window, softcap or sink
    plan is refused before it runs rather than giving the wrong output."""
    import numpy as np

    from fa4lab.plan.datasim import run_plan

    s = AttentionSpec(1, 64, 64, 1, 1, 64, **options)
    q = np.zeros((1, 64, 1, 64), np.float32)
    with pytest.raises(ValueError, match=next(iter(options))):
        run_plan(plan_forward(s, "sm100"), q, q, q)


PERSISTENT_EDGES = [(arch, hd, b.name) for arch in ("sm100", "sm90") for hd in (64, 128)
                    for b in plan(arch, hd, persistent=True).barriers.barriers
                    if b.name not in unobservable(plan(arch, hd, persistent=True))]


@pytest.mark.parametrize("arch,hd,barrier", PERSISTENT_EDGES)
def test_persistent_plan_needs_every_edge(arch, hd, barrier):
    """Note [persistent CTAs] (sm100) and Note [sm90 persistent CTAs]: two work tiles per CTA,
    so q_empty (and on sm100 o_empty), which order the tiles, show too; removing any barrier is
    a hazard or a deadlock."""
    p = plan(arch, hd, persistent=True)
    assert edge_check(p, barrier, n_tiles=2), f"removing {barrier} went unnoticed"


def test_sm90_persistent_consumer_drains_its_store_before_reusing_o():
    """Note [sm90 persistent CTAs]: without the drain of the last O store at the next tile's
    epilogue, the simulator sees the store still reading O's SMEM while the next O is written."""
    from dataclasses import replace

    from fa4lab.plan.protocol import Step, TileLoop

    p = plan("sm90", 128, persistent=True)
    assert simulate(p, 1, 3).ok
    prog = p.protocol.program("consumer")

    def strip(body):
        out = []
        for n in body:
            if isinstance(n, Step) and n.what == "drain store":
                continue
            out.append(replace(n, body=strip(n.body)) if isinstance(n, TileLoop) else n)
        return tuple(out)

    broken = replace(p.protocol, programs=tuple(
        replace(x, body=strip(x.body)) if x is prog else x for x in p.protocol.programs))
    r = simulate(replace(p, protocol=broken), 1, 3)
    assert any(h.region.startswith("o[") for h in r.hazards), r.summary()


@pytest.mark.parametrize("n_tiles,n_blocks,masked", [(1, 3, 1), (2, 1, 1), (3, 4, 2)])
def test_persistent_plan_runs_clean_over_tiles(n_tiles, n_blocks, masked):
    p = plan_forward(spec(128, causal=True), "sm100", persistent=True)
    r = simulate(p, n_blocks, n_tiles, masked_blocks=masked)
    assert r.ok and r.leftover == {} and r.n_tiles == n_tiles, r.summary()
    # Tile t + 1's Q loads while tile t's epilogue runs (q_empty, not o_empty, gates it).
    if n_tiles > 1:
        one = simulate(p, n_blocks, 1, masked_blocks=masked).cycles
        assert r.cycles < n_tiles * one


def test_one_tile_plans_refuse_persistence():
    with pytest.raises(PlanError, match="persistent"):
        plan("sm100", 256, persistent=True)
    with pytest.raises(PlanError, match="persistent"):
        plan("sm90", 256, persistent=True)
    r = simulate(plan("sm100", 128, persistent=False), 3, 2)
    assert r.n_tiles == 1   # one work tile per CTA: the simulator runs one


@pytest.mark.parametrize("hd,page_size", [(64, 1), (96, 1), (128, 4), (128, 100), (256, 8)])
def test_cp_async_plans_run_clean_and_every_edge_counts(hd, page_size):
    """A cp.async producer (Note [cp.async pages] in fa4lab.limits): K and V fulls count the
    128 producer threads' arrivals, no bytes; the table runs clean, and dropping any edge or
    any arrival is seen as on the TMA plan."""
    from fa4lab.plan.sm90 import SM90_CP_ASYNC_REGISTERS

    p = plan_forward(AttentionSpec(2, 4096, 4096, 8, 8, hd, causal=True, page_size=page_size),
                     "sm90")
    assert p.tiles.kv_load == "cp.async"
    full = {b.name: b for b in p.barriers.barriers if b.name in ("k_full", "v_full")}
    assert {(b.arrive_count, b.tx_bytes) for b in full.values()} == {(128, 0)}
    assert (p.role("load").registers, p.role("consumer0").registers) \
        == SM90_CP_ASYNC_REGISTERS[p.tiles.q_stage]
    for n, masked in ((1, 1), (5, 2)):
        r = simulate(p, n, masked_blocks=masked)
        assert r.ok and r.leftover == {}, r.summary()
    checks = mutation_check(p)
    assert {k for k, v in checks.items() if not v} == unguarded(p), checks
    for barrier in full:
        r = simulate(p, 4, drop=barrier, mutation="drop_arrive")
        assert r.deadlock and any(barrier in line for line in r.deadlock), r.summary()
