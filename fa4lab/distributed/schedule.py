"""Context-parallel sharding and the ring's schedule: which rank holds which part of the
sequence, and what each rank computes at each step of the ring. Plain Python and numpy (torch
only to slice tensors); read by `ring_attention`, `simulate_ring`, the timeline model below and
notebook 09.

    shards = [shard(x, r, world, layout="zigzag") for r in range(world)]   # dim 1 = sequence
    x == unshard(shards, layout="zigzag")
    ring_step(rank, step, world, causal=True, layout="zigzag")            # one RingStep

The sequence is cut into `world * chunks_per_rank(layout)` equal chunks, so its length must be a
multiple of that (`check_divisible`); chunk i holds tokens [i * c, (i + 1) * c).

Note [zig-zag sharding]
Under a causal mask, query chunk i sees key chunks 0..i. Give rank r the contiguous chunk r
and its last step does a full block while rank 0 idles after its diagonal: the work per rank
grows with r. Zig-zag gives rank r the two chunks r and 2N-1-r (N ranks, 2N chunks; as in
ring-flash-attention's zigzag ring, Megatron-LM's context parallelism): an early chunk and its
mirror. At step s rank r holds the K/V of rank src = (r - s) mod N, and the mask between its
queries (chunks r, 2N-1-r) and those keys (chunks src, 2N-1-src) is one of three shapes,
each expressible with the kernel's own causal flag on contiguous slices:
  * src == r: the local causal square (both halves in order: plain causal, seqlen_q == seqlen_k);
  * src < r: every query sees key chunk src, none sees chunk 2N-1-src: all queries x first half
    of the keys, no mask;
  * src > r: query chunk r sees nothing, chunk 2N-1-r sees both key chunks: second half of the
    queries x all keys, no mask (the first half's rows merge nothing this step).
Every step then costs the same 2c^2 (query, key) pairs, the diagonal about the same, so the ranks
finish together. Without a causal mask every step is full and the layout does not matter.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fa4lab.spec import visible_key_counts

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def chunks_per_rank(layout: str) -> int:
    """2 for zig-zag (chunks r and 2N-1-r), 1 for contiguous."""
    return 2 if check_layout(layout) == "zigzag" else 1


def check_world(rank: int, world: int) -> None:
    if not (isinstance(world, int) and world >= 1):
        raise ValueError(f"world must be a positive int (the number of ranks), got {world!r}")
    if not (isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")


def check_divisible(seqlen: int, world: int, layout: str) -> int:
    """The chunk length c; ValueError when seqlen is not a multiple of world * chunks."""
    parts = world * chunks_per_rank(layout)
    if seqlen % parts:
        lo, hi = seqlen // parts * parts, -(-seqlen // parts) * parts
        raise ValueError(
            f"seqlen {seqlen} does not split over {world} ranks with layout {layout!r}: it must "
            f"be a multiple of {parts} (world * {chunks_per_rank(layout)} chunks per rank). Pad "
            f"or trim the sequence to {hi}" + (f" or {lo}" if lo else "") +
            (", or use layout='contiguous' (a multiple of world)" if layout == "zigzag" else ""))
    return seqlen // parts


def shard_chunks(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The chunk indices rank holds, in order. See Note [zig-zag sharding]."""
    check_world(rank, world)
    return (rank, 2 * world - 1 - rank) if chunks_per_rank(layout) == 2 else (rank,)


def shard(x, rank: int, world: int, layout: str = "zigzag", *, dim: int = 1):
    """Rank's part of x (torch tensor or numpy array) along dim (1: the sequence of a
    (batch, seqlen, heads, head_dim) tensor): its chunks, concatenated in sequence order."""
    c = check_divisible(x.shape[dim], world, layout)
    parts = [_take(x, i * c, (i + 1) * c, dim) for i in shard_chunks(rank, world, layout)]
    return parts[0] if len(parts) == 1 else _cat(parts, dim)


def unshard(shards, layout: str = "zigzag", *, dim: int = 1):
    """The full tensor from every rank's shard, in rank order: the inverse of `shard`."""
    world = len(shards)
    k = chunks_per_rank(layout)
    c = shards[0].shape[dim] // k
    if any(s.shape[dim] != k * c for s in shards):
        raise ValueError(f"unshard needs {world} shards of one length, a multiple of {k} along "
                         f"dim {dim}; got {[s.shape[dim] for s in shards]}")
    chunks = [None] * (world * k)
    for r, s in enumerate(shards):
        for j, i in enumerate(shard_chunks(r, world, layout)):
            chunks[i] = _take(s, j * c, (j + 1) * c, dim)
    return _cat(chunks, dim)


def _take(x, start, stop, dim):
    index = [slice(None)] * x.ndim
    index[dim] = slice(start, stop)
    return x[tuple(index)]


def _cat(parts, dim):
    if type(parts[0]).__module__.startswith("torch"):
        import torch

        return torch.cat(parts, dim=dim)
    return np.concatenate(parts, axis=dim)


@dataclass(frozen=True)
class RingStep:
    """What `rank` computes at `step`: its queries in q_part against the K/V block of rank src,
    keys in kv_part. Parts are (first, stop) in chunks of the local shard; None: nothing this
    step (a skip). causal: the kernel's causal flag on those slices (Note [zig-zag sharding])."""

    rank: int
    step: int
    src: int
    q_part: tuple[int, int] | None
    kv_part: tuple[int, int] | None
    causal: bool

    @property
    def kind(self) -> str:
        """'diagonal' (causal), 'full', or 'skip'."""
        return "skip" if self.q_part is None else "diagonal" if self.causal else "full"

    def visible_pairs(self, chunk: int) -> int:
        """(query, key) pairs this step computes, per (batch, head), for chunks of `chunk`."""
        if self.q_part is None:
            return 0
        sq = (self.q_part[1] - self.q_part[0]) * chunk
        sk = (self.kv_part[1] - self.kv_part[0]) * chunk
        return int(visible_key_counts(sq, sk, (None, 0 if self.causal else None)).sum())


def ring_step(rank: int, step: int, world: int, *, causal: bool, layout: str) -> RingStep:
    """The step `step` of `rank` in a ring of `world` (Note [zig-zag sharding])."""
    check_world(rank, world)
    if not 0 <= step < world:
        raise ValueError(f"step must be in [0, {world}), got {step}")
    src = (rank - step) % world
    k = chunks_per_rank(layout)
    whole = (0, k)
    if not causal:
        return RingStep(rank, step, src, whole, whole, False)
    if src == rank:
        return RingStep(rank, step, src, whole, whole, True)
    if k == 1:
        return RingStep(rank, step, src, whole if src < rank else None,
                        whole if src < rank else None, False)
    if src < rank:
        return RingStep(rank, step, src, whole, (0, 1), False)
    return RingStep(rank, step, src, (1, 2), whole, False)


def ring_schedule(world: int, *, causal: bool, layout: str) -> list[list[RingStep]]:
    """[rank][step] -> RingStep for every rank of the ring."""
    return [[ring_step(r, s, world, causal=causal, layout=layout) for s in range(world)]
            for r in range(world)]


def work_per_rank(seqlen: int, world: int, *, causal: bool, layout: str) -> np.ndarray:
    """(world, world) int64: visible (query, key) pairs of rank r at step s, per (batch, head).
    Rows sum to the single-device count for the whole sequence."""
    c = check_divisible(seqlen, world, layout)
    return np.array([[st.visible_pairs(c) for st in row]
                     for row in ring_schedule(world, causal=causal, layout=layout)],
                    dtype=np.int64)
