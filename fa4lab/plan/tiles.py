"""Tiles and MMAs: the shapes every other part of the plan is built from.

`Tiles` says how a CTA cuts the problem: `q_stage` query tiles of `m_block` rows each (they
ping-pong between the softmax roles), swept over key/value blocks of `n_block` rows that stream
through `kv_stage` shared-memory buffers. `MmaPlan` describes the two matrix products of one
K/V block for one Q tile: the score MMA S = Q K^T and the value MMA O += P V.

`pack_gqa` (both archs) folds the query heads that share a KV head into M: a tile's rows are
packed rows (see Note [pack-GQA rows] in `fa4lab.tiling`), so K/V are loaded once for them.
"""

from __future__ import annotations

from dataclasses import dataclass

from fa4lab.errors import PlanError


@dataclass(frozen=True)
class Tiles:
    m_block: int      # query rows per Q stage (one MMA M, one softmax role)
    n_block: int      # key/value rows per K/V block
    q_stage: int      # Q tiles in flight per CTA (2: the softmax ping-pong)
    kv_stage: int     # K/V shared-memory buffers (see SmemPlan)
    head_dim: int
    head_dim_v: int
    pack_gqa: bool = False  # M rows are packed (position, query head) rows of one KV head
    order: str = "grid"     # tile dispatch order, "grid" or "lpt" (fa4lab.tiling.SCHEDULERS)

    @property
    def cta_m(self) -> int:
        """Query rows one CTA owns: m_block * q_stage."""
        return self.m_block * self.q_stage


@dataclass(frozen=True)
class MmaPlan:
    """One tensor-core product per Q tile per K/V block: (m x k) @ (k x n) -> (m x n)."""

    name: str          # "score" (S = Q K^T) or "value" (O += P V)
    m: int
    n: int
    k: int
    a_dtype: str       # "bf16" | "fp16"
    b_dtype: str
    acc_dtype: str     # "fp32"
    a_source: str      # "smem" | "tmem" | "rmem"
    b_source: str
    out: str           # "tmem" | "rmem"
    instruction: str   # the PTX family and atom shape, e.g. "tcgen05.mma kind::f16 M128 N128 K16"

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


def check_pack_gqa(spec, m_block: int, pack_gqa: bool, arch: str) -> bool:
    """The pack_gqa the plan records (False when there is one query head per KV head).

    Both kernels load a packed Q tile as one (heads, positions) TMA box of m_block rows, so the
    head ratio g must divide m_block."""
    g = spec.qhead_per_kvhead
    if not pack_gqa or g == 1:
        return False
    if m_block % g:
        divisors = ", ".join(str(d) for d in range(1, m_block + 1) if m_block % d == 0)
        raise PlanError(f"pack_gqa=True with qhead_per_kvhead={g} (heads_q={spec.heads_q}, "
                        f"heads_kv={spec.heads_kv}): the {arch} kernel loads a {m_block}-row "
                        f"Q tile as a (heads, positions) TMA box, so qhead_per_kvhead must "
                        f"divide m_block={m_block} ({divisors}); use pack_gqa=False for this "
                        f"head ratio (each query head reads its KV head)")
    return True


def pack_gqa_notes(spec, tiles: Tiles) -> tuple[str, ...]:
    """The plan note a packed plan carries (none otherwise)."""
    if not tiles.pack_gqa:
        return ()
    g = spec.qhead_per_kvhead
    return (f"pack-GQA: each CTA serves the {g} query heads of one KV head "
            f"(M rows = position * {g} + head in group).",)
