"""Tile orders and schedules: which CTA runs which tile, and what each order costs.

The work of one forward call is a `Workload` of (batch, head, m_block) tiles, each costing the
key blocks it visits (`fa4lab.tiling`'s block ranges) under `CostModel` (Note [tile cost
model]). Here are the orders the kernels launch tiles in (`TILE_ORDERS`: grid, grid with the
m_blocks reversed, LPT in L2 sections, Note [L2 swizzle]; `tile_at` the linear tile -> (m_block,
head, batch) map both kernels read, `persistent_tiles` a persistent CTA's share) and the
schedulers that play an order on a number of SMs (`SCHEDULERS`, `schedule`): makespan, per-SM
busy time and load imbalance. `kernel_tile_order` is the order a kernel of an arch launches.
CPU only, no GPU needed:

    from fa4lab.scheduling import Workload, schedule
    work = Workload.from_spec(spec, m_block_size=128, n_block_size=128)
    schedule("lpt", work, num_sms=132).imbalance
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from fa4lab.limits import ELEMENT_BYTES
from fa4lab.spec import normalize_mask
from fa4lab.tiling import _check_sizes, _positive, block_counts, num_m_blocks

# Note [tile cost model]
# The unit of time is one unmasked K/V block iteration of one query tile (two MMAs, S = Q K^T
# and O += P V, plus the softmax of m_block_size x n_block_size scores). A block that needs the
# element mask costs `masked_block_cost` units: the mask is a compare-and-select on every score
# of the fragment before the row max, work the unmasked blocks never do (1.25 is a model
# assumption, not a measurement). Every tile also pays `tile_overhead` units whatever its
# length: loading Q, filling the K/V pipeline, normalising O and storing O and LSE. A tile with
# no visible block still pays it (it writes O = 0, LSE = -inf). The model is MMA-bound:
# `Schedule.predicted_seconds` turns units into seconds with 4 * m * n * head_dim FLOPs per
# unit at the chip's dense MMA rate, an optimistic floor, used only to compare schedules.


@dataclass(frozen=True)
class CostModel:
    """Work of one tile, in units of one unmasked K/V block. See Note [tile cost model]."""

    masked_block_cost: float = 1.25
    tile_overhead: float = 1.0

    def __post_init__(self):
        if not self.masked_block_cost >= 1.0:
            raise ValueError(f"masked_block_cost={self.masked_block_cost} must be >= 1 (a masked "
                             f"block does all of an unmasked block's work and more)")
        if not self.tile_overhead >= 0.0:
            raise ValueError(f"tile_overhead={self.tile_overhead} must be >= 0")

    def tile_cost(self, n_unmasked: int, n_masked: int) -> float:
        return n_unmasked + self.masked_block_cost * n_masked + self.tile_overhead


# Note [L2 swizzle]
# LPT walks the heads in sections of `swizzle` (batch, head) pairs whose K and V fit in L2 at
# once: inside a section every m_block of every head is issued before the next section starts,
# so CTAs running at the same time share K/V in L2. As FA4 does, the section is the largest
# power of two of heads whose K+V (seqlen_k * (head_dim + head_dim_v) * element_size bytes)
# fits in the L2 budget below. The budget is FA4's own constant (`size_l2` in
# flash_attn/cute/tile_scheduler.py, the same on Hopper and Blackwell), not a cache size: it
# stays below the H200's L2 (`fa4lab.hardware.H200_L2_BYTES`), leaving room for Q and O.
L2_KV_BUDGET_BYTES = 50 * 1024 * 1024


def pow2_floor(x):
    """The largest power of two <= x, for 1 <= x < 2**31 (int or Int32: shifts and ors only)."""
    for s in (1, 2, 4, 8, 16):
        x = x | (x >> s)
    return x - (x >> 1)


def l2_swizzle(seqlen_k, bytes_per_key: int, budget: int = L2_KV_BUDGET_BYTES, *, imax=max):
    """(batch, head) pairs per L2 section (Note [L2 swizzle]): the largest power of two whose
    K + V (seqlen_k * bytes_per_key each) fit `budget`, at least 1. The one rule, for Python
    ints (the order the plan and notebooks draw) and in the kernels (DSL Int32,
    imax=cutlass.max)."""
    # budget // bytes_per_key is a compile-time number: no product that could overflow Int32.
    fit = (budget // bytes_per_key) // imax(seqlen_k, 1)
    return pow2_floor(imax(fit, 1))


@dataclass(frozen=True)
class Workload:
    """The (batch, head, m_block) work items of one forward call.

    `heads` is the head axis of the grid: heads_q, or heads_kv with pack-GQA (then
    `qhead_per_kvhead` > 1 query heads are folded into M). `window_size` is a sliding window
    (stored as `fa4lab.spec.normalize_mask` does, which may set `causal`).
    """

    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    m_block_size: int
    n_block_size: int
    causal: bool
    qhead_per_kvhead: int = 1
    head_dim: int = 128
    head_dim_v: int | None = None
    element_size: int = ELEMENT_BYTES["bf16"]
    window_size: tuple = (None, None)

    def __post_init__(self):
        causal, window_size = normalize_mask(self.causal, self.window_size)
        object.__setattr__(self, "causal", causal)
        object.__setattr__(self, "window_size", window_size)
        _positive("batch", self.batch)
        _positive("heads", self.heads)
        _check_sizes(self.seqlen_q, self.seqlen_k, self.m_block_size, self.n_block_size,
                     self.qhead_per_kvhead)
        _positive("head_dim", self.head_dim)
        if self.head_dim_v is not None:
            _positive("head_dim_v", self.head_dim_v)
        _positive("element_size", self.element_size)

    @classmethod
    def from_spec(cls, spec, *, m_block_size: int, n_block_size: int,
                  pack_gqa: bool = False) -> Workload:
        """From an `AttentionSpec`: one tile per (batch, head, m_block)."""
        group = spec.qhead_per_kvhead if pack_gqa else 1
        return cls(batch=spec.batch, heads=spec.heads_kv if pack_gqa else spec.heads_q,
                   seqlen_q=spec.seqlen_q, seqlen_k=spec.seqlen_k, m_block_size=m_block_size,
                   n_block_size=n_block_size, causal=spec.causal, qhead_per_kvhead=group,
                   head_dim=spec.head_dim, head_dim_v=spec.head_dim_v,
                   element_size=spec.element_bytes, window_size=spec.window_size)

    @property
    def num_m_blocks(self) -> int:
        return num_m_blocks(self.seqlen_q, self.m_block_size, self.qhead_per_kvhead)

    @property
    def num_tiles(self) -> int:
        return self.batch * self.heads * self.num_m_blocks

    @property
    def l2_swizzle(self) -> int:
        """(batch, head) pairs per L2 section. See Note [L2 swizzle]."""
        hdv = self.head_dim if self.head_dim_v is None else self.head_dim_v
        return l2_swizzle(self.seqlen_k, (self.head_dim + hdv) * self.element_size)

    def blocks_per_m_block(self) -> tuple[np.ndarray, np.ndarray]:
        """(unmasked, masked) K/V block counts per m_block (the same for every batch, head);
        masked counts both edges of a sliding window (`block_counts`)."""
        return block_counts(np.arange(self.num_m_blocks, dtype=np.int64), self.seqlen_q,
                            self.seqlen_k, m_block_size=self.m_block_size,
                            n_block_size=self.n_block_size, causal=self.causal,
                            qhead_per_kvhead=self.qhead_per_kvhead,
                            window_size=self.window_size)

    def tile_costs(self, cost: CostModel | None = None) -> np.ndarray:
        """Cost of each m_block's tile, shape (num_m_blocks,). See Note [tile cost model]."""
        cost = cost or CostModel()
        unmasked, masked = self.blocks_per_m_block()
        return unmasked + cost.masked_block_cost * masked + cost.tile_overhead

    def unit_flops(self) -> float:
        """MMA FLOPs of one cost unit (one K/V block of one tile): 2*m*n*(d + d_v)."""
        hdv = self.head_dim if self.head_dim_v is None else self.head_dim_v
        return 2.0 * self.m_block_size * self.n_block_size * (self.head_dim + hdv)


# --------------------------------------------------------------------------- tile orders


TILE_ORDERS = ("grid", "grid_reversed", "lpt")


def tile_at(t, order: str, num_m, heads, batch, swizzle=1, *, imin=min):
    """(batch, head, m_block) of linear tile t in `order` (one of TILE_ORDERS), for ints, numpy
    arrays or the kernels' DSL Int32 (`imin`: the DSL's min). The one formula from linear tile
    index to tile: the orders below, the simulated schedules and both kernels' schedulers read it.

    "grid": m_block fastest, then head, then batch (how the hardware dispatches a (num_m, heads,
    batch) grid); "grid_reversed": the same with each head's m_blocks last-first; "lpt": FA4's
    longest-processing-time-first order in L2 sections of `swizzle` (batch, head) pairs (Note [L2
    swizzle]): inside a section m_block runs from the LAST to the first, the section's heads
    fastest; the last section may be shorter (the residual)."""
    if order not in TILE_ORDERS:
        raise ValueError(f"unknown tile order {order!r}: one of {TILE_ORDERS}")
    if order == "lpt":
        n_hb = heads * batch
        swizzle = imin(swizzle, n_hb)
        full = n_hb // swizzle  # >= 1
        section = t // (swizzle * num_m)
        within = t - section * (swizzle * num_m)
        # The last section holds the n_hb % swizzle leftover pairs; section // full is 1 there
        # and 0 before it (section <= full), so `width` needs no branch.
        width = swizzle - (swizzle - (n_hb - full * swizzle)) * (section // full)
        block = within // width
        hb = section * swizzle + (within - block * width)
        m = num_m - 1 - block
    else:
        hb = t // num_m
        m = t - hb * num_m
        if order == "grid_reversed":
            m = num_m - 1 - m
    b = hb // heads
    return b, hb - b * heads, m


def _order(work: Workload, order: str, swizzle: int = 1) -> np.ndarray:
    t = np.arange(work.num_tiles)
    return np.stack(tile_at(t, order, work.num_m_blocks, work.heads, work.batch, swizzle), axis=1)


def grid_order(work: Workload) -> np.ndarray:
    """(num_tiles, 3) rows (batch, head, m_block), m_block fastest then head then batch: the
    order the hardware dispatches a (num_m_blocks, heads, batch) grid."""
    return _order(work, "grid")


def grid_reversed_order(work: Workload) -> np.ndarray:
    """Grid order with each head's m_blocks reversed (last first): what a one-CTA-per-tile
    causal kernel gets by flipping blockIdx.x. Longest first within a head only."""
    return _order(work, "grid_reversed")


def lpt_order(work: Workload) -> np.ndarray:
    """(num_tiles, 3) rows (batch, head, m_block) in FA4's longest-processing-time-first order
    (`tile_at`, Note [L2 swizzle])."""
    return _order(work, "lpt", work.l2_swizzle)


def persistent_tiles(cta: int, num_ctas: int, num_tiles: int) -> range:
    """The linear tiles persistent CTA `cta` of `num_ctas` runs, in turn: cta, cta + num_ctas,
    ... (the kernels' tile loop; FA4's static persistent scheduler)."""
    return range(cta, num_tiles, num_ctas)


# --------------------------------------------------------------------------- schedules


@dataclass(frozen=True, eq=False)
class Schedule:
    """Which SM runs which tile when. Arrays are indexed by dispatch position."""

    name: str
    num_sms: int
    order: np.ndarray    # (T, 3) int: (batch, head, m_block) in dispatch order
    sm: np.ndarray       # (T,) int: the SM (persistent CTA) that runs it
    start: np.ndarray    # (T,) float: start time, cost units
    end: np.ndarray      # (T,) float
    unit_flops: float    # MMA FLOPs per cost unit (for predicted_seconds)

    def __repr__(self) -> str:
        return (f"Schedule({self.name!r}, num_sms={self.num_sms}, tiles={len(self.order)}, "
                f"makespan={self.makespan:.1f}, lower_bound={self.lower_bound:.1f}, "
                f"efficiency={self.efficiency:.3f})")

    @property
    def makespan(self) -> float:
        return float(self.end.max()) if self.end.size else 0.0

    @property
    def busy(self) -> np.ndarray:
        """Busy time of each SM, shape (num_sms,)."""
        return np.bincount(self.sm, weights=self.end - self.start, minlength=self.num_sms)

    @property
    def total_work(self) -> float:
        return float((self.end - self.start).sum())

    @property
    def lower_bound(self) -> float:
        """No schedule beats max(total work / num_sms, the longest tile)."""
        longest = float((self.end - self.start).max()) if self.end.size else 0.0
        return max(self.total_work / self.num_sms, longest)

    @property
    def efficiency(self) -> float:
        """Mean SM busy fraction until the makespan (1 = perfect balance)."""
        return self.total_work / (self.num_sms * self.makespan) if self.makespan else 1.0

    @property
    def imbalance(self) -> float:
        """makespan / mean per-SM busy time - 1 (0 = perfect balance)."""
        return 1.0 / self.efficiency - 1.0

    def predicted_seconds(self, hardware) -> float:
        """Makespan in seconds if one unit runs at the chip's dense MMA rate (a floor)."""
        per_sm = hardware.mma_flops_per_cycle * hardware.clock_ghz * 1e9
        return self.makespan * self.unit_flops / per_sm


def _resolve_sms(num_sms, arch):
    if num_sms is None:
        from fa4lab.hardware import hardware_for

        num_sms = hardware_for(arch).num_sms
    return _positive("num_sms", num_sms, " (e.g. 148 on B200, 132 on H200)")


def _greedy(name, work, order, num_sms, cost):
    """Each tile in `order` goes to the SM that frees up first (ties: the lowest SM): how the
    hardware dispatches a grid's CTAs, and how persistent CTAs that pull the next tile from a
    global counter behave."""
    costs = work.tile_costs(cost)[order[:, 2]]
    sm = np.empty(len(order), dtype=np.int64)
    start = np.empty(len(order))
    free = [(0.0, s) for s in range(num_sms)]
    for t, c in enumerate(costs):
        at, s = heapq.heappop(free)
        sm[t], start[t] = s, at
        heapq.heappush(free, (at + c, s))
    return Schedule(name, num_sms, order, sm, start, start + costs, work.unit_flops())


def schedule_grid(work: Workload, *, num_sms: int | None = None, arch: str = "sm100",
                  cost: CostModel | None = None) -> Schedule:
    """One CTA per tile in grid order; the hardware hands the next CTA to the first free SM."""
    return _greedy("grid", work, grid_order(work), _resolve_sms(num_sms, arch), cost)


def schedule_grid_reversed(work: Workload, *, num_sms: int | None = None, arch: str = "sm100",
                           cost: CostModel | None = None) -> Schedule:
    """One CTA per tile, each head's m_blocks last-first; the first free SM takes the next."""
    return _greedy("grid_reversed", work, grid_reversed_order(work), _resolve_sms(num_sms, arch),
                   cost)


def _round_robin(name, work, order, num_ctas, cost):
    """Persistent CTA c runs tiles c, c + num_ctas, ... of `order` in turn
    (`persistent_tiles`), whatever the other CTAs' progress: a static persistent kernel, as
    fa4lab's sm100 kernel and FA4's static scheduler run."""
    costs = work.tile_costs(cost)[order[:, 2]]
    n = len(order)
    sm = np.empty(n, dtype=np.int64)
    start = np.empty(n)
    for c in range(min(num_ctas, n)):
        clock = 0.0
        for t in persistent_tiles(c, num_ctas, n):
            sm[t], start[t] = c, clock
            clock += costs[t]
    return Schedule(name, num_ctas, order, sm, start, start + costs, work.unit_flops())


def schedule_static_persistent(work: Workload, *, num_sms: int | None = None,
                               arch: str = "sm100", cost: CostModel | None = None) -> Schedule:
    """num_sms persistent CTAs; CTA i takes grid-order tiles i, i + num_sms, ... in turn."""
    return _round_robin("static", work, grid_order(work), _resolve_sms(num_sms, arch), cost)


def schedule_persistent(order: str, work: Workload, *, num_sms: int | None = None,
                        arch: str = "sm100", cost: CostModel | None = None) -> Schedule:
    """min(tiles, num_sms) persistent CTAs taking the tiles of `order` (one of TILE_ORDERS)
    round-robin (`persistent_tiles`): how a persistent kernel's CTAs share them, where
    `schedule(order, ...)` hands each tile to the first free SM, as a grid of one CTA per tile
    runs."""
    orders = {"grid": grid_order, "grid_reversed": grid_reversed_order, "lpt": lpt_order}
    if order not in orders:
        raise ValueError(f"unknown tile order {order!r}: one of {TILE_ORDERS}")
    return _round_robin(order, work, orders[order](work), _resolve_sms(num_sms, arch), cost)


def schedule_lpt(work: Workload, *, num_sms: int | None = None, arch: str = "sm100",
                 cost: CostModel | None = None) -> Schedule:
    """LPT order (longest m_blocks first, L2-swizzled heads), each tile to the first free SM."""
    return _greedy("lpt", work, lpt_order(work), _resolve_sms(num_sms, arch), cost)


def kernel_tile_order(causal: bool, arch: str, persistent: bool = False) -> str:
    """The order fa4lab's `arch` kernel takes tiles in (a key of SCHEDULERS, a `tile_at`
    order): the plain grid where tile costs are equal (not causal); for causal, LPT on sm90 and
    in a persistent sm100 kernel, else the grid with each head's m_blocks reversed. See Note
    [tile order] in `fa4lab.kernels.device.scheduler`."""
    if not causal:
        return "grid"
    return "lpt" if arch == "sm90" or persistent else "grid_reversed"


SCHEDULERS = {
    "grid": schedule_grid,
    "grid_reversed": schedule_grid_reversed,
    "static": schedule_static_persistent,
    "lpt": schedule_lpt,
}


def schedule(name: str, work: Workload, *, num_sms: int | None = None, arch: str = "sm100",
             cost: CostModel | None = None) -> Schedule:
    """Run the scheduler called `name`: one of `SCHEDULERS` ('grid', 'grid_reversed',
    'static', 'lpt')."""
    if name not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {name!r}: choose one of {sorted(SCHEDULERS)}")
    return SCHEDULERS[name](work, num_sms=num_sms, arch=arch, cost=cost)

