"""The B200 (sm100) plan: FA4's design with S, P and O in tensor memory.

One CTA owns two Q tiles of 128 rows (q_stage 2). The MMA warp issues tcgen05 MMAs for both;
two softmax warpgroups ping-pong (while one computes exp2 on its S the tensor core works on the
other's), a correction warpgroup rescales O in TMEM when a row max grows by more than the
threshold and runs the epilogue, and single warps issue the TMA loads and stores.

Constraints: head_dim == head_dim_v, a multiple of 16; S + O of every Q stage within the 512
TMEM columns (head_dim 64 and 128 with q_stage 2; head_dim 256 needs q_stage 1); SMEM within
the per-CTA limit. The role programs for the protocol simulator live here too (`programs`).

`pack_gqa=True` (see Note [sm100 pack-GQA]) makes a CTA's rows the packed rows of one KV head.
"""

from __future__ import annotations

from fa4lab.errors import PlanError
from fa4lab.hardware import B200
from fa4lab.limits import ELEMENT_BYTES, KERNEL_HEAD_DIMS, RESCALE_THRESHOLD
from fa4lab.plan.barriers import PHASE_EMPTY, PHASE_FULL, Barrier, BarrierGraph
from fa4lab.plan.costs import balanced_exp2_fraction
from fa4lab.plan.plan import Plan
from fa4lab.plan.roles import Role, check_roles
from fa4lab.plan.smem import MBARRIER_BYTES, SmemPlan, SmemRegion
from fa4lab.plan.tiles import MmaPlan, Tiles, check_pack_gqa, pack_gqa_notes
from fa4lab.plan.tmem import TmemPlan, TmemRegion, alloc_columns
from fa4lab.tiling import kernel_tile_order

# Defaults (FA4 on B200). Tuning knobs sit together.
M_BLOCK = 128            # one TMEM lane per query row: the MMA's M and a softmax warpgroup
N_BLOCK = 128
Q_STAGE = 2
KV_STAGE = 3             # K and V share one ring of buffers (K_j, V_j, K_j+1, ...)
REGISTERS = {"softmax": 192, "correction": 80, "other": 48}
SOFTMAX_REG_OVERHEAD = 48   # registers a softmax thread needs besides its row of S


# Note [sm100 pack-GQA]
# As on sm90 (Note [sm90 pack-GQA] in fa4lab.plan.sm90): with pack_gqa the qhead_per_kvhead (g)
# query heads of a KV head share one CTA, whose 2 x 128 M rows are packed rows (position * g +
# head within the group, Note [pack-GQA rows] in fa4lab.tiling). The grid has heads_kv columns
# and ceil(seqlen_q * g / cta_m) row tiles; K/V are loaded once per group. Q and O keep their
# TMA: a 128-row tile is a (g, 128 / g) box over (head, position), so g must divide m_block.
# TMEM, SMEM, barriers, roles and MMAs are those of the unpacked plan. With g == 1 there is
# nothing to pack, and the plan records pack_gqa=False.


def tmem_columns(q_stage: int, n_block: int, head_dim_v: int) -> int:
    """S (fp32, n_block cols) and O (fp32, head_dim_v cols) per Q stage; P lives inside S."""
    return q_stage * n_block + q_stage * head_dim_v


def _tmem_error(spec, tiles: Tiles, limit: int) -> PlanError:
    q, n, dv = tiles.q_stage, tiles.n_block, tiles.head_dim_v
    need = tmem_columns(q, n, dv)
    why = ""
    if q * dv >= limit:
        why = (f" O alone needs {q}x{dv}={q * dv} columns, so no n_block helps; q_stage=1 "
               f"fits TMEM but keeps one Q tile per CTA and loses the softmax ping-pong.")
    fallback = ""
    built = KERNEL_HEAD_DIMS["sm100"]   # what the kernel builds; the planner plans any that fit
    if spec.head_dim not in built:
        fallback = (f" Fallback for head_dim {spec.head_dim}: the Hopper-style design (S, P, O "
                    f"in registers: arch='sm90') or q_stage=1; this lab's sm100 kernel builds "
                    f"head_dim {', '.join(map(str, built))}.")
    return PlanError(
        f"TMEM over budget: S {q}x{n} cols + O {q}x{dv} cols (fp32) = {need} columns > "
        f"{limit} per SM ({need - limit} over) for head_dim {spec.head_dim}.{why}{fallback}")


def build_tmem(spec, tiles: Tiles, limit: int) -> TmemPlan:
    q, n, dv = tiles.q_stage, tiles.n_block, tiles.head_dim_v
    if tmem_columns(q, n, dv) > limit:
        raise _tmem_error(spec, tiles, limit)
    regions = []
    for i in range(q):
        s = i * n
        regions.append(TmemRegion("S", i, s, n, "fp32", None, "p_ready"))
        # See Note [P aliases S]
        regions.append(TmemRegion("P", i, s + n // 2, n // 2, spec.dtype, "S", "s_full"))
    for i in range(q):
        regions.append(TmemRegion("O", i, q * n + i * dv, dv, "fp32", None, "o_rescaled"))
    total = tmem_columns(q, n, dv)
    return TmemPlan(tuple(regions), total, alloc_columns(total), B200.tmem_lanes, limit)


def build_barriers(tiles: Tiles, eb: int) -> BarrierGraph:
    """The mbarriers; `eb` is the bytes per element of Q, K and V (the TMA transaction counts)."""
    q, kv = tiles.q_stage, tiles.kv_stage
    softmax = ",".join(f"softmax{i}" for i in range(q))
    sm_threads = 32 * 4   # one softmax warpgroup per Q stage; stage i belongs to softmax{i}
    corr_threads = 32 * 4
    q_bytes = tiles.m_block * tiles.head_dim * eb
    kv_bytes = tiles.n_block * tiles.head_dim * eb
    b = [
        Barrier("q_full", "load", "mma", 1, q, q_bytes, PHASE_FULL,
                "Q tile i landed in SMEM before the score MMA reads it"),
        Barrier("q_empty", "mma", "load", 1, q, 0, PHASE_EMPTY,
                "the last score MMA of a work tile has read Q tile i before the next tile's Q "
                "overwrites it (tcgen05.commit)", starts_released=True),
        Barrier("kv_full", "load", "mma", 1, kv, kv_bytes, PHASE_FULL,
                "a K or V block landed in its ring buffer before an MMA reads it"),
        Barrier("kv_empty", "mma", "load", 1, kv, 0, PHASE_EMPTY,
                "the MMAs reading a K/V buffer completed before TMA refills it "
                "(tcgen05.commit)", starts_released=True),
        Barrier("s_full", "mma", softmax, 1, q, 0, PHASE_FULL,
                "S_i = Q_i K^T is in TMEM (and, the tensor pipe being in order, the value MMA "
                "before it finished) before softmax_i reads it (tcgen05.commit)",
                per_role_stage=True),
        Barrier("p_ready", softmax, "mma", sm_threads, q, 0, PHASE_FULL,
                "softmax_i read S_i and wrote P_i into TMEM before the value MMA reads P_i and "
                "the next score MMA overwrites S_i", per_role_stage=True),
        Barrier("o_rescaled", "correction", "mma", corr_threads, q, 0, PHASE_EMPTY,
                "correction finished with O_i (rescale, or the epilogue's read) before the "
                "next value MMA accumulates into it", starts_released=True),
        Barrier("o_final", "mma", "correction", 1, q, 0, PHASE_FULL,
                "the last value MMA of a work tile completed before the epilogue reads O_i "
                "(tcgen05.commit)"),
        Barrier("stats_full", softmax, "correction", sm_threads, q, 0, PHASE_FULL,
                "softmax_i posted a block's rescale factor (or the final row sum and max) in "
                "the mailbox before correction reads it", group="mailbox",
                per_role_stage=True),
        Barrier("stats_empty", "correction", softmax, corr_threads, q, 0, PHASE_EMPTY,
                "correction read the mailbox before softmax_i posts again", group="mailbox",
                starts_released=True, per_role_stage=True),
        Barrier("o_staged", "correction", "epilogue", corr_threads, q, 0, PHASE_FULL,
                "normalized O_i is in SMEM (after fence.proxy.async) before the TMA store "
                "reads it"),
        Barrier("o_empty", "epilogue", "correction", 1, q, 0, PHASE_EMPTY,
                "the TMA store finished reading O_i's SMEM staging (store drained) before the "
                "next tile's epilogue writes it", starts_released=True),
    ]
    return BarrierGraph(tuple(b))


def build_roles(q_stage: int) -> tuple[Role, ...]:
    r = REGISTERS
    roles = [Role("softmax0", (0, 1, 2, 3), r["softmax"],
                  "Q stage 0: S0 from TMEM, row max, exp2 (MUFU + polynomial), row sum, P0 to "
                  "TMEM; posts rescale factors to the mailbox")]
    if q_stage == 2:
        roles.append(Role("softmax1", (4, 5, 6, 7), r["softmax"],
                          "Q stage 1: the same on S1/P1, ping-ponging with softmax0"))
    roles += [
        Role("correction", (8, 9, 10, 11), r["correction"],
             "rescales O_i in TMEM when a row max grew past the threshold; epilogue: O_i / "
             "row_sum to SMEM, LSE to global"),
        Role("mma", (12,), r["other"], "one thread issues every tcgen05.mma and tcgen05.commit"),
        Role("load", (13,), r["other"], "TMA loads of Q tiles and the K/V ring"),
        Role("epilogue", (14,), r["other"], "TMA store of O from SMEM, waits until drained"),
        Role("empty", (15,) if q_stage == 2 else (4, 5, 6, 7, 15), r["other"],
             "no work; holds the warpgroup's register count"),
    ]
    return tuple(roles)


def build_sm100(spec, m_block=M_BLOCK, n_block=N_BLOCK, q_stage=Q_STAGE,
                kv_stage=KV_STAGE, pack_gqa: bool = False) -> Plan:
    hw = B200
    d, dv = spec.head_dim, spec.head_dim_v
    if d != dv:
        raise PlanError(f"sm100 plan needs head_dim == head_dim_v (got {d} and {dv}): K and V "
                        f"share one SMEM ring of equal buffers")
    if d % 16 or not 16 <= d <= 256:
        raise PlanError(f"head_dim {d} must be a multiple of 16 in [16, 256] (MMA K step 16)")
    if m_block != 128:
        raise PlanError(f"m_block={m_block}: sm100 plans use m_block 128 (one TMEM lane per "
                        f"query row; each softmax warp owns 32 lanes)")
    if q_stage not in (1, 2):
        raise PlanError(f"q_stage={q_stage}: use 1 or 2 (two softmax warpgroups at most)")
    if n_block % 16 or not 16 <= n_block <= 256:
        raise PlanError(f"n_block={n_block} must be a multiple of 16 in [16, 256] (tcgen05 N)")
    if kv_stage < 2:
        raise PlanError(f"kv_stage={kv_stage}: the K/V ring needs >= 2 buffers (K and V of "
                        f"one block)")
    tiles = Tiles(m_block, n_block, q_stage, kv_stage, d, dv,
                  pack_gqa=check_pack_gqa(spec, m_block, pack_gqa, "sm100"),
                  order=kernel_tile_order(spec.causal, "sm100"))
    need = n_block + SOFTMAX_REG_OVERHEAD
    if need > REGISTERS["softmax"]:
        raise PlanError(f"n_block={n_block}: a softmax thread holds its row of S ({n_block} "
                        f"registers) + ~{SOFTMAX_REG_OVERHEAD} = {need} > setmaxnreg "
                        f"{REGISTERS['softmax']}; use n_block <= "
                        f"{REGISTERS['softmax'] - SOFTMAX_REG_OVERHEAD}")
    tmem = build_tmem(spec, tiles, hw.tmem_columns)
    eb = spec.element_bytes
    barriers = build_barriers(tiles, eb)
    regions = (   # the kernel's shared-storage struct declares them in this order
        SmemRegion("o", m_block * dv * eb, q_stage, what="O staging for the TMA store"),
        SmemRegion("q", m_block * d * eb, q_stage, what="Q tiles, one per Q stage"),
        SmemRegion("kv", n_block * d * eb, kv_stage,
                   what="K/V ring: K_j and V_j take turns in the same buffers"),
        SmemRegion("stats", m_block * 2 * ELEMENT_BYTES["fp32"], q_stage, align=16,
                   what="softmax -> correction mailbox: rescale factor and row sum per row"),
        SmemRegion("barriers", MBARRIER_BYTES, barriers.mbarrier_count, align=8,
                   what="mbarriers"),
        SmemRegion("tmem_ptr", 4, 1, align=4, what="TMEM base address from tcgen05.alloc"),
    )
    smem = SmemPlan.build(regions, hw.smem_per_cta)
    roles = build_roles(q_stage)
    check_roles(roles, hw.registers_per_sm)
    mmas = (
        MmaPlan("score", m_block, n_block, d, spec.dtype, spec.dtype, "fp32", "smem", "smem",
                "tmem", f"tcgen05.mma.cta_group::1.kind::f16 M{m_block} N{n_block} K16"),
        MmaPlan("value", m_block, dv, n_block, spec.dtype, spec.dtype, "fp32", "tmem", "smem",
                "tmem", f"tcgen05.mma.cta_group::1.kind::f16 M{m_block} N{dv} K16 (A=P in TMEM)"),
    )
    notes = (
        "K and V share one ring of kv_stage buffers, loaded K_0, V_0, K_1, V_1, ...",
        "The MMA warp issues, per Q stage i and block j: O_i += P_i V_j-1, then S_i = Q_i K_j; "
        "tcgen05 MMAs complete in order, so S_i never overwrites P_i before it is read.",
        f"exp2_emulation_fraction balances MUFU ({hw.exp2_per_cycle}/cycle) against FMA "
        f"({hw.fma_per_cycle}/cycle) under fa4lab.plan.costs' instruction counts.",
    ) + pack_gqa_notes(spec, tiles)
    return Plan(spec, "sm100", hw, tiles, mmas, tmem, smem, roles, barriers,
                RESCALE_THRESHOLD, balanced_exp2_fraction(hw), notes)


# ---- role programs for the protocol simulator (fa4lab.plan.simulate) ----
def programs(plan: Plan, n_blocks: int, n_tiles: int, costs, masked_blocks: int = 0):
    """Each role's sequence of waits, work, async issues and arrivals over persistent tiles.

    Loads run K_0, V_0, K_1, V_1, ... through the K/V ring (Q tiles in between); the MMA warp
    issues, per block j and Q stage i, O_i += P_i V_j-1 then S_i = Q_i K_j (see the notes).
    """
    from fa4lab.plan.simulate import Arrive, Commit, Issue, Ref, Wait, WaitEngine, Work

    hw, t_, tm = plan.hardware, plan.tiles, plan.tmem
    q, S, N, m, n = t_.q_stage, t_.kv_stage, n_blocks, t_.m_block, t_.n_block
    d, dv = t_.head_dim, t_.head_dim_v
    eb, acc_b = plan.spec.element_bytes, ELEMENT_BYTES["fp32"]   # inputs, P; S and O (fp32)
    f = plan.exp2_emulation_fraction
    stages = range(q)
    corr = plan.role("correction").threads
    smx = {i: plan.role(f"softmax{i}").threads for i in stages}

    def tref(name, i):
        r = tm.region(name, i)
        return Ref("tmem", f"{name}", i, r.col_offset, r.col_end)

    def sref(name, i):
        return Ref("smem", name, i)

    q_bytes, kv_bytes = m * d * eb, n * d * eb
    qk = costs.mma_op_cycles(hw, plan.mma("score"))
    pv = costs.mma_op_cycles(hw, plan.mma("value"))
    rescale_at = costs.rescale_blocks(N)

    def masked(j):
        return j >= N - masked_blocks

    def slot(g):          # global load index -> (ring stage, phase use)
        return g % S, g // S

    load, mma = [], []
    softmax = {i: [] for i in stages}
    correction, epilogue = [], []
    for t in range(n_tiles):
        base = t * 2 * N

        def kv_load(g, what, _base=base):
            s, use = slot(_base + g)
            return [Wait("kv_empty", s, use - 1),
                    Arrive("kv_full", s, 1, expect_tx=kv_bytes),
                    Issue("tma", what, costs.tma_cycles(kv_bytes), writes=(sref("kv", s),),
                          complete_tx=("kv_full", s, kv_bytes))]

        def q_load(i, _t=t):
            return [Wait("q_empty", i, _t - 1), Arrive("q_full", i, 1, expect_tx=q_bytes),
                    Issue("tma", f"Q{i}", costs.tma_cycles(q_bytes), writes=(sref("q", i),),
                          complete_tx=("q_full", i, q_bytes))]

        # load warp: Q0, K0, Q1, V0, K1, V1, ...
        load += q_load(0) + kv_load(0, "K0")
        for i in range(1, q):
            load += q_load(i)
        for j in range(N):
            load += kv_load(2 * j + 1, f"V{j}")
            if j + 1 < N:
                load += kv_load(2 * j + 2, f"K{j + 1}")

        # mma warp
        def k_slot(j, _base=base):
            return slot(_base + 2 * j)

        def v_slot(j, _base=base):
            return slot(_base + 2 * j + 1)

        def score(i, j):
            s, _ = k_slot(j)
            return [Issue("tensor", f"S{i}=Q{i}K{j}", qk,
                          reads=(sref("q", i), sref("kv", s)), writes=(tref("S", i),)),
                    Commit("tensor", "s_full", i)]

        def value(i, j, _t=t):
            s, _ = v_slot(j)
            o_reads = (tref("O", i),) if j > 0 else ()
            return [Wait("p_ready", i, _t * N + j), Wait("o_rescaled", i, _t * N + j - 1),
                    Issue("tensor", f"O{i}+=P{i}V{j}", pv,
                          reads=(tref("P", i), sref("kv", s)) + o_reads,
                          writes=(tref("O", i),))]

        s0, u0 = k_slot(0)
        for i in stages:
            mma += [Wait("q_full", i, t)]
            if i == 0:
                mma += [Wait("kv_full", s0, u0)]
            mma += score(i, 0)
        mma += [Commit("tensor", "kv_empty", s0)]
        for j in range(1, N):
            sv, uv = v_slot(j - 1)
            sk, uk = k_slot(j)
            mma += [Wait("kv_full", sv, uv), Wait("kv_full", sk, uk)]
            for i in stages:
                mma += value(i, j - 1)
                if i == q - 1:
                    mma += [Commit("tensor", "kv_empty", sv)]
                mma += score(i, j)
            mma += [Commit("tensor", "kv_empty", sk)]
        for i in stages:
            mma += [Commit("tensor", "q_empty", i)]
        sv, uv = v_slot(N - 1)
        mma += [Wait("kv_full", sv, uv)]
        for i in stages:
            mma += value(i, N - 1) + [Commit("tensor", "o_final", i)]
        mma += [Commit("tensor", "kv_empty", sv)]

        # softmax warpgroups: one per Q stage
        for i in stages:
            prog = softmax[i]
            for j in range(N):
                prog += [Wait("s_full", i, t * N + j),
                         Work(f"ld S{i}", costs.tmem_cycles(m * n * acc_b), reads=(tref("S", i),))]
                if j > 0:   # post the rescale factor early so correction overlaps the exp2
                    post = t * N + j - 1
                    prog += [Wait("stats_empty", i, post - 1),
                             Work("post scale", 8, writes=(sref("stats", i),)),
                             Arrive("stats_full", i, smx[i])]
                prog += [Work(f"exp2 S{i}", costs.softmax_cycles(hw, m * n, f, masked(j)),
                              unit="mufu"),
                         Work(f"st P{i}", costs.tmem_cycles(m * n * eb), writes=(tref("P", i),)),
                         Arrive("p_ready", i, smx[i])]
            post = t * N + N - 1
            prog += [Wait("stats_empty", i, post - 1),
                     Work("post row sum", 8, writes=(sref("stats", i),)),
                     Arrive("stats_full", i, smx[i])]

        # correction warpgroup: rescale O when told, then the epilogue
        o_bytes = m * dv * acc_b
        for j in range(1, N):
            for i in stages:
                correction += [Wait("stats_full", i, t * N + j - 1),
                               Work("read scale", 8, reads=(sref("stats", i),)),
                               Arrive("stats_empty", i, corr)]
                if j in rescale_at:
                    correction += [Work(f"rescale O{i}",
                                        costs.tmem_cycles(2 * o_bytes) + m * dv / hw.fma_per_cycle,
                                        reads=(tref("O", i),), writes=(tref("O", i),))]
                correction += [Arrive("o_rescaled", i, corr)]
        for i in stages:
            correction += [Wait("stats_full", i, t * N + N - 1),
                           Work("read row sum", 8, reads=(sref("stats", i),)),
                           Arrive("stats_empty", i, corr),
                           Wait("o_final", i, t),
                           Work(f"ld O{i}, / row sum",
                                costs.tmem_cycles(o_bytes) + m * dv / hw.fma_per_cycle,
                                reads=(tref("O", i),)),
                           Arrive("o_rescaled", i, corr),
                           Wait("o_empty", i, t - 1),
                           Work(f"O{i} to SMEM", costs.smem_cycles(hw, m * dv * eb),
                                writes=(sref("o", i),)),
                           Arrive("o_staged", i, corr)]
            epilogue += [Wait("o_staged", i, t),
                         Issue("tma_store", f"store O{i}", costs.tma_cycles(m * dv * eb),
                               reads=(sref("o", i),)),
                         WaitEngine("tma_store"),
                         Arrive("o_empty", i, 1)]
    progs = {"load": load, "mma": mma}
    progs.update({f"softmax{i}": softmax[i] for i in stages})
    progs.update({"correction": correction, "epilogue": epilogue})
    return progs
