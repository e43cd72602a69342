"""Tensor memory (TMEM, sm100 only): where S, P and O live, column by column.

TMEM is 128 lanes x 512 columns of 32-bit cells per SM; lane r holds row r of a 128-row tile,
so a region is a range of columns. `tcgen05.alloc` takes a power of two >= 32 columns.
See Note [P aliases S]: P (16-bit, two per column) is written into the upper half of the
columns of the S it was computed from, so S and P of one Q stage cost n_block columns, not 1.5x.
"""

from __future__ import annotations

from dataclasses import dataclass

from fa4lab.errors import PlanError

TMEM_MIN_ALLOC = 32

# Note [P aliases S]
# Softmax reads S_i (fp32, n_block columns) into registers, computes P_i = exp2(...) in 16 bits
# and stores it back into S_i's upper n_block/2 columns (two 16-bit values per 32-bit column).
# The value MMA reads P_i from TMEM as its A operand. S_i is overwritten by the next score MMA
# only after the value MMA that read P_i was issued, both by the same MMA thread. That reuse has
# no barrier of its own: it rests on the tensor core executing tcgen05.mma in issue order. The
# PTX ISA ("Pipelined tcgen05 Instructions", #tcgen05-memory-consistency-model-pipelined-
# instructions) guarantees mma -> mma order only for the same accumulator and shape, which
# this pair (P V into O, then Q K^T into S) is not; FA4 relies on the hardware's issue order
# here, and so does this plan. It is the one ordering in the protocol without a barrier. The
# barrier that makes the reuse safe otherwise is p_ready (softmax has finished reading S_i and
# writing P_i).


@dataclass(frozen=True)
class TmemRegion:
    name: str                  # "S", "P", "O"
    stage: int                 # the Q stage this region belongs to
    col_offset: int
    columns: int               # 32-bit columns
    dtype: str                 # "fp32" | "bf16" | "fp16"
    alias_of: str | None       # "S" for P (same stage), else None
    reuse_guard: str           # barrier whose completion makes overwriting this region safe

    @property
    def col_end(self) -> int:
        return self.col_offset + self.columns


def alloc_columns(total_cols: int) -> int:
    """tcgen05.alloc size: the smallest power of two >= max(32, total_cols)."""
    n = TMEM_MIN_ALLOC
    while n < total_cols:
        n *= 2
    return n


@dataclass(frozen=True)
class TmemPlan:
    regions: tuple[TmemRegion, ...]
    total_cols: int
    alloc_cols: int
    lanes: int = 128
    capacity_cols: int = 512

    def __post_init__(self):
        end = max((r.col_end for r in self.regions), default=0)
        if end != self.total_cols:
            raise PlanError(f"TMEM regions end at column {end} but total_cols={self.total_cols}")
        if self.total_cols > self.capacity_cols:
            raise PlanError(
                f"TMEM holds {self.capacity_cols} columns per SM; this plan needs "
                f"{self.total_cols}")
        if self.alloc_cols != alloc_columns(self.total_cols):
            raise PlanError(f"alloc_cols={self.alloc_cols} is not the tcgen05.alloc size for "
                            f"{self.total_cols} columns ({alloc_columns(self.total_cols)})")

    def region(self, name: str, stage: int) -> TmemRegion:
        for r in self.regions:
            if r.name == name and r.stage == stage:
                return r
        raise KeyError(f"no TMEM region {name}[{stage}]; have "
                       f"{[f'{r.name}[{r.stage}]' for r in self.regions]}")

    def s_offset(self, stage: int) -> int:
        return self.region("S", stage).col_offset

    def p_offset(self, stage: int) -> int:
        return self.region("P", stage).col_offset

    def o_offset(self, stage: int) -> int:
        return self.region("O", stage).col_offset

    def overlaps(self) -> list[tuple[TmemRegion, TmemRegion]]:
        """Pairs of regions sharing columns that are NOT a declared alias (should be empty)."""
        bad = []
        for i, a in enumerate(self.regions):
            for b in self.regions[i + 1:]:
                if a.col_offset < b.col_end and b.col_offset < a.col_end:
                    declared = (a.stage == b.stage and (a.alias_of == b.name
                                                        or b.alias_of == a.name))
                    if not declared:
                        bad.append((a, b))
        return bad
