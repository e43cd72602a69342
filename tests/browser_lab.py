"""Drive JupyterLab in headless Debian Chromium with Playwright: open, run all, move widgets.

The browser test (tests/test_browser.py) uses these helpers. Nothing is downloaded: Playwright
launches the system Chromium (`make test` apt-installs it), with a fresh profile per test.
JupyterLab is configured for testing through a private config folder: the news announcement
toast (which can cover widgets) is disabled, notifications are silenced, the notebook renders
every cell (no windowing) and the app object is exposed so the test can wait on kernel state.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import urllib.request
from pathlib import Path

CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-quic",
    "--disable-dev-shm-usage",
]
# Generous: a 2-core machine shared with other work starts kernels and renders PNGs slowly.
TIMEOUT_MS = 120_000

# Note [lab config for tests]
# The announcements plugin asks "notified about official Jupyter news?" in a toast that lies
# over the bottom-right of the page, where a widget may be. It is disabled in
# labconfig/page_config.json of a private JUPYTER_CONFIG_DIR (the user's config is left alone;
# the environment's own config folders still apply). User settings (a private folder) switch off
# notebook windowing, so every cell stays in the DOM, and silence toasts.
_DISABLED = ["@jupyterlab/apputils-extension:announcements"]
_USER_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True},
}


def browser_missing() -> str | None:
    """Why the browser test cannot run here, or None when Playwright and Chromium are present."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the Python package playwright is missing (`make test` installs it)"
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing (`make test` installs Debian's chromium with apt-get)"
    return None


def lab_config(folder: Path) -> tuple[dict, str]:
    """Write test settings under `folder`; return (environment additions, JupyterLab args)."""
    config_dir = folder / "jupyter-config"
    (config_dir / "labconfig").mkdir(parents=True, exist_ok=True)
    (config_dir / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {name: True for name in _DISABLED}}))
    settings_dir = folder / "lab-user-settings"
    for rel, value in _USER_SETTINGS.items():
        path = settings_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    workspaces = folder / "lab-workspaces"
    workspaces.mkdir(exist_ok=True)
    args = (f"--LabApp.user_settings_dir={settings_dir} --LabApp.workspaces_dir={workspaces} "
            "--LabApp.expose_app_in_browser=True")
    return {"JUPYTER_CONFIG_DIR": str(config_dir)}, args


class Lab:
    """One Chromium page on a running JupyterLab; screenshots go to `shots`; `work` is the
    folder the server serves."""

    def __init__(self, page, url: str, token: str, shots: Path, work: Path | None = None):
        self.page, self.url, self.token, self.shots, self.work = page, url, token, shots, work
        self.shots.mkdir(parents=True, exist_ok=True)
        page.set_default_timeout(TIMEOUT_MS)

    def screenshot(self, name: str) -> Path:
        path = self.shots / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=False)
        return path

    def open_notebook(self, name: str) -> None:
        """Open `name` (relative to the server's root) in a clean workspace."""
        self.page.goto(f"{self.url}/lab/tree/{name}?reset&token={self.token}",
                       wait_until="domcontentloaded")
        self.page.wait_for_function("() => window.jupyterapp && window.jupyterapp.started",
                                    timeout=TIMEOUT_MS)
        self.page.evaluate("() => window.jupyterapp.started")
        self.page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").first.wait_for()
        # The kernel has to be connected before "Run All" means anything.
        self.page.wait_for_function(_KERNEL_IDLE_JS, timeout=TIMEOUT_MS)

    def run_all(self) -> None:
        """Run > Run All Cells through the menu bar, as a person would; wait until done."""
        page = self.page
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu .lm-Menu-itemLabel",
                     has_text=re.compile(r"^Run All Cells$")).click()
        self.wait_done()

    def save(self) -> None:
        """Ctrl+S, as a person would; wait until the notebook is no longer marked dirty."""
        self.page.locator(".jp-NotebookPanel .jp-Notebook").first.click(
            position={"x": 5, "y": 5})
        self.page.keyboard.press("Control+s")
        self.page.wait_for_function(
            "() => !window.jupyterapp.shell.currentWidget.context.model.dirty",
            timeout=TIMEOUT_MS)

    def wait_done(self) -> None:
        """Wait until no cell is queued or running and the kernel is idle, twice in a row
        half a second apart (a kernel goes idle between two queued cells)."""
        for _ in range(2):
            self.page.wait_for_function(_DONE_JS, timeout=TIMEOUT_MS)
            self.page.wait_for_timeout(500)
        self.page.wait_for_function(_DONE_JS, timeout=TIMEOUT_MS)

    def unexecuted_cells(self) -> list[int]:
        """Indices of code cells without an execution count (a run all stopped early)."""
        return self.page.evaluate(_UNEXECUTED_JS)

    def disabled_extensions(self) -> list[str]:
        """The plugins this JupyterLab page has disabled (from its page config)."""
        config = json.loads(self.page.locator("#jupyter-config-data").text_content())
        return list(config.get("disabledExtensions", []))

    def cell_errors(self) -> list[str]:
        """Tracebacks shown in the notebook (stderr, a progress bar say, is not an error)."""
        return self.page.locator(
            "[data-mime-type='application/vnd.jupyter.error']").all_inner_texts()

    def live_panel(self, *control_labels: str):
        """The first LiveFigure panel (`.fa4lab-live`) with controls labelled by all of
        `control_labels` (substrings of the labels)."""
        panel = self.page.locator(".fa4lab-live")
        for label in control_labels:
            panel = panel.filter(has=self.page.locator(".widget-label", has_text=label))
        panel.first.wait_for(state="visible")
        panel.first.scroll_into_view_if_needed()
        return panel.first

    def live_panel_with_text(self, pattern):
        """The LiveFigure panel whose state text matches `pattern` (a str or compiled regex)."""
        panel = self.page.locator(".fa4lab-live").filter(
            has=self.page.locator(".fa4lab-live-text", has_text=pattern))
        panel.first.wait_for(state="visible")
        panel.first.scroll_into_view_if_needed()
        return panel.first

    @contextlib.contextmanager
    def screenshot_on_failure(self, name: str):
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                print(f"screenshot of the failure: {self.screenshot(f'FAILED-{name}')}")
            raise

    def image_digest(self, panel) -> str | None:
        """SHA-256 of the PNG the panel's image shows now (None when the image is hidden)."""
        image = panel.locator("img.fa4lab-live-image").first
        if not image.is_visible():
            return None
        return image.evaluate(_IMAGE_DIGEST_JS)

    def wait_kernel_idle(self) -> None:
        self.page.wait_for_function(_KERNEL_IDLE_JS, timeout=TIMEOUT_MS)

    def settle(self, panel, previous_text: str, timeout_s: float = TIMEOUT_MS / 1000) -> str:
        """Wait until the panel's text differs from `previous_text` and the redraw is complete;
        return the new text.

        LiveFigure sets the text, then the image: two widget messages. The kernel's "idle"
        status comes after both on the same channel, so text changed + kernel idle means the
        image shown is the new one.
        """
        text = panel.locator(".fa4lab-live-text")
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            now = text.inner_text()
            if now != previous_text:
                self.wait_kernel_idle()
                return text.inner_text()
            self.page.wait_for_timeout(200)
        raise AssertionError(f"the panel text stayed {previous_text!r} for {timeout_s:.0f}s")


def shutdown_kernels(url: str, token: str) -> None:
    """Stop every kernel of the server (they hold memory on a small CI machine)."""
    headers = {"Authorization": f"token {token}"}
    with urllib.request.urlopen(urllib.request.Request(f"{url}/api/kernels", headers=headers),
                                timeout=10) as resp:
        kernels = json.loads(resp.read())
    for kernel in kernels:
        req = urllib.request.Request(f"{url}/api/kernels/{kernel['id']}", headers=headers,
                                     method="DELETE")
        with contextlib.suppress(OSError):
            urllib.request.urlopen(req, timeout=30).close()


_IMAGE_DIGEST_JS = """async (img) => {
  const bytes = await (await fetch(img.src)).arrayBuffer();
  const digest = new Uint8Array(await crypto.subtle.digest('SHA-256', bytes));
  return Array.from(digest).map(b => b.toString(16).padStart(2, '0')).join('');
}"""

_KERNEL_IDLE_JS = """() => {
  const nb = window.jupyterapp.shell.currentWidget;
  const k = nb && nb.sessionContext && nb.sessionContext.session
            && nb.sessionContext.session.kernel;
  return !!k && k.connectionStatus === 'connected' && k.status === 'idle';
}"""

# Idle kernel, no cell queued or running ([*]), and at least one cell has run.
_DONE_JS = """() => {
  const idle = (KERNEL_IDLE)();
  const prompts = Array.from(document.querySelectorAll('.jp-CodeCell .jp-InputPrompt'));
  return idle && prompts.some(p => /\\[\\d+\\]/.test(p.textContent))
    && !prompts.some(p => p.textContent.includes('*'));
}""".replace("KERNEL_IDLE", _KERNEL_IDLE_JS)

_UNEXECUTED_JS = """() => {
  const cells = Array.from(window.jupyterapp.shell.currentWidget.content.model.cells);
  return cells.map((c, i) => [c, i])
    .filter(([c, _]) => c.type === 'code' && c.executionCount === null
            && c.sharedModel.getSource().trim() !== '')
    .map(([_, i]) => i);
}"""
