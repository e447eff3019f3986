"""The dashboard draws an ensemble as a graph: steps as boxes, tensors as arrows, each step's
rate, its model's p50/p99 and failures, a failed step marked. The kernel poller brings the
graph (the ensemble's config) and the steps' models' statistics along with a one-model
reading; dashboard.js draws the same from the browser. Rendering is checked in node with a
small stand-in for the DOM (the real browser is tests/test_browser_ensemble_graph.py)."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import serve
from decoupled_models import write_model
from jupyter_triton.widgets import dashboard as dashboard_module
from jupyter_triton.widgets.dashboard import Dashboard

DASHBOARD_JS = (Path(dashboard_module.__file__).parent / "dashboard.js").as_uri()

# x -> 2x, and a checker that fails on a negative value: a pipeline with a step that can fail
DOUBLE = '''\
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.005)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2)]) for r in requests]
'''

CHECK = '''\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            if (x < 0).any():
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative input")))
            else:
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x + 1)]))
        return out
'''

STEP = '''\
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "X", data_type: TYPE_FP32, dims: [ 2 ] }} ]
output [ {{ name: "Y", data_type: TYPE_FP32, dims: [ 2 ] }} ]
'''

PIPE = '''\
name: "pipe"
platform: "ensemble"
max_batch_size: 0
input [ { name: "x", data_type: TYPE_FP32, dims: [ 2 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 2 ] } ]
ensemble_scheduling { step [
  { model_name: "double" model_version: -1
    input_map { key: "X" value: "x" } output_map { key: "Y" value: "doubled" } },
  { model_name: "check" model_version: -1
    input_map { key: "X" value: "doubled" } output_map { key: "Y" value: "y" } } ] }
'''


def write_pipeline(root: Path) -> Path:
    write_model(root, "double", DOUBLE, STEP.format(name="double"))
    write_model(root, "check", CHECK, STEP.format(name="check"))
    (root / "pipe" / "1").mkdir(parents=True)
    (root / "pipe" / "config.pbtxt").write_text(PIPE)
    return root


def call(client, value: float) -> bool:
    x = httpclient.InferInput("x", [2], "FP32")
    x.set_data_from_numpy(np.full(2, value, np.float32))
    try:
        client.infer("pipe", [x])
        return True
    except Exception:  # noqa: BLE001 - the failing step's error is what the test wants
        return False


class Connection:
    def __init__(self, url: str) -> None:
        self.url, self.mode, self.token = url, "test", ""

    @property
    def headers(self) -> dict[str, str]:
        return {}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = write_pipeline(tmp_path_factory.mktemp("graph") / "models")
    server, client = serve(root, model_control_mode="explicit", load_models=["*"],
                           histogram_latencies=True)
    yield server, client
    client.close()
    server.close()


# A stand-in for the few DOM calls graphSvg makes; serialised as nested JSON.
FAKE_DOM = """
class Node {
  constructor(tag) { this.tag = tag; this.attrs = {}; this.children = []; this.text = ""; }
  setAttribute(k, v) { this.attrs[k] = String(v); }
  appendChild(c) { this.children.push(c); return c; }
  set textContent(t) { this.text = String(t); }
  get textContent() { return this.text + this.children.map(c => c.textContent).join(""); }
  toJSON() { return { tag: this.tag, attrs: this.attrs, text: this.text, children: this.children }; }
}
globalThis.document = { createElementNS: (ns, tag) => new Node(tag), createElement: tag => new Node(tag) };
"""


def run_node(tmp_path: Path, body: str) -> object:
    script = tmp_path / "run.mjs"
    script.write_text(FAKE_DOM + f"const m = await import({json.dumps(DASHBOARD_JS)});\n" + body)
    done = subprocess.run(["node", str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def walk(node: dict):
    yield node
    for child in node.get("children", []):
        yield from walk(child)


def test_the_kernel_poller_brings_the_graph_and_the_steps_percentiles(pipeline, tmp_path):
    server, client = pipeline
    dash = Dashboard(Connection(server.url + "/"), model="pipe", poll_kernel=False)
    first = dash.poller.poll_once()
    assert first.graphs["pipe"] == {
        "inputs": ["x"], "outputs": ["y"],
        "steps": [{"step": 1, "model": "double", "inputs": {"X": "x"}, "outputs": {"Y": "doubled"}},
                  {"step": 2, "model": "check", "inputs": {"X": "doubled"}, "outputs": {"Y": "y"}}]}
    # a one-model reading: the steps' models come along, for their percentiles
    assert sorted(m["name"] for m in first.composing) == ["check", "double"]
    results = [call(client, v) for v in (1, 2, -1, 3, 4)]
    assert results == [True, True, False, True, True]
    second = dash.poller.poll_once()
    dash.close()
    if shutil.which("node") is None:
        pytest.skip("node not installed (needed to run dashboard.js here)")
    out = run_node(tmp_path, (
        f"const windows = m.latencyWindows();\n"
        f"const [f0] = m.figures(null, {json.dumps(first.to_json())}, windows);\n"
        f"const [f] = m.figures({json.dumps(first.to_json())}, {json.dumps(second.to_json())}, windows);\n"
        f"console.log(JSON.stringify({{steps: f.steps, graph: f.graph, svg: m.graphSvg(f.graph, f.steps)}}));\n"))
    steps = {s["model"]: s for s in out["steps"]}
    assert steps["double"]["runs"] == 5 and steps["double"]["failures"] == 0
    assert steps["check"]["runs"] == 4 and steps["check"]["failures"] == 1 and steps["check"]["failing"]
    assert steps["double"]["perS"] > 0
    # double sleeps 5 ms a request: no percentile of its can be below that bucket's bound
    assert 5.0 <= steps["double"]["p50"] <= steps["double"]["p99"], steps["double"]
    nodes = [n for n in walk(out["svg"]) if n["tag"] == "g" and "jt-node" in n["attrs"].get("class", "")]
    by_model = {n["attrs"].get("data-model", n["attrs"].get("data-io")): n for n in nodes}
    assert set(by_model) == {"inputs", "outputs", "double", "check"}
    assert "jt-step-failed" in by_model["check"]["attrs"]["class"]
    assert "jt-step-failed" not in by_model["double"]["attrs"]["class"]
    text = {k: " | ".join(c["text"] for c in n["children"] if c["tag"] == "text") for k, n in by_model.items()}
    assert text["check"].startswith("2. check v1") and "1 failed" in text["check"]
    assert "req/s" in text["double"] and "p50 " in text["double"] and "p99 " in text["double"]
    edges = {n["attrs"]["data-tensor"]: (n["attrs"]["data-from"], n["attrs"]["data-to"])
             for n in walk(out["svg"]) if "jt-edge" == n["attrs"].get("class")}
    assert edges == {"x": ("in", "1"), "doubled": ("1", "2"), "y": ("2", "out")}


def test_a_diamond_lays_out_in_columns_by_depth(tmp_path):
    if shutil.which("node") is None:
        pytest.skip("node not installed (needed to run dashboard.js here)")
    config = {"input": [{"name": "a"}], "output": [{"name": "z"}],
              "ensemble_scheduling": {"step": [
                  {"model_name": "join", "input_map": {"L": "l", "R": "r"}, "output_map": {"Z": "z"}},
                  {"model_name": "left", "input_map": {"X": "a"}, "output_map": {"Y": "l"}},
                  {"model_name": "right", "input_map": {"X": "a"}, "output_map": {"Y": "r"}}]}}
    out = run_node(tmp_path, f"console.log(JSON.stringify(m.graphSvg(m.ensembleGraph({json.dumps(config)}), [])));\n")
    x = {n["attrs"].get("data-model", n["attrs"].get("data-io")): float(n["attrs"]["transform"][10:].split(",")[0])
         for n in walk(out) if n["tag"] == "g" and "jt-node" in n["attrs"].get("class", "")}
    assert x["inputs"] < x["left"] == x["right"] < x["join"] < x["outputs"]
    labels = sorted(n["attrs"]["data-tensor"] for n in walk(out) if n["attrs"].get("class") == "jt-edge")
    assert labels == ["a", "a", "l", "r", "z"]
