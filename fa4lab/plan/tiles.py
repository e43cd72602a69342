"""Tiles and MMAs: the shapes every other part of the plan is built from.

`Tiles` says how a CTA cuts the problem: `q_stage` query tiles of `m_block` rows each (they
ping-pong between the softmax roles), swept over key/value blocks of `n_block` rows that stream
through `kv_stage` shared-memory buffers. `MmaPlan` describes the two matrix products of one
K/V block for one Q tile: the score MMA S = Q K^T and the value MMA O += P V.

`pack_gqa` (both archs) folds the query heads that share a KV head into M: a tile's rows are
packed rows (see Note [pack-GQA rows] in fa4lab.gqa), so K/V are loaded once for them.
"""

from __future__ import annotations

from dataclasses import dataclass

from fa4lab.errors import PlanError

# Note [head dims 96 and 192/128]
# What a head dim changes is the width of the SMEM tiles and of the MMAs, never the tile rows:
# * Swizzle. Both kernels take the widest swizzle whose atom row divides a tile row (the CuTe
#   DSL helpers: `sm90_utils.get_smem_layout_atom`, `sm100_utils.make_smem_layout_a/b/epi`).
#   16-bit rows of 64, 128, 192 and 256 elements are whole 128-byte atoms (SWIZZLE_128B); a
#   96-element row is 192 bytes, which 128-byte atoms do not divide, so 96 takes 64-byte atoms
#   (SWIZZLE_64B, 32 elements: a mode TMA, wgmma and tcgen05 descriptors all take). No padding:
#   the TMA box is the tile, 96 columns wide.
# * MMAs. head_dim is the score MMA's K (16 per instruction: 6 steps for 96, 12 for 192);
#   head_dim_v is the value MMA's N (wgmma N a multiple of 8, tcgen05 N of 16, up to 256).
# * Memory. K's width (head_dim) costs SMEM only; V's (head_dim_v) costs SMEM, the O
#   accumulator (sm90 registers, sm100 TMEM columns) and the O staging. (192, 128) therefore
#   fits TMEM as 128 does and pays its wider K in SMEM: see Note [sm90 tuning table] and
#   Note [sm100 tuning table] for the tiles each arch takes.


@dataclass(frozen=True)
class Tiles:
    m_block: int      # query rows per Q stage (one MMA M, one softmax role)
    n_block: int      # key/value rows per K/V block
    q_stage: int      # Q tiles in flight per CTA (2: the softmax ping-pong)
    kv_stage: int     # K/V shared-memory buffers (see SmemPlan)
    head_dim: int
    head_dim_v: int
    pack_gqa: bool = False  # M rows are packed (position, query head) rows of one KV head
    order: str = "grid"     # tile dispatch order, "grid" or "lpt" (fa4lab.scheduling.SCHEDULERS)
    kv_load: str = "tma"    # how K/V reach SMEM: "tma" or "cp.async" (fa4lab.limits.page_loader)

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
