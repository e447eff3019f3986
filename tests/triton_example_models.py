"""Models of our own that do what NVIDIA's published python_backend examples do, for the tests
that make those examples' calls; and the switch that runs the published files themselves.

NVIDIA's example files (BSD-3, their text) are not kept in this repository. A test that runs
one unchanged takes it from a folder named in the environment and skips, saying which, where
the variable is unset or the folder lacks the file:

- ``$JUPYTER_TRITON_CLIENT_EXAMPLES``: a checkout's ``client/src/python/examples`` folder
  (simple_grpc_custom_repeat.py, simple_{http,grpc}_model_control.py, the three sequence
  clients, simple_{http,grpc}_health_metadata.py, grpc_explicit_int*_content_client.py).
- ``$JUPYTER_TRITON_BACKEND_EXAMPLES``: a checkout's ``python_backend/examples`` folder, in its
  own layout: ``decoupled/`` (repeat and square models, configs, clients), ``bls/``
  (sync_model.py, sync_client.py), ``bls_decoupled/`` (sync_model.py, sync_client.py),
  ``custom_metrics/`` (model.py, client.py) and ``pytorch/model.py``.

What the models here do, in the examples' terms:

- ``repeat_int32`` (decoupled): for a request of IN (INT32 [n]), DELAY (UINT32 [n], ms) and
  WAIT (UINT32 [1], ms), n responses, the i-th after DELAY[i] ms with OUT = [IN[i]] and
  IDX = [i], sent from a thread, then the final flag alone; execute returns after WAIT ms,
  whether or not the responses are all sent.
- ``square_int32`` (decoupled): for IN = [k], k responses each OUT = [k], then the final flag.
- ``bls_sync``: calls the model named by its MODEL_NAME input (the BYTES element as it comes,
  not decoded) with INPUT0 and INPUT1 and answers with that model's OUTPUT0 and OUTPUT1; the
  callee's error is raised as its own.
- ``pytorch``: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 through a torch module.
- ``bls_decoupled_sync``: streams ``square_int32`` for its IN and answers SUM, the sum of the
  OUT of every response that has one (an int64 array for an INT32 output, as the example's).
- ``custom_metrics``: add/sub, and a counter ``requests_process_latency_ns`` labelled
  model="custom_metrics", version="1" that each execute adds its time to, in ns.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

WHERE = {
    "JUPYTER_TRITON_CLIENT_EXAMPLES": "triton-inference-server/client src/python/examples",
    "JUPYTER_TRITON_BACKEND_EXAMPLES": "triton-inference-server/python_backend examples",
}


def published(variable: str, relative: str) -> Path:
    """The published file ``relative`` under the folder ``$variable`` names; skips otherwise."""
    folder = os.environ.get(variable, "")
    path = Path(folder) / relative
    if not folder or not path.is_file():
        pytest.skip(f"${variable} does not hold {relative} (NVIDIA's {WHERE[variable]}; "
                    "not kept in this repository)")
    return path


def run_published(script: Path, *args: str, addresses: dict[str, str] | None = None,
                  workdir: Path | None = None) -> subprocess.CompletedProcess:
    """Runs a published client. One without address flags runs as a copy in ``workdir``
    whose only change is each ``addresses`` key (its default address, which must be there)
    replaced by its value."""
    if addresses:
        text = script.read_text()
        for default, ours in addresses.items():
            assert default in text, f"{script.name} no longer says {default}"
            text = text.replace(default, ours)
        script = workdir / script.name
        script.write_text(text)
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=120)


def add_model(repo: Path, name: str, model_py: str, config: str) -> Path:
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    (repo / name / "1" / "model.py").write_text(model_py)
    (repo / name / "config.pbtxt").write_text(config)
    return repo / name


REPEAT_INT32_PY = '''
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(
                f"{args['model_name']} answers a request any number of times: it must be decoupled")
        self.out_type = pb_utils.triton_string_to_numpy(
            pb_utils.get_output_config_by_name(config, "OUT")["data_type"])
        self.idx_type = pb_utils.triton_string_to_numpy(
            pb_utils.get_output_config_by_name(config, "IDX")["data_type"])
        self.senders = []

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            delays = pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy()
            if values.shape != delays.shape:
                raise pb_utils.TritonModelException(
                    f"IN {list(values.shape)} and DELAY {list(delays.shape)} differ in shape")
            sender = threading.Thread(target=self.answer, daemon=True,
                                      args=(request.get_response_sender(), values, delays))
            sender.start()
            self.senders.append(sender)
            wait_ms = pb_utils.get_input_tensor_by_name(request, "WAIT").as_numpy()[0]
            time.sleep(wait_ms / 1000)
        return None

    def answer(self, sender, values, delays):
        for i, (value, delay_ms) in enumerate(zip(values, delays)):
            time.sleep(delay_ms / 1000)
            sender.send(pb_utils.InferenceResponse([
                pb_utils.Tensor("IDX", np.array([i], self.idx_type)),
                pb_utils.Tensor("OUT", np.array([value], self.out_type))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for sender in self.senders:
            sender.join()
'''

REPEAT_INT32_CONFIG = '''
name: "repeat_int32"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "DELAY" data_type: TYPE_UINT32 dims: [ -1 ] },
  { name: "WAIT" data_type: TYPE_UINT32 dims: [ 1 ] }
]
output [
  { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] }
]
instance_group [ { kind: KIND_CPU } ]
'''

SQUARE_INT32_PY = '''
import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(f"{args['model_name']} must be decoupled")
        for tensor in (pb_utils.get_input_config_by_name(config, "IN"),
                       pb_utils.get_output_config_by_name(config, "OUT")):
            if tensor["dims"] != [1] or tensor["data_type"] != "TYPE_INT32":
                raise pb_utils.TritonModelException(
                    f"{tensor['name']} must be TYPE_INT32 [1], not {tensor['data_type']} {tensor['dims']}")
        self.senders = []

    def execute(self, requests):
        for request in requests:
            k = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            sender = threading.Thread(target=self.answer, daemon=True,
                                      args=(request.get_response_sender(), k))
            sender.start()
            self.senders.append(sender)
        return None

    def answer(self, sender, k):
        for _ in range(k):
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([k], np.int32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for sender in self.senders:
            sender.join()
'''

SQUARE_INT32_CONFIG = '''
name: "square_int32"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
'''

BLS_SYNC_PY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        answers = []
        for request in requests:
            callee = pb_utils.get_input_tensor_by_name(request, "MODEL_NAME").as_numpy()[0]
            call = pb_utils.InferenceRequest(
                model_name=callee, requested_output_names=["OUTPUT0", "OUTPUT1"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                        pb_utils.get_input_tensor_by_name(request, "INPUT1")])
            answer = call.exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            answers.append(pb_utils.InferenceResponse(answer.output_tensors()))
        return answers
'''

TORCH_ADD_SUB_PY = '''
import json

import torch
import triton_python_backend_utils as pb_utils


class SumAndDifference(torch.nn.Module):
    def forward(self, a, b):
        return a + b, a - b


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.types = [pb_utils.triton_string_to_numpy(
            pb_utils.get_output_config_by_name(config, name)["data_type"])
            for name in ("OUTPUT0", "OUTPUT1")]
        self.net = SumAndDifference()

    def execute(self, requests):
        answers = []
        for request in requests:
            a, b = (torch.from_numpy(pb_utils.get_input_tensor_by_name(request, name).as_numpy())
                    for name in ("INPUT0", "INPUT1"))
            total, difference = self.net(a, b)
            answers.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", total.numpy().astype(self.types[0])),
                pb_utils.Tensor("OUTPUT1", difference.numpy().astype(self.types[1]))]))
        return answers
'''

BLS_DECOUPLED_SYNC_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        answers = []
        for request in requests:
            call = pb_utils.InferenceRequest(
                model_name="square_int32", requested_output_names=["OUT"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "IN")])
            total = np.array([0])
            for part in call.exec(decoupled=True):
                if part.has_error():
                    raise pb_utils.TritonModelException(part.error().message())
                if part.output_tensors():          # the last one carries only the final flag
                    total += pb_utils.get_output_tensor_by_name(part, "OUT").as_numpy()
            answers.append(pb_utils.InferenceResponse([pb_utils.Tensor("SUM", total)]))
        return answers
'''

CUSTOM_METRICS_PY = '''
import json
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.types = [pb_utils.triton_string_to_numpy(
            pb_utils.get_output_config_by_name(config, name)["data_type"])
            for name in ("OUTPUT0", "OUTPUT1")]
        family = pb_utils.MetricFamily(name="requests_process_latency_ns",
                                       description="Cumulative time spent processing requests",
                                       kind=pb_utils.COUNTER)
        self.busy_ns = family.Metric(labels={"model": "custom_metrics", "version": "1"})

    def execute(self, requests):
        began = time.time_ns()
        answers = []
        for request in requests:
            a, b = (pb_utils.get_input_tensor_by_name(request, name).as_numpy()
                    for name in ("INPUT0", "INPUT1"))
            answers.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", (a + b).astype(self.types[0])),
                pb_utils.Tensor("OUTPUT1", (a - b).astype(self.types[1]))]))
        self.busy_ns.increment(time.time_ns() - began)
        print("time spent in execute so far (ns):", self.busy_ns.value())
        return answers
'''
