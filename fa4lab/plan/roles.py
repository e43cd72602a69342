"""Warp roles: which warps do what, and the registers each role keeps (setmaxnreg).

`setmaxnreg` takes a multiple of 8 in [24, 256] and applies per warpgroup (4 consecutive warps
starting at a multiple of 4), so roles sharing a warpgroup share a register count. The register
file is 64K 32-bit registers per SM: sum over warps of 32 * registers must fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from fa4lab.errors import PlanError

WARP = 32


@dataclass(frozen=True)
class Role:
    name: str
    warps: tuple[int, ...]
    registers: int        # setmaxnreg value per thread
    does: str

    @property
    def threads(self) -> int:
        return WARP * len(self.warps)


def check_roles(roles: tuple[Role, ...], registers_per_sm: int) -> None:
    seen: dict[int, str] = {}
    for r in roles:
        if r.registers % 8 or not 24 <= r.registers <= 256:
            raise PlanError(f"role {r.name}: setmaxnreg {r.registers} must be a multiple of 8 "
                            f"in [24, 256]")
        for w in r.warps:
            if w in seen:
                raise PlanError(f"warp {w} is in both {seen[w]} and {r.name}")
            seen[w] = r.name
    n = len(seen)
    if sorted(seen) != list(range(n)) or n % 4:
        raise PlanError(f"warps {sorted(seen)} must be 0..N-1 with N a multiple of 4")
    for g in range(n // 4):
        regs = {next(r.registers for r in roles if w in r.warps) for w in range(4 * g, 4 * g + 4)}
        if len(regs) > 1:
            raise PlanError(f"warpgroup {g} (warps {4 * g}-{4 * g + 3}) mixes register counts "
                            f"{sorted(regs)}: setmaxnreg applies per warpgroup")
    used = sum(r.threads * r.registers for r in roles)
    if used > registers_per_sm:
        detail = " + ".join(f"{r.name} {r.threads}x{r.registers}" for r in roles)
        raise PlanError(f"registers: {detail} = {used} > {registers_per_sm} per SM; lower the "
                        f"softmax or consumer budget")


def register_usage(roles: tuple[Role, ...]) -> int:
    return sum(r.threads * r.registers for r in roles)
