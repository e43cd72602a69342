"""The memories of a CTA in the data-carrying simulator (`fa4lab.plan.datasim`): TMEM as
32-bit words, the SMEM buffers and the mailbox, over the global out and lse; memory no op has
written holds NaN (`POISON`). 16-bit values are stored as the kernel stores them
(`to_bits16`, `from_bits16`, `round16`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fa4lab.plan.datasim_problem import WorkTile

# NaN as fp32, and a NaN in each 16-bit half: what unwritten memory holds.
POISON = np.uint32(0xFFC0FFC0)


def to_bits16(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> uint16 bits of bf16 (round to nearest even) or fp16."""
    x = np.asarray(x, np.float32)
    if dtype == "fp16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).view(np.uint16)
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def from_bits16(b: np.ndarray, dtype: str) -> np.ndarray:
    b = np.asarray(b, np.uint16)
    if dtype == "fp16":
        return b.view(np.float16).astype(np.float32)
    return (b.astype(np.uint32) << 16).view(np.float32)


def round16(x: np.ndarray, dtype: str) -> np.ndarray:
    """x rounded to the 16-bit dtype, held as float32."""
    return from_bits16(to_bits16(x, dtype), dtype)


@dataclass
class Memory:
    tmem: np.ndarray                 # (lanes, columns) uint32
    smem: dict[str, np.ndarray]      # name -> (stages, rows, cols) float32
    stats: np.ndarray                # (2 * q_stage * m_block,) float32: the mailbox
    out: np.ndarray                  # (batch, seqlen_q, heads_q, head_dim_v) float32
    lse: np.ndarray                  # (batch, heads_q, seqlen_q) float32
    tmem_ptr: int | None = None      # SMEM word tcgen05.alloc writes the TMEM address into
    tags: dict = field(default_factory=dict)   # cell -> what it holds (for the report)


def fresh_memory(plan, out: np.ndarray, lse: np.ndarray) -> Memory:
    """A CTA's memories as it starts (NaN: not written yet), over the global out and lse."""
    t, tm = plan.tiles, plan.tmem
    nan = np.float32(np.nan)
    return Memory(
        tmem=np.full((tm.lanes, tm.capacity_cols), POISON, np.uint32),
        smem={"q": np.full((t.q_stage, t.m_block, t.head_dim), nan, np.float32),
              # K/V rows in one ring of max(head_dim, head_dim_v) columns
              "kv": np.full((t.kv_stage, t.n_block, max(t.head_dim, t.head_dim_v)), nan,
                            np.float32),
              "o": np.full((t.q_stage, t.m_block, t.head_dim_v), nan, np.float32)},
        stats=np.full(2 * t.q_stage * t.m_block, nan, np.float32), out=out, lse=lse)


def to_global(plan, dst, tile: WorkTile, stage: int, rows: np.ndarray, lse: bool) -> None:
    """Q tile `stage` of `tile` into global out (batch, seqlen_q, heads, dim) or lse (batch,
    heads, seqlen_q); rows past seqlen_q are dropped, as the TMA store clips them."""
    t, sq = plan.tiles, plan.spec.seqlen_q
    lo = (tile.m_block * t.q_stage + stage) * t.m_block
    hi = min(lo + t.m_block, sq)
    if hi <= lo:
        return
    if lse:
        dst[tile.batch, tile.head, lo:hi] = rows[:hi - lo]
    else:
        dst[tile.batch, lo:hi, tile.head] = rows[:hi - lo]
