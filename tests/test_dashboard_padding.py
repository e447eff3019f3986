"""The dashboard's padding line (issue 36): a model served with ``ragged_batching: "pad"``
shows its padding waste (padded tokens / request tokens, from the statistics' ``padding``),
over the interval between two readings, in the kernel's figures, its text and HTML tables and
the browser's figures alike; a model that does not pad shows none."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from batch_clients import client, start_server, together
from jupyter_triton.widgets import Dashboard, Snapshot, figures
from jupyter_triton.widgets.figures import html_table, text_table
from test_padding_batching import _infer, _request, config, embedder
from test_widgets import FakeConnection, stats_row, wait_for


def padded(row: dict, batch_tokens: int, request_tokens: int) -> dict:
    row["padding"] = {"batch_tokens": batch_tokens, "request_tokens": request_tokens,
                      "waste_ratio": batch_tokens / request_tokens}
    return row


def snapshots() -> tuple[Snapshot, Snapshot]:
    before = Snapshot(t=1.0, model_stats=[padded(stats_row(name="pad", inferences=4), 400, 100),
                                          stats_row(name="plain", inferences=4)])
    # the interval: 150 padded tokens for 120 sent (since load it is 550 for 220)
    after = Snapshot(t=2.0, model_stats=[padded(stats_row(name="pad", inferences=8), 550, 220),
                                         stats_row(name="plain", inferences=8)])
    return before, after


def test_padding_waste_is_over_the_interval_and_only_where_a_model_pads():
    pad, plain = figures(*snapshots())
    assert pad.padding_waste == pytest.approx(150 / 120)
    assert plain.padding_waste is None
    (first, _) = figures(None, snapshots()[1])               # no earlier reading: since load
    assert first.padding_waste == pytest.approx(550 / 220)
    text, page = text_table([pad, plain]), html_table([pad, plain])
    assert text.count("padding waste") == 1 and "padding waste 1.25" in text
    assert page.count("padding waste") == 1 and "padding waste 1.25" in page
    assert "padding waste" not in text_table([plain]) + html_table([plain])


@pytest.mark.skipif(shutil.which("node") is None, reason="node not installed (needed to run dashboard.js here)")
def test_the_browser_shows_the_same_padding_waste(tmp_path):
    import jupyter_triton.widgets as widgets
    before, after = snapshots()
    script = tmp_path / "run.mjs"
    script.write_text(
        f"import {{ figures }} from {json.dumps((Path(widgets.__file__).parent / 'dashboard.js').as_uri())};\n"
        f"console.log(JSON.stringify([figures({json.dumps(before.to_json())}, {json.dumps(after.to_json())}),"
        f" figures(null, {json.dumps(after.to_json())})]));\n")
    done = subprocess.run(["node", str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    (js_pad, js_plain), (js_first, _) = json.loads(done.stdout)
    py_pad, _ = figures(before, after)
    assert js_pad["paddingWaste"] == pytest.approx(py_pad.padding_waste)
    assert js_plain["paddingWaste"] is None
    assert js_first["paddingWaste"] == pytest.approx(550 / 220)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("dashboard-padding") / "models"
    # a batch leaves when 2 requests wait (a 30 s delay otherwise)
    embedder(repo / "embed" / "1" / "model.onnx")
    (repo / "embed" / "config.pbtxt").write_text(
        config("embed", "max_queue_delay_microseconds: 30000000 preferred_batch_size: [ 2 ]"))
    srv = start_server(repo, ["embed"])
    yield srv
    srv.close()


def test_a_served_padding_model_shows_its_waste_in_the_dashboard(server):
    """Requests of 4 and 8 tokens batch together: 16 padded tokens for 12 sent."""
    rng = np.random.default_rng(3)
    sent = [_request(rng, 4), _request(rng, 8)]
    together(lambda i: _infer(client(server), "embed", *sent[i]), 2)
    dash = Dashboard(FakeConnection(url=f"http://127.0.0.1:{server.http_port}/"), interval=0.1)
    try:
        f = wait_for(lambda: (f := dash.figures_for("embed")) and f.inference_count == 2 and f)
        assert f.padding_waste == pytest.approx(16 / 12)
        assert "padding waste 1.33" in text_table([f])
    finally:
        dash.close()
