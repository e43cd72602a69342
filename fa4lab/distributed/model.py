"""A model of the ring's time: what N ranks would take, NOT a measurement.

    cost = h200_cost("nvlink_h200")                          # ASSUMED rates, with sources
    tl = ring_timeline(RingProblem(seqlen=131072), world=8, cost=cost)
    tl.total_s, tl.efficiency                                 # vs one GPU doing it all

Every step of `ring_schedule` is one kernel call, costing its FLOPs (`AttentionSpec.flops`, the
benchmarks' count) divided by an ASSUMED per-GPU attention rate (the H200's dense bf16 peak
from `fa4lab.hardware` times an ASSUMED kernel efficiency); every hand-over of a K/V shard costs
its bytes divided by an ASSUMED link bandwidth (`fa4lab.hardware.INTERCONNECT`, published
peaks). The events follow `ring_attention`'s order (Note [ring timeline]). What it leaves out:
kernel launch and NCCL latency, a smaller block's lower kernel efficiency, the merge's memory
traffic, contention between the transfer and the kernel for HBM. Use it for shapes and trends;
`python -m fa4lab.distributed bench` measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fa4lab.distributed.schedule import check_divisible, ring_schedule
from fa4lab.hardware import H200, INTERCONNECT
from fa4lab.spec import AttentionSpec

# ASSUMED: the share of the dense peak a forward attention kernel sustains on Hopper at long
# sequence lengths. FlashAttention-3 (Shah et al. 2024) reports up to ~740 TFLOP/s bf16/fp16
# forward on an H100 SXM, about 75% of its 989 TFLOP/s.
ASSUMED_KERNEL_EFFICIENCY = 0.75
ASSUMED_KERNEL_EFFICIENCY_SOURCE = ("FlashAttention-3 paper (Shah et al. 2024): up to ~740 "
                                    "TFLOP/s forward on H100 SXM, ~75% of peak")


@dataclass(frozen=True)
class RingCost:
    """The two ASSUMED rates of the model and where they come from."""

    flops_per_s: float
    link_bytes_per_s: float
    sources: tuple[str, ...] = ()

    def describe(self) -> str:
        return (f"ASSUMED: {self.flops_per_s / 1e12:.0f} TFLOP/s per GPU, link "
                f"{self.link_bytes_per_s / 1e9:.0f} GB/s per direction")


def h200_cost(link: str = "nvlink_h200", *,
              kernel_efficiency: float = ASSUMED_KERNEL_EFFICIENCY) -> RingCost:
    """H200 ranks joined by `link` (a key of fa4lab.hardware.INTERCONNECT)."""
    if link not in INTERCONNECT:
        raise ValueError(f"link must be one of {sorted(INTERCONNECT)}, got {link!r}")
    return RingCost(
        flops_per_s=H200.peak_mma_tflops * 1e12 * kernel_efficiency,
        link_bytes_per_s=INTERCONNECT[link]["bytes_per_s"],
        sources=(H200.sources[0], f"kernel efficiency {kernel_efficiency:g}: "
                 + ASSUMED_KERNEL_EFFICIENCY_SOURCE, INTERCONNECT[link]["source"]))


@dataclass(frozen=True)
class RingProblem:
    """One attention layer's shape (the whole sequence) and how it is sharded."""

    seqlen: int
    heads_q: int = 32
    heads_kv: int = 8
    head_dim: int = 128
    batch: int = 1
    causal: bool = True
    layout: str = "zigzag"
    dtype: str = "bf16"

    def spec(self, seqlen_q: int, seqlen_k: int, causal: bool) -> AttentionSpec:
        return AttentionSpec(self.batch, seqlen_q, seqlen_k, self.heads_q, self.heads_kv,
                             self.head_dim, dtype=self.dtype, causal=causal)

    def shard_bytes(self, world: int) -> int:
        """Bytes of one rank's K and V shards: what travels at each step."""
        s = self.seqlen // world
        spec = self.spec(s, s, False)
        return self.batch * s * self.heads_kv * (spec.head_dim + spec.head_dim_v) \
            * spec.element_bytes


@dataclass
class Timeline:
    """Modelled events, in seconds: compute[r][s] and transfer[r][s] = (start, end) of rank r's
    kernel at step s and of its send to rank r + 1 after step s (None at the last step)."""

    world: int
    compute: list[list[tuple[float, float]]]
    transfer: list[list[tuple[float, float] | None]]
    kinds: list[list[str]]
    single_s: float                      # one GPU, the whole sequence, same rate
    cost: RingCost
    problem: RingProblem
    notes: dict = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return max(max(end for _, end in row) for row in self.compute)

    @property
    def efficiency(self) -> float:
        """single_s / (world * total_s): 1 when N GPUs are N times as fast as one."""
        return self.single_s / (self.world * self.total_s)


# Note [ring timeline]
# `ring_attention` at step s on rank r: issue the send of the block it holds to r + 1 and the
# receive from r - 1, run the kernel, then wait for both transfers. A transfer moves once both
# ends have posted it (NCCL's point-to-point rendezvous), so the one from r to r + 1 at step s
# runs from max(start(r, s), start(r + 1, s)) for bytes / bandwidth, and step s + 1 of rank r
# starts when its kernel, its send and its receive are all done. Without a causal mask every
# rank's steps are equal and a transfer hides behind the kernel while it is shorter; with
# causal and contiguous shards the ranks that skip wait for the ones that work.

def ring_timeline(problem: RingProblem, world: int, cost: RingCost) -> Timeline:
    """Model one forward over `world` ranks (Note [ring timeline])."""
    chunk = check_divisible(problem.seqlen, world, problem.layout)
    schedule = ring_schedule(world, causal=problem.causal, layout=problem.layout)
    move = problem.shard_bytes(world) / cost.link_bytes_per_s if world > 1 else 0.0

    def kernel_s(st) -> float:
        if st.q_part is None:
            return 0.0
        sq = (st.q_part[1] - st.q_part[0]) * chunk
        sk = (st.kv_part[1] - st.kv_part[0]) * chunk
        return problem.spec(sq, sk, st.causal).flops() / cost.flops_per_s

    start = [0.0] * world
    compute = [[] for _ in range(world)]
    transfer = [[] for _ in range(world)]
    for s in range(world):
        sends = [None] * world
        if s < world - 1:
            sends = [(t0 := max(start[r], start[(r + 1) % world]), t0 + move)
                     for r in range(world)]
        for r in range(world):
            work = kernel_s(schedule[r][s])
            compute[r].append((start[r], start[r] + work))
            transfer[r].append(sends[r])
        ends = []
        for r in range(world):
            done = [compute[r][s][1]]
            if sends[r] is not None:
                done += [sends[r][1], sends[(r - 1) % world][1]]
            ends.append(max(done))
        start = ends
    single = problem.spec(problem.seqlen, problem.seqlen, problem.causal).flops() \
        / cost.flops_per_s
    kinds = [[st.kind for st in row] for row in schedule]
    return Timeline(world, compute, transfer, kinds, single, cost, problem)


def scaling_efficiency(seqlens, worlds, *, problem: RingProblem | None = None,
                       link_of_world=None) -> dict[int, list[float]]:
    """{seqlen: [efficiency at each world]}; link_of_world(world) -> RingCost (default: NVLink
    up to 8 ranks, one node; InfiniBand NDR beyond, the slowest hop of a multi-node ring)."""
    problem = problem or RingProblem(seqlen=0)
    if link_of_world is None:
        def link_of_world(world):
            return h200_cost("nvlink_h200" if world <= 8 else "ib_ndr")
    out = {}
    for s in seqlens:
        p = RingProblem(**{**problem.__dict__, "seqlen": int(s)})
        out[int(s)] = [ring_timeline(p, w, link_of_world(w)).efficiency for w in worlds]
    return out
