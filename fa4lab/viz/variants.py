"""Notebook 08's variant picker: a dropdown of `fa4lab.variants` and the chosen variant's plan.

`variant_view` draws the plan's tiles of one (batch, head) by kind (`fa4lab.viz.tiles.
tile_grid_figure` of `fa4lab.plan.throughput.tile_classes`) under the variant's description,
spec and predicted throughput; `variant_picker` is the `LiveFigure` with the variant and the
arch as dropdowns, whose values the notebook's later cells read.

    from fa4lab.viz.variants import variant_picker
    picker = variant_picker(arch="sm90")          # last expression of a cell
    picker.values()                               # {"name": "sliding window", "arch": "sm90"}
"""

from __future__ import annotations

import functools
import html

from fa4lab.viz._live import LiveFigure, View

__all__ = ["variant_picker", "variant_view"]


def variant_view(name: str, arch: str, size: str = "small") -> View:
    """The variant's tiles on `arch`'s plan and one paragraph: what it is, the hooks it goes
    through, the spec and the report's predicted TFLOP/s."""
    from fa4lab import variants
    from fa4lab.plan.throughput import tile_classes
    from fa4lab.viz.tiles import tile_grid_figure

    variant = variants.get(name)
    plan = variants.plan_of(variant, arch, size)
    rep, _ = variants.report_of(plan)
    spec_line = variants.report_sections(plan)[""].splitlines()[-1]
    pred, tiles = rep["prediction"], rep["tiles"]
    per = "(batch, KV head), packed" if plan.tiles.pack_gqa else "(batch, head)"
    fig = tile_grid_figure(tile_classes(plan), title=f"{name}: {arch} plan, one {per}")
    text = (f"<b>{html.escape(name)}</b>: {html.escape(variant.what)}<br>"
            f"<i>hooks</i>: {html.escape(variant.hooks)}<br>{html.escape(spec_line)}<br>"
            f"{arch} plan: predicted {pred['tflops']:.0f} TFLOP/s ({pred['utilization']:.0%} of "
            f"the dense MMA peak, simulated); {tiles['SKIP']} of {tiles['tiles']} tiles skipped")
    return View(fig, text)


def variant_picker(*, name: str | None = None, arch: str = "sm90",
                   size: str = "small") -> LiveFigure:
    """Dropdowns for the variant (`fa4lab.variants.NAMES`) and the plan's arch; each change
    re-plans and redraws (`variant_view`)."""
    import ipywidgets as widgets

    from fa4lab import variants
    from fa4lab.plan.plan import ARCHS

    controls = {
        "name": widgets.Dropdown(options=list(variants.NAMES), value=name or variants.DEFAULT,
                                 description="variant"),
        "arch": widgets.Dropdown(options=list(ARCHS), value=arch, description="plan for"),
    }
    return LiveFigure(controls, functools.partial(variant_view, size=size),
                      title="pick a variant: its plan's tiles and prediction")
