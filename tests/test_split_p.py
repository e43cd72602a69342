"""Note [split P hand-off] (fa4lab.plan.sm100): the softmax hands P_i to the value MMA in two
parts (p_part, then p_ready). The table's programs, the timing simulator's hazards and the
data-carrying simulator's output, with the protocol as planned and mutated."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import fa4lab.plan.datasim as ds
import fa4lab.plan.datasim_check as dc
from fa4lab.errors import PlanError
from fa4lab.plan import plan_forward
from fa4lab.plan.protocol import Op, Protocol, Step
from fa4lab.plan.simulate import Issue, Wait, Work, programs_for, simulate
from fa4lab.plan.sm100 import S_CHUNK, p_split
from fa4lab.reference import attention_reference
from fa4lab.spec import AttentionSpec


def plan(hd=128, causal=True, **kw):
    return plan_forward(AttentionSpec(2, 4096, 4096, 8, 8, hd, causal=causal), "sm100", **kw)


@pytest.mark.parametrize("hd,n_block,q_stage", [(64, None, None), (128, None, None),
                                                (128, 64, None), (128, 32, None),
                                                (128, None, 1), (96, None, None),
                                                (256, None, None)])
def test_split_is_three_quarters_in_whole_chunks(hd, n_block, q_stage):
    """Two Q tiles: p_split is a whole number of softmax chunks, the most not above 3/4 of the
    keys, and the table has p_part exactly when it is not 0. One Q tile: one hand-off."""
    try:
        p = plan(hd, n_block=n_block, q_stage=q_stage)
    except PlanError:
        pytest.skip("no such plan")
    t, split = p.tiles, p_split(p.tiles)
    names = [b.name for b in p.barriers.barriers]
    if t.q_stage == 1:
        assert split == 0
    else:
        assert split % S_CHUNK == 0 and 0 <= t.n_block * 3 / 4 - split < S_CHUNK
    assert ("p_part" in names) == (split > 0)


def _issues(ops, what):
    return [k for k, op in enumerate(ops) if isinstance(op, (Issue, Work)) and what in op.label]


def test_value_mma_reads_each_part_after_its_own_signal():
    """Per block: wait p_part -> PV over P's first p_split keys -> wait p_ready -> PV over the
    rest; the softmax stores the first part, arrives p_part, then the rest, then p_ready. The
    two MMAs read disjoint P columns that together are P_i's region, V's rows split alike."""
    p = plan()
    split, n = p_split(p.tiles), p.tiles.n_block
    progs = programs_for(p, 3)
    mma = progs["mma"]
    for k in _issues(mma, f"keys 0-{split - 1}"):
        waits = [op.barrier for op in mma[k - 2:k] if isinstance(op, Wait)]
        assert waits == ["p_part", "o_rescaled"], mma[k - 2:k]
        assert isinstance(mma[k + 1], Wait) and mma[k + 1].barrier == "p_ready"
        assert f"keys {split}-{n - 1}" in mma[k + 2].label
        first, rest = (next(r for r in op.reads if r.name == "P") for op in (mma[k], mma[k + 2]))
        region = p.tmem.region("P", first.stage)
        assert (first.lo, first.hi, rest.lo, rest.hi) == (
            region.col_offset, region.col_offset + split // 2, region.col_offset + split // 2,
            region.col_end)
        # The second part accumulates into O (it reads O) whatever the block.
        assert any(r.name == "O" for r in mma[k + 2].reads)
    sm = progs["softmax0"]
    stores = _issues(sm, "st P0")
    assert len(stores) == 2 * 3
    for a, b in zip(stores[::2], stores[1::2]):
        assert [str(op).split()[1] for op in sm[a + 1:b] if not isinstance(op, Work)] == [
            "p_part[0]"]
        assert str(sm[b + 1]).startswith("arrive p_ready[0]")
    assert simulate(p, 3).ok


def test_one_q_tile_plans_keep_one_hand_off():
    p = plan(256)
    assert p.tiles.q_stage == 1 and "p_part" not in [b.name for b in p.barriers.barriers]
    assert not _issues(programs_for(p, 3)["mma"], "keys")


def test_split_lets_the_value_mma_start_before_the_last_keys_of_p():
    """The timing model: the first part of O += P V starts before the softmax has stored the
    last part of P, and a tile takes no longer than with one hand-off."""
    p = plan()
    one = _one_hand_off(p)
    r = simulate(p, 6)
    st_rest = {s.start for s in r.spans if s.lane == "softmax0" and "st P0 keys" in s.label
               and not s.label.endswith("keys 0-95")}
    pv_part = [s.start for s in r.spans if s.lane == "tensor" and "O0+=P0" in s.label
               and "keys 0-" in s.label]
    assert any(a < b for a in pv_part for b in st_rest)
    assert r.cycles <= simulate(one, 6).cycles


def _one_hand_off(p):
    """`p` with the table of one hand-off (p_part gone): the plan before the split."""
    from fa4lab.plan.protocol_sm100 import build_protocol

    bars = p.barriers.without("p_part")
    return dataclasses.replace(p, protocol=build_protocol(bars, p.tiles.q_stage,
                                                          p.protocol.persistent))


# ---- mutations of the table: the simulators must catch each ----
def _rewrite(body, fn):
    out = tuple(dataclasses.replace(n, body=_rewrite(n.body, fn)) if hasattr(n, "body") else n
                for n in body)
    return fn(out)


def _swap(first, second):
    """A table rewrite: wherever node `first` is followed by `second`, swap them."""
    def fn(body):
        body = list(body)
        for k in range(len(body) - 1):
            if body[k] == first and body[k + 1] == second:
                body[k], body[k + 1] = second, first
        return tuple(body)
    return fn


def _mutated(p, fn):
    proto = p.protocol
    programs = tuple(dataclasses.replace(g, body=_rewrite(g.body, fn)) for g in proto.programs)
    assert programs != proto.programs, "the mutation changed nothing"
    return dataclasses.replace(p, protocol=Protocol(proto.barriers, programs))


MUTATIONS = {   # name: (rewrite, the edge it weakens, the part of P read too early)
    # the value MMA's second part issued before it waits for p_ready
    "PV rest before wait p_ready": (_swap(Op("wait", "p_ready", "i"), Step("PV rest", "V")),
                                    "p_ready", "rest"),
    # the softmax signals p_part before it stored the first part of P
    "arrive p_part before st P part": (
        _swap(Step("st P part", "i"), Op("arrive", "p_part", "i")), "p_part", "part"),
}


def _p_cols(p, part: str) -> str:
    """P[0]'s columns holding the part's keys, as the simulator names a region."""
    r, half = p.tmem.region("P", 0), p_split(p.tiles) // 2
    lo, hi = (r.col_offset, r.col_offset + half) if part == "part" else (
        r.col_offset + half, r.col_end)
    return f"P[0] cols {lo}-{hi - 1}"


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_timing_simulator_flags_the_mutation(name):
    fn, _, part = MUTATIONS[name]
    p = plan()
    cols = _p_cols(p, part)
    r = simulate(_mutated(p, fn), 3)
    assert not r.deadlock, r.summary()
    # The MMA's read and the softmax's store of those columns, unordered (either way round)
    assert any(h.region == cols and "softmax0: st P0" in h.first + h.second
               for h in r.hazards), r.summary()


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_data_simulator_computes_wrong_output_under_the_mutation(name):
    """The adversary of the weakened edge (its producers slow, consumers fast) makes the MMA
    read P's columns before the softmax wrote them: wrong rows, where the planned table is
    right under the same schedule."""
    fn, barrier, _ = MUTATIONS[name]
    q, k, v, _ = dc.check_problem()
    good = ds.plan_for(q, k, v)
    qb, kb, vb = (ds.round16(x, "bf16") for x in (q, k, v))
    ref = attention_reference(qb, kb, vb)
    tol = dc.tolerance(vb)
    for p, ok in ((good, True), (_mutated(good, fn), False)):
        run = ds.run_plan(p, q, k, v, schedule=ds.adversary(p, barrier))
        err = np.abs(np.nan_to_num(run.out - ref, nan=np.inf))
        assert (err.max() <= tol) == ok, (name, ok, err.max())


def test_datasim_split_reads_only_the_first_part():
    """Without p_ready's wait before the second part the first part still reads only what its
    own signal covers: dropping p_ready reports the second part's read of stale S, never the
    first part's."""
    f = dc.barrier_check("p_ready")
    split = p_split(ds.plan_for(*dc.check_problem()[:3]).tiles)
    assert f.wrong_output and f"keys {split}-" in f.first_bad_read


def test_a_held_unit_serves_its_role_first():
    """Work.hold: a role's pass over the MUFU cut into two steps (the two parts of exp2) keeps
    the unit, so another role's exp2 waits for the whole pass, not only its first step; without
    the hold it would slip in between."""
    from fa4lab.plan.costs import DEFAULT_COSTS
    from fa4lab.plan.simulate import Simulator

    def run(hold):
        progs = {"a": [Work("exp2 part", 30, unit="mufu", hold=hold), Work("st", 5),
                       Work("exp2 rest", 10, unit="mufu")],
                 "b": [Work("late", 1), Work("exp2", 40, unit="mufu")]}
        spans = Simulator(progs, {}, DEFAULT_COSTS).run().spans
        return {s.label: (s.start, s.end) for s in spans if s.kind == "work"}

    held, free = run(15.0), run(0.0)
    assert held["exp2 rest"] == (35, 45) and held["exp2"][0] >= 45
    assert free["exp2"] == (30, 70) and free["exp2 rest"][0] >= 70


def test_first_part_reads_only_the_first_part_stores():
    """Over the planned and random interleavings (seeded) the first value MMA's read of P
    finds only the first-part stores of its own block, never a second-part store or scores;
    the output matches the reference each time."""
    q, k, v, _ = dc.check_problem()
    p = ds.plan_for(q, k, v)
    split, n = p_split(p.tiles), p.tiles.n_block
    qb, kb, vb = (ds.round16(x, "bf16") for x in (q, k, v))
    ref = attention_reference(qb, kb, vb)
    for sched in [ds.AS_PLANNED] + ds.random_schedules(p, 4, seed=7):
        run = ds.run_plan(p, q, k, v, schedule=sched)
        firsts = [r for r in run.reads if r.region.startswith("P[")
                  and r.op.endswith(f"keys 0-{split - 1}")]
        assert firsts, sched
        for r in firsts:
            block = r.op.split("V")[1].split()[0]
            assert r.holds == tuple(h for h in r.holds if h.startswith("P") and
                                    f"block {block} " in h and
                                    h.endswith(f"(keys 0-{split - 1})")), (sched, r)
            assert len(r.holds) == 1, (sched, r)
        assert not any(f"keys {split}-{n - 1}" in h for r in firsts for h in r.holds)
        assert np.abs(run.out - ref).max() <= dc.tolerance(vb), sched
