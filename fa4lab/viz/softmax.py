"""Figures for lesson 01 (the online-softmax state machine) and its block stepper widget.

Each function returns a matplotlib Figure; `BlockStepper` is a `LiveFigure` with one slider,
`block`, that steps through the K/V blocks of an `online_attention(..., trace=True)` run.
Blocks are counted as a reader counts them, from 1: "block 3 of 7" is the third block
processed, in the slider, the stepper's table and the x axis of `plot_row_max` alike (the
trace's lists index it as 2).

    from fa4lab.viz.softmax import BlockStepper, plot_row_max
    BlockStepper(q, k, v, block_n=32)          # last expression of a notebook cell
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fa4lab.limits import EXP2_POLY3_MAX_REL_ERROR, RESCALE_THRESHOLD
from fa4lab.online_softmax import (
    MISTAKES,
    OnlineTrace,
    exp2_poly3,
    fit_exp2_poly3,
    online_attention,
)
from fa4lab.viz._live import LiveFigure, View, subplots

__all__ = ["plot_row_max", "plot_variant_errors", "plot_exp2_poly3_error", "BlockStepper"]

# Errors of exactly 0 still need a bar on a log axis.
_LOG_FLOOR = 1e-18


def plot_row_max(trace: OnlineTrace, *, rows: Sequence[int] = (0, 1, 2), batch: int = 0,
                 head: int = 0, title: str | None = None):
    """The basis row_max (solid) against the true running max (dashed) after each block, in
    log2 units, with a marker where the state was rescaled."""
    fig, ax = subplots(figsize=(7, 3.4))
    steps = np.arange(1, len(trace.steps) + 1)      # blocks counted from 1, as the stepper
    events = 0
    for c, r in enumerate(rows):
        color = f"C{c}"
        basis = np.array([s.row_max_after[batch, head, r] for s in trace.steps]) * trace.scale_log2
        seen = np.maximum.accumulate(
            np.array([s.block_max[batch, head, r] for s in trace.steps])) * trace.scale_log2
        hit = np.array([bool(s.rescaled[batch, head, r]) for s in trace.steps])
        ax.step(steps, basis, where="post", color=color, label=f"row {r}: basis (row_max)")
        ax.step(steps, seen, where="post", color=color, ls="--", alpha=0.6,
                label=f"row {r}: true running max")
        ax.plot(steps[hit], basis[hit], "o", color=color, ms=6, mfc="none")
        events += int(hit.sum())
    if events:      # a legend entry for markers only where some are drawn
        ax.plot([], [], "ko", mfc="none", label="rescale event")
    ax.set_xlabel("K/V blocks processed (block k of n, in processing order)")
    ax.set_ylabel("max score x scale_log2 (log2 units)")
    thr = trace.rescale_threshold
    ax.set_title(title or (f"threshold {thr:g}: {trace.rescales} rescales, "
                           f"{trace.rescales_saved} saved of {trace.max_rises} rises (all rows)"),
                 fontsize=10)
    ax.legend(fontsize=7, ncol=2, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_variant_errors(errors: Mapping[str, Mapping[str, float]], *, tolerance: float = 1e-10):
    """Grouped bars (log scale) of max |out - reference| per variant, one group per input set.

    `errors`: {input name: {variant: error}} as returned by `online_softmax.variant_errors`.
    Mistakes are drawn in red; the tests' tolerance is the dashed line.
    """
    inputs = list(errors)
    variants = list(dict.fromkeys(v for e in errors.values() for v in e))
    fig, ax = subplots(figsize=(8, 3.6))
    width = 0.8 / max(1, len(inputs))
    x = np.arange(len(variants))
    hatches = ["", "//", "..", "xx"]
    for i, name in enumerate(inputs):
        vals = [max(errors[name].get(v, np.nan), _LOG_FLOOR) for v in variants]
        colors = ["#c0392b" if v in MISTAKES else "#2e86c1" for v in variants]
        ax.bar(x + (i - (len(inputs) - 1) / 2) * width, vals, width, color=colors,
               hatch=hatches[i % len(hatches)], edgecolor="white", label=name)
    ax.axhline(tolerance, color="k", ls="--", lw=1, label=f"test tolerance {tolerance:g}")
    ax.set_yscale("log")
    ax.set_ylim(_LOG_FLOOR / 2, 10)
    ax.set_xticks(x)
    ax.set_xticklabels(variants, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("max |out - reference|")
    ax.set_title("blue: correct state machines; red: the mistakes", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_exp2_poly3_error(samples: int = 4096):
    """Relative error of `exp2_poly3` against exact 2**x over three periods of the fraction."""
    x = np.linspace(-2.0, 1.0, samples, endpoint=False).astype(np.float32)
    exact = np.exp2(x.astype(np.float64))
    rel = exp2_poly3(x).astype(np.float64) / exact - 1.0
    free = exp2_poly3(x, fit_exp2_poly3()).astype(np.float64) / exact - 1.0
    fig, ax = subplots(figsize=(7, 3.2))
    ax.plot(x, rel, lw=1, label="exp2_poly3 (float32, 3 FMAs + exponent add; p(0) = 1, "
                                "the sm100 kernel's coefficients)")
    ax.plot(x, free, lw=1, alpha=0.7, label="the free minimax fit (c0 not pinned)")
    for y in (EXP2_POLY3_MAX_REL_ERROR, -EXP2_POLY3_MAX_REL_ERROR):
        ax.axhline(y, color="C3", ls="--", lw=1)
    ax.text(0.01, 0.03, f"for scale: rounding P to bf16 costs up to 2^-8 = {2.0**-8:.1e}, "
            f"{2.0**-8 / EXP2_POLY3_MAX_REL_ERROR:.0f}x more", transform=ax.transAxes,
            fontsize=7, color="gray")
    ax.set_xlabel("x")
    ax.set_ylabel("exp2_poly3(x) / 2**x - 1")
    ax.set_title(f"equi-oscillating error, max {EXP2_POLY3_MAX_REL_ERROR:.1e} (dashed)",
                 fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


class BlockStepper(LiveFigure):
    """Step through the K/V blocks: the state of a few rows after block i, and the partial
    output (as if the keys ended there) against the final output."""

    def __init__(self, q, k, v, *, block_n: int = 32, causal: bool = False,
                 rescale_threshold: float = RESCALE_THRESHOLD, rows: Sequence[int] = (0, 1, 2, 3),
                 batch: int = 0, head: int = 0):
        import ipywidgets as widgets

        self.trace = online_attention(q, k, v, block_n=block_n, causal=causal, trace=True,
                                      rescale_threshold=rescale_threshold)
        seqlen_q = self.trace.out.shape[1]
        self.rows = [r for r in rows if r < seqlen_q] or [0]
        self.batch, self.head = batch, head
        n = len(self.trace.steps)
        slider = widgets.IntSlider(value=1, min=1, max=n, step=1, description="block",
                                   continuous_update=False)
        super().__init__({"block": slider}, self.render_block,
                         title=f"online softmax over {n} K/V blocks of {block_n} keys "
                               f"(threshold {rescale_threshold:g})")

    def state_html(self, block: int) -> str:
        """The table of the rows' state after block `block` (1 = the first processed)."""
        t, b, h = self.trace, self.batch, self.head
        step = t.steps[block - 1]
        n0, n1 = t.blocks[block - 1]
        head_row = ("<tr><th>row</th><th>block max</th><th>row_max before</th>"
                    "<th>row_max after</th><th>alpha</th><th>rescaled</th><th>row_sum</th></tr>")
        cells = []
        for r in self.rows:
            def f(a, r=r):
                return f"{a[b, h, r] * t.scale_log2:.3f}"
            cells.append(
                f"<tr><td>{r}</td><td>{f(step.block_max)}</td><td>{f(step.row_max_before)}</td>"
                f"<td>{f(step.row_max_after)}</td><td>{step.alpha[b, h, r]:.4g}</td>"
                f"<td>{'yes' if step.rescaled[b, h, r] else 'no'}</td>"
                f"<td>{step.row_sum[b, h, r]:.6g}</td></tr>")
        done = sum(int(s.rescaled.sum()) for s in t.steps[:block])
        return (f"<div><b>after block {block}</b> of {len(t.steps)} (keys {n0}..{n1 - 1}); "
                f"maxima in log2 units (score x scale_log2); rescales so far "
                f"(all rows): {done}</div>"
                f"<table style='font-family:monospace;font-size:12px'>{head_row}"
                f"{''.join(cells)}</table>")

    def render_block(self, block: int) -> View:
        """The view after block `block`, counted from 1 as the slider counts."""
        t, b, h = self.trace, self.batch, self.head
        if not 1 <= block <= len(t.steps):
            raise ValueError(f"block {block} is out of range: blocks are counted 1..{len(t.steps)}")
        partial = t.partial_out(block - 1)[b, :, h]      # (seqlen_q, head_dim_v)
        final = t.out[b, :, h]
        fig, (ax0, ax1) = subplots(1, 2, figsize=(9, 3.0))
        dims = np.arange(final.shape[-1])
        for c, r in enumerate(self.rows[:3]):
            ax0.plot(dims, final[r], color=f"C{c}", ls="--", lw=1, label=f"row {r} final")
            ax0.plot(dims, partial[r], color=f"C{c}", marker=".", lw=1,
                     label=f"row {r} after block {block}")
        ax0.set_xlabel("output feature")
        ax0.set_title("partial output vs final", fontsize=9)
        ax0.legend(fontsize=6, ncol=2)
        err = np.maximum(np.abs(partial - final).max(axis=-1), _LOG_FLOOR)
        ax1.bar(np.arange(len(err)), err, color="#2e86c1")
        ax1.set_yscale("log")
        ax1.set_ylim(_LOG_FLOOR / 2, 10)
        ax1.set_xlabel("query row")
        ax1.set_title(f"max |partial - final| after block {block}", fontsize=9)
        fig.tight_layout()
        return View(figure=fig, html=self.state_html(block))
