"""Figures for lesson 09 (ring attention): work per rank, a modelled timeline, scaling.

    from fa4lab.viz.ring import plot_work_per_rank, plot_ring_timeline, plot_scaling
    plot_work_per_rank(seqlen=4096, world=4)
    plot_ring_timeline(ring_timeline(RingProblem(seqlen=32768), 4, h200_cost()))

Timelines and scaling curves come from `fa4lab.distributed.model`: modelled from ASSUMED rates,
and every title says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fa4lab.distributed.model import Timeline
from fa4lab.distributed.schedule import LAYOUTS, work_per_rank
from fa4lab.viz._live import subplots

__all__ = ["plot_work_per_rank", "plot_ring_timeline", "plot_scaling"]

_KIND_COLOR = {"diagonal": "C1", "full": "C0", "skip": "0.85"}


def plot_work_per_rank(seqlen: int, world: int, *, causal: bool = True,
                       layouts: Sequence[str] = LAYOUTS):
    """Visible (query, key) pairs each rank computes, stacked by ring step, one panel per layout,
    as a share of a perfectly even split (1 = its fair share)."""
    fig, axes = subplots(1, len(layouts), figsize=(4.2 * len(layouts), 3.4), sharey=True,
                         squeeze=False)
    for ax, layout in zip(axes[0], layouts):
        work = work_per_rank(seqlen, world, causal=causal, layout=layout).astype(float)
        fair = work.sum() / world
        bottom = np.zeros(world)
        for s in range(world):
            ax.bar(np.arange(world), work[:, s] / fair, bottom=bottom, color=f"C{s % 10}",
                   edgecolor="white", label=f"step {s}")
            bottom += work[:, s] / fair
        ax.axhline(1.0, color="k", ls="--", lw=1)
        ax.set_xticks(np.arange(world))
        ax.set_xlabel("rank")
        ax.set_title(f"{layout}: slowest rank {bottom.max():.2f}x its share", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("work / even share")
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{'causal' if causal else 'no mask'}, seqlen {seqlen}, {world} ranks",
                 fontsize=10)
    fig.tight_layout()
    return fig


def plot_ring_timeline(timeline: Timeline, *, title: str | None = None):
    """Per rank, its kernels (coloured by step kind) on one lane and its sends to rank + 1 on the
    lane below, in milliseconds."""
    n = timeline.world
    fig, ax = subplots(figsize=(8, 0.7 * n + 1.4))
    for r in range(n):
        y = 2 * (n - 1 - r)
        for s, ((a, b), kind) in enumerate(zip(timeline.compute[r], timeline.kinds[r])):
            if b > a:
                ax.broken_barh([(a * 1e3, (b - a) * 1e3)], (y + 1.0, 0.8),
                               facecolors=_KIND_COLOR[kind], edgecolor="white")
                ax.text((a + b) / 2 * 1e3, y + 1.4, str(s), ha="center", va="center", fontsize=7)
        for t in timeline.transfer[r]:
            if t is not None:
                ax.broken_barh([(t[0] * 1e3, (t[1] - t[0]) * 1e3)], (y + 0.15, 0.6),
                               facecolors="C2", alpha=0.7, edgecolor="white")
    ax.set_yticks([2 * (n - 1 - r) + 0.9 for r in range(n)])
    ax.set_yticklabels([f"rank {r}" for r in range(n)])
    for kind, color in _KIND_COLOR.items():
        if kind != "skip":
            ax.bar(0, 0, color=color, label=f"kernel: {kind} block")
    ax.bar(0, 0, color="C2", alpha=0.7, label="send K/V to rank + 1")
    ax.set_ylim(0, 2 * n + 1.2)                    # room above rank 0 for the legend
    ax.set_xlim(left=0)
    ax.set_xlabel("time (ms), MODELLED")
    p = timeline.problem
    ax.set_title(title or (
        f"{p.layout}, {'causal' if p.causal else 'no mask'}, seqlen {p.seqlen}, {n} ranks: "
        f"{timeline.total_s * 1e3:.2f} ms, efficiency {timeline.efficiency:.0%}\n"
        f"{timeline.cost.describe()}"), fontsize=9)
    ax.legend(fontsize=7, loc="upper right", ncol=3)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_scaling(efficiency: Mapping[int, Sequence[float]], worlds: Sequence[int], *,
                 title: str = "", node_size: int | None = 8):
    """Modelled scaling efficiency against the number of ranks, one line per seqlen
    (`fa4lab.distributed.model.scaling_efficiency`); a dotted line where a ring leaves one
    node."""
    fig, ax = subplots(figsize=(6.5, 3.6))
    for seqlen, eff in efficiency.items():
        label = f"{seqlen // 1024}k" if seqlen < 1 << 20 else f"{seqlen / (1 << 20):g}M"
        ax.plot(worlds, eff, "o-", label=f"seqlen {label}")
    if node_size is not None:
        ax.axvline(node_size + 0.5, color="k", ls=":", lw=1)
        ax.text(node_size + 0.7, 0.05, "beyond one node:\nInfiniBand", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(worlds))
    ax.set_xticklabels([str(w) for w in worlds])
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("ranks (GPUs)")
    ax.set_ylabel("efficiency: T(1) / (N T(N))")
    ax.set_title(title or "MODELLED scaling (ASSUMED rates)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
