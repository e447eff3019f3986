"""The ensemble drawn live in a real browser: JupyterLab with the extension keeping latency
histograms, the sidebar's dashboard view of a two-step pipeline whose second step fails on
negative inputs; while requests flow, each box shows its step's rate, its model's p50/p99 and
failures, and the failing step is marked.

The screenshot goes to $JUPYTER_TRITON_SCREENSHOTS when set (benchmarks/results/browser/ for
the committed one), else to a scratch folder."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from test_ensemble_graph import write_pipeline
from test_labextension import IGNORED_CONSOLE, PANEL_TAB, _card

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "browser"))

from lab import CHROMIUM, launch_browser, start_lab  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason=f"no {CHROMIUM} (apt-get install chromium fonts-dejavu-core)"),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None,
                       reason="the python package playwright is not installed"),
    pytest.mark.timeout(300),
]

# Each box of the drawn graph, as the user reads it.
JS_GRAPH = """() => {
  const svg = document.querySelector('.jp-TritonModelView[data-model="pipe"] svg.jt-graph');
  if (!svg) return null;
  const boxes = {};
  for (const g of svg.querySelectorAll('g.jt-node')) {
    const key = g.dataset.model || g.dataset.io;
    boxes[key] = {cls: g.getAttribute('class'),
                  lines: [...g.querySelectorAll('text')].map(t => t.textContent)};
  }
  const arrows = [...svg.querySelectorAll('g.jt-edge')].map(g => g.dataset.tensor).sort();
  return {boxes, arrows};
}"""


def test_the_ensemble_graph_moves_live_in_the_lab(tmp_path):
    from playwright.sync_api import sync_playwright

    shots = Path(os.environ.get("JUPYTER_TRITON_SCREENSHOTS") or tempfile.mkdtemp(prefix="jt-shots-"))
    shots.mkdir(parents=True, exist_ok=True)
    repository = write_pipeline(tmp_path / "models")
    (tmp_path / "root").mkdir()
    lab = start_lab(tmp_path / "state", tmp_path / "root", repository,
                    triton={"histogram_latencies": True})
    stop = threading.Event()
    outcomes = {"ok": 0, "failed": 0}

    def traffic() -> None:
        # every fifth request fails at the second step; bounded in count and time
        deadline = time.monotonic() + 120
        for i in range(4000):
            if stop.is_set() or time.monotonic() > deadline:
                return
            value = -1.0 if i % 5 == 4 else 1.0
            body = json.dumps({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32",
                                           "data": [value, value]}]}).encode()
            req = urllib.request.Request(f"{lab.url}v2/models/pipe/infer", data=body, method="POST",
                                         headers={"Authorization": f"token {lab.token}"})
            try:
                with urllib.request.urlopen(req, timeout=30):
                    outcomes["ok"] += 1
            except urllib.error.HTTPError:
                outcomes["failed"] += 1
            time.sleep(0.02)

    errors: list[str] = []
    sender = threading.Thread(target=traffic, daemon=True)
    try:
        with sync_playwright() as p:
            ctx = launch_browser(p, tmp_path / "chromium", viewport=(1400, 900))
            try:
                page = ctx.pages[0] if ctx.pages else ctx.new_page()
                page.set_default_timeout(60_000)
                page.on("console", lambda m: m.type == "error"
                        and not any(r.search(m.text) for r in IGNORED_CONSOLE)
                        and errors.append(f"console.error: {m.text[:300]}"))
                page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
                page.goto(f"{lab.url}lab/workspaces/t{int(time.time() * 1000)}?reset&token="
                          f"{urllib.parse.quote(lab.token)}", wait_until="domcontentloaded")
                page.locator(PANEL_TAB).click()
                page.locator(_card("pipe", "1", "READY")).wait_for(timeout=30_000)
                page.locator(f'{_card("pipe", "1")} button[data-action="dashboard"]').click()
                view = page.locator('.jp-TritonModelView[data-model="pipe"]')
                view.locator('.jt-dash[data-source="browser"] svg.jt-graph').wait_for(timeout=30_000)
                drawn = page.evaluate(JS_GRAPH)
                assert set(drawn["boxes"]) == {"inputs", "outputs", "double", "check"}, drawn
                assert drawn["arrows"] == ["doubled", "x", "y"], drawn
                sender.start()
                # live: rates above zero, percentiles from the steps' models, the failing step marked
                page.wait_for_function(
                    f"() => {{ const g = ({JS_GRAPH})(); if (!g) return false;"
                    " const d = g.boxes.double, c = g.boxes.check;"
                    " return d && c && !d.lines[1].startsWith('0.0 req/s') && /p50 [0-9.]+ ms/.test(d.lines[2])"
                    " && c.cls.includes('jt-step-failed') && /[1-9][0-9]* failed/.test(c.lines[3]); }",
                    timeout=60_000)
                first = page.evaluate(JS_GRAPH)
                ticks = int(view.locator(".jt-dash").get_attribute("data-ticks"))
                page.wait_for_function(
                    "(t) => parseInt(document.querySelector('.jp-TritonModelView[data-model=\"pipe\"] .jt-dash')"
                    ".dataset.ticks, 10) >= t + 2", arg=ticks, timeout=15_000)
                later = page.evaluate(JS_GRAPH)
                view.locator(".jt-card").first.screenshot(path=str(shots / "labextension-ensemble-graph.png"))
            finally:
                stop.set()
                ctx.close()
    finally:
        stop.set()
        lab.stop()
    assert errors == [], errors
    assert "jt-step-failed" not in first["boxes"]["double"]["cls"]
    failed = [int(later["boxes"]["check"]["lines"][3].split()[0]),
              int(first["boxes"]["check"]["lines"][3].split()[0])]
    assert failed[0] >= failed[1] >= 1 and outcomes["failed"] >= 1, (first, later, outcomes)
    assert later["boxes"]["double"]["lines"][0] == "1. double v1"


def test_the_sidebar_tells_resident_from_evicted_models(tmp_path):
    """Within a residency budget of one model, calling the second evicts the first: its card
    says EVICTED (not a failure), the other's is resident."""
    from playwright.sync_api import sync_playwright

    from test_residency import budget_for, fleet, ones
    import tritonclient.http as httpclient

    shots = Path(os.environ.get("JUPYTER_TRITON_SCREENSHOTS") or tempfile.mkdtemp(prefix="jt-shots-"))
    repository = tmp_path / "models"
    size = fleet(repository, n=2)
    (tmp_path / "root").mkdir()
    lab = start_lab(tmp_path / "state", tmp_path / "root", repository,
                    triton={"model_residency_bytes": budget_for(1, size), "load_on_demand": True})
    errors: list[str] = []
    try:
        address = lab.url.split("//", 1)[1].rstrip("/")
        client = httpclient.InferenceServerClient(address, network_timeout=120)
        auth = {"Authorization": f"token {lab.token}"}
        for model in ("m0", "m1"):
            client.infer(model, [ones()], headers=auth)
        index = {r["name"]: r for r in client.get_model_repository_index(headers=auth)}
        assert index["m0"].get("reason") == "evicted: residency budget", index
        with sync_playwright() as p:
            ctx = launch_browser(p, tmp_path / "chromium", viewport=(1400, 900))
            try:
                page = ctx.pages[0] if ctx.pages else ctx.new_page()
                page.set_default_timeout(60_000)
                page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
                page.goto(f"{lab.url}lab/workspaces/t{int(time.time() * 1000)}?reset&token="
                          f"{urllib.parse.quote(lab.token)}", wait_until="domcontentloaded")
                page.locator(PANEL_TAB).click()
                evicted = page.locator(f'{_card("m0")}[data-residency="evicted"]')
                evicted.wait_for(timeout=30_000)
                assert evicted.locator(".jp-TritonPanel-state").text_content() == "EVICTED"
                assert "jp-TritonPanel-state-evicted" in evicted.locator(".jp-TritonPanel-state").get_attribute("class")
                resident = page.locator(f'{_card("m1", "1", "READY")}[data-residency="resident"]')
                resident.wait_for(timeout=30_000)
                page.locator("#jupyter-triton-panel").screenshot(path=str(shots / "labextension-residency.png"))
            finally:
                ctx.close()
    finally:
        lab.stop()
    assert errors == [], errors
