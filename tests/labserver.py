"""Start JupyterLab the way `make lab` does (headless, a free port, a token) and stop it."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api_status(url: str, token: str) -> dict | None:
    import json

    req = urllib.request.Request(f"{url}/api/status", headers={"Authorization": f"token {token}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.loads(resp.read())
    except OSError:
        return None


@contextlib.contextmanager
def running_lab(extra_args: str = "", timeout: float = 120.0, log_path: Path | None = None,
                notebook: Path | None = None, target: str = "lab",
                make_vars: tuple[str, ...] = ()):
    """Yield (base_url, token) of a JupyterLab started with `make lab NO_BROWSER=1` (or
    `make <target>`, with `make_vars` such as RELEASE=...).

    `notebook` is passed as `make lab NOTEBOOK=...`; the server then serves that notebook's
    folder (a temporary copy, say, so a test never writes to the committed notebooks).
    """
    port, token = free_port(), secrets.token_hex(16)
    args = f"--IdentityProvider.token={token} --ServerApp.disable_check_xsrf=False {extra_args}"
    env = dict(os.environ, NO_BROWSER="1")
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    make_vars = [f"PORT={port}", f"LAB_ARGS={args}", *make_vars]
    if notebook is not None:
        make_vars.append(f"NOTEBOOK={Path(notebook).resolve()}")
    proc = subprocess.Popen(
        ["make", "--no-print-directory", target, *make_vars],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while api_status(url, token) is None:
            if proc.poll() is not None:
                raise RuntimeError(f"make {target} exited with {proc.returncode} before "
                                   f"answering")
            if time.time() > deadline:
                raise TimeoutError(f"JupyterLab did not answer on {url} within {timeout:.0f}s")
            time.sleep(0.5)
        yield url, token
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        if log_path:
            log.close()
