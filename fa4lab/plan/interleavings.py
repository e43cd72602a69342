"""Interleavings for the data-carrying simulator (`fa4lab.plan.datasim`): a `Schedule` scales
the cycles of each lane (a role's own Work, or the engine its async ops run on), so one run
of the role programs can take any order the barriers allow.

`AS_PLANNED` keeps the cost model's cycles; `adversary(plan, barrier)` is the interleaving
that hurts most without `barrier` (its producers late, its consumers early);
`random_schedules` draws more from a fixed seed (`fa4lab.plan.datasim_check` searches them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from fa4lab.plan.costs import CostModel
from fa4lab.plan.steps import Issue, Work

# `adversary`'s cycle multipliers for the roles that arrive late and those that wait early
SLOW, FAST = 32.0, 1.0 / 32.0

# role -> the lanes (its own Work, and the engine its async ops run on) a schedule scales
ROLE_LANES = {"load": ("load", "tma"), "mma": ("mma", "tensor"),
              "epilogue": ("epilogue", "tma_store")}


@dataclass(frozen=True)
class Schedule:
    """Cycle multipliers per lane (a role's Work, or an engine's async ops): an interleaving.

    The simulator is deterministic; a schedule changes only how long each lane's steps take,
    so the barriers still decide what may run before what.
    """

    name: str
    speed: tuple[tuple[str, float], ...] = ()

    def factor(self, lane: str) -> float:
        return dict(self.speed).get(lane, 1.0)

    def apply(self, programs: dict[str, list], costs: CostModel):
        out = {}
        for role, prog in programs.items():
            ops = []
            for op in prog:
                if isinstance(op, Work):
                    op = dataclasses.replace(op, cycles=op.cycles * self.factor(role),
                                             hold=op.hold * self.factor(role))
                elif isinstance(op, Issue):
                    op = dataclasses.replace(op, cycles=op.cycles * self.factor(op.engine))
                ops.append(op)
            out[role] = ops
        latency = int(round(costs.tma_latency * self.factor("tma")))
        return out, costs.with_(tma_latency=latency)

    def __str__(self) -> str:
        if not self.speed:
            return self.name
        parts = ", ".join(f"{lane} x{f:g}" for lane, f in self.speed)
        return f"{self.name} ({parts})"


AS_PLANNED = Schedule("as planned")


def _lanes(role: str) -> tuple[str, ...]:
    return ROLE_LANES.get(role, (role,))


def adversary(plan, barrier: str) -> Schedule:
    """The interleaving that hurts most without `barrier`: the roles that arrive on it run
    slow, the roles that wait on it run ahead. For a "full" barrier the reader then reads
    before the writer wrote; for an "empty" (release) barrier the writer refills a buffer while
    its reader still reads."""
    b = plan.barriers.barrier(barrier)
    speed = {}
    for role in b.consumers:
        for lane in _lanes(role):
            speed[lane] = FAST
    for role in b.producers:
        for lane in _lanes(role):
            speed[lane] = SLOW
    return Schedule(f"{barrier}'s producers late, consumers early", tuple(sorted(speed.items())))


def random_schedules(plan, count: int, seed: int = 0) -> list[Schedule]:
    """`count` interleavings drawn from a fixed seed: each lane 1/32x .. 32x slower."""
    lanes = sorted({lane for r in plan.roles if not r.name.startswith("empty")
                    for lane in _lanes(r.name)})
    gen = np.random.default_rng(seed)
    choices = (1 / 32, 1 / 4, 1.0, 4.0, 32.0)
    return [Schedule(f"random #{n} (seed {seed})",
                     tuple((lane, float(gen.choice(choices))) for lane in lanes))
            for n in range(count)]
