"""The widgets work in JupyterLab, in a real browser, the way a reader uses them.

`make lab` starts JupyterLab (headless, a free port, a token) on a temporary copy of the
notebooks; Playwright drives Debian's Chromium: open a notebook, Run > Run All Cells, wait for
the kernel, then move a widget and check that what is shown changes accordingly:

- a small generated notebook: the harness itself and `LiveFigure` (slider, dropdown, error);
- 01_online_softmax: ArrowRight on the block stepper's slider advances "after block i" to
  i + 1 and redraws the plot;
- 03_tmem_layout: a smaller n_block or head_dim (fits, since the default does) redraws the
  TMEM map; head_dim 256 shows a PlanError instead of a figure; back to the default brings
  the default map back, byte for byte.

Screenshots land in test-output/browser/ (git-ignored). The committed notebooks are never
opened in place, and the last test checks that they are still free of outputs on disk.

Run: `.venv/bin/pytest -q tests/test_browser.py` (under two minutes on two cores). Without
Chromium or Playwright it skips, except under CI, where it fails: `make test` installs both.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from browser_lab import CHROMIUM, CHROMIUM_ARGS, Lab, browser_missing, lab_config, shutdown_kernels
from labserver import ROOT, running_lab

pytestmark = pytest.mark.browser

NOTEBOOKS = ROOT / "notebooks"
STEPPER = "01_online_softmax.ipynb"
TMEM = "03_tmem_layout.ipynb"
SHOTS = ROOT / "test-output" / "browser"


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _executed_cells() -> dict[str, list[int]]:
    """Code cells with outputs or an execution count, on disk, in the notebooks the browser
    runs (the other notebook authors may edit their sources meanwhile: that is fine)."""
    found = {}
    for name in (STEPPER, TMEM):
        path = NOTEBOOKS / name
        if path.exists():
            cells = json.loads(path.read_text())["cells"]
            found[name] = [i for i, c in enumerate(cells) if c["cell_type"] == "code"
                           and (c.get("outputs") or c.get("execution_count"))]
    return found


@pytest.fixture(scope="module")
def browser():
    reason = browser_missing()
    if reason:
        if _in_ci():
            pytest.fail(f"the browser test must not be skipped in CI, but {reason}",
                        pytrace=False)
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        # Playwright gives the browser a fresh temporary profile; nothing is downloaded.
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def committed():
    """The executed cells on disk before any browser test ran (none, normally)."""
    return _executed_cells()


@pytest.fixture(scope="module")
def lab_server(browser, committed, tmp_path_factory, request):
    """A `make lab` server on a temporary copy of notebooks/, with the test lab config."""
    work = tmp_path_factory.mktemp("lab") / "notebooks"
    shutil.copytree(NOTEBOOKS, work, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    _write_widget_check_notebook(work / "widget_check.ipynb")
    env, args = lab_config(work.parent)
    shutil.rmtree(SHOTS, ignore_errors=True)
    SHOTS.mkdir(parents=True)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        with running_lab(extra_args=args, log_path=SHOTS / "lab.log",
                         notebook=work / "widget_check.ipynb") as (url, token):
            yield url, token, work
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\nbrowser test screenshots: {SHOTS}")


@pytest.fixture
def lab(browser, lab_server):
    """A fresh page; its notebook's kernel is shut down afterwards."""
    url, token, work = lab_server
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    yield Lab(page, url, token, SHOTS, work=work)
    page.close()
    shutdown_kernels(url, token)


def _need(name: str) -> None:
    assert (NOTEBOOKS / name).exists(), (
        f"notebooks/{name} is missing: it is a lesson (fa4lab/lessons.py)")


def _open_and_run_all(lab: Lab, name: str) -> None:
    """Open `name`, Run All, check no cell raised, and save (Ctrl+S) so the outputs go to
    disk: into the served copy, never into notebooks/."""
    lab.open_notebook(name)
    lab.screenshot(f"{Path(name).stem}-0-opened")
    lab.run_all()
    errors = lab.cell_errors()
    assert not errors, f"{name}: cells raised under Run All:\n" + "\n".join(errors)
    assert not lab.unexecuted_cells(), f"{name}: Run All stopped at cells {lab.unexecuted_cells()}"
    lab.screenshot(f"{Path(name).stem}-1-ran")
    lab.save()
    saved = json.loads((lab.work / name).read_text())["cells"]
    assert any(c.get("outputs") for c in saved if c["cell_type"] == "code"), (
        f"Ctrl+S did not save {name}'s outputs into the served copy {lab.work}")


def _press_slider(lab: Lab, panel, key: str) -> int:
    """Focus the slider's handle, press `key`; return the handle's new value."""
    handle = panel.locator("[role=slider]").first
    before = float(handle.get_attribute("aria-valuenow"))
    handle.focus()
    handle.press(key)
    lab.page.wait_for_function(
        "([h, v]) => Number(h.getAttribute('aria-valuenow')) !== v",
        arg=[handle.element_handle(), before])
    return round(float(handle.get_attribute("aria-valuenow")))


def _slider_range(panel) -> tuple[int, int, int]:
    handle = panel.locator("[role=slider]").first
    return tuple(round(float(handle.get_attribute(a)))
                 for a in ("aria-valuemin", "aria-valuenow", "aria-valuemax"))


def _dropdown(panel, label: str):
    return panel.locator(".widget-dropdown", has=panel.page.locator(
        ".widget-label", has_text=label)).locator("select").first


def _choose(lab: Lab, panel, label: str, option: str) -> str:
    """Select `option` in the dropdown labelled `label`; return the panel text once redrawn."""
    before = _text(panel)
    _dropdown(panel, label).select_option(label=option)
    return lab.settle(panel, before)


def test_live_figure_redraws_in_lab(lab):
    """The harness and LiveFigure on a generated notebook whose answers are known."""
    name = "widget_check.ipynb"
    with lab.screenshot_on_failure("widget_check"):
        _open_and_run_all(lab, name)
        # The test config took effect: no news toast over the widgets.
        assert "@jupyterlab/apputils-extension:announcements" in lab.disabled_extensions()
        assert lab.page.locator(".Toastify__toast").count() == 0
        stepper = lab.live_panel("step")
        assert stepper.locator(".fa4lab-live-text").inner_text() == "after block 0"
        first = lab.image_digest(stepper)
        assert first is not None
        assert _press_slider(lab, stepper, "ArrowRight") == 1
        lab.settle(stepper, "after block 0")
        assert stepper.locator(".fa4lab-live-text").inner_text() == "after block 1"
        assert lab.image_digest(stepper) not in (None, first)

        plan = lab.live_panel("width")
        assert _choose(lab, plan, "width", "3") == "width 3"
        assert lab.image_digest(plan) is not None
        assert "PlanError" in _choose(lab, plan, "width", "9")
        assert plan.locator(".fa4lab-error").is_visible()
        assert lab.image_digest(plan) is None
        assert _choose(lab, plan, "width", "2") == "width 2"
        assert plan.locator(".fa4lab-error").count() == 0
        lab.screenshot("widget_check-2-moved")


def test_online_softmax_block_stepper(lab):
    """ArrowRight on the block slider: the state text says the next block, the plot redraws."""
    _need(STEPPER)
    with lab.screenshot_on_failure("01"):
        _open_and_run_all(lab, STEPPER)
        panel = lab.live_panel_with_text(re.compile(r"after block \d+"))
        lo, value, hi = _slider_range(panel)
        assert hi > lo, f"the block slider has a single position ({lo}); nothing to step"
        text = panel.locator(".fa4lab-live-text").inner_text()
        assert f"after block {value}" in text, text
        image = lab.image_digest(panel)
        assert image is not None, "the block stepper shows no plot at its default state"

        key, step = ("ArrowRight", 1) if value < hi else ("ArrowLeft", -1)
        moved = _press_slider(lab, panel, key)
        assert moved == value + step
        text = lab.settle(panel, text)
        assert f"after block {moved}" in text, text
        assert f"after block {value}" not in text, text
        moved_image = lab.image_digest(panel)
        assert moved_image not in (None, image), "the plot did not change with the block"
        lab.screenshot("01_online_softmax-2-stepped")

        # Back to where it was: the text follows the slider both ways.
        assert _press_slider(lab, panel, "ArrowLeft" if step == 1 else "ArrowRight") == value
        assert f"after block {value}" in lab.settle(panel, text)


def test_tmem_layout_dropdowns(lab):
    """Smaller tiles redraw the TMEM map; head_dim 256 does not fit and shows a PlanError."""
    _need(TMEM)
    with lab.screenshot_on_failure("03"):
        _open_and_run_all(lab, TMEM)
        panel = lab.live_panel("head_dim", "n_block")
        default_image = lab.image_digest(panel)
        assert panel.locator(".fa4lab-error").count() == 0, (
            f"the default TMEM plan is an error: {_text(panel)}")
        assert default_image is not None, "the TMEM panel shows no figure at its default state"

        # A smaller n_block or head_dim needs fewer TMEM columns (and less SMEM) than the
        # default, which fits: it must fit too, and draw a different map.
        for label in ("n_block", "head_dim"):
            default, options = _options(panel, label)
            smaller = [o for o in options if _number(o) < _number(default)]
            assert smaller, f"{label}: no option below the default {default} in {options}"
            before = _text(panel)
            assert _choose(lab, panel, label, smaller[-1]) != before
            assert panel.locator(".fa4lab-error").count() == 0, (
                f"{label} {smaller[-1]} should fit (the default {default} does): {_text(panel)}")
            assert lab.image_digest(panel) not in (None, default_image), (
                f"{label} {default} -> {smaller[-1]} did not redraw the TMEM map")
            lab.screenshot(f"03_tmem_layout-2-{label}-{smaller[-1]}")
            _choose(lab, panel, label, default)
            assert lab.image_digest(panel) == default_image, "the default map did not come back"

        default, options = _options(panel, "head_dim")
        big = next((o for o in options if _number(o) == 256), None)
        assert big is not None, f"head_dim offers no 256: {options}"
        _choose(lab, panel, "head_dim", big)
        error = panel.locator(".fa4lab-error")
        assert error.count() == 1 and error.is_visible(), (
            f"head_dim 256 shows no error: {_text(panel)!r}")
        assert "PlanError" in error.inner_text(), error.inner_text()
        assert lab.image_digest(panel) is None, "a figure is still shown beside the error"
        lab.screenshot("03_tmem_layout-3-over-budget")

        _choose(lab, panel, "head_dim", default)
        assert panel.locator(".fa4lab-error").count() == 0
        assert lab.image_digest(panel) == default_image
        lab.screenshot("03_tmem_layout-4-back")


def _text(panel) -> str:
    return panel.locator(".fa4lab-live-text").inner_text()


def _number(option: str) -> float:
    match = re.search(r"-?\d+(\.\d+)?", option)
    assert match, f"option {option!r} has no number"
    return float(match.group())


def _options(panel, label: str) -> tuple[str, list[str]]:
    """The selected option and all options of the dropdown labelled `label`."""
    select = _dropdown(panel, label)
    return (select.evaluate("s => s.options[s.selectedIndex].text"),
            select.locator("option").all_inner_texts())


def test_committed_notebooks_stay_output_free(committed):
    """Running them in the browser wrote no outputs into notebooks/ (the server ran a copy)."""
    assert _executed_cells() == committed


def _write_widget_check_notebook(path: Path) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (_SETUP, _STEPPER, _PLAN)]
    nbformat.write(nb, path)


_SETUP = """\
import ipywidgets as widgets
import matplotlib.pyplot as plt
from fa4lab.errors import PlanError
from fa4lab.viz import LiveFigure, View"""

_STEPPER = """\
def step(block):
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot(range(block + 2))
    return View(fig, f"after block {block}")

LiveFigure({"block": widgets.IntSlider(0, min=0, max=4, description="step")}, step)"""

_PLAN = """\
def plan(width):
    if width > 4:
        raise PlanError(f"width {width} does not fit in 4 columns; choose 4 or less")
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.bar(range(width), 1)
    return View(fig, f"width {width}")

LiveFigure({"width": widgets.Dropdown(options=[2, 3, 9], value=2, description="width")}, plan)"""


def test_make_student_serves_the_release(tmp_path):
    """`make student` builds the release (solutions replaced by stubs) and serves it: the
    served 01 notebook has nbgrader's stubs where the instructor's has solutions."""
    import urllib.request

    release = tmp_path / "release"
    with running_lab(target="student", make_vars=(f"RELEASE={release}",), timeout=300,
                     log_path=tmp_path / "student.log") as (url, token):
        req = urllib.request.Request(f"{url}/api/contents/01_online_softmax.ipynb?content=1",
                                     headers={"Authorization": f"token {token}"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            served = json.loads(resp.read())["content"]
    code = "\n".join("".join(c["source"]) if isinstance(c["source"], list) else c["source"]
                     for c in served["cells"] if c["cell_type"] == "code")
    assert "raise NotImplementedError()" in code and "BEGIN SOLUTION" not in code
    assert (release / "points.json").is_file()
