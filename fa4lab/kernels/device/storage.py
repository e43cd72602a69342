"""The kernels' shared-memory struct and barrier pipelines, built from the plan (host-side code).

Shared by the sm90 and sm100 kernels. `storage_struct` declares a CuTe DSL struct with one
field per region of `plan.smem`, in the plan's order and at the plan's alignments, so the
offsets `fa4lab plan` prints are the binary's (the audit reads them back from the PTX):

* a buffer region (Q, K/V, O staging, the statistics mailbox) is a MemRange of the element
  type and count the kernel's layout needs; its bytes must equal the plan's, or the kernel
  refuses to build;
* a region that aliases another (`alias_of`, e.g. sm90's O staging in Q's bytes) adds no field:
  the kernel views the aliased region's field;
* the `barriers` region is one Int64 array per mbarrier of the protocol table, in the table's
  order, each as long as its stages; `tmem_ptr` is one Int32.

`pipeline_barriers` checks that each full barrier of a DSL pipeline is followed by its empty
barrier (a DSL pipeline keeps its empty barriers right after its full ones) and returns the
stages, arrival counts and transaction bytes the pipeline is created with.

The sm100 kernel's two helpers over them: `stages_at` gives one region's layout another's stage
stride (Note [sm100 head_dim_v < head_dim] in fa4lab.kernels.fwd_sm100), `phase_state` names a
pipeline position by its stage and phase.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, Int64


def storage_struct(plan, elems: dict):
    """A `@cute.struct` class in plan.smem's order: `elems[name] = (dtype, count)` per buffer."""
    fields = {}
    for r in plan.smem.regions:
        if r.alias_of is not None:
            continue
        if r.name == "barriers":
            for b in plan.barriers.barriers:
                if b.kind == "mbarrier":
                    fields[b.name] = cute.struct.MemRange[Int64, b.stages]
        elif r.name == "tmem_ptr":
            fields[r.name] = Int32
        else:
            dtype, n = elems[r.name]
            if dtype.width * n // 8 != r.bytes:
                raise ValueError(f"SMEM region {r.name}: the layout has {dtype.width * n // 8} "
                                 f"bytes, the plan {r.bytes}")
            field = cute.struct.MemRange[dtype, n]
            fields[r.name] = cute.struct.Align[field, r.align] if r.align > 16 else field
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


@dataclass(frozen=True)
class PipelineBarriers:
    full: str
    empty: str
    stages: int
    producers: int     # arrivals that complete a full phase
    consumers: int     # arrivals that complete an empty phase
    tx_bytes: int      # bytes a full phase expects (TMA), 0 otherwise


def pipeline_barriers(plan, full: str, empty: str) -> PipelineBarriers:
    """The table's numbers for the DSL pipeline over (full, empty)."""
    bars = plan.barriers.barriers
    names = [b.name for b in bars]
    if names.index(empty) != names.index(full) + 1:
        raise ValueError(f"the protocol table must list {empty} right after {full}: a DSL "
                         f"pipeline keeps its empty barriers after its full ones")
    f, e = plan.barriers.barrier(full), plan.barriers.barrier(empty)
    if f.stages != e.stages:
        raise ValueError(f"{full} has {f.stages} stages but {empty} {e.stages}")
    return PipelineBarriers(full, empty, f.stages, f.arrive_count, e.arrive_count,
                            f.tx_bytes or 0)


def stages_at(layout, like):
    """`layout` (a swizzled SMEM layout whose last mode is the stage) with `like`'s stage
    stride: V in the K-sized ring buffers, O staged in Q's tiles."""
    def flat(x):   # a stage mode may be nested, e.g. (1, 2):(0, s)
        return max(flat(y) for y in x) if isinstance(x, tuple) else x

    shape, stride = layout.outer.shape, layout.outer.stride
    return cute.make_composed_layout(layout.inner, 0, cute.make_layout(
        (*shape[:-1], cute.size(shape[-1])), stride=(*stride[:-1], flat(like.outer.stride[-1]))))


def phase_state(num_stages: int, index, phase) -> pipeline.PipelineState:
    """A pipeline position addressed by (stage index, phase parity) instead of a running count.

    The per-Q-tile pipelines (s, o, stats, epi) are indexed by the Q tile, not round robin.
    """
    return pipeline.PipelineState(num_stages, Int32(0), Int32(index), Int32(phase))
