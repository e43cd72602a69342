"""Figures of variable-length batches (notebook 02): the real tiles against the padded grid.

The tiles come from `fa4lab.varlen_tiles.varlen_tiles` (nothing is recomputed here). CPU only:

    from fa4lab.viz.varlen import varlen_tiles_figure
    varlen_tiles_figure([700, 90, 1, 300], [700, 90, 1, 300], heads=1, m_block_size=128,
                        n_block_size=128, causal=True)
"""

from __future__ import annotations

import matplotlib
import numpy as np
from matplotlib.colors import Normalize
from matplotlib.patches import Patch, Rectangle

from fa4lab.errors import InputError
from fa4lab.varlen_tiles import varlen_tiles
from fa4lab.viz._live import subplots

__all__ = ["PADDING_COLOR", "varlen_tiles_figure"]

PADDING_COLOR = "#d9d9d9"
_MAX_LABELLED = 400     # beyond this many boxes the rank labels no longer fit


def varlen_tiles_figure(seqlens_q, seqlens_k, *, heads: int, m_block_size: int,
                        n_block_size: int, head: int = 0, ax=None, title: str | None = None,
                        **tile_options):
    """One row per sequence, one box per m_block of the padded (batch, max_seqlen_q) grid, for
    query head `head`: a real tile is coloured by the key blocks it visits and labelled with
    its place in the LPT order of the whole launch (0 starts first, all heads counted); a
    padding tile (no query row) is grey and hatched. `tile_options` go to `varlen_tiles`
    (causal, window_size, qhead_per_kvhead, max_seqlen_q, cost)."""
    if not 0 <= head < heads:
        raise InputError(f"head={head} is not one of the {heads} heads: pick 0..{heads - 1}")
    tiles = varlen_tiles(seqlens_q, seqlens_k, heads=heads, m_block_size=m_block_size,
                         n_block_size=n_block_size, **tile_options)
    batch = len(seqlens_q)
    width = tiles.padded_tiles // (batch * heads) if batch else 0
    fig, ax = (ax.figure, ax) if ax is not None else subplots(
        figsize=(min(2.6 + 0.55 * max(width, 1), 13.0), 1.6 + 0.42 * max(batch, 1)))
    rank, blocks = {}, {}
    for i, ((b, h, m), n) in enumerate(zip(tiles.tiles.tolist(), tiles.key_blocks.tolist())):
        if h == head:
            rank[b, m], blocks[b, m] = i, n
    cmap = matplotlib.colormaps["viridis"]
    norm = Normalize(0, max(max(blocks.values(), default=1), 1))
    labelled = batch * width <= _MAX_LABELLED
    for b in range(batch):
        for m in range(width):
            if (b, m) in rank:
                color = cmap(0.25 + 0.75 * norm(blocks[(b, m)]))
                ax.add_patch(Rectangle((m, b), 1, 1, facecolor=color, edgecolor="white", lw=1))
                if labelled:
                    ax.text(m + 0.5, b + 0.5, str(rank[(b, m)]), ha="center", va="center",
                            fontsize=7, color="white" if norm(blocks[(b, m)]) < 0.6 else "k")
            else:
                ax.add_patch(Rectangle((m, b), 1, 1, facecolor=PADDING_COLOR, hatch="///",
                                       edgecolor="#9a9a9a", lw=0.5))
    ax.set_xlim(0, max(width, 1))
    ax.set_ylim(max(batch, 1), 0)
    ax.set_xticks(np.arange(width) + 0.5, [str(m) for m in range(width)], fontsize=7)
    ax.set_yticks(np.arange(batch) + 0.5,
                  [f"seq {b}: {int(n)} q" for b, n in enumerate(seqlens_q)], fontsize=7)
    ax.xaxis.tick_top()
    ax.xaxis.set_label_position("top")
    ax.set_xlabel(f"m_block (m_block_size = {m_block_size})", fontsize=9)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    handles = [Patch(facecolor=cmap(0.6), label="real tile (label: LPT rank; colour: key "
                                                 "blocks it visits)"),
               Patch(facecolor=PADDING_COLOR, hatch="///", edgecolor="#9a9a9a",
                     label="padding tile (no query row)")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2,
              fontsize=8, frameon=False)
    of_head = f" (head {head} of {heads})" if heads > 1 else ""
    ax.set_title(title or (f"{tiles.num_tiles} real tiles vs {tiles.padded_tiles} in the "
                           f"padded grid: {tiles.padding_tiles} padding tiles skipped"
                           f"{of_head}"), fontsize=10)
    fig.tight_layout()
    return fig
