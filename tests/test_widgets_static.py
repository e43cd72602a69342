"""Widgets degrade well: without a live kernel every widget section still shows a figure.

A notebook rendered on a website, or opened without a kernel, has no widget manager and no
widget state: each widget section must then fall back to a static picture of its default state.
`LiveFigure` puts an `image/png` beside the widget view in its display bundle; this checks that
the notebooks keep that promise once executed (nbclient, in a temporary copy, widget state not
stored), and that nbconvert's HTML export, which drops widget views it has no state for, shows
that PNG as an <img> for every widget section.

Run: `.venv/bin/pytest -q tests/test_widgets_static.py` (executes notebooks 01-04 at their
default, small sizes).
"""

from __future__ import annotations

import base64
import re
import shutil
from pathlib import Path

import nbformat
import pytest
from labserver import ROOT

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NOTEBOOKS = ROOT / "notebooks"
# The lessons with widget sections (each one a LiveFigure).
WITH_WIDGETS = ("01_online_softmax.ipynb", "02_tiles_masks_gqa.ipynb", "03_tmem_layout.ipynb",
                "04_roles_and_barriers.ipynb")


def execute_copy(source: Path, folder: Path) -> nbformat.NotebookNode:
    """Execute a copy of `source` in `folder` (its working directory); return the result.

    Widget state is not stored in the notebook, as for a page rendered without a kernel.
    """
    from nbclient import NotebookClient

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / source.name
    shutil.copyfile(source, path)
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", store_widget_state=False,
                   resources={"metadata": {"path": str(folder)}}).execute()
    return nb


def widget_outputs(nb) -> list[tuple[int, dict]]:
    """(cell index, output) for every output that carries a widget view."""
    return [(i, out) for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
            for out in cell.get("outputs", []) if WIDGET_VIEW in out.get("data", {})]


def missing_fallbacks(nb) -> list[str]:
    """What is wrong with the static fallbacks of the widget outputs (empty when all is well)."""
    problems = []
    for i, out in widget_outputs(nb):
        data = out["data"]
        if "image/png" in data:
            png = base64.b64decode("".join(data["image/png"]))
            if not png.startswith(PNG_SIGNATURE) or len(png) < 1000:
                problems.append(f"cell {i}: the image/png fallback is not a real picture "
                                f"({len(png)} bytes)")
        elif "<img" not in "".join(data.get("text/html", "")):
            problems.append(f"cell {i}: a widget view with no static fallback (image/png, or "
                            f"text/html with an <img>); use fa4lab.viz.LiveFigure. Has: "
                            f"{sorted(data)}")
    return problems


def html_without_widget_state(nb) -> str:
    from nbconvert import HTMLExporter

    nb = nbformat.from_dict(nb)
    nb.metadata.pop("widgets", None)
    html, _ = HTMLExporter().from_notebook_node(nb)
    return html


def figures_missing_from_html(nb, html: str) -> list[int]:
    """Cells whose widget section is not shown as its fallback <img> in `html`."""
    sources = {re.sub(r"\s", "", m) for m in re.findall(
        r'<img[^>]*src="data:image/png;base64,([^"]+)"', html)}
    missing = []
    for i, out in widget_outputs(nb):
        data = out["data"]
        if "image/png" in data:
            if re.sub(r"\s", "", "".join(data["image/png"])) not in sources:
                missing.append(i)
        else:
            fallback = "".join(data.get("text/html", ""))
            if "<img" not in fallback or fallback not in html:
                missing.append(i)
    return missing


@pytest.mark.slow
@pytest.mark.parametrize("name", WITH_WIDGETS)
def test_widget_sections_have_a_static_figure(name, tmp_path):
    source = NOTEBOOKS / name
    assert source.exists(), f"notebooks/{name} is missing: it is a lesson (fa4lab/lessons.py)"
    nb = execute_copy(source, tmp_path / "work")
    sections = widget_outputs(nb)
    assert sections, f"{name}: no widget section was displayed (expected LiveFigure outputs)"
    problems = missing_fallbacks(nb)
    assert not problems, f"{name}:\n" + "\n".join(problems)
    html = html_without_widget_state(nb)
    missing = figures_missing_from_html(nb, html)
    assert not missing, f"{name}: the HTML page shows no <img> for the widgets of cells {missing}"
    assert html.count("<img") >= len(sections)


def _notebook(*sources: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    return nb


_LIVE = """\
import ipywidgets as widgets
import matplotlib.pyplot as plt
from fa4lab.viz import LiveFigure

def draw(n):
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot(range(n))
    return fig

LiveFigure({"n": widgets.IntSlider(3, min=2, max=9)}, draw, title="line")"""


@pytest.fixture(scope="module")
def live_and_bare(tmp_path_factory):
    """One executed notebook (one kernel, 1-2 s) for the two tests below: cell 0 a LiveFigure,
    cell 1 a widget displayed without one; and its HTML export without widget state."""
    folder = tmp_path_factory.mktemp("live_and_bare")
    source = folder / "live_and_bare.ipynb"
    nbformat.write(_notebook(_LIVE, "import ipywidgets as widgets\nwidgets.IntSlider(3)"), source)
    nb = execute_copy(source, folder / "work")
    return nb, html_without_widget_state(nb)


def test_a_live_figure_section_renders_as_an_image(live_and_bare):
    """The checks above on a notebook whose answer is known: one LiveFigure, one <img>."""
    nb, html = live_and_bare
    assert [i for i, _ in widget_outputs(nb) if i == 0] == [0]
    assert [p for p in missing_fallbacks(nb) if p.startswith("cell 0:")] == []
    assert 0 not in figures_missing_from_html(nb, html)
    assert WIDGET_VIEW not in html  # no state: nbconvert dropped the view, kept the picture


def test_a_bare_widget_is_caught(live_and_bare):
    """A widget displayed without LiveFigure has no static fallback, and the check says so."""
    nb, html = live_and_bare
    assert [i for i, _ in widget_outputs(nb) if i == 1] == [1]
    problems = missing_fallbacks(nb)
    assert len(problems) == 1 and problems[0].startswith("cell 1:")
    assert "no static fallback" in problems[0]
    assert figures_missing_from_html(nb, html) == [1]
