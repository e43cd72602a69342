"""The Hopper (sm90) plan: the same design with S, P and O in registers (FA3-style).

One producer warpgroup (warp 0 issues the TMA loads; the group gives its registers away with
setmaxnreg) and two or three consumer warpgroups, each owning one Q tile of 64 rows (wgmma
M = 64). The consumers take turns at the tensor core through one named barrier each (the
ping-pong, a ring with three): while one issues its wgmmas the others run their softmax. No
TMEM: `plan.tmem` is None.

The tuning numbers live in the single table `SM90_TUNING` below, keyed by head_dim; the sm90
kernel reads them only through the plan. Supported head_dim: those of
`fa4lab.limits.KERNEL_HEAD_DIMS["sm90"]` (== head_dim_v), one table row each.

`pack_gqa=True` (see Note [sm90 pack-GQA]) makes a CTA's rows the packed rows of one KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

from fa4lab.errors import PlanError
from fa4lab.hardware import H200
from fa4lab.limits import KERNEL_HEAD_DIMS, RESCALE_THRESHOLD
from fa4lab.plan.barriers import PHASE_EMPTY, PHASE_FULL, PHASE_NAMED, Barrier, BarrierGraph
from fa4lab.plan.plan import Plan
from fa4lab.plan.roles import Role, check_roles
from fa4lab.plan.smem import MBARRIER_BYTES, SmemPlan, SmemRegion
from fa4lab.plan.tiles import MmaPlan, Tiles, check_pack_gqa, pack_gqa_notes
from fa4lab.tiling import kernel_tile_order


@dataclass(frozen=True)
class Sm90Tuning:
    n_block: int
    kv_stage: int
    q_stage: int               # consumer warpgroups (64 query rows each)
    o_in_q: bool               # stage O for the TMA store in Q's SMEM (Q is dead by then)


# Note [sm90 tuning table]
# The only numbers of the Hopper plan that are choices rather than consequences. head_dim 64
# runs three consumers (a 192-row CTA, as upstream FA4's Hopper path does): its per-block
# GEMMs are short, so a third warpgroup's softmax is needed to keep the tensor core fed, and
# its small accumulators fit the 160 registers three consumers leave each thread.
SM90_TUNING = {
    64: Sm90Tuning(n_block=128, kv_stage=2, q_stage=3, o_in_q=False),
    128: Sm90Tuning(n_block=128, kv_stage=2, q_stage=2, o_in_q=False),
    256: Sm90Tuning(n_block=80, kv_stage=2, q_stage=2, o_in_q=True),
}
# setmaxnreg (producer, each consumer) by consumer count. Each pair keeps
# 128 * producer + 128 * consumers * consumer <= 65536 (the SM's register file, one CTA per SM)
# and is a multiple of 8, as setmaxnreg needs.
SM90_REGISTERS = {1: (24, 240), 2: (24, 240), 3: (32, 160)}
M_BLOCK = 64      # wgmma M: one consumer warpgroup's Q tile
# Besides O (head_dim_v / 2 fp32 per thread), S (n_block / 2) and P (n_block / 4 packed
# pairs), a consumer thread needs about this many registers for addresses, row statistics and
# loop state (ptxas's count for the head_dim 64 three-consumer kernel: 160 with no spills).
CONSUMER_REG_OVERHEAD = 32


# Note [sm90 pack-GQA]
# With pack_gqa the qhead_per_kvhead (g) query heads of a KV head share one CTA: its M rows are
# packed rows (position * g + head within the group, Note [pack-GQA rows] in fa4lab.tiling), so
# the grid has heads_kv columns and ceil(seqlen_q * g / cta_m) row tiles, and K/V are loaded once
# per group instead of g times (what decode and short seqlen_q need). The kernel keeps TMA for
# Q and O: a 64-row tile is a (g, 64 / g) box over (head, position), which needs g to divide
# m_block; the SMEM, barriers and MMAs are the same as without packing. With g == 1 there is
# nothing to pack, and the plan records pack_gqa=False.


def consumer_registers_needed(n_block: int, head_dim_v: int) -> int:
    return head_dim_v // 2 + n_block // 2 + n_block // 4 + CONSUMER_REG_OVERHEAD


def build_barriers(tiles: Tiles, eb: int) -> BarrierGraph:
    """The mbarriers and named barriers; `eb` is the bytes per element of Q, K and V."""
    q, kv = tiles.q_stage, tiles.kv_stage
    consumers = ",".join(f"consumer{i}" for i in range(q))
    threads = 128 * q
    b = [
        Barrier("q_full", "load", consumers, 1, 1, tiles.cta_m * tiles.head_dim * eb, PHASE_FULL,
                "the CTA's Q rows (both consumers' tiles, one TMA) landed before any wgmma "
                "reads them"),
        Barrier("k_full", "load", consumers, 1, kv, tiles.n_block * tiles.head_dim * eb,
                PHASE_FULL, "K_j landed in its buffer before the score wgmma reads it"),
        Barrier("k_empty", consumers, "load", threads, kv, 0, PHASE_EMPTY,
                "every consumer finished the score wgmma on K_j before TMA refills the buffer",
                starts_released=True),
        Barrier("v_full", "load", consumers, 1, kv, tiles.n_block * tiles.head_dim_v * eb,
                PHASE_FULL, "V_j landed before the value wgmma reads it"),
        Barrier("v_empty", consumers, "load", threads, kv, 0, PHASE_EMPTY,
                "every consumer finished the value wgmma on V_j before TMA refills the buffer",
                starts_released=True),
    ]
    if q >= 2:
        for i in range(q):
            prev = (i - 1) % q
            b.append(Barrier(
                f"mma_turn{i}", f"consumer{prev}", f"consumer{i}", 256, 1, 0, PHASE_NAMED,
                f"consumer{i} issues its wgmmas only after consumer{prev} finished issuing "
                f"its own (warp-scheduler ping-pong: softmax overlaps the others' GEMMs)",
                kind="named", group="named"))
    return BarrierGraph(tuple(b))


def build_roles(tiles: Tiles) -> tuple[Role, ...]:
    producer_regs, consumer_regs = SM90_REGISTERS[tiles.q_stage]
    roles = [Role("load", (0, 1, 2, 3), producer_regs,
                  "producer warpgroup: warp 0 issues the TMA loads of Q, K, V; warps 1-3 idle")]
    for i in range(tiles.q_stage):
        roles.append(Role(f"consumer{i}", tuple(range(4 + 4 * i, 8 + 4 * i)),
                          consumer_regs,
                          f"Q rows {64 * i}-{64 * i + 63}: wgmma S = Q K^T, softmax in registers "
                          f"(rescale O when needed), wgmma O += P V, epilogue and TMA store"))
    return tuple(roles)


def build_sm90(spec, m_block=M_BLOCK, n_block=None, q_stage=None, kv_stage=None,
               pack_gqa: bool = False) -> Plan:
    hw = H200
    d, dv = spec.head_dim, spec.head_dim_v
    dims = KERNEL_HEAD_DIMS["sm90"]
    if d != dv or d not in dims:
        raise PlanError(f"sm90 plans head_dim {', '.join(map(str, dims[:-1]))} or {dims[-1]} "
                        f"with head_dim_v == head_dim (got {d}, {dv})")
    tuning = SM90_TUNING[d]
    n_block = tuning.n_block if n_block is None else n_block
    kv_stage = tuning.kv_stage if kv_stage is None else kv_stage
    if q_stage is None:
        # Packed tiles serve short query lengths (decode, small seqlen_q * g), where a third
        # 64-row tile would mostly be padding; they keep two consumers.
        q_stage = min(tuning.q_stage, 2) if pack_gqa and spec.qhead_per_kvhead > 1 \
            else tuning.q_stage
    if m_block != 64:
        raise PlanError(f"m_block={m_block}: sm90 consumers own 64 rows each (wgmma M = 64)")
    if q_stage not in SM90_REGISTERS:
        raise PlanError(f"q_stage={q_stage}: 1, 2 or 3 consumer warpgroups (4 warpgroups, 512 "
                        f"threads, is the most one CTA can run with registers to spare)")
    if n_block % 16 or not 16 <= n_block <= 256:
        raise PlanError(f"n_block={n_block} must be a multiple of 16 in [16, 256] (wgmma N, "
                        f"and K of the value wgmma)")
    if kv_stage < 1:
        raise PlanError(f"kv_stage={kv_stage} must be >= 1")
    tiles = Tiles(m_block, n_block, q_stage, kv_stage, d, dv,
                  pack_gqa=check_pack_gqa(spec, m_block, pack_gqa, "sm90"),
                  order=kernel_tile_order(spec.causal, "sm90"))
    need = consumer_registers_needed(n_block, dv)
    consumer_regs = SM90_REGISTERS[q_stage][1]
    if need > consumer_regs:
        raise PlanError(
            f"registers: a consumer thread holds O ({dv // 2}), S ({n_block // 2}), P "
            f"({n_block // 4}) + ~{CONSUMER_REG_OVERHEAD} = {need} > setmaxnreg "
            f"{consumer_regs} with {q_stage} consumers; lower n_block or q_stage")
    eb = spec.element_bytes
    barriers = build_barriers(tiles, eb)
    q_region = SmemRegion("q", m_block * d * eb, q_stage, what="Q tile per consumer")
    regions = [
        q_region,
        SmemRegion("k", n_block * d * eb, kv_stage, what="K ring"),
        SmemRegion("v", n_block * dv * eb, kv_stage, what="V ring"),
        SmemRegion("o", m_block * dv * eb, q_stage, alias_of="q" if tuning.o_in_q else None,
                   what="O staging for the TMA store" + (" (in Q's bytes)" if tuning.o_in_q
                                                         else "")),
        SmemRegion("barriers", MBARRIER_BYTES, barriers.mbarrier_count, align=8,
                   what="mbarriers"),
    ]
    smem = SmemPlan.build(tuple(regions), hw.smem_per_cta)
    roles = build_roles(tiles)
    check_roles(roles, hw.registers_per_sm)
    mmas = (
        MmaPlan("score", m_block, n_block, d, spec.dtype, spec.dtype, "fp32", "smem", "smem",
                "rmem", f"wgmma.mma_async m64n{n_block}k16 (SS)"),
        MmaPlan("value", m_block, dv, n_block, spec.dtype, spec.dtype, "fp32", "rmem", "smem",
                "rmem", f"wgmma.mma_async m64n{dv}k16 (RS: P from registers)"),
    )
    notes = (
        "One work tile per CTA (not persistent): Q is loaded once, so it needs no empty barrier.",
        "The ping-pong named barriers order the consumers' wgmma issue; the simulator "
        "treats the tensor-core turn as a region both write, so a missing turn is a hazard.",
        "exp2 runs on MUFU only (no polynomial emulation on Hopper).",
    ) + pack_gqa_notes(spec, tiles)
    return Plan(spec, "sm90", hw, tiles, mmas, None, smem, roles, barriers,
                RESCALE_THRESHOLD, 0.0, notes)


# ---- role programs for the protocol simulator (fa4lab.plan.simulate) ----
def programs(plan: Plan, n_blocks: int, n_tiles: int, costs, masked_blocks: int = 0):
    """The producer and the consumers over one work tile of `n_blocks` K/V blocks.

    Consumer c's section s issues S = Q_c K_s (s < N) and O += P V_s-1 (s >= 1) while holding
    the tensor-core turn; the named barriers pass the turn round the ring c0 -> c1 (-> c2)
    -> c0 ... and the last consumer arrives once at the start so consumer0 goes first.
    `n_tiles` is ignored (one tile per CTA).
    """
    from fa4lab.plan.simulate import Arrive, Issue, Ref, Wait, WaitEngine, Work

    hw, t_ = plan.hardware, plan.tiles
    q, S, N, m, n = t_.q_stage, t_.kv_stage, n_blocks, t_.m_block, t_.n_block
    d, dv = t_.head_dim, t_.head_dim_v
    eb = plan.spec.element_bytes
    o_region = plan.smem.region("o")
    turn = Ref("turn", "tensor-core turn", 0)
    rescale_at = costs.rescale_blocks(N)
    qk = costs.mma_op_cycles(hw, plan.mma("score"))
    pv = costs.mma_op_cycles(hw, plan.mma("value"))

    def sref(name, i):
        if name == "o" and o_region.alias_of:
            name = o_region.alias_of
        return Ref("smem", name, i)

    q_bytes = t_.cta_m * d * eb
    k_bytes, v_bytes = n * d * eb, n * dv * eb
    load = [Arrive("q_full", 0, 1, expect_tx=q_bytes),
            Issue("tma", "Q", costs.tma_cycles(q_bytes),
                  writes=tuple(sref("q", i) for i in range(q)),
                  complete_tx=("q_full", 0, q_bytes))]
    for j in range(N):
        for name, nbytes in (("k", k_bytes), ("v", v_bytes)):
            load += [Wait(f"{name}_empty", j % S, j // S - 1),
                     Arrive(f"{name}_full", j % S, 1, expect_tx=nbytes),
                     Issue("tma", f"{name.upper()}{j}", costs.tma_cycles(nbytes),
                           writes=(sref(name, j % S),),
                           complete_tx=(f"{name}_full", j % S, nbytes))]
    progs = {"load": load}
    threads = 128
    for c in range(q):
        prog = []
        pingpong = q >= 2
        if pingpong and c == q - 1:    # the last consumer lets consumer0 go first
            prog.append(Arrive("mma_turn0", 0, threads))
        prog.append(Wait("q_full", 0, 0))
        for s in range(N + 1):
            if s < N:
                prog.append(Wait("k_full", s % S, s // S))
            if s >= 1:
                prog.append(Wait("v_full", (s - 1) % S, (s - 1) // S))
            if pingpong:
                prog.append(Wait(f"mma_turn{c}", 0, s))
            if s < N:
                prog.append(Work(f"S{c}=Q{c}K{s}", qk, unit="tensor",
                                 reads=(sref("q", c), sref("k", s % S)), writes=(turn,)))
            if s >= 1:
                prog.append(Work(f"O{c}+=P{c}V{s - 1}", pv,
                                 unit="tensor", reads=(sref("v", (s - 1) % S),), writes=(turn,)))
            if pingpong and not (c == q - 1 and s == N):  # nobody takes a turn after it
                prog.append(Arrive(f"mma_turn{(c + 1) % q}", 0, threads))
            if s < N:
                prog.append(Arrive("k_empty", s % S, threads))
            if s >= 1:
                prog.append(Arrive("v_empty", (s - 1) % S, threads))
            if s < N:
                cyc = costs.softmax_cycles(hw, m * n, 0.0, s >= N - masked_blocks)
                if s in rescale_at:
                    cyc += m * dv / hw.fma_per_cycle
                prog.append(Work(f"softmax{c}", cyc, unit="mufu"))
        prog += [Work(f"O{c} to SMEM", costs.smem_cycles(hw, m * dv * eb),
                      writes=(sref("o", c),)),
                 Issue("tma_store", f"store O{c}", costs.tma_cycles(m * dv * eb),
                       reads=(sref("o", c),)),
                 WaitEngine("tma_store")]
        progs[f"consumer{c}"] = prog
    return progs
