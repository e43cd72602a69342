"""The barrier graph: every mbarrier (and, on sm90, named barrier) with who arrives and who waits.

A `Barrier` is an edge producer -> consumer in the graph. `stages` copies exist (one per
pipeline buffer or Q stage); the k-th use of a stage waits for that stage's k-th phase to
complete, i.e. parity k % 2 (`phase_rule`). A phase completes when `arrive_count` arrivals
have been made and, for TMA barriers, `tx_bytes` bytes have landed. Release ("empty") barriers
start as if one phase had completed: their first wait passes at once.

`group` sorts the edges for drawing: "pipeline" (data flowing through buffers), "mailbox" (the
softmax -> correction statistics hand-off), "named" (sm90 warp-scheduler ping-pong, `bar.sync`
ids rather than mbarriers).
"""

from __future__ import annotations

from dataclasses import dataclass

from fa4lab.errors import PlanError


@dataclass(frozen=True)
class Barrier:
    name: str
    producer: str          # role name(s) that arrive; "a,b" when two roles arrive
    consumer: str          # role name(s) that wait
    arrive_count: int      # arrivals per phase
    stages: int
    tx_bytes: int          # bytes a TMA delivers per phase (0: not a transaction barrier)
    phase_rule: str
    guards: str            # what ordering it guarantees
    kind: str = "mbarrier"     # "mbarrier" | "named"
    group: str = "pipeline"    # "pipeline" | "mailbox" | "named"
    starts_released: bool = False   # first wait passes at once (a release/"empty" barrier)
    # True when stage i belongs to the i-th role of a listed producer/consumer ("softmax0,
    # softmax1": stage 0 is softmax0's); False when every listed role uses every stage.
    per_role_stage: bool = False
    named_id: int = 0          # bar.sync / bar.arrive id of a named barrier
    ring: str = ""             # "kv", "k", "v": stages used as a ring (Note [ring slots])
    # Bytes of a V phase of a shared "kv" ring when V rows are narrower than K's (head_dim_v <
    # head_dim); 0: tx_bytes, as for every other phase.
    tx_bytes_v: int = 0

    def slot_tx_bytes(self, slot: str) -> int:
        """Bytes one phase of `slot` (a stage, or a ring slot "K", "V+1", ...) expects."""
        return self.tx_bytes_v if self.tx_bytes_v and slot[:1] == "V" else self.tx_bytes

    @property
    def producers(self) -> tuple[str, ...]:
        return tuple(self.producer.split(","))

    @property
    def consumers(self) -> tuple[str, ...]:
        return tuple(self.consumer.split(","))


@dataclass(frozen=True)
class BarrierGraph:
    barriers: tuple[Barrier, ...]

    def __post_init__(self):
        names = [b.name for b in self.barriers]
        if len(set(names)) != len(names):
            raise PlanError(f"duplicate barrier names in {names}")

    @property
    def mbarrier_count(self) -> int:
        """mbarrier.init calls the kernel makes: one per stage of every mbarrier."""
        return sum(b.stages for b in self.barriers if b.kind == "mbarrier")

    def barrier(self, name: str) -> Barrier:
        for b in self.barriers:
            if b.name == name:
                return b
        raise KeyError(f"no barrier {name!r}; have {[b.name for b in self.barriers]}")

    def edges(self) -> list[tuple[str, str, str]]:
        """(producer role, consumer role, barrier name) for every edge."""
        return [(p, c, b.name) for b in self.barriers for p in b.producers for c in b.consumers]

    def without(self, name: str) -> BarrierGraph:
        self.barrier(name)
        return BarrierGraph(tuple(b for b in self.barriers if b.name != name))


PHASE_FULL = ("consumer waits parity k % 2 for the k-th fill of a stage; the producer's "
              "arrive (+ TMA bytes) completes the phase")
PHASE_EMPTY = ("producer waits parity (k + 1) % 2 before the k-th refill: the first wait "
               "passes at once (barrier starts released)")
PHASE_NAMED = ("bar.sync id: completes when the waiting warpgroup and the arriving warpgroup "
               "have both arrived; no phase memory")
