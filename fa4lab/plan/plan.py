"""`Plan` and `plan_forward`: every number of the forward kernel, computed once and checked.

    from fa4lab.plan import plan_forward
    plan = plan_forward(AttentionSpec(1, 4096, 4096, 16, 16, 128), arch="sm100", n_block=128)

The arch modules (`sm100.py`, `sm90.py`) build the pieces; this module holds the frozen result,
the override checks and the JSON round trip (`fa4lab plan --format json`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from fa4lab.errors import PlanError
from fa4lab.hardware import Hardware, hardware_for
from fa4lab.limits import arch_key
from fa4lab.plan.barriers import BarrierGraph
from fa4lab.plan.protocol import Protocol
from fa4lab.plan.roles import Role, register_usage
from fa4lab.plan.smem import SmemPlan, SmemRegion
from fa4lab.plan.tiles import MmaPlan, Tiles
from fa4lab.plan.tmem import TmemPlan, TmemRegion
from fa4lab.spec import AttentionSpec

OVERRIDES = ("m_block", "n_block", "q_stage", "kv_stage")
ARCHS = ("sm100", "sm90")


@dataclass(frozen=True)
class Plan:
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
                at += 8 * b.stages
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

    # ---- JSON ----
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["protocol"] = self.protocol.to_dict()
        d = _to_plain(d)
        d["spec"] = {k: v for k, v in d["spec"].items() if k != "qhead_per_kvhead"}
        d["hardware"] = {"name": self.hardware.name, "arch": self.hardware.arch}
        d["derived"] = {"threads_per_cta": self.threads_per_cta, "cta_m": self.tiles.cta_m,
                        "mbarrier_count": self.barriers.mbarrier_count,
                        "registers_used": self.registers_used}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)

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


def _to_plain(x):
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _to_plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {k: _to_plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_to_plain(v) for v in x]
    return x


def check_overrides(arch: str, overrides: dict[str, Any]) -> dict[str, int]:
    unknown = sorted(set(overrides) - set(OVERRIDES))
    if unknown:
        raise PlanError(f"unknown override(s) {unknown} for plan_forward; known overrides: "
                        f"{list(OVERRIDES)}")
    out = {}
    for k, v in overrides.items():
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise PlanError(f"override {k}={v!r} must be an integer")
        if v < 1:
            raise PlanError(f"override {k}={v} must be >= 1")
        out[k] = v
    return out


def plan_forward(spec: AttentionSpec, arch: str = "sm100", **overrides) -> Plan:
    """The frozen plan of the forward kernel for `spec` on `arch` ("sm100" B200, "sm90" H200).

    Overrides (all optional): m_block, n_block, q_stage, kv_stage, and the switches pack_gqa
    (bool: fold the query heads of a KV head into M; see `fa4lab.plan.sm90` and
    `fa4lab.plan.sm100`) and persistent (bool; None: the arch's default, Note [persistent
    CTAs] in `fa4lab.plan.sm100` and Note [sm90 persistent CTAs] in `fa4lab.plan.sm90`). A plan
    that does not fit TMEM, SMEM or the register file raises PlanError saying what is over and
    what would fit.
    """
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"plan_forward takes an AttentionSpec, got {type(spec).__name__}")
    key = arch_key(arch)
    pack_gqa = overrides.pop("pack_gqa", False)
    if not isinstance(pack_gqa, bool):
        raise PlanError(f"override pack_gqa={pack_gqa!r} must be True or False")
    persistent = overrides.pop("persistent", None)
    if persistent not in (None, True, False):
        raise PlanError(f"override persistent={persistent!r}: True, False or None (the plan's "
                        f"default)")
    ov = check_overrides(key, overrides)
    if key == "sm100":
        from fa4lab.plan.sm100 import build_sm100 as build
    else:
        from fa4lab.plan.sm90 import build_sm90 as build
    if pack_gqa and spec.varlen:
        raise PlanError("pack_gqa=True with a varlen spec: the varlen kernels do not pack the "
                        "query heads of a KV head into M yet; plan with pack_gqa=False (the "
                        "varlen API does)")
    if pack_gqa:
        ov["pack_gqa"] = True
    if persistent is not None:
        ov["persistent"] = persistent
    try:
        return build(spec, **ov)
    except PlanError as err:
        fits = fitting_overrides(build, spec, ov)
        if fits:
            raise PlanError(f"{err} [{key}: overrides that fit: {'; '.join(fits)}]") from None
        if " over" in str(err) or "> setmaxnreg" in str(err):
            raise PlanError(f"{err} [{key}: no single change of q_stage, n_block or kv_stage "
                            f"fits]") from None
        raise


# Alternatives tried when a plan does not fit, in order of preference (least design change).
_CANDIDATES = ({"kv_stage": 2}, {"n_block": 96}, {"n_block": 64}, {"q_stage": 1},
               {"n_block": 32}, {"q_stage": 1, "n_block": 64}, {"q_stage": 1, "kv_stage": 2})


def fitting_overrides(build, spec: AttentionSpec, current: dict[str, int],
                      limit: int = 3) -> list[str]:
    """Up to `limit` override sets (changing `current`) for which `build` succeeds."""
    out = []
    for cand in _CANDIDATES:
        if all(current.get(k) == v for k, v in cand.items()):
            continue
        try:
            build(spec, **{**current, **cand})
        except PlanError:
            continue
        out.append(", ".join(f"{k}={v}" for k, v in cand.items()))
        if len(out) == limit:
            break
    return out
