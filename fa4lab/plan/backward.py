"""`plan_backward`: the plan of the FlashAttention backward on a B200, computed once and checked.

    from fa4lab.plan.backward import plan_backward
    plan = plan_backward(AttentionSpec(1, 8192, 8192, 16, 16, 128), arch="sm100")
    plan.tmem.total_cols, plan.smem.total_bytes, plan.protocol     # 512, 232448, the table

One CTA owns a key block of 128 keys (of one KV head) and walks the query blocks that see it
(Note [key blocks outside] in fa4lab.backward_blocks), under GQA for each query head of the
KV head's group in turn (`spec.qhead_per_kvhead`): per query block, five tcgen05 MMAs (S^T =
K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q, dQ = dS K), P and dS computed by two compute
warpgroups, dQ added into a float32 buffer in global memory by a reduce warpgroup, dK and dV
stored once.
Its TMEM map is `fa4lab.backward_budget.backward_tmem` (Note [the backward's TMEM]); its
protocol table is `fa4lab.plan.protocol_bwd_sm100` (Note [the backward's protocol]), which the
simulator runs (`fa4lab.plan.simulate.simulate(plan)`); `fa4lab plan --backward` prints the
report (`fa4lab.plan.report_backward`).

Constraints: sm100 only (an sm90 backward plan raises PlanError: this planner does not plan
one yet); head_dim == head_dim_v in {64, 96, 128}, the 1-CTA layout's TMEM. (192, 128) and
(256, 256) raise PlanError: upstream FA4 runs them with 2-CTA MMA in a different TMEM layout
(Note [the backward's 2-CTA MMA] in fa4lab.plan.protocol_bwd_sm100), which is not planned here.
"""

from __future__ import annotations

from dataclasses import dataclass

from fa4lab.errors import PlanError
from fa4lab.hardware import B200, Hardware
from fa4lab.limits import ELEMENT_BYTES, arch_key
from fa4lab.plan.plan import PlanViews
from fa4lab.plan.protocol import Protocol
from fa4lab.plan.roles import Role, check_roles
from fa4lab.plan.smem import MBARRIER_BYTES, SmemPlan, SmemRegion
from fa4lab.plan.tiles import MmaPlan
from fa4lab.plan.tmem import TmemPlan
from fa4lab.spec import AttentionSpec

__all__ = ["BackwardTiles", "BackwardPlan", "plan_backward", "BACKWARD_HEAD_DIMS",
           "backward_registers"]

# Head dims the 1-CTA layout holds (Note [the backward's TMEM] in fa4lab.backward_budget): dQ
# over dP needs head_dim <= 128, and S + dV + dP + dK <= 512 columns.
BACKWARD_HEAD_DIMS = ((64, 64), (96, 96), (128, 128))

# Tuning knobs of the sm100 backward (upstream FA4's 1-CTA choices, flash_attn/cute/
# flash_bwd_sm100.py `_setup_attributes`): Q (and its LSE row) double-buffered, dO (and its D
# row) single; dQ leaves TMEM in chunks of 32 fp32 columns through two SMEM staging buffers
# (`dQ_reduce_ncol` 32, `sdQaccum_stage` 64 // 32).
Q_STAGE = 2
DO_STAGE = 1
DQ_CHUNK_COLS = 32
DQ_STAGES = 2


# Note [backward registers]
# setmaxnreg per warpgroup, upstream FA4's 1-CTA values (flash_bwd_sm100.py `__init__`): the
# dQ-reduce warpgroup 152 and the two compute warpgroups 136 without a mask, 136 and 144 with
# causal or a window (the mask's index arithmetic lives in the compute warps), the load and MMA
# warps 88 (`96 - 8`). Upstream asserts reduce + 2 x compute + max(load, mma) <= 512, i.e.
# that the four warpgroups fit the 64K registers: 152 + 2 x 136 + 88 = 136 + 2 x 144 + 88 =
# 512 exactly. Upstream lowers its two idle warps (14, 15) to 24 while warps 12 and 13 keep
# 88; setmaxnreg is a warpgroup's instruction (all four warps execute it with one value), so
# this plan keeps the whole fourth warpgroup at 88, the budget upstream's assert counts.
def backward_registers(masked: bool) -> dict[str, int]:
    """setmaxnreg per role group: Note [backward registers]."""
    if masked:
        return {"reduce": 136, "compute": 144, "other": 88}
    return {"reduce": 152, "compute": 136, "other": 88}


@dataclass(frozen=True)
class BackwardTiles:
    m_block: int          # query rows per step (the N of S^T = K Q^T, the M of dQ = dS K)
    n_block: int          # keys per CTA (TMEM lanes: the M of S^T, dP^T, dV, dK)
    q_stage: int          # Q (and LSE) SMEM buffers
    do_stage: int         # dO (and D) SMEM buffers
    head_dim: int
    head_dim_v: int
    dq_chunk: int = DQ_CHUNK_COLS    # fp32 columns of dQ per reduce-add
    dq_stages: int = DQ_STAGES       # SMEM staging buffers of the dQ reduce-adds
    cta_group: int = 1               # tcgen05 cta_group (2: an MMA across a CTA pair)

    @property
    def dq_chunks(self) -> int:
        """Reduce-adds per step: head_dim / dq_chunk."""
        return self.head_dim // self.dq_chunk


@dataclass(frozen=True)
class BackwardPlan(PlanViews):
    spec: AttentionSpec
    arch: str
    hardware: Hardware
    tiles: BackwardTiles
    mmas: tuple[MmaPlan, ...]
    tmem: TmemPlan
    smem: SmemPlan
    roles: tuple[Role, ...]
    protocol: Protocol
    notes: tuple[str, ...] = ()
    direction: str = "backward"

    def step_flops(self) -> int:
        """FLOPs of one step's five MMAs."""
        return sum(m.flops for m in self.mmas)


def plan_backward(spec: AttentionSpec, arch: str = "sm100") -> BackwardPlan:
    """The frozen plan of the backward kernel for `spec` on `arch` (module docstring). A spec
    the plan cannot hold raises PlanError saying why and what runs it instead."""
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"plan_backward takes an AttentionSpec, got {type(spec).__name__}")
    key = arch_key(arch)
    if key != "sm100":
        raise PlanError(
            "no sm90 backward plan: this planner plans the B200 backward only (TMEM, tcgen05, "
            "the protocol table of fa4lab.plan.protocol_bwd_sm100). A Hopper backward keeps S, "
            "dP and the dK/dV accumulators in registers (wgmma); plan the B200 one with "
            "arch='sm100', or see fa4lab.backward_budget for the cost of dQ on any chip")
    return _build_sm100(spec)


def _check_head_dims(spec: AttentionSpec) -> None:
    from fa4lab.backward_budget import backward_tmem

    pair = (spec.head_dim, spec.head_dim_v)
    if pair in BACKWARD_HEAD_DIMS:
        return
    try:
        tm = backward_tmem(*pair, dtype=spec.dtype)
        why = f"it needs {tm.total_cols} TMEM columns"
    except PlanError as err:
        why = str(err)
    raise PlanError(
        f"no 1-CTA sm100 backward plan for (head_dim, head_dim_v) = {pair}: {why}. This plan "
        f"holds {', '.join(str(p) for p in BACKWARD_HEAD_DIMS)}. Upstream FA4 runs (192, 128) "
        f"with 2-CTA MMA in another TMEM layout and (256, 256) in a dedicated 2-CTA kernel "
        f"(Note [the backward's 2-CTA MMA] in fa4lab.plan.protocol_bwd_sm100); neither is "
        f"planned here. Fallback: the float64 reference backward on CPU "
        f"(fa4lab.reference_backward)")


def _build_sm100(spec: AttentionSpec) -> BackwardPlan:
    from fa4lab.backward_budget import backward_tmem
    from fa4lab.plan.protocol_bwd_sm100 import build_barriers, build_protocol

    hw = B200
    _check_head_dims(spec)
    d, dv = spec.head_dim, spec.head_dim_v
    tmem = backward_tmem(d, dv, dtype=spec.dtype)        # one source: Note [the backward's TMEM]
    n_block = tmem.lanes                                  # keys: one per TMEM lane
    m_block = tmem.region("S", 0).columns                 # queries: S^T's columns
    tiles = BackwardTiles(m_block, n_block, Q_STAGE, DO_STAGE, d, dv)
    if d % tiles.dq_chunk:
        raise PlanError(f"head_dim {d} is not a multiple of the dQ reduce-add chunk "
                        f"({tiles.dq_chunk} columns)")
    regs = backward_registers(spec.has_mask)
    roles = _roles(regs)
    check_roles(roles, hw.registers_per_sm)
    eb, f32 = spec.element_bytes, ELEMENT_BYTES["fp32"]
    barriers = build_barriers(tiles, eb, roles)
    regions = (   # upstream's 1-CTA SharedStorage order: barriers, TMEM address, then buffers
        SmemRegion("barriers", MBARRIER_BYTES, barriers.mbarrier_count, align=8,
                   what="mbarriers"),
        SmemRegion("tmem_ptr", 4, 1, align=4, what="TMEM base address from tcgen05.alloc"),
        SmemRegion("q", m_block * d * eb, tiles.q_stage,
                   what="Q blocks (B of S^T = K Q^T and of dK += dS^T Q)"),
        SmemRegion("k", n_block * d * eb, 1,
                   what="the CTA's K block (A of S^T, B of dQ = dS K), loaded once"),
        SmemRegion("v", n_block * dv * eb, 1, what="the CTA's V block (A of dP^T), loaded once"),
        SmemRegion("do", m_block * dv * eb, tiles.do_stage,
                   what="dO blocks (B of dP^T = V dO^T and of dV += P^T dO)"),
        SmemRegion("ds", n_block * m_block * eb, 1, align=128,
                   what="dS, 16-bit (A of dQ = dS K; dK reads it from TMEM)"),
        SmemRegion("lse", m_block * f32, tiles.q_stage, align=128,
                   what="the Q block's LSE rows (fp32), with Q's stages"),
        SmemRegion("dpsum", m_block * f32, tiles.do_stage, align=128,
                   what="the dO block's D = rowsum(dO * O) rows (fp32), with dO's stages"),
        SmemRegion("dq_acc", m_block * tiles.dq_chunk * f32, tiles.dq_stages,
                   what=f"dQ staging for the TMA reduce-adds, {tiles.dq_chunk} fp32 columns "
                        f"each"),
        SmemRegion("dk_out", n_block * d * eb, 1, alias_of="q",
                   what="dK staging for its TMA store (in Q's bytes: every MMA is done)"),
        SmemRegion("dv_out", n_block * dv * eb, 1, alias_of="do",
                   what="dV staging for its TMA store (in dO's bytes)"),
    )
    smem = SmemPlan.build(regions, hw.smem_per_cta)
    mmas = _mmas(spec, tiles)
    notes = (
        "One CTA per key block of 128 keys, walking the query blocks that see it (Note [key "
        "blocks outside] in fa4lab.backward_blocks); not persistent, as upstream's default "
        "backward (`is_persistent=False`, SingleTileScheduler).",
        "K and V are loaded once per CTA (one kv_full phase); Q and LSE stream through "
        f"{tiles.q_stage} buffers, dO and D through {tiles.do_stage}. Upstream folds K into "
        "the first Q phase and V into the first dO phase (`extra_tx_count`); this table gives "
        "them their own barrier.",
        "The MMA warp runs one query block ahead: S^T of block j + 1 is issued before dK and "
        "dQ of block j, dP^T and dV of block j + 1 after them (upstream's 1-CTA main loop; Note "
        "[the backward's protocol]).",
        "P and dS are exp2 on the MUFU only (upstream's backward emulates no exp2); dS = P * "
        "(dP - D) runs on the FMA pipe.",
        f"dQ leaves TMEM into registers, then SMEM in {tiles.dq_chunks} chunks of "
        f"{tiles.dq_chunk} fp32 columns, each a TMA reduce-add into dQ_accum in global memory "
        f"(Note [accumulating dQ] in fa4lab.backward_budget: the atomic scheme).",
    )
    g = spec.qhead_per_kvhead
    if g > 1:
        notes += (f"GQA {g}: one CTA per (key block, KV head) walks its query blocks for each "
                  f"of the group's {g} query heads in turn, the same protocol over {g} times "
                  f"the steps; dK and dV accumulate in TMEM over the group and are stored once "
                  f"(Note [sm100 backward, GQA] in fa4lab.kernels.bwd_sm100).",)
    return BackwardPlan(spec, "sm100", hw, tiles, mmas, tmem, smem, roles,
                        build_protocol(barriers, tiles), notes)


def _roles(regs: dict[str, int]) -> tuple[Role, ...]:
    other = regs["other"]
    return (
        Role("dq_reduce", (0, 1, 2, 3), regs["reduce"],
             "dQ from TMEM to registers to SMEM, 32 columns at a time, each a TMA reduce-add "
             "(cp.reduce.async.bulk .add.f32) into dQ_accum"),
        Role("compute", tuple(range(4, 12)), regs["compute"],
             "two warpgroups, 64 queries each: P = exp2(S scale_log2 - LSE) to TMEM over S; "
             "dS = P (dP - D) to TMEM over dP and to SMEM; epilogue: dV and dK from TMEM to "
             "SMEM, TMA stores"),
        Role("mma", (12,), other, "one thread issues the five tcgen05.mma per step and every "
                                  "tcgen05.commit; allocates and frees TMEM"),
        Role("load", (13,), other, "TMA loads: K and V once; Q, LSE, dO and D per step"),
        Role("relay", (14,), other, "no work in the 1-CTA kernel (upstream's 2-CTA kernel "
                                    "relays the dS exchange between the CTA pair here)"),
        Role("empty", (15,), other, "no work; holds the warpgroup's register count"),
    )


def _mmas(spec: AttentionSpec, t: BackwardTiles) -> tuple[MmaPlan, ...]:
    """The five MMAs of one step (the keys in TMEM's lanes: Note [the backward's TMEM])."""
    dt, n, m, d, dv = spec.dtype, t.n_block, t.m_block, t.head_dim, t.head_dim_v

    def inst(mm, nn, a_tmem=False):
        return (f"tcgen05.mma.cta_group::{t.cta_group}.kind::f16 M{mm} N{nn} K16"
                + (" (A in TMEM)" if a_tmem else ""))
    return (
        MmaPlan("S", n, m, d, dt, dt, "fp32", "smem", "smem", "tmem", inst(n, m)),
        MmaPlan("dP", n, m, dv, dt, dt, "fp32", "smem", "smem", "tmem", inst(n, m)),
        MmaPlan("dV", n, dv, m, dt, dt, "fp32", "tmem", "smem", "tmem", inst(n, dv, True)),
        MmaPlan("dK", n, d, m, dt, dt, "fp32", "tmem", "smem", "tmem", inst(n, d, True)),
        MmaPlan("dQ", m, d, n, dt, dt, "fp32", "smem", "smem", "tmem", inst(m, d)),
    )
