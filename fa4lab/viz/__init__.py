"""Figures (functions returning a matplotlib Figure) and live widgets built on `LiveFigure`."""

from fa4lab.viz._live import LiveFigure, View, figure_png

__all__ = ["LiveFigure", "View", "figure_png"]
