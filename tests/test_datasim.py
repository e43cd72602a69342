"""The data-carrying simulator: the plan's role programs compute attention on numpy TMEM/SMEM.

With every barrier the output matches the float64 reference (up to 16-bit rounding of P and O)
on any interleaving; with any one barrier removed, an adversarial interleaving corrupts it, and
the report says where.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fa4lab.plan import datasim as ds
from fa4lab.plan import datasim_check as dc
from fa4lab.plan.simulate import Issue, Ref, WaitEngine, Work
from fa4lab.reference import attention_reference, visible_mask


def problem(rng, batch, sq, sk, hq, hkv, d=64, scale=1.0):
    q = (rng.standard_normal((batch, sq, hq, d)) * scale).astype(np.float32)
    k = rng.standard_normal((batch, sk, hkv, d)).astype(np.float32)
    v = rng.standard_normal((batch, sk, hkv, d)).astype(np.float32)
    return q, k, v


def check_against_reference(run, q, k, v, causal, dtype="bf16"):
    qb, kb, vb = (ds.round16(x, dtype) for x in (q, k, v))
    ref, ref_lse = attention_reference(qb, kb, vb, causal=causal, return_lse=True)
    tol = dc.tolerance(vb, dtype)
    assert np.isfinite(run.out).all(), "NaN/inf in out: a row was never stored"
    err = np.abs(run.out - ref)
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err.max() <= tol, f"max error {err.max():.3g} > {tol:.3g} at (b, row, h, d) {worst}"
    empty = np.isneginf(ref_lse)
    assert (np.isneginf(run.lse) == empty).all(), "LSE -inf exactly where no key is visible"
    assert np.abs(run.lse[~empty] - ref_lse[~empty]).max() <= 1e-3
    return err


# Trimmed grid: every case is a few 128x128 tiles at head_dim 64 (numpy runs each in < 1 s).
CASES = {
    # name: (batch, seqlen_q, seqlen_k, heads_q, heads_kv, causal)
    "plain": (1, 256, 384, 2, 2, False),
    "causal": (1, 256, 256, 2, 2, True),
    "tails_mqa": (1, 200, 330, 2, 1, False),
    "causal_tails_gqa_empty_rows": (1, 300, 200, 4, 2, True),
    "causal_no_key_tile": (2, 300, 40, 1, 1, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference(rng, case):
    batch, sq, sk, hq, hkv, causal = CASES[case]
    q, k, v = problem(rng, batch, sq, sk, hq, hkv)
    run = ds.run_attention(q, k, v, causal=causal)
    assert not run.deadlock
    check_against_reference(run, q, k, v, causal)
    hidden = ~visible_mask(sq, sk, causal).any(axis=1)
    if hidden.any():   # rows that see no key: O = 0 and LSE = -inf, never NaN
        assert (run.out[:, hidden] == 0).all()
        assert np.isneginf(run.lse[:, :, hidden]).all()


def test_extreme_logits_rescale_in_the_correction(rng):
    # Scores of +-hundreds (in log2 units) and rows whose max jumps block after block: the
    # correction warpgroup really multiplies O, and the answer still matches.
    q, k, v = problem(rng, 1, 256, 384, 2, 2, scale=12.0)
    run = ds.run_attention(q, k, v)
    check_against_reference(run, q, k, v, False)
    q, k, v, _ = dc.check_problem(seed=int(rng.integers(1 << 16)))
    run = ds.run_attention(q, k, v)
    check_against_reference(run, q, k, v, False)
    assert run.rescaled_rows > 0


def _out_when_o_empty_0_is_released(monkeypatch, q, k, v, drain=None):
    """Run with store O1 32x slower (and, given `drain`, every drain of the epilogue replaced
    by it); global out as it is when the epilogue releases o_empty[0], and the run."""
    plan = ds.plan_for(q, k, v)
    progs = dict(ds.role_programs(plan, 1))
    progs["epilogue"] = [
        dataclasses.replace(op, cycles=op.cycles * 32)
        if isinstance(op, Issue) and op.label == "store O1"
        else drain if drain is not None and isinstance(op, WaitEngine) else op
        for op in progs["epilogue"]]
    seen = []

    class Probe(ds.DataSimulator):
        def _arrive(self, key, count, tx, clock, t):
            super()._arrive(key, count, tx, clock, t)
            if key == ("o_empty", 0) and not seen:
                seen.append(self.mem.out.copy())

    monkeypatch.setattr(ds, "role_programs", lambda *args, **kw: progs)
    monkeypatch.setattr(ds, "DataSimulator", Probe)
    run = ds.run_plan(plan, q, k, v)
    return seen[0], run


def test_store_drain_releases_o_empty_0_with_store_1_in_flight(rng, monkeypatch):
    # Note [store drains]: the epilogue's first drain is wait_group.read 1, so o_empty[0] is
    # released once store 0 is done, Q tile 1's rows still on their way to global memory. One
    # work tile, one K/V block: rows 0..127 are Q tile 0, rows 128..255 Q tile 1.
    q, k, v = problem(rng, 1, 256, 128, 1, 1)
    out, run = _out_when_o_empty_0_is_released(monkeypatch, q, k, v)
    assert np.isfinite(out[:, :128]).all() and np.isnan(out[:, 128:]).all()
    assert not run.hazards and not run.deadlock
    check_against_reference(run, q, k, v, False)
    # A drain that waits for every store (the wait-all model) releases it only after both.
    out, _ = _out_when_o_empty_0_is_released(monkeypatch, q, k, v,
                                             drain=WaitEngine("tma_store"))
    assert np.isfinite(out).all()


def test_fp16(rng):
    q, k, v = problem(rng, 1, 256, 256, 1, 1)
    run = ds.run_attention(q, k, v, causal=True, dtype="fp16")
    check_against_reference(run, q, k, v, True, "fp16")


def test_clean_protocol_has_no_hazard(rng):
    q, k, v = problem(rng, 1, 256, 384, 1, 1)
    run = ds.run_attention(q, k, v)
    assert not run.hazards, [str(h) for h in run.hazards[:4]]
    assert not run.deadlock


def test_output_does_not_depend_on_the_interleaving(rng):
    # With every barrier, any role speeds give the same bits: the barriers alone order the data.
    q, k, v, _ = dc.check_problem(seed=int(rng.integers(1 << 16)))
    plan = ds.plan_for(q, k, v)
    base = ds.run_plan(plan, q, k, v)
    for sched in ds.random_schedules(plan, 3, seed=1) + [ds.adversary(plan, "p_ready")]:
        run = ds.run_plan(plan, q, k, v, schedule=sched)
        assert np.array_equal(run.out, base.out), sched
        assert np.array_equal(run.lse, base.lse), sched


def test_exp2_split_uses_both_pipes():
    # The plan emulates a fraction of the exp2 on the FMA pipe: some columns use the polynomial,
    # the others MUFU, in the kernel's pairs.
    q = k = v = np.zeros((1, 128, 1, 64), np.float32)
    plan = ds.plan_for(q, k, v)
    assert 0.0 < plan.exp2_emulation_fraction < 1.0
    prog = ds.role_programs(plan, 1)
    sim = ds.DataSimulator(plan, prog, ds._needed(plan, prog), ds.DATA_COSTS, None,
                           ds.work_tiles(plan), ds.fresh_memory(plan, None, None))
    cols = sim.emulated
    assert cols.any() and not cols.all()
    assert (cols[0::2] == cols[1::2]).all()


# Barriers that carry data: removing one must corrupt the output (not only raise a hazard).
DATA_BARRIERS = ("q_full", "kv_full", "kv_empty", "s_full", "p_ready", "o_rescaled", "o_final",
                 "stats_full", "stats_empty", "o_staged")


def _barriers():
    q, k, v, _ = dc.check_problem()
    return [b.name for b in ds.plan_for(q, k, v).barriers.barriers]


@pytest.mark.parametrize("barrier", _barriers())
def test_every_barrier_is_needed(barrier):
    f = dc.barrier_check(barrier)
    assert f.barrier == barrier and str(f).startswith(f"without {barrier}: ")
    if f.not_waited and not f.caught:
        # Only a barrier the protocol table itself says never blocks with one tile per CTA.
        q, k, v, _ = dc.check_problem()
        plan = ds.plan_for(q, k, v)
        assert not ds.persistent(plan)
        assert barrier in plan.protocol.first_use_only(plan.tiles.q_stage), str(f)
        return
    assert f.caught, str(f)
    if barrier in DATA_BARRIERS:
        assert f.wrong_output, str(f)
    if f.wrong_output:
        assert f.first_bad_read and " read " in f.first_bad_read, str(f)
        assert "wrong, max error" in str(f)


def test_p_ready_report_names_the_stale_read():
    f = dc.barrier_check("p_ready")
    assert f.wrong_output
    # The value MMA read P before softmax wrote it: the S scores still sit in P's columns.
    assert "O0+=P0V" in f.first_bad_read and "read P[0]" in f.first_bad_read
    assert "rows 0..127 of Q tile 0" in str(f)


def test_barrier_check_is_deterministic():
    a, b = dc.barrier_check("stats_empty"), dc.barrier_check("stats_empty")
    assert str(a) == str(b)


def test_unknown_op_is_reported():
    odd = Work("mystery", 1, reads=(Ref("smem", "q", 0),), writes=(Ref("smem", "kv", 0),))
    with pytest.raises(ds.DataSimError, match="mystery"):
        ds.classify("mma", odd)
    assert ds.classify("mma", Issue("tensor", "S0=Q0K0", 1, reads=(Ref("smem", "q", 0),),
                                    writes=(Ref("tmem", "S", 0, 0, 128),))) == "mma_s"


def test_bf16_rounding_is_nearest_even():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, np.inf], np.float32)
    assert ds.round16(x, "bf16").tolist() == [1.0, 1.0, 1.0 + 4 * 2**-8, -2.5, np.inf]
    assert np.isnan(ds.round16(np.float32(np.nan), "bf16"))


def test_row_error_figure(rng):
    from fa4lab.viz.datasim import draw_row_errors

    q, k, v = problem(rng, 1, 128, 128, 1, 1)
    run = ds.run_attention(q, k, v)
    ref = attention_reference(*(ds.round16(x, "bf16") for x in (q, k, v)))
    fig = draw_row_errors({"every barrier": run}, ref, dc.tolerance(v))
    assert len(fig.axes[0].lines) == 2      # the run and the tolerance


def test_a_persistent_cta_runs_its_tiles_in_turn(rng):
    """Note [persistent CTAs] in fa4lab.plan.sm100: the 4 work tiles of one length run in one
    CTA (its pipeline phases running on from tile to tile) and still give the reference; with
    persistent=False each is its own CTA."""
    q, k, v = problem(rng, 2, 256, 384, 2, 2)
    plan = ds.plan_for(q, k, v)
    assert plan.protocol.persistent
    run = ds.run_plan(plan, q, k, v)
    assert not run.deadlock and [s.n_tiles for s in run.sims] == [4]
    check_against_reference(run, q, k, v, False)
    one = ds.run_plan(ds.plan_for(q, k, v, persistent=False), q, k, v)
    assert [s.n_tiles for s in one.sims] == [1] * 4
    check_against_reference(one, q, k, v, False)
