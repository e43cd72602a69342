"""`LiveFigure`: controls + a figure that redraws, with a static fallback.

Every interactive section of the notebooks is one of these. In JupyterLab the controls drive a
redraw; where no live kernel or widget manager is present (a notebook rendered on a website, or
opened read-only) the saved output still carries a PNG of the default state, because the
display bundle holds `image/png` beside the widget view. Errors raised by the render function
(a tile plan over budget, say) are shown in the panel, in red, instead of a figure.
"""

from __future__ import annotations

import base64
import html as _html
import io
import sys
from collections.abc import Callable
from dataclasses import dataclass

from matplotlib.figure import Figure


@dataclass
class View:
    """What a render function returns: a figure and/or a short HTML text (state, numbers)."""

    figure: object | None = None
    html: str = ""


def subplots(*args, figsize=None, dpi=None, **kwargs):
    """`plt.subplots` without registering the figure with pyplot.

    A notebook cell that returns such a figure shows it once (pyplot's inline backend would
    show a registered figure a second time at the end of the cell), and nothing leaks into
    pyplot's figure list when a widget redraws.
    """
    fig = Figure(figsize=figsize, dpi=dpi)
    return fig, fig.subplots(*args, **kwargs)


def close(fig) -> None:
    """Release `fig` from pyplot's figure list if it is there. fa4lab builds its figures without
    pyplot (and never imports it or picks a backend): the notebook's own backend shows them."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:
        pyplot.close(fig)


def figure_png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    close(fig)
    return buf.getvalue()


def _as_view(result) -> View:
    if isinstance(result, View):
        return result
    if isinstance(result, str):
        return View(html=result)
    return View(figure=result)


class LiveFigure:
    """Compose ipywidgets controls with a render function `render(**values) -> View | Figure`.

    `controls` maps the render function's keyword names to ipywidgets value widgets.
    """

    def __init__(self, controls: dict, render: Callable, *, title: str = ""):
        import ipywidgets as widgets

        self.controls = controls
        self.render = render
        self.title = title
        self.text = widgets.HTML(layout=widgets.Layout(min_height="1.5em"))
        self.text.add_class("fa4lab-live-text")
        self.image = widgets.Image(
            format="png", layout=widgets.Layout(align_self="flex-start", max_width="100%"))
        self.image.add_class("fa4lab-live-image")
        self.renders = 0
        for control in controls.values():
            control.observe(self._on_change, "value")
        header = [widgets.HTML(f"<b>{_html.escape(title)}</b>")] if title else []
        self.widget = widgets.VBox(
            header + [widgets.HBox(list(controls.values()),
                                   layout=widgets.Layout(flex_flow="row wrap")),
                      self.text, self.image])
        self.widget.add_class("fa4lab-live")
        self._default_png = None
        self.update()

    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def _draw(self) -> tuple[bytes | None, str]:
        from fa4lab.errors import Fa4labError

        try:
            view = _as_view(self.render(**self.values()))
        except (Fa4labError, ValueError) as err:
            msg = _html.escape(str(err))
            return None, (f'<div class="fa4lab-error" style="color:#b00020">'
                          f'<b>{type(err).__name__}</b>: {msg}</div>')
        png = figure_png(view.figure) if view.figure is not None else None
        return png, view.html

    def update(self) -> None:
        png, text = self._draw()
        self.renders += 1
        self.text.value = text
        self.image.value = png or b""
        self.image.layout.display = "" if png else "none"
        if self._default_png is None:
            self._default_png = png

    def _on_change(self, change) -> None:
        self.update()

    def _repr_mimebundle_(self, **kwargs):
        bundle = self.widget._repr_mimebundle_(**kwargs)
        data = bundle[0] if isinstance(bundle, tuple) else bundle
        data = dict(data)
        # Static fallback for renderers without a widget manager: the default state's figure.
        if self._default_png:
            data["image/png"] = base64.b64encode(self._default_png).decode()
        data["text/plain"] = f"{self.title or 'interactive figure'} (static: default state)"
        return data
