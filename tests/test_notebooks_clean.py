"""Notebooks are committed with outputs cleared and no execution counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def dirty_cells(path: Path) -> list[int]:
    """Indices of code cells carrying outputs or an execution count."""
    cells = json.loads(path.read_text())["cells"]
    return [i for i, c in enumerate(cells)
            if c.get("cell_type") == "code" and (c.get("outputs") or c.get("execution_count"))]


def test_there_are_notebooks():
    assert any(p.name == "00_start_here.ipynb" for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs(path):
    dirty = dirty_cells(path)
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; clear them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_cell_has_a_unique_id(path):
    """nbformat 4.5 cell ids: a cell added by hand without one is fixed up (with a warning)
    by every reader today and will be an error in future nbformat versions."""
    ids = [c.get("id") for c in json.loads(path.read_text())["cells"]]
    missing = [i for i, cid in enumerate(ids) if not cid]
    assert not missing, f"{path.name}: cells {missing} have no id; add one (any unique string)"
    assert len(set(ids)) == len(ids), f"{path.name}: cell ids repeat"


def test_detects_a_notebook_with_outputs(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("1 + 1")
    cell.execution_count = 1
    out = nbformat.v4.new_output("execute_result", {"text/plain": "2"}, execution_count=1)
    cell.outputs = [out]
    nb.cells = [nbformat.v4.new_code_cell("x = 1"), cell]
    path = tmp_path / "dirty.ipynb"
    nbformat.write(nb, path)
    assert dirty_cells(path) == [1]


def test_notebooks_import_the_package():
    """Thin notebooks: each one imports fa4lab (lessons live in the package)."""
    for path in NOTEBOOKS:
        src = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                        if c["cell_type"] == "code")
        assert "fa4lab" in src, f"{path.name} does not import fa4lab"


def test_lesson_table_matches_notebooks():
    from fa4lab.lessons import LESSONS

    assert [x.notebook for x in LESSONS] == [p.name for p in NOTEBOOKS], (
        "fa4lab/lessons.py and notebooks/ disagree: add or rename the lesson entry")


def test_readme_carries_the_lesson_table():
    """The README's notebook table is `lesson_table_markdown()`, said once in fa4lab.lessons."""
    from fa4lab.lessons import lesson_table_markdown

    readme = (NOTEBOOKS[0].parents[1] / "README.md").read_text()
    block = readme.split("<!-- lessons:begin -->\n")[1].split("\n<!-- lessons:end -->")[0]
    assert block == lesson_table_markdown(), (
        "README.md's notebook table is stale: run `python -m fa4lab.lessons`, which rewrites it "
        "between the lessons markers")


def twice_shown(path: Path) -> list[int]:
    """Code cells that make a pyplot figure and end on a bare name: under %matplotlib inline
    the figure shows at the cell's end and again as its value."""
    import re

    found = []
    for i, c in enumerate(json.loads(path.read_text())["cells"]):
        src = "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        lines = [line for line in src.strip().splitlines() if line.strip()]
        if (c.get("cell_type") == "code" and lines and re.search(r"plt\.(subplots|figure)\(", src)
                and re.fullmatch(r"[A-Za-z_]\w*", lines[-1].strip())):
            found.append(i)
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_figure_shows_twice(path):
    twice = twice_shown(path)
    assert not twice, f"{path.name}: cells {twice} show their figure twice; end on plt.show()"
