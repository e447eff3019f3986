"""Drive JupyterLab with the jupyter_triton extension in Debian's headless Chromium.

Used by tests/test_browser.py, and runnable by hand to look at a notebook:

    .venv/bin/python tests/browser/lab.py notebooks/02-dynamic-batching.ipynb --out /tmp/shots

JupyterLab runs on 127.0.0.1 (free port, a token), with every Jupyter folder in a scratch
directory and the extension serving a model repository of the caller's choosing; its
kernels inherit JUPYTER_TRITON_URL, so notebooks talk to the server extension.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage"]

# Per code cell: 'done' ([n]), 'pending' ([ ]), 'running' ([*]).
JS_CELL_STATES = """(panel) => [...panel.querySelectorAll('.jp-Notebook .jp-CodeCell')].map(c => {
  const p = c.querySelector('.jp-InputArea-prompt');
  const t = p ? p.textContent : '';
  return t.includes('*') ? 'running' : (/\\[\\d+\\]/.test(t) ? 'done' : 'pending');
})"""

JS_TRACEBACKS = """(panel) => [...panel.querySelectorAll(
    '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
  .map(o => o.innerText || '')
  .filter(t => /Traceback \\(most recent call last\\)|^\\w+Error\\b/m.test(t))
  .map(t => t.length > 1500 ? t.slice(0, 500) + '\\n...\\n' + t.slice(-1000) : t)"""   # the exception is last


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Lab:
    url: str
    token: str
    root: Path
    proc: subprocess.Popen
    log: Path

    def api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(self.url + path.lstrip("/"), method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def notebook_url(self, notebook: str) -> str:
        workspace = f"t{int(time.time() * 1000)}"        # fresh workspace: no restored tabs
        return (f"{self.url}lab/workspaces/{workspace}/tree/{urllib.parse.quote(notebook)}"
                f"?reset&token={urllib.parse.quote(self.token)}")

    def kernels_of(self, notebook: str) -> list[dict]:
        return [s["kernel"] for s in self.api("api/sessions") or []
                if s.get("path", "").lstrip("/") == notebook and s.get("kernel")]

    def wait_kernel_stable(self, notebook: str, timeout: float = 60.0, settle: float = 2.0) -> str:
        """One idle kernel with the same id for ``settle`` s: on a fresh server JupyterLab may
        start a kernel, kill it and start another while the toolbar already says idle."""
        deadline, last, since = time.monotonic() + timeout, None, 0.0
        while time.monotonic() < deadline:
            ks = self.kernels_of(notebook)
            k = ks[0] if len(ks) == 1 else None
            if k and k.get("execution_state") == "idle":
                if k["id"] != last:
                    last, since = k["id"], time.monotonic()
                elif time.monotonic() - since >= settle:
                    return last
            else:
                last = None
            time.sleep(0.25)
        raise TimeoutError(f"kernel for {notebook} not idle and stable within {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_lab(state: Path, root: Path, repository: Path, timeout: float = 60.0,
              triton: dict | None = None) -> Lab:
    """JupyterLab with the extension enabled, serving ``repository``; state under ``state``;
    ``triton``: more JupyterTriton traits."""
    for sub in ("config", "data", "runtime", "ipython", "xdg"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    settings = state / "config" / "lab" / "user-settings"
    notify = settings / "@jupyterlab" / "apputils-extension"
    notify.mkdir(parents=True, exist_ok=True)
    (notify / "notification.jupyterlab-settings").write_text(
        '{"fetchNews": "false", "checkForUpdates": false}\n')   # no pop-ups over screenshots
    tracker = settings / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True, exist_ok=True)
    # every cell stays in the DOM: tests read outputs (a dashboard) scrolled out of view
    (tracker / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}\n')
    (state / "config" / "jupyter_server_config.json").write_text(json.dumps({
        "ServerApp": {"jpserver_extensions": {"jupyter_triton": True}},
        "JupyterTriton": {"model_repository": str(repository), "create_demo_model": False, **(triton or {})}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER_TRITON_", "JUPYTERHUB_"))}
    env.update(JUPYTER_CONFIG_DIR=str(state / "config"), JUPYTER_DATA_DIR=str(state / "data"),
               JUPYTER_RUNTIME_DIR=str(state / "runtime"), IPYTHONDIR=str(state / "ipython"),
               JUPYTER_PLATFORM_DIRS="1", JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTERLAB_WORKSPACES_DIR=str(state / "config" / "lab" / "workspaces"),
               XDG_CONFIG_HOME=str(state / "xdg"), XDG_CACHE_HOME=str(state / "xdg"))
    port, token = free_port(), secrets.token_hex(16)
    log = state / "lab.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--ServerApp.token={token}",
         f"--ServerApp.port={port}", "--ServerApp.port_retries=0", "--ServerApp.ip=127.0.0.1",
         "--ServerApp.allow_root=True", f"--ServerApp.root_dir={root}"],
        env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    lab = Lab(f"http://127.0.0.1:{port}/", token, root, proc, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited early:\n{log.read_text()[-3000:]}")
        try:
            lab.api("v2/health/live")     # ready is false while a model failed (strict readiness)
            return lab
        except OSError:
            time.sleep(0.5)
    lab.stop()
    raise TimeoutError(f"jupyter lab not ready within {timeout} s:\n{log.read_text()[-3000:]}")


def launch_browser(playwright, profile: Path, viewport=(1400, 1000)):
    env = dict(os.environ, XDG_CONFIG_HOME=str(profile / "xdg-config"),
               XDG_CACHE_HOME=str(profile / "xdg-cache"))
    return playwright.chromium.launch_persistent_context(
        str(profile / "profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
        viewport={"width": viewport[0], "height": viewport[1]}, env=env)


def open_notebook(page, lab: Lab, notebook: str, timeout: float = 60.0):
    """Open ``notebook`` and wait for its kernel; returns the notebook panel's element handle."""
    page.goto(lab.notebook_url(notebook), wait_until="domcontentloaded")
    panel = page.locator("#jp-main-dock-panel .jp-NotebookPanel:visible").first
    panel.locator(".jp-Cell").first.wait_for(state="visible", timeout=timeout * 1000)
    lab.wait_kernel_stable(notebook, timeout)
    handle = panel.element_handle()
    page.wait_for_function(
        "(p) => { const i = p.querySelector('.jp-Notebook-ExecutionIndicator');"
        " return i && i.getAttribute('data-status') === 'idle'; }", arg=handle, timeout=timeout * 1000)
    return panel, handle


def run_all(page, handle, attempts: int = 4) -> None:
    """Run -> Run All Cells, retried while no cell starts (the first click after a server
    start can be swallowed)."""
    started = ("(p) => (" + JS_CELL_STATES + ")(p).some(x => x !== 'pending')")
    for _ in range(attempts):
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        item = page.locator(".lm-Menu-item:not(.lm-mod-disabled) .lm-Menu-itemLabel",
                            has_text=re.compile(r"^Run All Cells$"))
        item.wait_for(state="visible", timeout=10000)
        item.click()
        try:
            page.wait_for_function(started, arg=handle, timeout=10000)
            return
        except Exception:
            page.keyboard.press("Escape")
    raise TimeoutError("Run All Cells never started a cell")


def cell_states(page, handle) -> list[str]:
    return page.evaluate(JS_CELL_STATES, handle)


def wait_all_done(page, handle, timeout: float = 180.0) -> None:
    page.wait_for_function("(p) => (" + JS_CELL_STATES + ")(p).every(x => x === 'done')",
                           arg=handle, timeout=timeout * 1000)


def tracebacks(page, handle) -> list[str]:
    return page.evaluate(JS_TRACEBACKS, handle)


def main() -> int:
    import argparse
    from playwright.sync_api import sync_playwright

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import build_repository

    ap = argparse.ArgumentParser(description="run a notebook in JupyterLab + Chromium, take screenshots")
    ap.add_argument("notebook")
    ap.add_argument("--out", default="benchmarks/results/browser")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="jt-lab-") as tmp:
        tmp = Path(tmp)
        (tmp / "root").mkdir()
        shutil.copy(a.notebook, tmp / "root")
        name = Path(a.notebook).name
        lab = start_lab(tmp / "state", tmp / "root", build_repository(tmp / "models"))
        try:
            with sync_playwright() as p:
                ctx = launch_browser(p, tmp / "browser")
                page = ctx.pages[0] if ctx.pages else ctx.new_page()
                page.on("console", lambda m: m.type == "error" and print("console.error:", m.text))
                _, handle = open_notebook(page, lab, name)
                run_all(page, handle)
                wait_all_done(page, handle)
                page.screenshot(path=str(out / f"{Path(name).stem}.png"), full_page=True)
                for tb in tracebacks(page, handle):
                    print("traceback:", tb)
                ctx.close()
        finally:
            lab.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
