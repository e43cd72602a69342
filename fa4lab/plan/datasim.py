"""A simulator that carries data: the sm100 role programs computing attention on numpy memories.

`fa4lab.plan.simulate` runs the roles' programs (the plan's protocol) for timing and hazards;
this module runs the SAME programs again, and when an op executes in the simulated
interleaving it does its real math on numpy arrays that stand for the CTA's memories:

  - TMEM: 128 lanes x 512 columns of 32-bit words (`plan.tmem`). S_i is fp32 in its columns,
    P_i is 16-bit, two per word, in the upper half of S_i's columns (Note [P aliases S] in
    fa4lab.plan.tmem), O_i fp32 in its columns;
  - SMEM (`plan.smem`): the Q stages, the K/V ring of kv_stage buffers, the O staging tiles and
    the softmax -> correction mailbox (`stats`);
  - global memory: q, k, v (rounded to the plan's dtype), out and lse.

Memory that no op has written holds NaN, as a stand-in for garbage
(`fa4lab.plan.datasim_memory`). See Note [data effects] in fa4lab.plan.data_effects for which
op does what and when. Nothing here restates the protocol: the ops, their order, the barriers
and the regions all come from the plan's `programs` (fa4lab.plan.simulate `programs_for`); the
online-softmax update is `fa4lab.online_softmax.update_state`, the epilogue is its `finalize`,
the software exp2 is `fa4lab.online_softmax.exp2_poly3`.

What it is for: with every barrier in place the output matches the float64 reference up to the
16-bit rounding of P and of O, whatever the interleaving; with one barrier removed, an
adversarial interleaving (`adversary`, then a seeded random search over role speeds:
`fa4lab.plan.interleavings`) makes a
role read a buffer too early or overwrite it too soon, and
`fa4lab.plan.datasim_check.barrier_check` reports what went wrong where. That is a property of
this MODEL of the kernel, not a proof about the binary.

Run it:
    run = run_attention(q, k, v, causal=True)           # numpy (batch, seqlen, heads, dim)
    print(datasim_check.barrier_check("p_ready"))
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from fa4lab.online_softmax import (
    SoftmaxState,
    emulated_pairs,
    exp2_poly3,
    finalize,
    init_state,
    update_state,
)
from fa4lab.plan.costs import DEFAULT_COSTS, CostModel
from fa4lab.plan.data_effects import (
    PER_BLOCK,
    DataSimError,  # noqa: F401 (re-exported)
    buffer_of,
    cells_of,
    classify,
    stage_of,
)
from fa4lab.plan.datasim_memory import (
    POISON,
    Memory,
    fresh_memory,
    from_bits16,
    round16,
    to_bits16,
    to_global,
)
from fa4lab.plan.datasim_problem import Problem, WorkTile, block_of_step, work_tiles
from fa4lab.plan.interleavings import (
    AS_PLANNED,
    Schedule,
    adversary,  # noqa: F401 (re-exported)
    random_schedules,  # noqa: F401 (re-exported)
)
from fa4lab.plan.simulate import Arrive, SimResult, Simulator, _mutate
from fa4lab.reference import kv_head_index

# Every correction step gets its rescale op, so the data decides (as the kernel's vote does)
# whether O changes; the default cost model rescales only on some blocks (a timing estimate).
DATA_COSTS = DEFAULT_COSTS.with_(rescale_fraction=1.0)


# ---- the run's record ----
@dataclass(frozen=True)
class Read:
    """One op reading one region: what the region held then."""

    time: float
    role: str
    index: int           # the role's index-th data op (Work or Issue)
    op: str
    region: str
    holds: tuple[str, ...]


@dataclass
class DataRun:
    out: np.ndarray                  # (batch, seqlen_q, heads_q, head_dim_v), 16-bit values
    lse: np.ndarray                  # (batch, heads_q, seqlen_q) float32, natural log
    sims: list[SimResult]
    reads: list[Read]
    tiles: list[WorkTile]
    schedule: Schedule
    drop: str | None = None
    rescaled_rows: int = 0           # O rows the correction rescaled (scale != 1), all tiles

    @property
    def hazards(self) -> list:
        return [h for s in self.sims for h in s.hazards]

    @property
    def deadlock(self) -> list[str]:
        return [d for s in self.sims for d in s.deadlock]


# ---- the simulator ----
class DataSimulator(Simulator):
    """`fa4lab.plan.simulate.Simulator` whose Work and Issue ops also move and compute data.

    The event loop, barriers, vector clocks and hazard checks are the parent's; this class adds
    the memories and a queue of timed data effects (Note [data effects] in
    fa4lab.plan.data_effects) that is drained, in time order, before every event the parent
    processes.
    """

    def __init__(self, plan, programs, needed, costs, problem: Problem, tiles: list[WorkTile],
                 mem: Memory):
        n_blocks = tiles[0].n_blocks
        super().__init__(programs, needed, costs, plan.arch, n_blocks, len(tiles))
        self.plan, self.problem, self.tiles, self.mem = plan, problem, tiles, mem
        self.n_blocks = n_blocks
        self.effects: list = []
        self.effect_seq = itertools.count()
        self.counts: dict = defaultdict(int)
        self.op_index: dict[str, int] = defaultdict(int)
        self.reads: list[Read] = []
        self.rescaled_rows = 0            # rows the correction multiplied by a scale != 1
        self.softmax: dict[int, dict] = {}
        self.correction: dict[int, dict] = defaultdict(dict)
        # TMEM base address per role: 0 (valid) unless its program reads it from SMEM first;
        # None: not read yet (garbage)
        self.base = {role: (None if any(classify(role, op) == "tmem_address" for op in prog)
                            else 0) for role, prog in programs.items()}
        n = plan.tiles.n_block
        self.emulated = np.repeat(np.array(emulated_pairs(n, plan.exp2_emulation_fraction),
                                           dtype=bool), 2)

    # -- the parent's hooks --
    def _step(self, role, t):
        self._drain(t)
        super()._step(role, t)

    def _arrive(self, key, count, tx, clock, t):
        self._drain(t)
        super()._arrive(key, count, tx, clock, t)

    def run(self, mutation=None):
        result = super().run(mutation)
        self._drain(math.inf)
        return result

    def _access(self, who, event, clock, what, reads, writes, t):
        super()._access(who, event, clock, what, reads, writes, t)
        if who in self.programs:          # a Work op of a role (async ops: see _issue)
            op = self.programs[who][self.pc[who]]
            self._effects(who, op, t, t + op.cycles)

    def _issue(self, role, op, t):
        super()._issue(role, op, t)
        start = self.spans[-1].start
        end = start + op.cycles + (self.costs.tma_latency if op.engine != "tensor" else 0)
        self._effects(role, op, start, end)

    # -- the effect queue --
    def _push_effect(self, t: float, fn, write: bool = False) -> None:
        # At one instant writes land before reads start: an MMA that the in-order tensor pipe
        # starts as the one before it ends (the two parts of a split value MMA, Note [split P
        # hand-off] in fa4lab.plan.sm100) reads what that one wrote.
        heapq.heappush(self.effects, (t, not write, next(self.effect_seq), fn))

    def _drain(self, t: float) -> None:
        while self.effects and self.effects[0][0] <= t:
            when, _, _, fn = heapq.heappop(self.effects)
            fn(when)

    def _effects(self, role: str, op, start: float, end: float) -> None:
        kind = classify(role, op)
        index = self.op_index[role]
        self.op_index[role] += 1
        if kind is None:
            return
        handler = getattr(self, f"_do_{kind}")
        stage = stage_of(op)
        if stage is not None and self.plan.tiles.q_stage == 1:
            stage = 0            # one Q tile; its S buffers alternate (Note [S ping-pong])
        key = (kind, stage) if kind not in ("load_k", "load_v") else (kind, None)
        if kind in ("mma_pv", "st_p"):   # each part of P counts its own blocks
            key += (self._p_keys(op)[0],)
        count = self.counts[key]
        self.counts[key] += 1
        if kind in PER_BLOCK:
            tile, step = divmod(count, self.n_blocks)
        else:
            tile, step = count, None
        ctx = _Ctx(role, op, index, stage, self.tiles[min(tile, len(self.tiles) - 1)], tile,
                   step, buffer_of(op))

        def read(when):
            self._log_reads(ctx, when)
            with np.errstate(all="ignore"):     # garbage in a broken protocol is expected
                produced = handler(ctx)
            if produced is not None:
                self._push_effect(max(end, when), lambda w: self._write(ctx, produced),
                                  write=True)
        self._push_effect(start, read)

    def _log_reads(self, ctx, when) -> None:
        for ref in ctx.op.reads:
            holds = tuple(dict.fromkeys(self.mem.tags.get(c, "nothing (never written)")
                                        for c in cells_of(ref)))
            self.reads.append(Read(when, ctx.role, ctx.index, ctx.op.label, str(ref), holds))

    def _write(self, ctx, produced) -> None:
        tag, store = produced
        with np.errstate(all="ignore"):
            store()
        for ref in ctx.op.writes:
            for c in cells_of(ref):
                self.mem.tags[c] = tag

    # -- memories --
    def _cols(self, name: str, stage: int) -> slice:
        r = self.plan.tmem.region(name, stage)
        return slice(r.col_offset, r.col_end)

    # A role addresses TMEM through the base address it read from SMEM (Note [data effects] in
    # fa4lab.plan.data_effects): without one, its loads return garbage and its stores land
    # elsewhere.
    def _words(self, role: str, name: str, stage: int) -> np.ndarray:
        cols = self._cols(name, stage)
        if self.base.get(role, 0) != 0:
            return np.full((self.mem.tmem.shape[0], cols.stop - cols.start), POISON, np.uint32)
        return self.mem.tmem[:, cols].copy()

    def _set_words(self, role: str, name: str, stage: int, words: np.ndarray) -> None:
        if self.base.get(role, 0) == 0:
            self.mem.tmem[:, self._cols(name, stage)] = words

    def _tmem_f32(self, role: str, name: str, stage: int) -> np.ndarray:
        return self._words(role, name, stage).view(np.float32)

    def _set_tmem_f32(self, role: str, name: str, stage: int, x: np.ndarray) -> None:
        self._set_words(role, name, stage, np.asarray(x, np.float32).view(np.uint32))

    def _kv_stage(self, op) -> int:
        return next(r.stage for r in op.reads + op.writes if r.name == "kv")

    def _p_keys(self, op) -> tuple[int, int]:
        """The keys [lo, hi) of P an op reads or writes, from its P columns (16-bit P, two keys
        per 32-bit column: Note [P aliases S]): all n_block, or one part of a split hand-off
        (Note [split P hand-off] in fa4lab.plan.sm100)."""
        ref = next(r for r in op.reads + op.writes if r.name == "P")
        c = self.plan.tmem.region("P", ref.stage).col_offset
        return 2 * (ref.lo - c), 2 * (ref.hi - c)

    # -- the ops (Note [data effects] in fa4lab.plan.data_effects); each returns (tag, store)
    # or None --
    def _do_load_q(self, c):
        p, t = self.problem, self.plan.tiles
        tile_row = (c.tile.m_block * t.q_stage + c.stage) * t.m_block
        data = p.rows(p.q[c.tile.batch, :, c.tile.head], tile_row, t.m_block)
        return (f"Q{c.stage} of work tile {c.tile_index}",
                lambda: self.mem.smem["q"].__setitem__(c.stage, data))

    def _load_kv(self, c, src, what):
        p, n = self.problem, self.plan.tiles.n_block
        block = block_of_step(c.tile, c.step)
        data = p.rows(src[c.tile.batch, :, p.kv_head[c.tile.head]], block * n, n)
        s = self._kv_stage(c.op)
        width = data.shape[1]     # V narrower than K ((192, 128)): the buffer's first columns
        return (f"{what} block {block} of work tile {c.tile_index}",
                lambda: self.mem.smem["kv"][s].__setitem__((slice(None), slice(0, width)), data))

    def _do_load_k(self, c):
        return self._load_kv(c, self.problem.k, "K")

    def _do_load_v(self, c):
        return self._load_kv(c, self.problem.v, "V")

    def _do_mma_s(self, c):
        # 16-bit products are exact in fp32; the MMA accumulates in fp32.
        d = self.plan.tiles.head_dim
        s = self.mem.smem["q"][c.stage] @ self.mem.smem["kv"][self._kv_stage(c.op)][:, :d].T
        block = block_of_step(c.tile, c.step)
        return (f"S{c.buffer} of block {block} of work tile {c.tile_index}",
                lambda: self._set_tmem_f32(c.role, "S", c.buffer, s))

    def _do_mma_pv(self, c):
        dtype = self.problem.dtype
        lo, hi = self._p_keys(c.op)     # P's keys this MMA reads: V's rows [lo, hi)
        words = self._words(c.role, "P", c.buffer)[:, lo // 2:hi // 2]
        p = from_bits16(np.ascontiguousarray(words).view(np.uint16), dtype)
        o = p @ self.mem.smem["kv"][self._kv_stage(c.op)][lo:hi, :self.plan.tiles.head_dim_v]
        if c.step > 0 or lo > 0:     # the first value MMA of a work tile overwrites O
            o = o + self._tmem_f32(c.role, "O", c.stage)
        block = block_of_step(c.tile, c.step)
        return (f"O{c.stage} through block {block} of work tile {c.tile_index}",
                lambda: self._set_tmem_f32(c.role, "O", c.stage, o))

    def _do_ld_s(self, c):
        p, n = self.problem, self.plan.tiles.n_block
        if c.step == 0:
            self.softmax[c.stage] = {"state": init_state((self.plan.tiles.m_block,), 0,
                                                         p.scale_log2)}
        sm = self.softmax[c.stage]
        block = block_of_step(c.tile, c.step)
        tile_row = (c.tile.m_block * self.plan.tiles.q_stage + c.stage) * self.plan.tiles.m_block
        s = np.where(p.visible(tile_row, self.plan.tiles.m_block, block * n, n),
                     self._tmem_f32(c.role, "S", c.buffer), -np.inf)
        got = []

        def exp2(x):  # the kernel's split: these column pairs on the FMA pipe, the rest MUFU
            x = np.asarray(x, np.float32)
            y = np.where(self.emulated, exp2_poly3(x), np.exp2(x)).astype(np.float32)
            got.append(y)
            return y

        with np.errstate(all="ignore"):
            state, step = update_state(sm["state"], s, np.zeros((n, 0)),
                                       rescale_threshold=self.plan.rescale_threshold, exp2=exp2)
        sm["state"] = state
        # The kernel posts 1 where a row kept its basis (or saw its first key).
        sm["scale"] = np.where(step.rescaled, step.alpha, 1.0).astype(np.float32)
        sm["p"] = to_bits16(got[0], p.dtype)
        sm["what"] = f"block {block} of work tile {c.tile_index}"
        return None

    def _do_st_p(self, c):
        sm = self.softmax[c.stage]
        lo, hi = self._p_keys(c.op)
        bits = np.ascontiguousarray(sm["p"]).view(np.uint32)
        part = "" if hi - lo == self.plan.tiles.n_block else f" (keys {lo}-{hi - 1})"

        def store():
            words = self._words(c.role, "P", c.buffer)
            words[:, lo // 2:hi // 2] = bits[:, lo // 2:hi // 2]
            self._set_words(c.role, "P", c.buffer, words)
        return (f"P{c.buffer} of {sm['what']}{part}", store)

    def _do_alloc_tmem(self, c):
        def store():
            self.mem.tmem_ptr = 0
            self.mem.tmem[:] = POISON
        return "the TMEM address (tcgen05.alloc)", store

    def _do_tmem_address(self, c):
        self.base[c.role] = self.mem.tmem_ptr

    def _do_free_tmem(self, c):
        cols = slice(c.op.writes[0].lo, c.op.writes[0].hi)

        def store():
            self.mem.tmem[:, cols] = POISON
        return "freed TMEM (tcgen05.dealloc)", store

    def _mailbox(self, stage: int, half: int) -> slice:
        m, q = self.plan.tiles.m_block, self.plan.tiles.q_stage
        lo = (half * q + stage) * m
        return slice(lo, lo + m)

    def _do_post_scale(self, c):
        sm = self.softmax[c.stage]
        scale = sm["scale"]
        return (f"row scale of {sm['what']}",
                lambda: self.mem.stats.__setitem__(self._mailbox(c.stage, 0), scale))

    def _do_post_sum(self, c):
        sm = self.softmax[c.stage]
        total = sm["state"].row_sum.astype(np.float32)
        row_max = sm["state"].row_max.astype(np.float32)

        def store():
            self.mem.stats[self._mailbox(c.stage, 0)] = total
            self.mem.stats[self._mailbox(c.stage, 1)] = row_max
        return (f"row sum and max of work tile {c.tile_index}, Q{c.stage}", store)

    def _do_read_scale(self, c):
        self.correction[c.stage]["scale"] = self.mem.stats[self._mailbox(c.stage, 0)].copy()

    def _do_read_sum(self, c):
        cr = self.correction[c.stage]
        cr["row_sum"] = self.mem.stats[self._mailbox(c.stage, 0)].astype(np.float64)
        cr["row_max"] = self.mem.stats[self._mailbox(c.stage, 1)].astype(np.float64)

    def _do_rescale_o(self, c):
        scale = self.correction[c.stage].get("scale")
        if scale is None:
            scale = np.full(self.plan.tiles.m_block, np.nan, np.float32)
        self.rescaled_rows += int(np.count_nonzero(scale != 1.0))
        o = self._tmem_f32(c.role, "O", c.stage) * scale[:, None]
        return (f"O{c.stage} rescaled (correction)",
                lambda: self._set_tmem_f32(c.role, "O", c.stage, o))

    def _do_ld_o(self, c):
        cr = self.correction[c.stage]
        state = SoftmaxState(cr["row_max"], cr["row_sum"],
                             self._tmem_f32(c.role, "O", c.stage).astype(np.float64),
                             self.problem.scale_log2)
        with np.errstate(all="ignore"):
            out, lse = finalize(state)
        cr["out"] = round16(out, self.problem.dtype)
        cr["lse"] = lse.astype(np.float32)
        cr["tile"] = (c.tile, c.tile_index)

    def _do_stage_o(self, c):
        cr = self.correction[c.stage]
        out, lse, (tile, index) = cr["out"], cr["lse"], cr["tile"]

        def store():
            self.mem.smem["o"][c.stage] = out
            to_global(self.plan, self.mem.lse, tile, c.stage, lse, lse=True)
        return (f"normalized O{c.stage} of work tile {index}", store)

    def _do_store_o(self, c):
        data = self.mem.smem["o"][c.stage].copy()
        return (f"out of work tile {c.tile_index}",
                lambda: to_global(self.plan, self.mem.out, c.tile, c.stage, data,
                                           lse=False))

@dataclass(frozen=True)
class _Ctx:
    role: str
    op: object
    index: int
    stage: int | None
    tile: WorkTile
    tile_index: int
    step: int | None
    buffer: int | None = None    # the S / P buffer it touches (Note [S ping-pong])


def persistent(plan) -> bool:
    """Whether the plan's programs run several work tiles in one CTA (a persistent kernel: Note
    [persistent CTAs] in fa4lab.plan.sm100); else each work tile is its own CTA, simulated on
    its own."""
    return plan.protocol.persistent


@functools.lru_cache(maxsize=64)
def role_programs(plan, n_blocks: int, n_tiles: int = 1, costs: CostModel = DATA_COSTS):
    """The plan's role programs (fa4lab.plan.sm100.programs) for `n_tiles` work tiles of
    `n_blocks` K/V blocks in one CTA (cached: treat them as read-only)."""
    from fa4lab.plan import sm100

    if n_tiles != 1 and not persistent(plan):
        raise ValueError(f"n_tiles={n_tiles}: the plan's programs run one work tile per CTA")
    return sm100.programs(plan, n_blocks, n_tiles, costs)


def _ctas(plan, tiles: list[WorkTile]) -> list[list[WorkTile]]:
    """Work tiles grouped by CTA: all tiles of one length in one persistent CTA, or one each."""
    if not persistent(plan):
        return [[w] for w in tiles]
    groups: dict[int, list[WorkTile]] = defaultdict(list)
    for w in tiles:
        groups[w.n_blocks].append(w)
    return [groups[n] for n in sorted(groups)]


def _needed(plan, programs: dict[str, list]) -> dict[tuple[str, int], int]:
    """Arrivals that complete a phase of each barrier stage, as `fa4lab.plan.simulate` counts
    them (its public `barrier_counts` when it has one). A named barrier's waiting warpgroup
    counts itself: by its own Arrive when its program has one (bar.sync written as arrive +
    wait), else implicitly."""
    import fa4lab.plan.simulate as simulate

    if hasattr(simulate, "barrier_counts"):
        return simulate.barrier_counts(plan)
    arrivers = {(op.barrier, role) for role, prog in programs.items() for op in prog
                if isinstance(op, Arrive)}
    threads = {r.name: r.threads for r in plan.roles}
    needed = {}
    for b in plan.barriers.barriers:
        n = b.arrive_count
        if b.kind == "named":
            n -= sum(threads[c] for c in b.consumers if (b.name, c) not in arrivers)
        for s in range(b.stages):
            needed[(b.name, s)] = n
    return needed


def run_plan(plan, q, k, v, *, schedule: Schedule = AS_PLANNED, drop: str | None = None,
             mutation: str = "drop", costs: CostModel = DATA_COSTS) -> DataRun:
    """Run `plan`'s role programs on q, k, v (numpy (batch, seqlen, heads, dim), rounded to the
    plan's dtype as the kernel's inputs), one simulation per group of work tiles that visit the
    same number of K/V blocks (a persistent CTA running them in turn).

    drop: a barrier to remove (mutation "drop": its waits and arrivals; "drop_arrive": only
    its arrivals), as `fa4lab.plan.simulate.simulate` does.
    """
    if plan.arch != "sm100":
        raise ValueError(f"the data-carrying simulator models the sm100 plan (TMEM), got "
                         f"{plan.arch!r}")
    spec = plan.spec
    unmodelled = [name for name, on in (("window_size", spec.window_size != (None, None)),
                                         ("softcap", bool(spec.softcap)),
                                         ("learnable_sink", spec.learnable_sink)) if on]
    if unmodelled:
        raise ValueError(f"the data-carrying simulator computes unmasked or causal attention, "
                         f"without {' or '.join(unmodelled)}: time such a plan with "
                         f"fa4lab.plan.simulate, and take its output from fa4lab.reference")
    shapes = (tuple(np.shape(q)), tuple(np.shape(k)), tuple(np.shape(v)))
    want = ((spec.batch, spec.seqlen_q, spec.heads_q, spec.head_dim),
            (spec.batch, spec.seqlen_k, spec.heads_kv, spec.head_dim),
            (spec.batch, spec.seqlen_k, spec.heads_kv, spec.head_dim_v))
    if shapes != want:
        raise ValueError(f"q, k, v have shapes {shapes}; the plan's spec wants {want}")
    if drop is not None:
        plan.barriers.barrier(drop)      # KeyError naming the barriers if unknown
    dtype = spec.dtype
    problem = Problem(*(round16(np.asarray(x, np.float32), dtype) for x in (q, k, v)),
                       causal=spec.causal, scale_log2=spec.scale_log2, dtype=dtype,
                       kv_head=kv_head_index(spec.heads_q, spec.heads_kv))
    t = plan.tiles
    nan = np.float32(np.nan)
    out = np.full((spec.batch, spec.seqlen_q, spec.heads_q, spec.head_dim_v), nan, np.float32)
    lse = np.full((spec.batch, spec.heads_q, spec.seqlen_q), nan, np.float32)
    tiles = work_tiles(plan)
    sims, reads, rescaled = [], [], 0
    for group in _ctas(plan, tiles):
        n_blocks = group[0].n_blocks
        if n_blocks == 0:
            # No key visible to any row: the kernel's n_block_max == 0 branches skip every
            # wait and store O = 0, LSE = -inf. No protocol runs.
            for w in group:
                for i in range(t.q_stage):
                    to_global(plan, out, w, i, np.zeros((t.m_block, t.head_dim_v)), lse=False)
                    to_global(plan, lse, w, i, np.full(t.m_block, -np.inf), lse=True)
            continue
        progs = role_programs(plan, n_blocks, len(group), costs)
        label = None
        if drop is not None:
            progs = _mutate(progs, drop, mutation)
            label = f"{mutation} {drop}"
        progs, sched_costs = schedule.apply(progs, costs)
        sim = DataSimulator(plan, progs, _needed(plan, progs), sched_costs, problem, group,
                            fresh_memory(plan, out, lse))
        sims.append(sim.run(label))
        reads += sim.reads
        rescaled += sim.rescaled_rows
    return DataRun(out, lse, sims, reads, tiles, schedule, drop, rescaled)


def plan_for(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
             dtype: str = "bf16", **overrides):
    """The sm100 plan of a numpy problem (overrides: n_block, kv_stage, ...)."""
    from fa4lab.plan import plan_forward
    from fa4lab.spec import AttentionSpec

    spec = AttentionSpec.from_tensors(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                      return_lse=True, dtype=dtype)
    return plan_forward(spec, "sm100", **overrides)


def run_attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
                  dtype: str = "bf16", schedule: Schedule = AS_PLANNED,
                  drop: str | None = None, **overrides) -> DataRun:
    """`run_plan` on the sm100 plan of q, k, v."""
    plan = plan_for(q, k, v, causal=causal, softmax_scale=softmax_scale, dtype=dtype,
                    **overrides)
    return run_plan(plan, q, k, v, schedule=schedule, drop=drop)
