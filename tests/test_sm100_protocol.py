"""The sm100 kernel's mbarrier protocol, replayed on the CPU with hardware parity semantics.

Each role of `FlashForwardSm100` is written here as the sequence of mbarrier operations its code
performs, in program order (see Note [sm100 barrier graph] in fa4lab/kernels/fwd_sm100.py): waits
with the parity the kernel passes, arrivals that complete a phase. A round-robin scheduler runs
the roles until all finish; it fails on a deadlock (no role can move) and on a wait that passes
on the wrong phase (a producer that ran two phases ahead, which parity alone cannot tell apart).

mbarrier semantics: a barrier has completed k phases; `try_wait.parity(p)` passes iff
p != k % 2, i.e. the phase of parity p is the last completed one. A fresh barrier passes
parity 1 at once ("starts released").

This checks the phase bookkeeping (which parity each wait uses, who arrives when, how many
times), not data hazards: those are argued in the Note and checked on a B200 by test_sm100.py.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

Q_STAGE, KV_STAGE = 2, 3


class PipelineState:
    """cutlass.pipeline's round-robin state: index, phase; advance wraps and flips the phase."""

    def __init__(self, stages, phase):
        self.stages, self.index, self.phase = stages, 0, phase

    def advance(self):
        self.index += 1
        if self.index == self.stages:
            self.index, self.phase = 0, self.phase ^ 1


def W(bar, index, parity):
    return ("wait", bar, index, parity)


def A(bar, index):
    return ("arrive", bar, index)


def load(n):
    kv = PipelineState(KV_STAGE, 1)

    def fill(kind):
        yield W("kv_empty", kv.index, kv.phase)
        yield A("kv_full", kv.index)
        kv.advance()

    if n > 0:
        for stage in range(Q_STAGE):
            yield W("q_empty", stage, 1)
            yield A("q_full", stage)
            if stage == 0:
                yield from fill("K")
        yield from fill("V")
        for _ in range(n - 1):
            yield from fill("K")
            yield from fill("V")


def mma(n):
    kv = PipelineState(KV_STAGE, 0)
    if n == 0:
        return
    for stage in range(Q_STAGE):
        yield W("q_full", stage, 0)
        if stage == 0:
            yield W("kv_full", kv.index, kv.phase)
        yield A("s_full", stage)
    yield A("kv_empty", kv.index)
    kv.advance()
    p_phase, o_phase = 0, 1
    for _ in range(n - 1):
        yield W("kv_full", kv.index, kv.phase)  # V_j
        v_index = kv.index
        kv.advance()
        for stage in range(Q_STAGE):
            yield W("p_ready", stage, p_phase)
            yield W("o_rescaled", stage, o_phase)
            if stage == Q_STAGE - 1:
                yield A("kv_empty", v_index)
            if stage == 0:
                yield W("kv_full", kv.index, kv.phase)  # K_{j-1}
            yield A("s_full", stage)
        yield A("kv_empty", kv.index)
        kv.advance()
        p_phase ^= 1
        o_phase ^= 1
    yield W("kv_full", kv.index, kv.phase)
    for stage in range(Q_STAGE):
        yield W("p_ready", stage, p_phase)
        yield W("o_rescaled", stage, o_phase)
        yield A("o_final", stage)
    yield A("kv_empty", kv.index)
    for stage in range(Q_STAGE):
        yield A("q_empty", stage)


def softmax(stage, n):
    s_phase, stats_phase = 0, 1
    for _ in range(n):
        yield W("s_full", stage, s_phase)
        yield W("stats_empty", stage, stats_phase)
        yield A("stats_full", stage)
        yield A("p_ready", stage)
        s_phase ^= 1
        stats_phase ^= 1
    if n > 0:
        yield W("stats_empty", stage, stats_phase)
        yield A("stats_full", stage)


def correction(n):
    stats = PipelineState(Q_STAGE, 0)
    for i in range(n):
        for stage in range(Q_STAGE):
            yield W("stats_full", stats.index, stats.phase)
            yield A("stats_empty", stats.index)
            stats.advance()
            if i > 0:
                yield A("o_rescaled", stage)
    for stage in range(Q_STAGE):
        if n > 0:
            yield W("stats_full", stats.index, stats.phase)
            yield A("stats_empty", stats.index)
            stats.advance()
            yield W("o_final", stage, 0)
        yield W("o_empty", stage, 1)
        yield A("o_staged", stage)
        if n > 0:
            yield A("o_rescaled", stage)


def epilogue():
    for stage in range(Q_STAGE):
        yield W("o_staged", stage, 0)
    for stage in range(Q_STAGE):
        yield A("o_empty", stage)


# Barriers whose first wait passes at once (plan: starts_released=True).
STARTS_RELEASED = {"q_empty", "kv_empty", "o_rescaled", "stats_empty", "o_empty"}


def run(n):
    roles = {"load": load(n), "mma": mma(n), "softmax0": softmax(0, n),
             "softmax1": softmax(1, n), "correction": correction(n), "epilogue": epilogue()}
    completed = defaultdict(int)            # (bar, index) -> phases completed
    waits = defaultdict(int)                # (role, bar, index) -> waits passed so far
    pending = {name: next(gen, None) for name, gen in roles.items()}
    used = set()
    while any(op is not None for op in pending.values()):
        moved = False
        for name, gen in roles.items():
            op = pending[name]
            while op is not None:
                kind, bar, index = op[:3]
                used.add(bar)
                key = (bar, index)
                if kind == "arrive":
                    completed[key] += 1
                else:
                    parity = op[3]
                    if parity == completed[key] % 2:
                        break  # blocked
                    j = waits[(name, bar, index)]
                    needed = j + (0 if bar in STARTS_RELEASED else 1)
                    assert completed[key] == needed, (
                        f"{name} passed wait #{j} on {bar}[{index}] parity {parity} with "
                        f"{completed[key]} phases completed, expected {needed}: a producer ran "
                        f"ahead")
                    waits[(name, bar, index)] += 1
                moved = True
                op = next(gen, None)
            pending[name] = op
        if not moved:
            stuck = {r: op for r, op in pending.items() if op is not None}
            raise AssertionError(f"deadlock with n_block_max={n}: {stuck}")
    return completed, used


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 7])
def test_protocol_completes_without_deadlock_or_overrun(n):
    completed, _ = run(n)
    if n:
        # every S_i, P_i, stats post happened once per block (+1 final stats per Q tile)
        for stage in range(Q_STAGE):
            assert completed[("s_full", stage)] == n
            assert completed[("p_ready", stage)] == n
            assert completed[("stats_full", stage)] == n + 1
            assert completed[("o_final", stage)] == 1
        assert sum(completed[("kv_full", i)] for i in range(KV_STAGE)) == 2 * n


def test_barrier_names_and_stage_counts_match_the_plan():
    """The model uses exactly the plan's barriers, each with the plan's stage count."""
    from fa4lab.plan import plan_forward
    from fa4lab.spec import AttentionSpec

    plan = plan_forward(AttentionSpec(1, 1024, 1024, 1, 1, 128), arch="sm100")
    _, used = run(3)
    stages = {b.name: b.stages for b in plan.barriers.barriers}
    assert used == set(stages)
    for name in used:
        assert stages[name] == (KV_STAGE if name.startswith("kv") else Q_STAGE), name
        assert (name in STARTS_RELEASED) == plan.barriers.barriers[
            [b.name for b in plan.barriers.barriers].index(name)].starts_released, name


def test_a_wrong_parity_is_caught():
    """Mutation: the MMA waits o_rescaled with parity 0 first -> deadlock is reported."""
    global mma
    original = mma

    def broken(n):
        for op in original(n):
            if op[:2] == ("wait", "o_rescaled"):
                op = (op[0], op[1], op[2], op[3] ^ 1)
            yield op

    mma = broken
    try:
        with pytest.raises(AssertionError, match="deadlock|ran ahead"):
            run(3)
    finally:
        mma = original
