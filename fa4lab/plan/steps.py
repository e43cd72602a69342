"""The steps of a role's program as the simulator runs it (`fa4lab.plan.simulate`): `Wait` on a
barrier phase, `Arrive`, `Work` for some cycles touching named TMEM / SMEM regions (`Ref`),
`Issue` of an async TMA copy or tcgen05 MMA, `Commit`, `WaitEngine`. The protocol table expands
into them (`fa4lab.plan.protocol.expand`) and the arch modules' programs are made of them
(`fa4lab.plan.sm100.programs`, `fa4lab.plan.sm90.programs`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ref:
    """A region a step touches: TMEM columns [lo, hi) or one SMEM buffer (name, stage)."""

    space: str          # "tmem" | "smem" | "turn"
    name: str
    stage: int
    lo: int = 0
    hi: int = 0

    def cells(self) -> tuple:
        if self.space == "tmem":
            return tuple(("tmem", c) for c in range(self.lo // 8, (self.hi + 7) // 8))
        return ((self.space, self.name, self.stage),)

    def __str__(self) -> str:
        where = f" cols {self.lo}-{self.hi - 1}" if self.space == "tmem" else ""
        return f"{self.name}[{self.stage}]{where}"


@dataclass(frozen=True)
class Wait:
    barrier: str
    stage: int
    k: int              # wait for this stage's k-th phase completion (k < 0: passes at once)

    def __str__(self) -> str:
        if self.k < 0:
            return f"wait  {self.barrier}[{self.stage}] (released at start: passes)"
        return f"wait  {self.barrier}[{self.stage}] phase {self.k} (parity {self.k % 2})"


@dataclass(frozen=True)
class Arrive:
    barrier: str
    stage: int
    count: int
    expect_tx: int = 0

    def __str__(self) -> str:
        tx = f" + expect {self.expect_tx} bytes" if self.expect_tx else ""
        return f"arrive {self.barrier}[{self.stage}] x{self.count}{tx}"


@dataclass(frozen=True)
class Work:
    label: str
    cycles: float
    unit: str | None = None          # shared execution unit held for the duration ("mufu", ...)
    reads: tuple[Ref, ...] = ()
    writes: tuple[Ref, ...] = ()
    # Cycles the unit stays this role's after the op: one pass over the unit that the table
    # cuts into two steps (Note [split P hand-off] in fa4lab.plan.sm100); the role's next op
    # on the unit starts without queueing behind another role's.
    hold: float = 0.0

    def __str__(self) -> str:
        return f"work  {self.label!r} {self.cycles:.0f} cycles{_unit(self.unit)}" \
               f"{_touch(self.reads, self.writes)}"


def _unit(unit) -> str:
    return f" on {unit}" if unit else ""


def _touch(reads, writes) -> str:
    out = ""
    if reads:
        out += " reads " + ", ".join(map(str, reads))
    if writes:
        out += " writes " + ", ".join(map(str, writes))
    return out


@dataclass(frozen=True)
class Issue:
    """An async op on an engine: "tensor" (in order), "tma" (loads), "tma_store", "cpasync"
    (a producer's cp.async copies of a block, landing on a `Commit`)."""

    engine: str
    label: str
    cycles: float
    reads: tuple[Ref, ...] = ()
    writes: tuple[Ref, ...] = ()
    complete_tx: tuple[str, int, int] | None = None   # (barrier, stage, bytes) on completion

    def __str__(self) -> str:
        done = (f"; lands on {self.complete_tx[0]}[{self.complete_tx[1]}]"
                if self.complete_tx else "")
        return f"issue {self.engine}: {self.label!r} {self.cycles:.0f} cycles" \
               f"{_touch(self.reads, self.writes)}{done}"


@dataclass(frozen=True)
class Commit:
    """tcgen05.commit ("tensor") or cp.async.mbarrier.arrive.noinc ("cpasync", `count` threads):
    arrive on a barrier once this role's ops on the engine completed."""

    engine: str
    barrier: str
    stage: int
    count: int = 1

    def __str__(self) -> str:
        return f"commit {self.engine} -> {self.barrier}[{self.stage}]"


@dataclass(frozen=True)
class WaitEngine:
    """Wait until at most `pending` of this role's newest ops on an engine are still in flight,
    every older one completed (cp.async.bulk.wait_group.read N); `pending=0` waits for all.
    See Note [store drains]."""

    engine: str
    pending: int = 0

    def __str__(self) -> str:
        if self.pending:
            return (f"wait  until this role's {self.engine} ops but the newest {self.pending} "
                    f"are done")
        return f"wait  until this role's {self.engine} ops are done"


# Note [store drains]
# `cp.async.bulk.wait_group.read N` returns once at most N of the thread's most recent bulk
# groups are pending and every earlier group is done (each TMA store is its own group). The
# sm100 epilogue issues both O stores, then drains them in order: drain i waits with
# N = q_stage - 1 - i, i.e. for the stores up to and including store i, and releases o_empty[i]
# while the newer stores may still be in flight. `WaitEngine(engine, pending=N)` is that wait:
# it takes in the completion times and clocks of all but the role's newest N ops on the engine.


Op = Wait | Arrive | Work | Issue | Commit | WaitEngine
