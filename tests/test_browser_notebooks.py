"""Every notebook of notebooks/ in a real JupyterLab with the extension, as a user runs them:
the lab ``./dev lab`` starts (the default repository in the Jupyter data dir, the demo model
written into it on first start, gRPC on a free port), each notebook opened in Debian's headless
Chromium, Run All, every cell run and no error in any output; 01 to 09 in order, then all of
them a second time in the same lab, so that a notebook that finds what an earlier one (or its
own first run) served fails here.

Each notebook gets a fresh kernel (its session is shut down after it, as a user closing it), a
clean copy of its file (what the lab saved of the first run is not mistaken for the second),
and a fresh browser. Screenshots of a failure go to $JUPYTER_TRITON_SCREENSHOTS when set.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
NOTEBOOKS = sorted((HERE.parent / "notebooks").glob("*.ipynb"))
sys.path.insert(0, str(HERE / "browser"))

from lab import JS_CELL_STATES, JS_TRACEBACKS, open_notebook, run_all, start_lab  # noqa: E402
from test_browser import browser_page  # noqa: E402,F401  (the fixture: a fresh Chromium per test)
from test_browser import pytestmark as BROWSER_MARKS  # noqa: E402

PER_NOTEBOOK_S = 240      # the slowest (09) takes 30-40 s on 2 cores; room for a busy CI machine
ROUNDS = (1, 2)

pytestmark = [*(mark for mark in BROWSER_MARKS if mark.name == "skipif"),     # no chromium, no playwright
              pytest.mark.timeout(PER_NOTEBOOK_S + 90)]

# Settled: every cell ran, or Run All stopped at an error (no cell running, a traceback shown).
JS_SETTLED = (f"(p) => {{ const s = ({JS_CELL_STATES})(p); "
              f"return s.every(x => x === 'done') || (!s.includes('running') && ({JS_TRACEBACKS})(p).length > 0); }}")

# Widget outputs (dashboards, plots): those still loading, and those that failed to display.
JS_WIDGETS = """(p) => { const outs = [...p.querySelectorAll('.jp-OutputArea-output')];
  return {loading: outs.filter(o => /Loading widget/i.test(o.innerText || '')).length,
          errors: outs.filter(o => o.querySelector('.jupyter-widgets-error-widget')
                                   || /Error displaying widget/i.test(o.innerText || ''))
                      .map(o => (o.innerText || '').slice(0, 300))}; }"""


@pytest.fixture(scope="module")
def dev_lab(tmp_path_factory):
    """JupyterLab as ``./dev lab`` starts it: no repository configured, so the extension serves
    the default one in the (scratch) Jupyter data dir and writes the demo model into it."""
    tmp = tmp_path_factory.mktemp("dev-lab")
    (tmp / "root").mkdir()
    default_repository = tmp / "state" / "data" / "jupyter_triton" / "model_repository"
    server = start_lab(tmp / "state", tmp / "root", default_repository, timeout=120,
                       triton={"create_demo_model": True})
    server.times = {}
    yield server
    server.stop()
    for (rnd, name), seconds in sorted(server.times.items()):
        print(f"round {rnd} {name}: {seconds:.1f} s")


def shut_down_sessions(lab, notebook: str) -> None:
    for session in lab.api("api/sessions") or []:
        if session.get("path", "").lstrip("/") == notebook:
            lab.api(f"api/sessions/{session['id']}", method="DELETE")


@pytest.mark.parametrize("rnd,notebook", [(r, nb) for r in ROUNDS for nb in NOTEBOOKS],
                         ids=lambda v: f"round{v}" if isinstance(v, int) else v.stem)
def test_notebook_runs_in_the_lab(dev_lab, browser_page, rnd: int, notebook: Path):
    page = browser_page
    shutil.copy(notebook, dev_lab.root / notebook.name)      # as stored: no outputs of an earlier run
    started = time.monotonic()
    try:
        _, handle = open_notebook(page, dev_lab, notebook.name, timeout=120)
        run_all(page, handle)
        page.wait_for_function(JS_SETTLED, arg=handle, timeout=PER_NOTEBOOK_S * 1000)
        states = page.evaluate(JS_CELL_STATES, handle)
        errors = page.evaluate(JS_TRACEBACKS, handle)
        if errors or "pending" in states:
            shots = Path(os.environ.get("JUPYTER_TRITON_SCREENSHOTS") or tempfile.mkdtemp(prefix="jt-shots-"))
            shots.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shots / f"round{rnd}-{notebook.stem}-failed.png"), full_page=True)
        ran = [i for i, state in enumerate(states) if state == "done"]
        assert not errors, (f"round {rnd}: {notebook.name} stopped at code cell {ran[-1] if ran else 0} "
                            f"(of {len(states)}):\n" + "\n---\n".join(errors))
        page.wait_for_function(f"(p) => ({JS_WIDGETS})(p).loading === 0", arg=handle, timeout=60_000)
        assert page.evaluate(JS_WIDGETS, handle)["errors"] == []
        assert page.js_errors == [], page.js_errors
    finally:
        dev_lab.times[(rnd, notebook.stem)] = time.monotonic() - started
        shut_down_sessions(dev_lab, notebook.name)
