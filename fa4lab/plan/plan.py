"""`Plan`: every number of the forward kernel, computed once and checked.

    from fa4lab.plan import plan_forward
    plan = plan_forward(AttentionSpec(1, 4096, 4096, 16, 16, 128), arch="sm100", n_block=128)

The arch modules (`sm100.py`, `sm90.py`) build the pieces and `fa4lab.plan.forward.plan_forward`
picks the arch's builder; this module holds the frozen result and the JSON round trip
(`fa4lab plan --format json`), and `PlanViews`, what the forward and backward plans read from
their fields alike.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from fa4lab.hardware import Hardware, hardware_for
from fa4lab.plan.barriers import BarrierGraph
from fa4lab.plan.protocol import Protocol, to_plain
from fa4lab.plan.roles import Role, register_usage
from fa4lab.plan.smem import MBARRIER_BYTES, SmemPlan, SmemRegion
from fa4lab.plan.tiles import MmaPlan, Tiles
from fa4lab.plan.tmem import TmemPlan, TmemRegion
from fa4lab.spec import AttentionSpec

ARCHS = ("sm100", "sm90")


class PlanViews:
    """What a kernel plan reads from its fields the same way forward (`Plan`) and backward
    (`fa4lab.plan.backward.BackwardPlan`): its barriers, roles and MMAs by name, the numbers
    derived from them, and the JSON of `fa4lab plan --format json`. The dataclass using it holds
    spec, hardware, mmas, smem, roles and protocol."""

    @property
    def barriers(self) -> BarrierGraph:
        """The protocol table's barriers (a view of `protocol.barriers`)."""
        return self.protocol.barriers

    def barrier_offsets(self) -> dict[str, int]:
        """SMEM byte offset of each mbarrier's stage 0, in the table's (the struct's) order."""
        at = self.smem.offsets()["barriers"]
        out = {}
        for b in self.barriers.barriers:
            if b.kind == "mbarrier":
                out[b.name] = at
                at += MBARRIER_BYTES * b.stages
        return out

    @property
    def threads_per_cta(self) -> int:
        return sum(r.threads for r in self.roles)

    @property
    def registers_used(self) -> int:
        return register_usage(self.roles)

    def role(self, name: str) -> Role:
        for r in self.roles:
            if r.name == name:
                return r
        raise KeyError(f"no role {name!r}; have {[r.name for r in self.roles]}")

    def mma(self, name: str) -> MmaPlan:
        for m in self.mmas:
            if m.name == name:
                return m
        raise KeyError(f"no MMA {name!r}; have {[m.name for m in self.mmas]}")

    def derived(self) -> dict[str, int]:
        """The numbers computed from the fields, written under to_dict()'s "derived"."""
        return {"threads_per_cta": self.threads_per_cta,
                "mbarrier_count": self.barriers.mbarrier_count,
                "registers_used": self.registers_used}

    # ---- JSON ----
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["protocol"] = self.protocol.to_dict()
        d = to_plain(d)
        d["spec"] = {k: v for k, v in d["spec"].items() if k != "qhead_per_kvhead"}
        d["hardware"] = {"name": self.hardware.name, "arch": self.hardware.arch}
        d["derived"] = self.derived()
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)


@dataclass(frozen=True)
class Plan(PlanViews):
    spec: AttentionSpec
    arch: str
    hardware: Hardware
    tiles: Tiles
    mmas: tuple[MmaPlan, ...]
    tmem: TmemPlan | None
    smem: SmemPlan
    roles: tuple[Role, ...]
    protocol: Protocol          # the barriers and each role's program (fa4lab.plan.protocol)
    rescale_threshold: float
    exp2_emulation_fraction: float
    notes: tuple[str, ...] = ()

    def derived(self) -> dict[str, int]:
        return {**super().derived(), "cta_m": self.tiles.cta_m}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        tmem = d["tmem"]
        return cls(
            spec=AttentionSpec(**d["spec"]),
            arch=d["arch"],
            hardware=hardware_for(d["hardware"]["arch"]),
            tiles=Tiles(**d["tiles"]),
            mmas=tuple(MmaPlan(**m) for m in d["mmas"]),
            tmem=None if tmem is None else TmemPlan(
                regions=tuple(TmemRegion(**r) for r in tmem["regions"]),
                **{k: v for k, v in tmem.items() if k != "regions"}),
            smem=SmemPlan(regions=tuple(SmemRegion(**r) for r in d["smem"]["regions"]),
                          total_bytes=d["smem"]["total_bytes"],
                          limit_bytes=d["smem"]["limit_bytes"]),
            roles=tuple(Role(**{**r, "warps": tuple(r["warps"])}) for r in d["roles"]),
            protocol=Protocol.from_dict(d["protocol"]),
            rescale_threshold=d["rescale_threshold"],
            exp2_emulation_fraction=d["exp2_emulation_fraction"],
            notes=tuple(d.get("notes", ())),
        )

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))
