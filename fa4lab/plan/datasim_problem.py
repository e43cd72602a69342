"""The problem the data-carrying simulator (`fa4lab.plan.datasim`) computes: the inputs, rounded
to the plan's 16-bit dtype, with the mask the softmax applies (`Problem`), and the CTAs' work
tiles in grid order with the K/V blocks each visits (`work_tiles`, `block_of_step`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fa4lab.tiling import n_block_range


@dataclass(frozen=True)
class WorkTile:
    """One CTA's work: Q tiles (m_block * q_stage + i) of query head `head` in `batch`."""

    batch: int
    head: int
    m_block: int
    n_blocks: int        # K/V blocks it visits (the kernel's n_block_max)


def work_tiles(plan) -> list[WorkTile]:
    """Every CTA of the problem, in grid order, with the K/V blocks it visits."""
    spec, t = plan.spec, plan.tiles
    out = []
    for b in range(spec.batch):
        for h in range(spec.heads_q):
            for m in range(math.ceil(spec.seqlen_q / t.cta_m)):
                _, n_max = n_block_range(m, seqlen_q=spec.seqlen_q, seqlen_k=spec.seqlen_k,
                                         m_block_size=t.cta_m, n_block_size=t.n_block,
                                         causal=spec.causal)
                out.append(WorkTile(b, h, m, n_max))
    return out


def block_of_step(tile: WorkTile, step: int) -> int:
    """The K/V block a work tile's step-th score MMA reads: the last block first (the kernel's
    order, so the masked blocks come first)."""
    return tile.n_blocks - 1 - step


@dataclass(frozen=True)
class Problem:
    q: np.ndarray              # (batch, seqlen_q, heads_q, head_dim) float32 of 16-bit values
    k: np.ndarray
    v: np.ndarray
    causal: bool
    scale_log2: float
    dtype: str
    kv_head: np.ndarray

    @staticmethod
    def rows(src: np.ndarray, lo: int, count: int) -> np.ndarray:
        """A TMA box of `count` rows from `lo` of a (seqlen, dim) view, zero past the end."""
        out = np.zeros((count, src.shape[-1]), np.float32)
        got = src[lo:lo + count]
        out[:len(got)] = got
        return out

    def visible(self, row0: int, rows: int, col0: int, cols: int) -> np.ndarray:
        """The softmax's mask: key in bounds and, with causal, j <= i + seqlen_k - seqlen_q."""
        sq, sk = self.q.shape[1], self.k.shape[1]
        i = np.arange(row0, row0 + rows)[:, None]
        j = np.arange(col0, col0 + cols)[None, :]
        ok = j < sk
        if self.causal:
            ok = ok & (j <= i + sk - sq)
        return ok
