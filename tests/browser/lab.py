"""JupyterLab on 127.0.0.1 + headless Debian chromium driven by Python playwright
(see /work/shared/FACTS.md): start, open a notebook, run all, read the page, stop."""
from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

CHROMIUM = os.environ.get("HVD_MAGIC_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
         "--disable-dev-shm-usage"]


def missing() -> Optional[str]:
    """Why the browser test cannot run here (None when it can)."""
    if not os.path.exists(CHROMIUM):
        return f"no chromium at {CHROMIUM} (make test installs it: apt-get install -y chromium)"
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "python playwright is not installed (make test installs it)"
    if shutil.which("jupyter-lab", path=str(Path(sys.executable).parent)) is None:
        return "jupyterlab is not installed (make test installs it)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def jupyter_lab(root: Path, log: Path) -> Iterator[str]:
    """Run JupyterLab serving ``root``; yields the base URL with the token."""
    token = secrets.token_hex(16)
    port = _free_port()
    exe = str(Path(sys.executable).parent / "jupyter-lab")
    env = dict(os.environ, JUPYTER_PLATFORM_DIRS="1", PYTHONUNBUFFERED="1")
    argv = [exe, "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--allow-root",
            f"--IdentityProvider.token={token}", "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--expose-app-in-browser", f"--ServerApp.root_dir={root}"]
    fh = open(log, "w")
    proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=root)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2).read()
                break
            except Exception:  # noqa: BLE001
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"jupyter lab did not start; see {log}")
                time.sleep(0.2)
        yield f"{base}|{token}"
    finally:
        try:
            req = urllib.request.Request(f"{base}/api/shutdown?token={token}", method="POST")
            urllib.request.urlopen(req, timeout=5).read()
            proc.wait(10)
        except Exception:  # noqa: BLE001
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
        fh.close()


@contextmanager
def browser(profile: Path) -> Iterator[object]:
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=FLAGS,
            viewport={"width": 1400, "height": 1300})
        try:
            yield ctx
        finally:
            ctx.close()


def open_notebook(page, base: str, name: str) -> None:
    url, token = base.split("|")
    page.goto(f"{url}/lab/tree/{name}?reset&token={token}")
    page.get_by_text("Python 3 (ipykernel) | Idle").wait_for(timeout=60000)


def run_all(page) -> None:
    # not awaited: the command's promise resolves only when every cell has finished
    page.evaluate("() => { window.jupyterapp.commands.execute('runmenu:run-all'); }")
