"""Live views show the recent past: a dashboard (or an ensemble's graph) opened after the
traffic stopped shows the figures of the last requests and says over what window, not dashes;
so does one that watched the traffic stop a minute ago. Kernel side (figures.py) and browser
side (dashboard.js, in node) alike."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import serve
from jupyter_triton.widgets import Dashboard, Snapshot, figures
from jupyter_triton.widgets.figures import LatencyWindows, html_table, text_table
from test_ensemble_graph import Connection, call, run_node, walk, write_pipeline
from test_widgets import stats_row, with_histogram

needs_node = pytest.mark.skipif(shutil.which("node") is None,
                                reason="node not installed (needed to run dashboard.js here)")


@pytest.fixture(scope="module")
def after_traffic(tmp_path_factory):
    """The notebook-08 story: 16 requests through a two-step ensemble, then a dashboard of it
    opened once they are done, and a second reading with still no traffic."""
    root = write_pipeline(tmp_path_factory.mktemp("live") / "models")
    server, client = serve(root, model_control_mode="explicit", load_models=["*"], histogram_latencies=True)
    try:
        assert all(call(client, v) for v in range(1, 17))
        dash = Dashboard(Connection(server.url + "/"), model="pipe", poll_kernel=False)
        first, first_figures = dash._last, list(dash.figures)
        second_figures = dash.refresh()
        yield dash, first, dash._last, first_figures, second_figures
        dash.close()
    finally:
        client.close()
        server.close()


def test_a_dashboard_opened_after_traffic_stopped_shows_the_last_requests(after_traffic):
    _, _, _, first, second = after_traffic
    for (f,) in (first, second):
        request = f.latency["request"]
        assert request["count"] == 16 and request["window"] == "16 since load", request
        assert None not in (request["p50"], request["p95"], request["p99"])
        assert 5.0 <= request["p50"] <= request["p99"], request    # the 'double' step sleeps 5 ms
        # each step's time: every run's mean since load, said so (no run in the interval)
        assert [(s.model, s.runs, s.mean_window) for s in f.steps] == [
            ("double", 16, "since load"), ("check", 16, "since load")]
        assert all(s.mean_us and s.mean_us > 0 for s in f.steps)
        assert f.last_request_s is not None and f.last_request_s >= 0
    text = text_table(second)
    assert "p50 –" not in text and "16 since load" in text and "last request" in text, text
    assert "mean of 16 runs since load" in text
    assert "16 since load" in html_table(second)


def test_a_window_that_emptied_keeps_the_last_requests_figures():
    """A dashboard watching when the traffic stopped: a minute later its window holds no request;
    it shows the last ones' percentiles, and says that none came in the last minute."""
    windows, prev, seen = LatencyWindows(60.0), None, []
    for t, total in ((100.0, 0), (110.0, 8), (200.0, 8), (300.0, 8)):
        snap = Snapshot(t=t, model_stats=[with_histogram(stats_row(), [total, total, total, total])])
        (f,) = figures(prev, snap, windows)
        seen.append(f.latency["request"])
        prev = snap
    assert seen[0]["window"] == "no requests yet" and seen[0]["p50"] is None
    assert seen[1]["window"] == "8 since load" and seen[1]["p50"] == pytest.approx(0.5)
    for q in seen[2:]:
        assert q["window"] == "the last 8, none in the last minute" and q["p50"] == pytest.approx(0.5)
        assert q["p99"] == pytest.approx(0.99) and q["count"] == 8


@needs_node
def test_the_browser_shows_the_same_after_traffic_stopped(after_traffic, tmp_path):
    """dashboard.js from the same readings: the percentiles and their window, each step's
    mean (no 'req/s · –' box in the graph), and the idle sparkline says when the last request was."""
    _, first, second, _, (py,) = after_traffic
    out = run_node(tmp_path, (
        "const windows = m.latencyWindows();\n"
        f"m.figures(null, {json.dumps(first.to_json())}, windows);\n"
        f"const [f] = m.figures({json.dumps(first.to_json())}, {json.dumps(second.to_json())}, windows);\n"
        "console.log(JSON.stringify({f, svg: m.graphSvg(f.graph, f.steps), spark: m.spark([0, 0], f.lastRequestS),"
        " sparkNew: m.spark([0], null)}));\n"))
    js = out["f"]
    for kind, q in js["latency"].items():
        assert q["count"] == py.latency[kind]["count"] == 16 and q["window"] == py.latency[kind]["window"]
        for p in ("p50", "p95", "p99"):
            assert q[p] == pytest.approx(py.latency[kind][p])
    assert [(s["meanUs"], s["meanWindow"]) for s in js["steps"]] == [
        (pytest.approx(s.mean_us), s.mean_window) for s in py.steps]
    boxes = [n for n in walk(out["svg"]) if n["tag"] == "g" and n["attrs"].get("data-step")]
    assert len(boxes) == 2
    for box in boxes:
        lines = [c["text"] for c in box["children"] if c["tag"] == "text"]
        assert not any("–" in line for line in lines), lines
        assert any(line.startswith("idle · ") and "mean of 16" in line for line in lines), lines
        assert any(line.startswith("p50 ") and "ms" in line for line in lines), lines
    idle = [n["text"] for n in walk(out["spark"]) if n["tag"] == "text"]
    assert len(idle) == 1 and "last request" in idle[0], idle
    assert [n["text"] for n in walk(out["sparkNew"]) if n["tag"] == "text"] == ["no requests yet"]


@needs_node
def test_the_browser_window_that_emptied_matches(tmp_path):
    snaps = [Snapshot(t=t, model_stats=[with_histogram(stats_row(), [n, n, n, n])]).to_json()
             for t, n in ((100.0, 0), (110.0, 8), (200.0, 8))]
    out = run_node(tmp_path, (
        f"const snaps = {json.dumps(snaps)}, w = m.latencyWindows(60);\n"
        "let prev = null; const out = [];\n"
        "for (const s of snaps) { out.push(m.figures(prev, s, w)[0].latency.request); prev = s; }\n"
        "console.log(JSON.stringify(out));\n"))
    assert [q["window"] for q in out] == ["no requests yet", "8 since load", "the last 8, none in the last minute"]
    assert out[2]["p50"] == pytest.approx(0.5) and out[2]["count"] == 8
