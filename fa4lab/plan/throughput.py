"""A plan's predicted throughput: each work tile's simulated time, spread over the SMs.

The protocol simulator (`fa4lab.plan.simulate`) times one work tile (one CTA) of N K/V blocks,
the first M of them masked. `block_cycles` fits that time as linear in both counts (see Note
[tile time]); `predict` gives every (batch, head, m_block) tile its own counts from
`fa4lab.tiling` (the causal diagonal, both edges of a sliding window and the seqlen_k tail
mask a block; blocks outside the window are never loaded), dispatches the tiles in the plan's
order to the first free SM (`fa4lab.scheduling.schedule`; a persistent plan's CTAs take them
round-robin, `fa4lab.scheduling.schedule_persistent`) and divides the visible scores' FLOPs by
the makespan. So a window that skips half the blocks predicts about half the time.

    from fa4lab.plan.throughput import predict
    predict(plan_forward(spec, "sm100")).tflops
"""

from __future__ import annotations

from dataclasses import dataclass

from fa4lab import scheduling, tiling
from fa4lab.plan.costs import CostModel, costs_for
from fa4lab.plan.simulate import simulate

# Note [tile time]
# Once the pipeline is full every K/V block adds the same cycles, so one work tile takes
#     cycles = fixed + unmasked * per_unmasked + masked * per_masked
# `block_cycles` fits the three figures on three simulated tiles, all with at least one masked
# block (the sm90 consumer costs its first block as masked whatever M is): (3 blocks, 1
# masked) and (9, 1) give per_unmasked, (9, 7) against (9, 1) gives per_masked - per_unmasked.
# A masked block costs more only when the mask's FMA work (CostModel.fma_ops_per_masked_score)
# is on the critical path; the simulation decides. `fixed` (Q load, pipeline fill, epilogue)
# is what one more tile adds beyond its blocks: for a CTA per tile, one simulated tile's rest
# plus CostModel.cta_start_cycles; for a persistent CTA, a second tile simulated after the
# first in the same CTA (its Q and K/V loads overlap the first tile's epilogue), so smaller.
# It can come out below 0 where the next block's loads overlap a tile's start; no tile costs
# less than its blocks, so `predict` clamps it at 0.
_FIT = ((3, 1), (9, 1), (9, 7))   # (n_blocks, masked_blocks) of the three simulated tiles


@dataclass(frozen=True)
class BlockCycles:
    """One work tile's cycles: `fixed` + `unmasked` per unmasked K/V block + `masked` per
    masked one. See Note [tile time]."""

    fixed: float
    unmasked: float
    masked: float

    def tile(self, n_unmasked: int, n_masked: int) -> float:
        return self.fixed + self.unmasked * n_unmasked + self.masked * n_masked


def block_cycles(plan, costs: CostModel | None = None) -> BlockCycles:
    """Fixed, per unmasked and per masked block cycles of one work tile of `plan`, fitted on
    three simulated tiles (`costs`: the chip's calibrated model by default). See Note [tile
    time]."""
    costs = costs_for(plan.hardware) if costs is None else costs
    (n1, m1), (n2, _), (_, m3) = _FIT
    t1, t2, t3 = (simulate(plan, n, 1, costs, masked_blocks=m).cycles for n, m in _FIT)
    unmasked = (t2 - t1) / (n2 - n1)
    masked = unmasked + (t3 - t2) / (m3 - m1)
    blocks = unmasked * (n1 - m1) + masked * m1
    if not plan.protocol.persistent:   # a CTA of its own per tile, and its start
        return BlockCycles(t1 - blocks + costs.cta_start_cycles, unmasked, masked)
    # A persistent CTA: what a second tile adds in the same CTA (Note [persistent CTAs]).
    t1 = simulate(plan, n1, 2, costs, masked_blocks=m1).cycles - t1
    return BlockCycles(t1 - blocks, unmasked, masked)


def tile_cost(plan, costs: CostModel | None = None, causal: bool | None = None,
              ) -> tuple[float, float]:
    """(fixed, per_block) cycles of one work tile (one CTA) of unmasked blocks, its fixed part
    including the masked blocks a causal tile crosses on the diagonal (cta_m / n_block)."""
    causal = plan.spec.causal if causal is None else causal
    b = block_cycles(plan, costs)
    masked = max(1, plan.tiles.cta_m // plan.tiles.n_block) if causal else 0
    return b.fixed + masked * (b.masked - b.unmasked), b.unmasked


def workload(plan, spec=None) -> scheduling.Workload:
    """The work tiles the plan's kernel runs for `spec` (default `plan.spec`): one per (batch,
    head, CTA of cta_m rows), K/V blocks of n_block keys, heads packed as the plan packs them,
    the spec's causal mask and window."""
    t = plan.tiles
    return scheduling.Workload.from_spec(spec or plan.spec, m_block_size=t.cta_m,
                                     n_block_size=t.n_block, pack_gqa=t.pack_gqa)


def tile_classes(plan) -> tiling.TileClasses:
    """Every (CTA, K/V block) tile of one (batch, head) of the plan, classified
    (`fa4lab.tiling.classify_tiles` on `workload`'s grid)."""
    w, s = workload(plan), plan.spec
    return tiling.classify_tiles(s.seqlen_q, s.seqlen_k, w.m_block_size, w.n_block_size,
                                 s.causal, w.qhead_per_kvhead, window_size=s.window_size)


@dataclass(frozen=True)
class Prediction:
    tflops: float
    seconds: float
    block_cycles: BlockCycles     # one work tile: fixed + per unmasked / masked K/V block
    tiles: int
    peak_tflops: float
    hardware: str

    @property
    def utilization(self) -> float:
        return self.tflops / self.peak_tflops


def predict(plan, costs: CostModel | None = None, spec=None) -> Prediction:
    """Predicted forward TFLOP/s of `plan` on `spec` (default `plan.spec`): every work tile's
    simulated time (`block_cycles` times its unmasked and masked blocks, `workload`),
    dispatched in the plan's tile order (`plan.tiles.order`) to the first free SM, as the
    hardware hands out a grid's CTAs (`fa4lab.scheduling.schedule`), or round-robin to the CTAs of
    a persistent plan (`fa4lab.scheduling.schedule_persistent`). `costs` defaults to the
    calibrated model of the plan's chip (`fa4lab.plan.costs.costs_for`)."""
    costs = costs_for(plan.hardware) if costs is None else costs
    return predict_with(plan, block_cycles(plan, costs), spec)


def predict_with(plan, b: BlockCycles, spec=None) -> Prediction:
    """`predict` from one work tile's already simulated `b` (`block_cycles(plan, costs)`): the
    tiles of `spec` (default `plan.spec`) scheduled on the SMs. The calibration fit calls this
    once per shape with the `b` of each (plan, costs)."""
    spec = spec or plan.spec
    hw = plan.hardware
    # tiling counts work in unmasked K/V blocks. A masked block never costs less than an
    # unmasked one (it does the same work and the mask); see Note [tile time] for the clamp.
    unit = scheduling.CostModel(masked_block_cost=max(b.masked / b.unmasked, 1.0),
                            tile_overhead=max(b.fixed, 0.0) / b.unmasked)
    # A persistent kernel's CTAs take the tiles round-robin; a grid's go to the first free SM.
    run = scheduling.schedule_persistent if plan.protocol.persistent else scheduling.schedule
    sched = run(plan.tiles.order, workload(plan, spec), num_sms=hw.num_sms, cost=unit)
    seconds = sched.makespan * b.unmasked / (hw.clock_ghz * 1e9)
    return Prediction(useful_flops(spec) / seconds / 1e12, seconds, b, len(sched.order),
                      hw.peak_mma_tflops, hw.name)


def useful_flops(spec) -> float:
    """FLOPs of the visible scores: spec.flops() (4·B·H·Sq·Sk·D, halved for causal; exact
    under a sliding window) when that convention is exact enough (not causal, or seqlen_q ==
    seqlen_k), else the exact count of visible (query, key) pairs."""
    if not spec.causal or spec.seqlen_q == spec.seqlen_k:
        return spec.flops()
    return 2.0 * spec.batch * spec.heads_q * spec.visible_pairs() * (
        spec.head_dim + spec.head_dim_v)
