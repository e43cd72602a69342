"""The sm100 protocol table (`fa4lab.plan.protocol`): FlashForwardSm100's role methods, op by
op. `build_protocol` lists each role's barrier ops in the order `fa4lab/kernels/fwd_sm100.py`
issues them; the plan holds the table (`fa4lab.plan.sm100.build_sm100`), the kernel emits its
ops by name, the simulators run it and the audit checks the binary against it.
"""

from __future__ import annotations

from fa4lab.plan.barriers import BarrierGraph
from fa4lab.plan.protocol import If, Loop, Op, Program, Protocol, Step, TileLoop, per_stage


def build_protocol(barriers: BarrierGraph, q_stage: int, persistent: bool = False) -> Protocol:
    """Each role's barrier ops in the order fwd_sm100.py issues them: per work tile, in a loop
    over the CTA's tiles when `persistent` (Note [persistent CTAs] in fa4lab.plan.sm100), else
    for its one tile.

    The softmax posts N + 1 times to the mailbox (a row scale per block, then row sum and max);
    the correction's epilogue stages O_i before it releases O_i (o_rescaled); the epilogue warp
    issues both stores, then drains them. With one Q tile the load and MMA programs are those
    of Note [S ping-pong] in fa4lab.plan.sm100, the S buffer is the block step's ("j % 2"), and
    the correction waits for each value MMA before it rescales. With p_part among the barriers P
    goes to the value MMA in two parts (Note [split P hand-off] in fa4lab.plan.sm100).
    """
    E = Op   # noqa: N806
    tmem_sync, tmem_done = E("sync", "tmem"), E("named_arrive", "tmem")
    tmem_use = (tmem_sync, Step("TMEM address"))
    pp = q_stage == 1

    def tiles(*body) -> tuple:   # the CTA's work tiles: Note [persistent CTAs] in sm100.py
        return (TileLoop(body),) if persistent else body
    load = tiles(*_load_ping_pong()) if pp else tiles(If("N > 0", (
        per_stage(E("wait", "q_empty", "i"), E("expect_tx", "q_full", "i", one=True),
                  Step("load Q", "i"),
                  If("i == 0", (E("wait", "kv_empty", "K"),
                                E("expect_tx", "kv_full", "K", one=True), Step("load K", "K")))),
        E("wait", "kv_empty", "V"), E("expect_tx", "kv_full", "V", one=True), Step("load V", "V"),
        Loop("N - 1", (E("wait", "kv_empty", "K+1"), E("expect_tx", "kv_full", "K+1", one=True),
                       Step("load K", "K+1"),
                       E("wait", "kv_empty", "V+1"), E("expect_tx", "kv_full", "V+1", one=True),
                       Step("load V", "V+1"))))))
    # Note [split P hand-off] in sm100.py: with p_part the value MMA takes P in two parts.
    split = any(b.name == "p_part" for b in barriers.barriers)
    value = ((E("wait", "p_part", "i"), E("wait", "o_rescaled", "i"), Step("PV part", "V"),
              E("wait", "p_ready", "i"), Step("PV rest", "V")) if split else
             (E("wait", "p_ready", "i"), E("wait", "o_rescaled", "i"), Step("PV", "V")))
    mma = (Step("alloc TMEM"), *tmem_use, *tiles(_mma_ping_pong()), tmem_sync,
           Step("free TMEM")) if pp else (Step("alloc TMEM"), *tmem_use, *tiles(If("N > 0", (
        per_stage(E("wait", "q_full", "i"), If("i == 0", (E("wait", "kv_full", "K"),)),
                  Step("QK", "K"), E("commit", "s_full", "i")),
        E("commit", "kv_empty", "K"),
        Loop("N - 1", (
            E("wait", "kv_full", "V"),
            per_stage(*value, If("i == q - 1", (E("commit", "kv_empty", "V"),)),
                      If("i == 0", (E("wait", "kv_full", "K+1"),)),
                      Step("QK", "K+1"), E("commit", "s_full", "i")),
            E("commit", "kv_empty", "K+1"))),
        # Every score MMA of the tile is issued: the next tile's Q may load once they are done.
        per_stage(E("commit", "q_empty", "i")),
        E("wait", "kv_full", "V"),
        per_stage(*value, E("commit", "o_final", "i")),
        E("commit", "kv_empty", "V")))),
        tmem_sync, Step("free TMEM"))
    sb = "j % 2" if pp else "i"    # the S buffer: the block step's, or the Q tile's
    p_out = ((Step("exp2 part", "i"), Step("st P part", sb), E("arrive", "p_part", sb),
              Step("exp2 rest", "i"), Step("st P rest", sb)) if split else
             (Step("exp2", "i"), Step("st P", sb)))
    step = (E("wait", "s_full", sb), Step("ld S", sb),
            E("wait", "stats_empty", "i"), Step("post scale", "i"),
            E("arrive", "stats_full", "i"), *p_out, E("arrive", "p_ready", sb))
    softmax = (*tmem_use, *tiles(Loop("M", step, "masked"), Loop("N - M", step, "unmasked"),
                                 If("N > 0", (E("wait", "stats_empty", "i"),
                                              Step("post row sum", "i"),
                                              E("arrive", "stats_full", "i")))),
               tmem_done)
    correction = (*tmem_use, *tiles(Loop("N", (per_stage(
        E("wait", "stats_full", "i"), Step("read scale", "i"), E("arrive", "stats_empty", "i"),
        If("j > 0", (If("q == 1", (E("wait", "o_final", "i"),)),
                     Step("rescale O", "i"), E("arrive", "o_rescaled", "i")))),)),
        per_stage(
            If("N > 0", (E("wait", "stats_full", "i"), Step("read row sum", "i"),
                         E("arrive", "stats_empty", "i"), E("wait", "o_final", "i"))),
            E("wait", "o_empty", "i"), Step("ld O", "i"), Step("O to SMEM", "i"),
            E("arrive", "o_staged", "i"), If("N > 0", (E("arrive", "o_rescaled", "i"),)))),
        tmem_done)
    epilogue = tiles(per_stage(E("wait", "o_staged", "i"), Step("store O", "i")),
                     per_stage(Step("drain store", "i"), E("arrive", "o_empty", "i", one=True)))
    softmax_roles = tuple(f"softmax{i}" for i in range(q_stage))
    return Protocol(barriers, (
        Program("load", ("load",), load),
        Program("mma", ("mma",), mma),
        Program("softmax", softmax_roles, softmax, var="i"),
        Program("correction", ("correction",), correction),
        Program("epilogue", ("epilogue",), epilogue),
    ))


def _load_ping_pong() -> tuple:
    """Note [S ping-pong] in fa4lab.plan.sm100: Q, K_0, then (K_j+1, V_j) per step, then V_N-1."""
    E = Op   # noqa: N806

    def load(slot):
        return (E("wait", "kv_empty", slot), E("expect_tx", "kv_full", slot, one=True),
                Step(f"load {slot[0]}", slot))
    return (If("N > 0", (
        E("wait", "q_empty", "0"), E("expect_tx", "q_full", "0", one=True), Step("load Q", "0"),
        *load("K"), Loop("N - 1", (*load("K+1"), *load("V"))), *load("V"))),)


def _mma_ping_pong() -> If:
    """Note [S ping-pong] in fa4lab.plan.sm100: S(0); then per step j < N - 1: S(j+1) into
    buffer (j+1) % 2, and O += P(j) V_j, committing o_final each time; then O += P(N-1)
    V_N-1."""
    E = Op   # noqa: N806
    value = (E("wait", "kv_full", "V"), E("wait", "p_ready", "j % 2"),
             E("wait", "o_rescaled", "0"), Step("PV", "V"), E("commit", "o_final", "0"),
             E("commit", "kv_empty", "V"))
    return If("N > 0", (
        E("wait", "q_full", "0"), E("wait", "kv_full", "K"), Step("QK", "K"),
        E("commit", "s_full", "j % 2"), E("commit", "kv_empty", "K"),
        Loop("N - 1", (E("wait", "kv_full", "K+1"), Step("QK", "K+1"),
                       E("commit", "s_full", "(j + 1) % 2"), E("commit", "kv_empty", "K+1"),
                       *value)),
        *value, E("commit", "q_empty", "0")))
