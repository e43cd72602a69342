"""A protocol simulator: the roles' programs run against the barrier graph, cycle by cycle.

Each role is a program (`fa4lab.plan.steps`: `Wait` on a barrier phase, `Work` for some cycles
touching named TMEM / SMEM regions, `Issue` of an async TMA copy or tcgen05 MMA, `Arrive`,
`Commit`). Barriers follow
mbarrier semantics: a phase completes after `arrive_count` arrivals and, for TMA barriers, once
the expected transaction bytes landed; the k-th use of a stage waits for its k-th phase
(parity k % 2); release barriers start completed. Costs come from `fa4lab.plan.costs`.

What it reports (`SimResult`):
  - the timeline per role and per engine (tensor pipe, TMA), for a Gantt chart;
  - deadlock: roles still waiting when nothing else can run, and on what;
  - hazards: two accesses to the same TMEM columns / SMEM buffer, at least one a write, that
    no chain of barrier edges orders (see Note [hazards by happens-before]).

`fa4lab.plan.throughput.predict` turns the tile times simulated here into TFLOP/s.

Run it:  `simulate(plan_forward(spec, "sm100"), n_blocks=6, n_tiles=2).summary()`
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field

from fa4lab.plan.costs import DEFAULT_COSTS, CostModel

# The programs' steps (`fa4lab.plan.steps`), importable from here too.
from fa4lab.plan.steps import Arrive, Commit, Issue, Op, Ref, Wait, WaitEngine, Work  # noqa: F401

# Note [hazards by happens-before]
# Every role, every async copy and the in-order tensor pipe carries a vector clock. An arrive
# publishes the arriver's clock into the barrier phase; a wait that sees the phase complete
# takes it in (acquire). An access is ordered after another iff its clock covers the other's
# event. A write unordered with an earlier read or write of the same cells, or a read
# unordered with the last write (or of cells never written), is a hazard. Because the check
# uses the orders the barriers create rather than the order in which this run happened to
# execute, removing any barrier edge that orders two accesses is reported even when the
# simulated timing happens to be benign.


# ---- results ----
@dataclass(frozen=True)
class Span:
    lane: str           # role name or engine name
    label: str
    start: float
    end: float
    kind: str           # "work" | "wait" | "mma" | "copy"


@dataclass(frozen=True)
class Hazard:
    kind: str           # "read before written" | "write while read" | "write after write" | ...
    region: str
    first: str          # the earlier access (who, what)
    second: str
    time: float

    def __str__(self) -> str:
        if self.kind in ("arrive count overflow", "phase overrun"):
            return f"{self.kind} on {self.region}: {self.second} ({self.first})"
        return (f"{self.kind} on {self.region}: {self.second} unordered with {self.first} "
                f"(cycle {self.time:.0f})")


@dataclass
class SimResult:
    arch: str
    n_blocks: int
    n_tiles: int
    spans: list[Span]
    hazards: list[Hazard]
    deadlock: list[str]
    cycles: float
    mutation: str | None = None
    completions: dict = field(default_factory=dict)
    leftover: dict = field(default_factory=dict)   # stage -> (arrivals, tx) of an open phase
    phase_times: dict = field(default_factory=dict)  # "name[stage]" -> cycle of each completion

    @property
    def ok(self) -> bool:
        return not self.hazards and not self.deadlock

    def lanes(self) -> list[str]:
        seen: list[str] = []
        for s in self.spans:
            if s.lane not in seen:
                seen.append(s.lane)
        return seen

    def busy(self) -> dict[str, float]:
        """Fraction of the run each lane spends working (not waiting)."""
        out: dict[str, float] = defaultdict(float)
        for s in self.spans:
            if s.kind != "wait":
                out[s.lane] += s.end - s.start
        return {k: v / self.cycles for k, v in out.items()} if self.cycles else {}

    def summary(self) -> str:
        head = (f"{self.arch}: {self.n_tiles} tile(s) x {self.n_blocks} K/V blocks in "
                f"{self.cycles:.0f} cycles")
        if self.mutation:
            head += f" [mutation: {self.mutation}]"
        lines = [head]
        if self.deadlock:
            lines.append("DEADLOCK: " + "; ".join(self.deadlock))
        if self.hazards:
            lines.append(f"{len(self.hazards)} HAZARD(S):")
            lines += [f"  {h}" for h in self.hazards[:6]]
        if self.ok:
            busy = ", ".join(f"{k} {v:.0%}" for k, v in self.busy().items())
            lines.append(f"no deadlock, no hazard; busy: {busy}")
        return "\n".join(lines)


# ---- the engine ----
class _Clock(dict):
    def join(self, other: dict) -> None:
        for k, v in other.items():
            if self.get(k, 0) < v:
                self[k] = v

    def covers(self, event: tuple[str, int]) -> bool:
        return self.get(event[0], 0) >= event[1]


@dataclass
class _Phase:
    arrivals: int = 0
    tx: int = 0
    last: float = 0.0
    clock: _Clock = field(default_factory=_Clock)


class _Barrier:
    def __init__(self, name: str, needed: int):
        self.name = name
        self.needed = needed
        self.phase = _Phase()
        self.completions: list[tuple[float, _Clock]] = []
        self.waiters: list[tuple[str, int]] = []


class Simulator:
    def __init__(self, programs: dict[str, list], needed: dict[tuple[str, int], int],
                 costs: CostModel, arch: str = "", n_blocks: int = 0, n_tiles: int = 0):
        self.programs = programs
        self.costs = costs
        self.meta = (arch, n_blocks, n_tiles)
        self.barriers = {key: _Barrier(f"{key[0]}[{key[1]}]", n) for key, n in needed.items()}
        self.clocks = {role: _Clock({role: 1}) for role in programs}
        self.pc = dict.fromkeys(programs, 0)
        self.unit_free: dict[str, float] = defaultdict(float)
        self.unit_held: set[tuple[str, str]] = set()   # (unit, role) a Work.hold keeps
        self.engine_free: dict[str, float] = defaultdict(float)
        self.engine_clock: dict[str, _Clock] = defaultdict(_Clock)
        self.pending: dict[tuple[str, str], tuple[float, _Clock]] = {}
        # (role, engine) -> (completion, clock) of each op it issued there, in issue order
        self.issued: dict[tuple[str, str], list[tuple[float, _Clock]]] = defaultdict(list)
        self.events: list = []
        self.seq = 0
        self.spans: list[Span] = []
        self.hazards: list[Hazard] = []
        self._hazard_keys: set = set()
        self.cells: dict = {}
        self.copies = 0
        self.blocked_since: dict[str, float] = {}
        self.now = 0.0

    # events
    def _push(self, t: float, kind: str, payload) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def run(self, mutation: str | None = None) -> SimResult:
        for role in self.programs:
            self._push(0.0, "step", role)
        while self.events:
            t, _, kind, payload = heapq.heappop(self.events)
            self.now = t
            if kind == "step":
                self._step(payload, t)
            else:
                key, count, tx, clock = payload
                self._arrive(key, count, -tx, clock, t)
        deadlock = []
        for role, prog in self.programs.items():
            if self.pc[role] < len(prog):
                op = prog[self.pc[role]]
                if isinstance(op, Wait):
                    b = self.barriers[(op.barrier, op.stage)]
                    deadlock.append(
                        f"{role} waits {op.barrier}[{op.stage}] phase {op.k} (parity {op.k % 2})"
                        f", which completed {len(b.completions)} time(s)")
                else:
                    deadlock.append(f"{role} stuck at {op}")
        end = max([s.end for s in self.spans] + [0.0])
        arch, n_blocks, n_tiles = self.meta
        done = {f"{k[0]}[{k[1]}]": len(b.completions) for k, b in self.barriers.items()}
        left = {b.name: (b.phase.arrivals, b.phase.tx) for b in self.barriers.values()
                if b.phase.arrivals or b.phase.tx}
        times = {f"{k[0]}[{k[1]}]": [t for t, _ in b.completions]
                 for k, b in self.barriers.items()}
        return SimResult(arch, n_blocks, n_tiles, self.spans, self.hazards, deadlock, end,
                         mutation, done, left, times)

    # barriers
    def _arrive(self, key, count: int, tx: int, clock: dict, t: float) -> None:
        if key not in self.barriers:
            return
        b = self.barriers[key]
        ph = b.phase
        ph.arrivals += count
        ph.tx += tx
        ph.last = max(ph.last, t)
        ph.clock.join(clock)
        if ph.arrivals > b.needed:
            self._hazard("arrive count overflow", b.name, f"arrive_count {b.needed}",
                         f"{ph.arrivals} arrivals in one phase", t)
        if ph.arrivals >= b.needed and ph.tx == 0:
            b.completions.append((ph.last, ph.clock))
            b.phase = _Phase(arrivals=ph.arrivals - b.needed)
            waiters, b.waiters = b.waiters, []
            for role, k in waiters:
                if len(b.completions) > k:
                    self._push(max(t, b.completions[k][0]), "step", role)
                else:
                    b.waiters.append((role, k))

    # accesses
    def _hazard(self, kind, region, first, second, t) -> None:
        key = (kind, region.split(" cols")[0], first.split(" @")[0], second.split(" @")[0])
        if key in self._hazard_keys:
            return
        self._hazard_keys.add(key)
        self.hazards.append(Hazard(kind, region, first, second, t))

    def _access(self, who: str, event: tuple[str, int], clock: _Clock, what: str,
                reads, writes, t: float) -> None:
        desc = f"{who}: {what} @{t:.0f}"
        for ref in reads:
            for cell in ref.cells():
                st = self.cells.setdefault(cell, {"w": None, "r": {}})
                w = st["w"]
                if w is None:
                    self._hazard("read before written", str(ref), "(never written)", desc, t)
                elif not clock.covers(w[0]):
                    self._hazard("read unordered with write", str(ref), w[1], desc, t)
                st["r"][event[0]] = (event, desc)
        for ref in writes:
            for cell in ref.cells():
                st = self.cells.setdefault(cell, {"w": None, "r": {}})
                w = st["w"]
                if w is not None and not clock.covers(w[0]):
                    self._hazard("write after write, unordered", str(ref), w[1], desc, t)
                for agent, (ev, rdesc) in st["r"].items():
                    if agent != event[0] and not clock.covers(ev):
                        self._hazard("write while a reader still needs it", str(ref), rdesc,
                                     desc, t)
                st["w"] = (event, desc)
                st["r"] = {}

    # roles
    def _tick(self, role: str) -> tuple[str, int]:
        c = self.clocks[role]
        c[role] = c.get(role, 0) + 1
        return (role, c[role])

    def _step(self, role: str, t: float) -> None:
        prog = self.programs[role]
        costs = self.costs
        while self.pc[role] < len(prog):
            op = prog[self.pc[role]]
            if isinstance(op, Wait):
                if op.k < 0:
                    self.pc[role] += 1
                    continue
                b = self.barriers[(op.barrier, op.stage)]
                if len(b.completions) <= op.k:
                    if (role, op.k) not in b.waiters:
                        b.waiters.append((role, op.k))
                    self.blocked_since.setdefault(role, t)
                    return
                if len(b.completions) > op.k + 1 and op.k >= 0:
                    self._hazard("phase overrun", b.name,
                                 f"{len(b.completions)} completions",
                                 f"{role} waiting for phase {op.k} (parity {op.k % 2})", t)
                done_t, clock = b.completions[op.k]
                start = self.blocked_since.pop(role, t)
                ready = max(t, done_t + (costs.barrier_latency if done_t > start else 0))
                if ready > start:
                    self.spans.append(Span(role, f"wait {b.name}", start, ready, "wait"))
                self.clocks[role].join(clock)
                self._tick(role)
                self.pc[role] += 1
                if ready > t:
                    self._push(ready, "step", role)
                    return
            elif isinstance(op, Arrive):
                self._tick(role)
                self.pc[role] += 1
                self._arrive((op.barrier, op.stage), op.count, op.expect_tx,
                             self.clocks[role], t)
            elif isinstance(op, Work):
                held = (op.unit, role) in self.unit_held
                self.unit_held.discard((op.unit, role))
                start = max(t, self.unit_free[op.unit]) if op.unit and not held else t
                end = start + op.cycles
                if op.unit:
                    self.unit_free[op.unit] = max(self.unit_free[op.unit], end + op.hold)
                    if op.hold:
                        self.unit_held.add((op.unit, role))
                ev = self._tick(role)
                self._access(role, ev, self.clocks[role], op.label, op.reads, op.writes, start)
                if start > t:
                    self.spans.append(Span(role, f"wait {op.unit}", t, start, "wait"))
                # A role that runs the MMA itself (sm90 wgmma) shows it as an MMA span.
                self.spans.append(Span(role, op.label, start, end,
                                       "mma" if op.unit == "tensor" else "work"))
                self.pc[role] += 1
                self._push(end, "step", role)
                return
            elif isinstance(op, Issue):
                self._issue(role, op, t)
                self.pc[role] += 1
                self._push(t + costs.issue_cycles, "step", role)
                return
            elif isinstance(op, Commit):
                self.pc[role] += 1
                done_t, clock = self.pending.get((role, op.engine), (t, self.clocks[role]))
                self._push(max(t, done_t), "arrive",
                           ((op.barrier, op.stage), op.count, 0, _Clock(clock)))
            elif isinstance(op, WaitEngine):
                ops = self.issued[(role, op.engine)]
                done = ops[: max(len(ops) - op.pending, 0)]
                done_t = max((end for end, _ in done), default=t)
                for _, clock in done:
                    self.clocks[role].join(clock)
                self._tick(role)
                self.pc[role] += 1
                if done_t > t:
                    self.spans.append(Span(role, f"wait {op.engine}", t, done_t, "wait"))
                    self._push(done_t, "step", role)
                    return
            else:
                raise TypeError(f"unknown op {op!r}")

    def _issue(self, role: str, op: Issue, t: float) -> None:
        self._tick(role)
        if op.engine == "tensor":
            # In order: one agent whose clock also carries every earlier MMA.
            clock = self.engine_clock["tensor"]
            clock.join(self.clocks[role])
            clock["tensor"] = clock.get("tensor", 0) + 1
            agent = "tensor"
            start = max(t, self.engine_free["tensor"])
            end = start + op.cycles
            self.engine_free["tensor"] = end
            kind = "mma"
        else:
            # Each copy is its own agent: TMA copies are not ordered among themselves.
            self.copies += 1
            agent = f"{op.engine}#{self.copies}"
            clock = _Clock(self.clocks[role])
            clock[agent] = 1
            start = max(t, self.engine_free[op.engine])
            self.engine_free[op.engine] = start + op.cycles
            end = start + op.cycles + self.costs.tma_latency
            kind = "copy"
        ev = (agent, clock[agent])
        self._access(agent.split("#")[0], ev, clock, f"{op.label} ({role})", op.reads,
                     op.writes, start)
        # The engine lane shows occupancy; a copy's latency is not the engine's busy time.
        self.spans.append(Span(op.engine, op.label, start, start + op.cycles, kind))
        snap = _Clock(clock)
        prev_t, prev_c = self.pending.get((role, op.engine), (0.0, _Clock()))
        merged = _Clock(prev_c)
        merged.join(snap)
        self.pending[(role, op.engine)] = (max(prev_t, end), merged)
        self.issued[(role, op.engine)].append((end, snap))
        if op.complete_tx is not None:
            name, stage, nbytes = op.complete_tx
            self._push(end, "arrive", ((name, stage), 0, nbytes, snap))


# ---- driving a plan ----
MUTATIONS = ("drop", "drop_arrive")


def programs_for(plan, n_blocks: int, n_tiles: int = 1, costs: CostModel = DEFAULT_COSTS,
                 masked_blocks: int = 0) -> dict[str, list]:
    """Each role's ops over a CTA's work tiles: `plan.protocol` expanded, `n_tiles` tiles if the
    plan is persistent (Note [persistent CTAs] in fa4lab.plan.sm100), else one (`tiles_per_cta`).
    A backward plan (`fa4lab.plan.backward`) has its own step catalogue; its "blocks" are the
    query blocks its CTA's key block walks."""
    if getattr(plan, "direction", "forward") == "backward":   # fa4lab.plan.backward
        from fa4lab.plan.protocol_bwd_sm100 import programs
    elif plan.arch == "sm100":
        from fa4lab.plan.sm100 import programs
    else:
        from fa4lab.plan.sm90 import programs
    return programs(plan, n_blocks, tiles_per_cta(plan, n_tiles), costs, masked_blocks)


def tiles_per_cta(plan, n_tiles: int) -> int:
    """`n_tiles` if the plan's CTAs are persistent (its table loops over work tiles), else 1."""
    return n_tiles if plan.protocol.persistent else 1


def _mutate(programs: dict[str, list], barrier: str, kind: str) -> dict[str, list]:
    def keep(op) -> bool:
        if isinstance(op, (Arrive, Commit)) and op.barrier == barrier:
            return False
        if kind == "drop" and isinstance(op, Wait) and op.barrier == barrier:
            return False
        return True

    out = {}
    for role, prog in programs.items():
        ops = []
        for op in prog:
            if not keep(op):
                continue
            if isinstance(op, Issue) and op.complete_tx and op.complete_tx[0] == barrier:
                op = Issue(op.engine, op.label, op.cycles, op.reads, op.writes, None)
            ops.append(op)
        out[role] = ops
    return out


def simulate(plan, n_blocks: int = 6, n_tiles: int = 2, costs: CostModel = DEFAULT_COSTS,
             drop: str | None = None, mutation: str = "drop",
             masked_blocks: int = 0) -> SimResult:
    """Run the plan's protocol table over a CTA's `n_tiles` work tiles of `n_blocks` K/V blocks
    each, the first `masked_blocks` of them masked (a plan whose kernel runs one work tile per
    CTA runs one, and records n_tiles 1: `tiles_per_cta`).

    `drop="kv_empty"` removes that barrier edge (its waits and arrivals, mutation="drop") or
    only its arrivals (mutation="drop_arrive"), to show what the edge protects.
    """
    if n_blocks < 1 or n_tiles < 1:
        raise ValueError(f"n_blocks={n_blocks}, n_tiles={n_tiles}: both must be >= 1")
    n_tiles = tiles_per_cta(plan, n_tiles)
    progs = programs_for(plan, n_blocks, n_tiles, costs, masked_blocks)
    label = None
    if drop is not None:
        if mutation not in MUTATIONS:
            raise ValueError(f"mutation {mutation!r}: use one of {MUTATIONS}")
        plan.barriers.barrier(drop)   # KeyError naming the barriers if unknown
        progs = _mutate(progs, drop, mutation)
        label = f"{mutation} {drop}"
    # A named barrier's bar.sync arrives with its own threads (the table's `sync` expands to
    # Arrive + Wait), so every barrier needs its arrive_count.
    needed = {(b.name, s): b.arrive_count for b in plan.barriers.barriers for s in range(b.stages)}
    return Simulator(progs, needed, costs, plan.arch, n_blocks, n_tiles).run(label)


def edge_check(plan, barrier: str, n_blocks=(1, 6), n_tiles: int = 2,
               costs: CostModel = DEFAULT_COSTS) -> str:
    """What removing one barrier breaks, over short and long work tiles: "" if nothing.

    Both lengths matter: with a two-buffer K/V ring and tiles of several blocks, the ring's
    own release happens to order the next tile's Q load after the last score MMA, so q_empty
    only shows its worth on a one-block tile (a causal tile near the diagonal).
    """
    found = []
    for n in n_blocks:
        r = simulate(plan, n, n_tiles, costs, drop=barrier)
        if r.deadlock and "deadlock" not in found:
            found.append("deadlock")
        for h in r.hazards:
            if h.kind not in found:
                found.append(h.kind)
    return " + ".join(found)


def unobservable(plan) -> dict[str, str]:
    """Barriers whose removal no one-tile run can show, and why (read off the table)."""
    out = {name: "waited only on its released first phase: it orders successive work tiles, "
                 "and this plan's kernel runs one per CTA"
           for name in plan.protocol.first_use_only(plan.tiles.q_stage)}
    for b in plan.barriers.barriers:
        if set(b.producers) == set(b.consumers):
            out[b.name] = "a role syncs its own warps; the simulator runs a role as one agent"
    return out


def mutation_check(plan, n_blocks=(1, 6), n_tiles: int = 2,
                   costs: CostModel = DEFAULT_COSTS) -> dict[str, str]:
    """Each barrier -> what its removal breaks ("" would mean the edge is redundant)."""
    return {b.name: edge_check(plan, b.name, n_blocks, n_tiles, costs)
            for b in plan.barriers.barriers}
