"""The dashboard in a real browser: JupyterLab with the extension, Debian's headless
Chromium driven by Playwright. The notebooks' kernels inherit JUPYTER_TRITON_URL, so they
serve through the Jupyter server; the dashboard must keep moving while a cell runs.

Screenshots go to $JUPYTER_TRITON_SCREENSHOTS when set (the committed ones in
benchmarks/results/browser/ were made with it pointing there), else to a scratch folder.
"""
from __future__ import annotations

import importlib.util
import re
import sys
import time
from pathlib import Path

import nbformat
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
import os
import tempfile

SHOTS = Path(os.environ.get("JUPYTER_TRITON_SCREENSHOTS") or tempfile.mkdtemp(prefix="jt-shots-"))
SHOTS.mkdir(parents=True, exist_ok=True)
sys.path.insert(0, str(HERE / "browser"))

from lab import (CHROMIUM, JS_CELL_STATES, cell_states, launch_browser, open_notebook, run_all,  # noqa: E402
                 start_lab, tracebacks, wait_all_done)

pytestmark = [
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason=f"no {CHROMIUM} (apt-get install chromium fonts-dejavu-core)"),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None,
                       reason="the python package playwright is not installed (pip install playwright; "
                              "the browser is Debian's chromium, no `playwright install`)"),
    pytest.mark.timeout(300),
]

IGNORED_CONSOLE = [re.compile(p) for p in (r"favicon", r"ERR_NETWORK_CHANGED")]

# The dashboard's figures, read from the DOM: the overview row of each model and the
# render counter the view stamps on its root.
JS_DASHBOARD = """() => {
  const d = document.querySelector('.jt-dash');
  if (!d) return null;
  const rows = {};
  for (const tr of d.querySelectorAll('table.jt-overview tr[data-model]')) {
    const td = [...tr.querySelectorAll('td')].map(x => x.textContent);
    rows[tr.dataset.model] = {infPerS: parseFloat(td[2].replace(/,/g, '')) || 0,
                              inferences: parseInt(td[8].replace(/,/g, ''), 10) || 0};
  }
  const bars = {};
  for (const c of d.querySelectorAll('.jt-card[data-model]'))
    bars[c.dataset.model] = c.querySelectorAll('rect.jt-bar').length;
  return {source: d.dataset.source, ticks: parseInt(d.dataset.ticks || '0', 10), rows, bars,
          text: d.innerText};
}"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lab")
    (tmp / "root").mkdir()
    (tmp / "models").mkdir()
    # histograms off (the extension's default is on): the percentiles note is one of the stories
    server = start_lab(tmp / "state", tmp / "root", tmp / "models",
                       triton={"histogram_latencies": False})
    yield server
    server.stop()


@pytest.fixture
def browser_page(tmp_path):
    from playwright.sync_api import sync_playwright
    errors: list[str] = []
    with sync_playwright() as p:
        ctx = launch_browser(p, tmp_path / "chromium")
        page = ctx.pages[0] if ctx.pages else ctx.new_page()
        page.set_default_timeout(60_000)
        page.on("console", lambda m: m.type == "error" and not any(r.search(m.text) for r in IGNORED_CONSOLE)
                and errors.append(f"console.error: {m.text[:300]}"))
        page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
        page.js_errors = errors
        try:
            yield page
        finally:
            ctx.close()


def code_cell_index(notebook: Path, marker: str) -> int:
    cells = [c for c in nbformat.read(notebook, as_version=4).cells if c.cell_type == "code"]
    return next(i for i, c in enumerate(cells) if marker in c.source)


def dashboard_while_running(page, handle, cell: int, source: str, reads: int = 2, gap: float = 1.5) -> list[dict]:
    """Wait until code cell ``cell`` runs and the dashboard draws from ``source`` ("browser"
    or "kernel"), then read it ``reads`` times, checking the cell still runs at each read."""
    # queued cells show [*] too: the cell runs once every cell above it is done
    page.wait_for_function(f"(p) => {{ const s = ({JS_CELL_STATES})(p); return s[{cell}] === 'running' "
                           f"&& s.slice(0, {cell}).every(x => x === 'done'); }}", arg=handle, timeout=150_000)
    try:
        page.wait_for_function(f"() => !!document.querySelector('.jt-dash[data-source=\"{source}\"] table.jt-overview')",
                               timeout=10_000)
    except Exception:       # say what the dashboard shows instead (its status line names the source)
        page.screenshot(path=str(SHOTS / "failed-no-dashboard.png"))
        shown = page.evaluate("() => [...document.querySelectorAll('.jt-dash')].map(d => "
                              "[d.dataset.source, d.innerText.slice(0, 300)])")
        raise AssertionError(f"no dashboard fed from the {source}: {shown}; tracebacks: "
                             f"{tracebacks(page, handle)}; page errors: {page.js_errors}") from None
    seen = []
    for i in range(reads):
        if i:
            time.sleep(gap)
        state = page.evaluate(JS_DASHBOARD)
        assert cell_states(page, handle)[cell] == "running", "the load cell finished before the reads"
        seen.append(state)
    return seen


def test_dashboard_of_the_batching_notebook_moves_while_the_load_cell_runs(lab, browser_page):
    source = REPO / "notebooks" / "02-dynamic-batching.ipynb"
    # the load cell runs longer than the notebook's 4 s a model: the dashboard is read twice
    # while it runs, after the browser drew it, which a busy machine may take seconds to do
    text = source.read_text()
    assert text.count("closed_loop(model, seconds=4.0)") == 1
    (lab.root / source.name).write_text(text.replace("closed_loop(model, seconds=4.0)",
                                                     "closed_loop(model, seconds=10.0)"))
    load_cell = code_cell_index(source, "closed_loop(model, seconds")
    page = browser_page
    SHOTS.mkdir(parents=True, exist_ok=True)

    panel, handle = open_notebook(page, lab, source.name)
    run_all(page, handle)
    first, second = dashboard_while_running(page, handle, load_cell, "browser")

    # polled by the browser itself, through the Jupyter server, while the kernel is busy
    assert first["source"] == "browser", first
    assert second["ticks"] > first["ticks"], (first, second)
    served = {name: second["rows"][name]["inferences"] - first["rows"][name]["inferences"]
              for name in ("one_at_a_time", "batched")}
    assert sum(served.values()) > 0, (first["text"], second["text"])
    assert any(second["rows"][n]["infPerS"] > 0 for n in served), second["text"]
    page.locator(".jt-dash").first.screenshot(path=str(SHOTS / "02-dashboard-during-load.png"))

    wait_all_done(page, handle, timeout=180)
    assert tracebacks(page, handle) == []
    page.wait_for_function("() => document.querySelectorAll('.jt-card[data-model=\"batched\"] rect.jt-bar').length > 1",
                           timeout=15_000)   # the batcher formed batches of several sizes
    final = page.evaluate(JS_DASHBOARD)
    assert final["bars"].get("one_at_a_time") == 1, final["bars"]     # max_batch_size 1: one size only
    page.locator(".jt-dash").first.scroll_into_view_if_needed()
    page.screenshot(path=str(SHOTS / "02-dynamic-batching.png"))
    assert page.js_errors == []


KERNEL_FALLBACK = [
    # A dashboard of a server the browser cannot reach (an in-kernel server on a loopback
    # port of this kernel): its figures come from the kernel-side poller.
    "import base64, json, urllib.request\n"
    "from onnx import TensorProto, helper\n"
    "from jupyter_triton.kernel.discovery import start_in_kernel\n"
    "from jupyter_triton.widgets import Dashboard\n"
    "conn = start_in_kernel()\n"
    "graph = helper.make_graph([helper.make_node('Identity', ['INPUT0'], ['OUTPUT0'])], 'ident',\n"
    "    [helper.make_tensor_value_info('INPUT0', TensorProto.FLOAT, ['batch', 4])],\n"
    "    [helper.make_tensor_value_info('OUTPUT0', TensorProto.FLOAT, ['batch', 4])])\n"
    "m = helper.make_model(graph, opset_imports=[helper.make_opsetid('', 13)]); m.ir_version = 8\n"
    "load = {'parameters': {'config': json.dumps({'name': 'ident', 'backend': 'onnxruntime', 'max_batch_size': 8}),\n"
    "                       'file:1/model.onnx': base64.b64encode(m.SerializeToString()).decode()}}\n"
    "urllib.request.urlopen(urllib.request.Request(conn.url + 'v2/repository/models/ident/load',\n"
    "                                              data=json.dumps(load).encode(),\n"
    "                                              headers={**conn.headers, 'Content-Type': 'application/json'}),\n"
    "                       timeout=60).read()\n"
    "dash = Dashboard(conn, interval=0.3)\n"
    "dash",

    "import json, time, urllib.request\n"
    "body = json.dumps({'inputs': [{'name': 'INPUT0', 'shape': [1, 4], 'datatype': 'FP32', 'data': [1, 2, 3, 4]}]}).encode()\n"
    "end = time.monotonic() + 6\n"
    "while time.monotonic() < end:\n"
    "    urllib.request.urlopen(urllib.request.Request(conn.url + 'v2/models/ident/infer', data=body,\n"
    "                           headers={**conn.headers, 'Content-Type': 'application/json'}), timeout=10).read()\n"
    "    time.sleep(0.002)\n"
    "print('done')",
]


def test_dashboard_falls_back_to_the_kernel_poller(lab, browser_page):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in KERNEL_FALLBACK]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, lab.root / "fallback.ipynb")
    page = browser_page
    panel, handle = open_notebook(page, lab, "fallback.ipynb")
    run_all(page, handle)
    first, second = dashboard_while_running(page, handle, 1, "kernel")
    assert first["source"] == "kernel" and second["source"] == "kernel", first
    assert second["ticks"] > first["ticks"]
    assert second["rows"]["ident"]["inferences"] > first["rows"]["ident"]["inferences"], (first, second)
    wait_all_done(page, handle, timeout=60)
    assert tracebacks(page, handle) == []
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.locator(".jt-dash").first.screenshot(path=str(SHOTS / "kernel-fallback-dashboard.png"))
    assert page.js_errors == []


NOTEBOOK_LOGS = [
    "%load_ext jupyter_triton",
    "%%serve chatty\n"
    "def chatty(prompt: str) -> str:\n"
    "    print(f'chatty saw {len(prompt.split())} words', flush=True)\n"
    "    return prompt.upper()\n"
    "chatty",
    "chatty = _\nprint(chatty.infer('a b c'))",
    "chatty.dashboard(interval=0.3)",
]


def test_notebook_dashboard_logs_tab_and_percentiles_note(lab, browser_page):
    """The notebook widget of one model: its logs tab shows what the served function printed
    (read by the browser through the Jupyter server), and without latency histograms the
    card says how to get percentiles."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in NOTEBOOK_LOGS]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, lab.root / "logs.ipynb")
    page = browser_page
    panel, handle = open_notebook(page, lab, "logs.ipynb")
    run_all(page, handle)
    wait_all_done(page, handle, timeout=150)
    assert tracebacks(page, handle) == []
    dash = page.locator('.jt-dash[data-source="browser"]')
    dash.locator('.jt-card[data-model="chatty"]').wait_for(timeout=30_000)
    assert dash.locator(".jt-latency-off").text_content() == "enable histogram_latencies for percentiles"
    dash.locator('.jt-tab[data-tab="logs"]').click()
    page.wait_for_function("() => [...document.querySelectorAll('.jt-dash .jt-log-line')]"
                           ".some(e => e.textContent.includes('[stdout] chatty saw 3 words'))", timeout=15_000)
    assert dash.locator(".jt-body").is_hidden() and dash.get_attribute("data-tab") == "logs"
    dash.screenshot(path=str(SHOTS / "notebook-dashboard-logs.png"))
    dash.locator('.jt-tab[data-tab="stats"]').click()
    assert dash.locator(".jt-logs").is_hidden() and dash.locator('.jt-card[data-model="chatty"]').is_visible()
    assert page.js_errors == []


KERNEL_LOGS = [
    # A python model in an in-kernel server (the browser cannot reach it): the logs tab is
    # fed by the kernel poller, which reads the lines once the view says the tab shows.
    "import base64, json, urllib.request\n"
    "from jupyter_triton.kernel.discovery import start_in_kernel\n"
    "from jupyter_triton.widgets import Dashboard\n"
    "conn = start_in_kernel()\n"
    "PY = '''\n"
    "import triton_python_backend_utils as pb_utils\n"
    "class TritonPythonModel:\n"
    "    def execute(self, requests):\n"
    "        out = []\n"
    "        for r in requests:\n"
    "            x = pb_utils.get_input_tensor_by_name(r, 'INPUT0').as_numpy()\n"
    "            pb_utils.Logger.log_warn(f'talker saw {x.shape[0]} rows')\n"
    "            out.append(pb_utils.InferenceResponse([pb_utils.Tensor('OUTPUT0', x)]))\n"
    "        return out\n"
    "'''\n"
    "config = {'name': 'talker', 'backend': 'python', 'max_batch_size': 8,\n"
    "          'input': [{'name': 'INPUT0', 'data_type': 'TYPE_FP32', 'dims': [2]}],\n"
    "          'output': [{'name': 'OUTPUT0', 'data_type': 'TYPE_FP32', 'dims': [2]}],\n"
    "          'parameters': {'EXECUTION_MODE': {'string_value': 'thread'}}}\n"
    "def post(path, body):\n"
    "    req = urllib.request.Request(conn.url + path, data=json.dumps(body).encode(),\n"
    "                                 headers={**conn.headers, 'Content-Type': 'application/json'})\n"
    "    return urllib.request.urlopen(req, timeout=60).read()\n"
    "post('v2/repository/models/talker/load', {'parameters': {'config': json.dumps(config),\n"
    "     'file:1/model.py': base64.b64encode(PY.encode()).decode()}})\n"
    "for rows in (1, 2):\n"
    "    post('v2/models/talker/infer', {'inputs': [{'name': 'INPUT0', 'shape': [rows, 2], 'datatype': 'FP32',\n"
    "                                                'data': [0.0] * (2 * rows)}]})\n"
    "import threading, time\n"
    "def later():   # a request after the view shows: its line comes once the logs tab is open\n"
    "    time.sleep(4)\n"
    "    post('v2/models/talker/infer', {'inputs': [{'name': 'INPUT0', 'shape': [3, 2], 'datatype': 'FP32',\n"
    "                                                'data': [0.0] * 6}]})\n"
    "threading.Thread(target=later, daemon=True).start()\n"
    "dash = Dashboard(conn, model='talker', interval=0.3)\n"
    "dash",
]


def test_notebook_logs_tab_fed_by_the_kernel(lab, browser_page):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in KERNEL_LOGS]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, lab.root / "kernel-logs.ipynb")
    page = browser_page
    panel, handle = open_notebook(page, lab, "kernel-logs.ipynb")
    run_all(page, handle)
    wait_all_done(page, handle, timeout=150)
    assert tracebacks(page, handle) == []
    dash = page.locator('.jt-dash[data-source="kernel"]')
    dash.locator('.jt-card[data-model="talker"]').wait_for(timeout=30_000)
    dash.locator('.jt-tab[data-tab="logs"]').click()
    page.wait_for_function("() => [...document.querySelectorAll('.jt-dash .jt-log-line')].filter(e => "
                           "/WARNING \\[logger\\] talker saw [123] rows/.test(e.textContent)).length === 3",
                           timeout=15_000)
    dash.screenshot(path=str(SHOTS / "notebook-dashboard-logs-from-the-kernel.png"))
    assert page.js_errors == []
