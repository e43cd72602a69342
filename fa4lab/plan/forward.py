"""`plan_forward`: the plan of the forward kernel for a spec on an arch, from that arch's builder
(`fa4lab.plan.sm100.build_sm100`, `fa4lab.plan.sm90.build_sm90`), its overrides checked; a plan
that does not fit names the overrides that would (`fitting_overrides`).

    from fa4lab.plan import plan_forward
    plan = plan_forward(AttentionSpec(1, 4096, 4096, 16, 16, 128), arch="sm100", n_block=128)
"""

from __future__ import annotations

from typing import Any

from fa4lab.errors import PlanError
from fa4lab.limits import arch_key
from fa4lab.plan.plan import Plan
from fa4lab.spec import AttentionSpec

OVERRIDES = ("m_block", "n_block", "q_stage", "kv_stage")


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
