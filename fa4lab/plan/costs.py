"""The cost model: cycles for each piece of work, from the hardware's feeds and speeds.

Hardware figures (MMA FLOPs, MUFU exp2, FMA lanes, SMEM bytes per SM per cycle, clock, SMs)
come from `fa4lab.hardware`. The few figures the datasheets do not give are ASSUMPTIONS, named
here once, shown by `fa4lab plan` and varied by notebook 04's widgets. DEFAULT_COSTS holds
them uncalibrated (the protocol checks use it); the values fitted per chip, which the
planner predicts with, are `costs_for(hw)` (Note [calibration] in `fa4lab.plan.calibration`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from fa4lab.hardware import Hardware, hardware_for
from fa4lab.limits import ELEMENT_BYTES, EXP2_PAIR_FADD2, EXP2_PAIR_FFMA2


@dataclass(frozen=True)
class CostModel:
    # fp32 FMA-pipe instructions per score besides exp2: scale-and-subtract (FFMA), row max,
    # row sum, half a packed conversion to 16 bits.
    fma_ops_per_score: float = 3.5
    # FMA-pipe instructions per element of the software exp2, on f32x2 pairs: Note [packed exp2
    # cost].
    fma_ops_per_poly_exp2: float = (EXP2_PAIR_FADD2 + EXP2_PAIR_FFMA2) / 2
    # Extra FMA-pipe instructions per score on a block that needs the element mask (the causal
    # diagonal, a sliding window's left or right edge, or the seqlen_k tail cuts it).
    fma_ops_per_masked_score: float = 2.0
    # With a softcap, per score: one FMUL (raw score x pre_scale) on the FMA pipe and one
    # tanh.approx.f32 on the MUFU (`fa4lab.kernels.device.softmax.softcap_row`; PTX ISA, tanh:
    # SASS MUFU.TANH on sm_75+). ASSUMED: MUFU.TANH issues at the MUFU's exp2 rate
    # (`Hardware.exp2_per_cycle`); the programming guide's throughput table lists ex2, lg2, sin,
    # cos, rcp and rsqrt at that rate but not tanh. See Note [softcap] there.
    fma_ops_per_softcap_score: float = 1.0
    mufu_ops_per_softcap_score: float = 1.0
    # ASSUMED: bytes per cycle per SM a TMA load gets from L2 (K/V are shared by many CTAs, so
    # L2 rather than HBM feeds them), and its latency.
    l2_bytes_per_cycle: float = 64.0
    tma_latency: int = 700
    # ASSUMED: TMEM <-> register bytes per cycle per SM (tcgen05.ld / st).
    tmem_bytes_per_cycle: float = 512.0
    # ASSUMED: wake-up latency of an mbarrier wait, and issue cost of an async instruction.
    barrier_latency: int = 30
    issue_cycles: int = 8
    # ASSUMED: fraction of K/V blocks (after the first) on which some row's max grows by more
    # than the rescale threshold, so the correction role rescales O (FA4: rare after warm-up).
    rescale_fraction: float = 0.125
    # ASSUMED (fitted on the H200, no lower than its measured GEMM): the share of the
    # datasheet's dense MMA rate the tensor pipe sustains (the clock under a sustained load).
    # See Note [calibration] in fa4lab.plan.calibration.
    mma_efficiency: float = 1.0
    # ASSUMED (fitted on the H200): the share of an sm90 consumer's softmax during which the
    # other consumers' wgmmas stall (the RS wgmma reads P from the register file the softmax
    # is using, and both draw on the same warp schedulers). Note [calibration].
    sm90_softmax_stall: float = 0.0
    # ASSUMED (fitted on the H200): cycles a CTA of a non-persistent kernel spends outside its
    # work tile's protocol (launch, mbarrier init, setmaxnreg, tensor-map prefetch, exit). A
    # persistent kernel pays it once per SM, not per tile. `fa4lab.plan.throughput`.
    cta_start_cycles: float = 0.0

    def with_(self, **changes) -> CostModel:
        known = {f.name for f in fields(self)}
        unknown = set(changes) - known
        if unknown:
            raise ValueError(f"unknown cost parameter(s) {sorted(unknown)}; known: {sorted(known)}")
        return replace(self, **changes)

    # ---- cycles ----
    def mma_cycles(self, hw: Hardware, m: int, n: int, k: int) -> float:
        return 2.0 * m * n * k / (hw.mma_flops_per_cycle * self.mma_efficiency)

    def mma_op_cycles(self, hw: Hardware, mma) -> float:
        """One MmaPlan: its FLOPs at the MMA rate, or the SMEM reads of its operands at the SMEM
        bandwidth, whichever is slower (a 128x128x128 score MMA on B200: 512 and 512)."""
        smem = (mma.m * mma.k * ELEMENT_BYTES[mma.a_dtype] if mma.a_source == "smem" else 0) + (
            mma.n * mma.k * ELEMENT_BYTES[mma.b_dtype] if mma.b_source == "smem" else 0)
        return max(self.mma_cycles(hw, mma.m, mma.n, mma.k), self.smem_cycles(hw, smem))

    def softmax_cycles(self, hw: Hardware, scores: int, emulated: float,
                       masked: bool = False, softcap: bool = False) -> float:
        """exp2 on MUFU for (1 - emulated) of the scores, the rest and the bookkeeping on FMA;
        `masked` adds the element mask, `softcap` the cap's tanh (MUFU) and multiply (FMA)."""
        mufu_ops = 1.0 - emulated
        ops = self.fma_ops_per_score + emulated * self.fma_ops_per_poly_exp2
        if masked:
            ops += self.fma_ops_per_masked_score
        if softcap:
            mufu_ops += self.mufu_ops_per_softcap_score
            ops += self.fma_ops_per_softcap_score
        return max(scores * mufu_ops / hw.exp2_per_cycle, scores * ops / hw.fma_per_cycle)

    def tmem_cycles(self, nbytes: int) -> float:
        return nbytes / self.tmem_bytes_per_cycle

    def tma_cycles(self, nbytes: int) -> float:
        return nbytes / self.l2_bytes_per_cycle

    def smem_cycles(self, hw: Hardware, nbytes: int) -> float:
        return nbytes / hw.smem_bytes_per_cycle

    def rescale_blocks(self, n_blocks: int) -> set[int]:
        """Which blocks j >= 1 trigger a rescale, spread evenly at `rescale_fraction`."""
        f = self.rescale_fraction
        if f <= 0:
            return set()
        # Block 1 always (the max of a fresh row moves most early), then every 1/f blocks.
        return {j for j in range(1, n_blocks) if j == 1 or int(j * f) != int((j - 1) * f)}


DEFAULT_COSTS = CostModel()


# Note [packed exp2 cost]
# The software exp2 of one element issues, on the FMA pipe, the range reduction's three adds
# (add.rm, sub, sub) and the cubic's three Horner FMAs; its clamp (FMNMX) and exponent insert
# (LEA) go to the ALU pipe and are not counted. sm100 runs them on f32x2 pairs (Note [packed
# exp2] in fa4lab.kernels.device.exp2): limits.EXP2_PAIR_FADD2 + EXP2_PAIR_FFMA2 = 6 FADD2 /
# FFMA2 per pair, 3 per element, half the scalar form's 6. ASSUMED: an f32x2 instruction holds
# the FMA pipe as long as a scalar one (two fp32 results per lane and issue, the premise of FA4's
# packing; the datasheets give no FFMA2 rate). `fma_ops_per_score` stays the scalar count: the
# sm90 plan prices its softmax with it, and Hopper has no f32x2.
# On B200 (128 FMA lanes, 16 MUFU exp2 per SM per cycle) the balance below gives
# f = (8 - 3.5) / (8 + 3) = 0.41, rounded to 7/16 = 0.4375 (the scalar cost, 6, would give 0.32),
# for every head dim: the model has no head-dim term. The sm100 plan asks for at most
# limits.SM100_EXP2_FRACTION_MAX, what the softmax's registers hold without spills, so its
# FMA pipe now has room to spare. Upstream FA4 emulates less, tuned on a
# B200: at hd128 (flash_attn/cute/flash_fwd_sm100.py, `_TUNING_CONFIG`) ex2_emu_freq 16 with
# the last 4 of every 16 elements of the middle two 32-column fragments (causal) is 1/8, and
# freq 10 (non-causal, 2 CTAs) 3/16. The balance counts two pipes only; an emulated element also
# costs two ALU instructions and five issue slots where MUFU costs one (each SM sub-partition
# issues one warp instruction per cycle), and the correction's rescale shares the FMA pipe: all
# push the measured optimum lower.


def balanced_exp2_fraction(hw: Hardware, costs: CostModel = DEFAULT_COSTS,
                           granularity: int = 16) -> float:
    """Fraction of exp2 to emulate on FMA so MUFU and FMA finish together (FA4's software exp2;
    Note [packed exp2 cost]).

    MUFU time per score (1 - f) / exp2_rate equals FMA time (base + f * poly) / fma_rate at
    f = (fma/exp2 - base) / (fma/exp2 + poly); rounded to 1/granularity (chunks of a row).
    """
    ratio = hw.fma_per_cycle / hw.exp2_per_cycle
    f = (ratio - costs.fma_ops_per_score) / (ratio + costs.fma_ops_per_poly_exp2)
    f = min(max(f, 0.0), 1.0)
    return round(f * granularity) / granularity


# The stored fit (Note [calibration] in fa4lab.plan.calibration; `python -m
# fa4lab.bench.calibration` refits; tests/test_calibration.py checks that a refit lands here and
# that these reproduce the stored tables, benchmarks/calibration/).
H200_COSTS = DEFAULT_COSTS.with_(
    mma_efficiency=0.8668, sm90_softmax_stall=0.5, barrier_latency=110, tma_latency=1200,
    cta_start_cycles=2250.0, fma_ops_per_score=6.1407, fma_ops_per_masked_score=7.0,
    rescale_fraction=0.25)
B200_OWN = ("fma_ops_per_score", "fma_ops_per_masked_score", "sm90_softmax_stall")


def b200_costs(h200: CostModel) -> CostModel:
    """The B200 model from an H200 fit: its constants but B200_OWN (Note [calibration] in
    fa4lab.plan.calibration)."""
    return h200.with_(**{k: getattr(DEFAULT_COSTS, k) for k in B200_OWN})


B200_COSTS = b200_costs(H200_COSTS)
CALIBRATED = {"sm90": H200_COSTS, "sm100": B200_COSTS}


def costs_for(hw: Hardware | str) -> CostModel:
    """The calibrated cost model of `hw` (a `Hardware` or an arch name). See Note
    [calibration] in fa4lab.plan.calibration."""
    arch = hw.arch if isinstance(hw, Hardware) else hardware_for(hw).arch
    return CALIBRATED[arch]
