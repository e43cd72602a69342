"""Shared memory: the Q, K/V and O staging buffers, the statistics mailbox and the barriers.

Regions are laid out in the order listed, each at its alignment (1024 bytes for swizzled
tiles), and the total is rounded up to the largest alignment, as a C struct (and the CuTe DSL's
`@cute.struct`) is: `total_bytes` is the size of the kernel's shared-storage struct declared in
the same order. A region with `alias_of` reuses another region's bytes and adds nothing: its
stage i lies in the target's stage i (the kernels give it the target's stage stride), so it
never overlaps another stage of the target.
"""

from __future__ import annotations

from dataclasses import dataclass

from fa4lab.errors import PlanError

MBARRIER_BYTES = 8


@dataclass(frozen=True)
class SmemRegion:
    name: str              # "q", "kv", "k", "v", "o", "stats", "barriers", "tmem_ptr"
    bytes_per_stage: int
    stages: int
    align: int = 1024
    alias_of: str | None = None   # reuses that region's bytes (e.g. O staging in Q on sm90)
    what: str = ""

    @property
    def bytes(self) -> int:
        return self.bytes_per_stage * self.stages


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True)
class SmemPlan:
    regions: tuple[SmemRegion, ...]
    total_bytes: int
    limit_bytes: int

    @staticmethod
    def layout(regions: tuple[SmemRegion, ...]) -> dict[str, int]:
        """Byte offset of each region in declaration order (aliases share their target's)."""
        offsets: dict[str, int] = {}
        end = 0
        for r in regions:
            if r.alias_of is not None:
                continue
            offsets[r.name] = _round_up(end, r.align)
            end = offsets[r.name] + r.bytes
        for r in regions:
            if r.alias_of is not None:
                offsets[r.name] = offsets[r.alias_of]
        # The struct's size is a multiple of its strictest member alignment.
        offsets["_end"] = _round_up(end, max((r.align for r in regions), default=1))
        return offsets

    @classmethod
    def build(cls, regions: tuple[SmemRegion, ...], limit_bytes: int) -> SmemPlan:
        total = cls.layout(regions)["_end"]
        for r in regions:
            if r.alias_of is not None:
                target = next(x for x in regions if x.name == r.alias_of)
                if r.bytes_per_stage > target.bytes_per_stage or r.stages > target.stages:
                    raise PlanError(f"SMEM region {r.name} ({r.stages}x{r.bytes_per_stage} B) "
                                    f"cannot alias {target.name} ({target.stages}x"
                                    f"{target.bytes_per_stage} B): each of its stages must fit "
                                    f"in a stage of {target.name}")
        if total > limit_bytes:
            parts = ", ".join(f"{r.name} {r.stages}x{r.bytes_per_stage} B" for r in regions
                              if r.alias_of is None)
            raise PlanError(
                f"shared memory: this plan needs {total} B ({parts}) but one CTA may use "
                f"{limit_bytes} B, {total - limit_bytes} B over; lower kv_stage or n_block")
        return cls(regions, total, limit_bytes)

    def offsets(self) -> dict[str, int]:
        return {k: v for k, v in self.layout(self.regions).items() if k != "_end"}

    def region(self, name: str) -> SmemRegion:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(f"no SMEM region {name!r}; have {[r.name for r in self.regions]}")
