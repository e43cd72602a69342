"""Figures of tiles, masks, GQA and schedules (notebook 02), and the widgets that drive them.

Every function returns a matplotlib Figure built from the rules in `fa4lab.tiling` (nothing is
recomputed here). The `*_widget` factories wrap them in `LiveFigure`, so each renders statically
as well (a PNG of the default state). CPU only:

    from fa4lab.tiling import classify_tiles
    from fa4lab.viz.tiles import tile_grid_figure
    tile_grid_figure(classify_tiles(1000, 1000, 128, 128, causal=True))
"""

from __future__ import annotations

import html

import matplotlib
import numpy as np
from matplotlib.cm import ScalarMappable
from matplotlib.colors import ListedColormap, Normalize
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from fa4lab.gqa import gqa_group_size, unpack_gqa_row
from fa4lab.hardware import B200, H200
from fa4lab.scheduling import SCHEDULERS, CostModel, Schedule, Workload, schedule
from fa4lab.tiling import TileClasses, TileKind, classify_tiles
from fa4lab.viz._live import LiveFigure, View, subplots

__all__ = [
    "SCHEDULER_COLORS",
    "TILE_COLORS",
    "gqa_figure",
    "schedule_comparison_figure",
    "schedule_gantt_figure",
    "schedule_widget",
    "tile_grid_figure",
    "tiles_widget",
]

TILE_COLORS = {
    TileKind.SKIP: "#eeeeee",
    TileKind.FULL: "#4c9f70",
    TileKind.MASKED: "#e8a33d",
    TileKind.TAIL: "#6d8fd0",
}
SCHEDULER_COLORS = {"grid": "#8c8c8c", "grid_reversed": "#6d8fd0", "static": "#e8a33d",
                    "lpt": "#4c9f70"}
_TILE_MEANING = {
    TileKind.SKIP: "SKIP: nothing visible, never computed",
    TileKind.FULL: "FULL: all visible, no mask",
    TileKind.MASKED: "MASKED: a mask edge inside, element mask",
    TileKind.TAIL: "TAIL: past seqlen_q/seqlen_k, bounds only",
}


def tile_grid_figure(tiles: TileClasses, *, ax=None, title: str | None = None):
    """The (m_block, n_block) grid coloured by tile kind, with the causal diagonal, a sliding
    window's edges and the seqlen bounds drawn in element coordinates (rows are packed rows
    under pack-GQA)."""
    fig, ax = (ax.figure, ax) if ax is not None else subplots(figsize=(7.2, 6.4))
    n_m, n_n = tiles.shape
    bm, bn = tiles.m_block_size, tiles.n_block_size
    rows = tiles.seqlen_q * tiles.qhead_per_kvhead
    cmap = ListedColormap([TILE_COLORS[k] for k in TileKind])
    ax.imshow(tiles.kinds, cmap=cmap, vmin=-0.5, vmax=len(TileKind) - 0.5, aspect="auto",
              extent=(0, n_n * bn, n_m * bm, 0), interpolation="nearest")
    if n_m <= 64:
        for m in range(n_m + 1):
            ax.axhline(m * bm, color="white", lw=0.8)
    if n_n <= 64:
        for n in range(n_n + 1):
            ax.axvline(n * bn, color="white", lw=0.8)
    ax.axvline(tiles.seqlen_k, color="k", ls="--", lw=1)
    ax.axhline(rows, color="k", ls="--", lw=1)
    # the diagonal key of position p is p + seqlen_k - seqlen_q; row r is position
    # r // qhead_per_kvhead (Note [pack-GQA rows] in fa4lab.gqa)
    r = np.array([0.0, rows])
    diagonal = r / tiles.qhead_per_kvhead + tiles.seqlen_k - tiles.seqlen_q
    if tiles.causal:
        ax.plot(diagonal, r, color="#b00020", lw=1.6, label="causal diagonal")
    left, right = tiles.effective_window
    edges = [d for d in (None if left is None else -left,
                         None if right in (None, 0) else right) if d is not None]
    for offset in edges:
        ax.plot(diagonal + offset, r, color="#7b2cbf", lw=1.4, ls="-.")
    ax.set_xlim(0, n_n * bn)
    ax.set_ylim(n_m * bm, 0)
    ax.set_xlabel(f"key index (n_block_size = {bn})")
    ylab = "packed row (position x heads)" if tiles.qhead_per_kvhead > 1 else "query index"
    ax.set_ylabel(f"{ylab} (m_block_size = {bm})")
    counts = tiles.counts
    handles = [Patch(color=TILE_COLORS[k], label=f"{_TILE_MEANING[k]} ({counts[k.name]})")
               for k in TileKind]
    if tiles.causal:
        handles.append(Line2D([], [], color="#b00020", label="causal diagonal"))
    if edges:
        handles.append(Line2D([], [], color="#7b2cbf", ls="-.", label="window edges"))
    handles.append(Line2D([], [], color="k", ls="--", label="seqlen bounds"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2,
              fontsize=8, frameon=False)
    window = "" if (left, right) in ((None, None), (None, 0)) else (
        f", window_size=({left}, {right})")
    ax.set_title(title or (f"seqlen_q={tiles.seqlen_q}, seqlen_k={tiles.seqlen_k}, "
                           f"causal={tiles.causal}{window}: {tiles.skipped_fraction:.0%} of "
                           f"tiles skipped"), fontsize=10)
    fig.tight_layout()
    return fig


def gqa_figure(heads_q: int, heads_kv: int, *, seqlen_q: int = 4, max_rows: int = 16):
    """Left: which KV head each query head reads. Right: the packed M rows of KV head 0 under
    pack-GQA, labelled (query head, position)."""
    group = gqa_group_size(heads_q, heads_kv)
    fig, (ax0, ax1) = subplots(1, 2, figsize=(9.0, 4.2),
                                   gridspec_kw={"width_ratios": [1.3, 1.0]})
    colors = matplotlib.colormaps["tab10"]
    yq = np.linspace(1, 0, heads_q) if heads_q > 1 else np.array([0.5])
    yk = np.linspace(1, 0, heads_kv) if heads_kv > 1 else np.array([0.5])
    for h in range(heads_q):
        g = h // group
        ax0.plot([0, 1], [yq[h], yk[g]], color=colors(g % 10), lw=1.2)
    ax0.scatter(np.zeros(heads_q), yq, s=60, c=[colors((h // group) % 10) for h in
                                                 range(heads_q)], zorder=3)
    ax0.scatter(np.ones(heads_kv), yk, s=140, marker="s",
                c=[colors(g % 10) for g in range(heads_kv)], zorder=3)
    if heads_q <= 32:
        for h in range(heads_q):
            ax0.annotate(f"q{h}", (0, yq[h]), xytext=(-22, -3), textcoords="offset points",
                         fontsize=8)
    if heads_kv <= 32:
        for g in range(heads_kv):
            ax0.annotate(f"kv{g}", (1, yk[g]), xytext=(8, -3), textcoords="offset points",
                         fontsize=8)
    ax0.set_xlim(-0.3, 1.3)
    ax0.axis("off")
    ax0.set_title(f"{heads_q} query heads -> {heads_kv} KV heads: kv = q // {group}",
                  fontsize=10)
    rows = min(seqlen_q * group, max_rows)
    for r in range(rows):
        q_head, pos = unpack_gqa_row(0, r, heads_q=heads_q, heads_kv=heads_kv,
                                     seqlen_q=seqlen_q)
        shade = 0.35 + 0.65 * (q_head + 1) / group
        ax1.add_patch(Rectangle((0, r), 1, 1, color=colors(0), alpha=shade))
        ax1.text(0.5, r + 0.5, f"row {r}: q{q_head}, pos {pos}", ha="center", va="center",
                 fontsize=8)
    ax1.set_xlim(0, 1)
    ax1.set_ylim(rows, 0)
    ax1.set_xticks([])
    ax1.set_ylabel("packed M row of kv0")
    more = f" (first {rows} of {seqlen_q * group})" if rows < seqlen_q * group else ""
    ax1.set_title(f"pack-GQA: row = pos x {group} + (q - kv x {group}){more}\n"
                  f"causal compares keys with pos = row // {group}", fontsize=9)
    fig.tight_layout()
    return fig


def schedule_gantt_figure(sched: Schedule, *, max_sms: int = 24, ax=None, color_by="m_block"):
    """Per-SM timeline of a schedule (the first `max_sms` SMs), each tile a bar coloured by its
    m_block (or head); the makespan and the lower bound drawn as vertical lines."""
    fig, ax = (ax.figure, ax) if ax is not None else subplots(figsize=(8.0, 4.6))
    # the first max_sms - 1 SMs, plus the one that finishes last (it sets the makespan)
    finish = np.zeros(sched.num_sms)
    np.maximum.at(finish, sched.sm, sched.end)
    rows = list(range(min(max_sms, sched.num_sms)))
    last = int(finish.argmax())
    if last not in rows:
        rows[-1] = last
    position = {s: i for i, s in enumerate(rows)}
    col = {"m_block": 2, "head": 1, "batch": 0}[color_by]
    values = sched.order[:, col]
    cmap = matplotlib.colormaps["viridis"]
    vmax = max(int(values.max()), 1) if values.size else 1
    keep = np.isin(sched.sm, rows)
    y = np.array([position[s] for s in sched.sm[keep]])
    ax.barh(y, (sched.end - sched.start)[keep], left=sched.start[keep],
            color=cmap(values[keep] / vmax), edgecolor="white", linewidth=0.3, height=0.85)
    ax.set_yticks(range(len(rows)), [str(s) for s in rows], fontsize=7)
    ax.axvline(sched.makespan, color="#b00020", lw=1.4,
               label=f"makespan {sched.makespan:.1f}")
    ax.axvline(sched.lower_bound, color="k", ls=":", lw=1.2,
               label=f"lower bound {sched.lower_bound:.1f}")
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_ylabel(f"SM ({len(rows)} of {sched.num_sms}; the last ends last)")
    ax.set_xlabel("time (units of one unmasked K/V block)")
    ax.set_title(f"{sched.name}: makespan {sched.makespan:.1f}, efficiency "
                 f"{sched.efficiency:.1%} (colour: {color_by})", fontsize=10)
    sm = ScalarMappable(cmap=cmap, norm=Normalize(0, vmax))
    fig.colorbar(sm, ax=ax, label=color_by, pad=0.01)
    ax.legend(loc="upper left", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    return fig


def schedule_comparison_figure(schedules: list[Schedule], *, ax=None):
    """Makespan of each schedule beside the common lower bound, with each SM's busy time."""
    fig, (ax0, ax1) = subplots(1, 2, figsize=(9.0, 3.6)) if ax is None else (ax.figure,
                                                                                  (ax, None))
    names = [s.name for s in schedules]
    spans = [s.makespan for s in schedules]
    bars = ax0.bar(names, spans, color=[SCHEDULER_COLORS.get(n, "#555555") for n in names])
    ax0.tick_params(axis="x", labelsize=8)
    for b, s in zip(bars, schedules):
        ax0.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{s.makespan:.0f}\n"
                 f"{s.efficiency:.0%}", ha="center", va="bottom", fontsize=8)
    lb = max(s.lower_bound for s in schedules) if schedules else 0.0
    ax0.axhline(lb, color="k", ls=":", lw=1.2, label=f"lower bound {lb:.0f}")
    ax0.set_ylabel("makespan (block units)")
    ax0.set_ylim(0, max(spans + [lb]) * 1.25 if spans else 1)
    ax0.legend(fontsize=8, loc="lower right")
    ax0.set_title("makespan (label: SM efficiency)", fontsize=10)
    if ax1 is not None:
        for s in schedules:
            ax1.plot(np.sort(s.busy)[::-1], label=s.name, lw=1.4,
                     color=SCHEDULER_COLORS.get(s.name, "#555555"))
        ax1.set_xlabel("SM (sorted by busy time)")
        ax1.set_ylabel("busy time")
        ax1.set_title("per-SM busy time", fontsize=10)
        ax1.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------- widgets


def _tiles_view(seqlen_q, seqlen_k, m_block_size, n_block_size, causal, heads_q, heads_kv,
                pack_gqa):
    group = gqa_group_size(heads_q, heads_kv) if pack_gqa else 1
    tiles = classify_tiles(seqlen_q, seqlen_k, m_block_size, n_block_size, causal,
                           qhead_per_kvhead=group)
    counts = ", ".join(f"{k}: {v}" for k, v in tiles.counts.items())
    text = (f"{html.escape(counts)} &nbsp;|&nbsp; the kernel skips "
            f"{tiles.skipped_fraction:.1%} of the tiles' MMA FLOPs; the mask hides "
            f"{1 - tiles.visible_element_fraction:.1%} of the scores (the ideal saving)")
    if group > 1:
        text += f" &nbsp;|&nbsp; pack-GQA: {group} query heads per tile row group"
    return View(tile_grid_figure(tiles), text)


def tiles_widget(*, seqlen_q=1000, seqlen_k=1000, m_block_size=128, n_block_size=128,
                 causal=True, heads_q=8, heads_kv=2, pack_gqa=False) -> LiveFigure:
    """Sliders for the tile grid: sizes, causal, heads and pack-GQA."""
    import ipywidgets as w

    style = {"description_width": "initial"}
    controls = {
        "seqlen_q": w.IntSlider(seqlen_q, min=1, max=4096, description="seqlen_q", style=style),
        "seqlen_k": w.IntSlider(seqlen_k, min=1, max=4096, description="seqlen_k", style=style),
        "m_block_size": w.Dropdown(options=[16, 32, 64, 128, 256], value=m_block_size,
                                   description="m_block", style=style),
        "n_block_size": w.Dropdown(options=[16, 32, 64, 128, 176, 256], value=n_block_size,
                                   description="n_block", style=style),
        "causal": w.Checkbox(causal, description="causal"),
        "heads_q": w.IntSlider(heads_q, min=1, max=64, description="heads_q", style=style),
        "heads_kv": w.IntSlider(heads_kv, min=1, max=64, description="heads_kv", style=style),
        "pack_gqa": w.Checkbox(pack_gqa, description="pack-GQA"),
    }
    return LiveFigure(controls, _tiles_view, title="Tiles and masks")


def _schedule_view(scheduler, batch, heads, seqlen, m_block_size, causal, num_sms,
                   masked_block_cost, max_sms):
    work = Workload(batch=batch, heads=heads, seqlen_q=seqlen, seqlen_k=seqlen,
                    m_block_size=m_block_size, n_block_size=128, causal=causal)
    cost = CostModel(masked_block_cost=masked_block_cost)
    all_scheds = {name: schedule(name, work, num_sms=num_sms, cost=cost) for name in SCHEDULERS}
    fig, (ax0, ax1) = subplots(1, 2, figsize=(11.0, 4.4),
                                   gridspec_kw={"width_ratios": [2.2, 1.0]})
    schedule_gantt_figure(all_scheds[scheduler], max_sms=max_sms, ax=ax0)
    schedule_comparison_figure(list(all_scheds.values()), ax=ax1)
    fig.tight_layout()
    text = " &nbsp;|&nbsp; ".join(f"{n}: makespan {s.makespan:.1f}, efficiency "
                                  f"{s.efficiency:.1%}" for n, s in all_scheds.items())
    return View(fig, f"{work.num_tiles} tiles on {num_sms} SMs, L2 section "
                     f"{work.l2_swizzle} heads. {text}")


def schedule_widget(*, scheduler="lpt", batch=2, heads=16, seqlen=8192, m_block_size=256,
                    causal=True, num_sms=B200.num_sms, masked_block_cost=1.25,
                    max_sms=24) -> LiveFigure:
    """Pick a scheduler and a shape; see the per-SM Gantt chart and all makespans."""
    import ipywidgets as w

    style = {"description_width": "initial"}
    controls = {
        "scheduler": w.Dropdown(options=list(SCHEDULERS), value=scheduler,
                                description="scheduler", style=style),
        "batch": w.IntSlider(batch, min=1, max=16, description="batch", style=style),
        "heads": w.IntSlider(heads, min=1, max=64, description="heads", style=style),
        "seqlen": w.Dropdown(options=[512, 1024, 2048, 4096, 8192, 16384], value=seqlen,
                             description="seqlen", style=style),
        "m_block_size": w.Dropdown(options=[64, 128, 256], value=m_block_size,
                                   description="m_block (CTA rows)", style=style),
        "causal": w.Checkbox(causal, description="causal"),
        "num_sms": w.Dropdown(options=[(f"B200 ({B200.num_sms})", B200.num_sms),
                                       (f"H200 ({H200.num_sms})", H200.num_sms), ("16", 16)],
                              value=num_sms, description="SMs", style=style),
        "masked_block_cost": w.FloatSlider(masked_block_cost, min=1.0, max=3.0, step=0.05,
                                           description="masked block cost", style=style),
        "max_sms": w.IntSlider(max_sms, min=4, max=148, description="SMs shown", style=style),
    }
    return LiveFigure(controls, _schedule_view, title="Tile schedulers")
