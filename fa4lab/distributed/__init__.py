"""Context parallelism: attention over a sequence split across GPUs (ring attention).

    from fa4lab.distributed import ring_attention, shard, unshard, simulate_ring

`ring_attention` (fa4lab.distributed.ring) runs inside a torch.distributed process group;
`simulate_ring` runs the same algorithm in one process; `shard` / `unshard` and the ring's
step schedule live in fa4lab.distributed.schedule, the timeline and scaling model of notebook
09 in fa4lab.distributed.model, the multi-process launcher and benchmark
(`python -m fa4lab.distributed bench`) in fa4lab.distributed.launch and .bench.
"""

from fa4lab.distributed.ring import ring_attention, simulate_ring
from fa4lab.distributed.schedule import (
    LAYOUTS,
    RingStep,
    check_divisible,
    ring_schedule,
    ring_step,
    shard,
    shard_chunks,
    unshard,
    work_per_rank,
)

__all__ = ["LAYOUTS", "RingStep", "check_divisible", "ring_attention", "ring_schedule",
           "ring_step", "shard", "shard_chunks", "simulate_ring", "unshard", "work_per_rank"]
