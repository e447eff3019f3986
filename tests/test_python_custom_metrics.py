"""Custom metrics (pb_utils.MetricFamily / Metric) of python models on the server's metrics
endpoint, in the worker process and in thread mode. The calls of NVIDIA's
examples/custom_metrics are made against our own model of theirs; the published model and
client run unchanged only where $JUPYTER_TRITON_BACKEND_EXAMPLES names a folder holding them
(tests/triton_example_models.py)."""
from __future__ import annotations

import textwrap
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from jupyter_triton.engine import EngineOptions
from test_backend_python import THREAD_MODE
from triton_example_models import CUSTOM_METRICS_PY, add_model, published, run_published

pytestmark = pytest.mark.timeout(180)

MODES = ["process", "thread"]

# examples/custom_metrics/config.pbtxt
CUSTOM_METRICS_CONFIG = '''
name: "custom_metrics"
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
input [ { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [{ kind: KIND_CPU }]
'''

# Every kind and every rule a model meets, reported back as text.
KINDS_MODEL_PY = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.calls = pb_utils.MetricFamily(name="demo_calls", description="Calls seen",
                                           kind=pb_utils.MetricFamily.COUNTER)
        self.calls_a = self.calls.Metric(labels={"path": "a"})
        # same name and kind: the same family; the first description stays
        self.calls_b = pb_utils.MetricFamily(name="demo_calls", description="ignored",
                                             kind=pb_utils.MetricFamily.COUNTER).Metric(labels={"path": "b"})
        self.depth = pb_utils.MetricFamily(name="demo_depth", description="Queue depth",
                                           kind=pb_utils.MetricFamily.GAUGE).Metric()
        self.sizes = pb_utils.MetricFamily(name="demo_sizes", description="Sizes",
                                           kind=pb_utils.MetricFamily.HISTOGRAM).Metric(
                                               labels={"unit": "items"}, buckets=[1.0, 10.0])

    def execute(self, requests):
        out = []
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy().reshape(-1)[0])
            self.calls_a.increment(1)
            self.calls_b.increment(2)
            self.depth.set(n)
            self.sizes.observe(n)
            errors = []
            for attempt in (lambda: self.calls_a.increment(-1), lambda: self.calls_a.set(3),
                            lambda: self.depth.observe(1), lambda: self.sizes.value(),
                            lambda: pb_utils.MetricFamily(name="demo_calls", description="",
                                                          kind=pb_utils.MetricFamily.GAUGE)):
                try:
                    attempt()
                    errors.append(None)
                except pb_utils.TritonModelException as err:
                    errors.append(str(err))
            report = {"a": self.calls_a.value(), "b": self.calls_b.value(), "depth": self.depth.value(),
                      "errors": errors}
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor(
                "REPORT", np.array([json.dumps(report).encode()], dtype=np.object_))]))
        return out
'''

KINDS_CONFIG = '''
name: "kinds"
backend: "python"
input [{ name: "N" data_type: TYPE_INT32 dims: [ 1 ] }]
output [{ name: "REPORT" data_type: TYPE_STRING dims: [ 1 ] }]
'''


def start(repo: Path):
    from jupyter_triton.standalone import start_in_thread
    return start_in_thread(EngineOptions(model_repository=repo, model_control_mode="explicit",
                                         load_models=["*"]),
                           host="127.0.0.1", http_port=0, metrics_port=0, grpc_port=None)


def scrape(server) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
        return r.read().decode()


@pytest.mark.parametrize("mode", MODES)
def test_the_custom_metrics_examples_calls(tmp_path, mode):
    # examples/custom_metrics client.py: add/sub of two random FP32 [4] inputs, then the
    # model's counter on the metrics endpoint with its HELP, TYPE and labelled series
    repo = tmp_path / "models"
    add_model(repo, "custom_metrics", CUSTOM_METRICS_PY,
              CUSTOM_METRICS_CONFIG + (THREAD_MODE if mode == "thread" else ""))
    server = start(repo)
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    try:
        rng = np.random.default_rng(3)
        a, b = rng.random(4, dtype=np.float32), rng.random(4, dtype=np.float32)
        inputs = [httpclient.InferInput("INPUT0", [4], "FP32"), httpclient.InferInput("INPUT1", [4], "FP32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        result = client.infer("custom_metrics", inputs, request_id="1", outputs=[
            httpclient.InferRequestedOutput("OUTPUT0"), httpclient.InferRequestedOutput("OUTPUT1")])
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b, rtol=1e-6)
        np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b, rtol=1e-6)
        text = scrape(server)
        assert "# HELP requests_process_latency_ns Cumulative time spent processing requests" in text
        assert "# TYPE requests_process_latency_ns counter" in text
        series = 'requests_process_latency_ns{model="custom_metrics",version="1"}'
        line = next(ln for ln in text.splitlines() if ln.startswith(series))
        assert float(line.split()[-1]) > 0      # the model's execute time, in ns
        client.unload_model("custom_metrics")
        # the model's metrics leave with it
        assert "requests_process_latency_ns" not in scrape(server)
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("mode", MODES)
def test_nvidias_custom_metrics_example_runs_unchanged(tmp_path, mode):
    model = published("JUPYTER_TRITON_BACKEND_EXAMPLES", "custom_metrics/model.py")
    script = published("JUPYTER_TRITON_BACKEND_EXAMPLES", "custom_metrics/client.py")
    repo = tmp_path / "models"
    add_model(repo, "custom_metrics", model.read_text(),
              CUSTOM_METRICS_CONFIG + (THREAD_MODE if mode == "thread" else ""))
    server = start(repo)
    try:
        # The client has no address flags: only its two addresses are changed, in a copy.
        run = run_published(script, workdir=tmp_path, addresses={
            '"localhost:8000"': f'"127.0.0.1:{server.http_port}"',
            "http://localhost:8002/metrics": f"http://127.0.0.1:{server.metrics_port}/metrics"})
        assert run.returncode == 0, run.stdout + run.stderr
        assert "PASS: custom_metrics" in run.stdout
        line = next(ln for ln in scrape(server).splitlines()
                    if ln.startswith('requests_process_latency_ns{model="custom_metrics",version="1"}'))
        assert float(line.split()[-1]) > 0      # the model's execute time, in ns
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        client.unload_model("custom_metrics")
        # the model's metrics leave with it
        assert "requests_process_latency_ns" not in scrape(server)
    finally:
        server.close()


@pytest.mark.parametrize("mode", MODES)
def test_counter_gauge_histogram_and_the_rules_of_each(tmp_path, mode):
    import json
    repo = tmp_path / "models"
    add_model(repo, "kinds", textwrap.dedent(KINDS_MODEL_PY), KINDS_CONFIG + (THREAD_MODE if mode == "thread" else ""))
    server = start(repo)
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        for n in (5, 20):
            inp = httpclient.InferInput("N", [1], "INT32")
            inp.set_data_from_numpy(np.array([n], dtype=np.int32))
            report = json.loads(client.infer("kinds", [inp]).as_numpy("REPORT")[0])
        assert (report["a"], report["b"], report["depth"]) == (2, 4, 20)
        negative, set_counter, observe_gauge, histogram_value, other_kind = report["errors"]
        assert "non-negative" in negative and "only a GAUGE can be set" in set_counter
        assert "only a HISTOGRAM observes" in observe_gauge
        assert "histogram" in histogram_value and "no single value" in histogram_value
        assert "already exists as a counter" in other_kind
        text = scrape(server)
        assert "# HELP demo_calls Calls seen\n# TYPE demo_calls counter" in text
        assert 'demo_calls{path="a"} 2' in text and 'demo_calls{path="b"} 4' in text
        assert "# TYPE demo_depth gauge\ndemo_depth 20" in text
        assert "# TYPE demo_sizes histogram" in text
        for sample in ('demo_sizes_bucket{unit="items",le="1.0"} 0',
                       'demo_sizes_bucket{unit="items",le="10.0"} 1',
                       'demo_sizes_bucket{unit="items",le="+Inf"} 2',
                       'demo_sizes_sum{unit="items"} 25', 'demo_sizes_count{unit="items"} 2'):
            assert sample in text, sample
    finally:
        server.close()


# Labels, names, descriptions and buckets that are not plain data. Triton's Metric API takes
# labels as a dict of str to str: anything else is the model's TypeError, which it may catch;
# uncaught, it fails that request only, and the same worker serves the next one.
BAD_ARGS_MODEL_PY = '''
import json, os
import numpy as np
import triton_python_backend_utils as pb_utils

BAD_LABELS = {"object": object(), "numpy": np.int64(3), "list": [1, 2]}

class TritonPythonModel:
    def initialize(self, args):
        self.family = pb_utils.MetricFamily(name="bad_args", description="Bad arguments",
                                            kind=pb_utils.MetricFamily.COUNTER)

    def execute(self, requests):
        out = []
        for request in requests:
            case = pb_utils.get_input_tensor_by_name(request, "CASE").as_numpy().reshape(-1)[0].decode()
            errors = {}
            if case == "caught":
                attempts = {name: (lambda v=value: self.family.Metric(labels={"k": v}))
                            for name, value in BAD_LABELS.items()}
                attempts["label_name"] = lambda: self.family.Metric(labels={object(): "v"})
                attempts["labels"] = lambda: self.family.Metric(labels=[("k", "v")])
                attempts["description"] = lambda: pb_utils.MetricFamily(
                    name="bad_description", description=object(), kind=pb_utils.MetricFamily.GAUGE)
                attempts["family_name"] = lambda: pb_utils.MetricFamily(
                    name=object(), description="", kind=pb_utils.MetricFamily.GAUGE)
                attempts["buckets"] = lambda: pb_utils.MetricFamily(
                    name="bad_buckets", description="", kind=pb_utils.MetricFamily.HISTOGRAM
                ).Metric(labels={"k": "v"}, buckets=[1.0, object()])
                for name, attempt in attempts.items():
                    try:
                        attempt()
                        errors[name] = None
                    except (TypeError, ValueError) as err:
                        errors[name] = f"{type(err).__name__}: {err}"
            elif case in BAD_LABELS:
                self.family.Metric(labels={"k": BAD_LABELS[case]})   # uncaught: this request fails
            # a numpy string is a str: Triton takes it, and it shows as plain text
            fine = self.family.Metric(labels={"k": np.str_("fine")})
            fine.increment(1)
            report = {"pid": os.getpid(), "fine": fine.value(), "errors": errors}
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor(
                "REPORT", np.array([json.dumps(report).encode()], dtype=np.object_))]))
        return out
'''

BAD_ARGS_CONFIG = '''
name: "bad_args"
backend: "python"
input [{ name: "CASE" data_type: TYPE_STRING dims: [ 1 ] }]
output [{ name: "REPORT" data_type: TYPE_STRING dims: [ 1 ] }]
'''


@pytest.mark.parametrize("mode", MODES)
def test_metric_arguments_that_are_not_plain_data_fail_in_the_model_not_the_worker(tmp_path, mode):
    import json
    from tritonclient.utils import InferenceServerException
    repo = tmp_path / "models"
    add_model(repo, "bad_args", textwrap.dedent(BAD_ARGS_MODEL_PY),
              BAD_ARGS_CONFIG + (THREAD_MODE if mode == "thread" else ""))
    server = start(repo)
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")

    def infer(case: str) -> dict:
        inp = httpclient.InferInput("CASE", [1], "BYTES")
        inp.set_data_from_numpy(np.array([case.encode()], dtype=np.object_))
        return json.loads(client.infer("bad_args", [inp]).as_numpy("REPORT")[0])

    try:
        first = infer("ok")
        caught = infer("caught")
        errors = caught["errors"]
        for name in ("object", "numpy", "list"):
            assert errors[name] is not None and errors[name].startswith("TypeError"), (name, errors)
            assert "'k'" in errors[name], errors[name]
        assert errors["label_name"].startswith("TypeError") and "label name" in errors["label_name"]
        assert errors["labels"].startswith("TypeError") and "dict" in errors["labels"]
        assert errors["description"].startswith("TypeError") and "description" in errors["description"]
        assert errors["family_name"].startswith("TypeError") and "name" in errors["family_name"]
        assert errors["buckets"].startswith("TypeError") and "buckets" in errors["buckets"]
        for case in ("object", "numpy", "list"):
            with pytest.raises(InferenceServerException) as failed:
                infer(case)
            assert "TypeError" in str(failed.value) and "'k'" in str(failed.value), str(failed.value)
        last = infer("ok")
        # the same worker (thread mode: the server) served every request, none was lost
        assert last["pid"] == first["pid"] == caught["pid"]
        assert (first["fine"], caught["fine"], last["fine"]) == (1, 2, 3)
        text = scrape(server)
        assert 'bad_args{k="fine"} 3' in text
        assert "bad_description" not in text and "bad_buckets_bucket" not in text
    finally:
        client.close()
        server.close()
