"""The sequence batcher, as a Triton user meets it: a stateful model served from a
repository the test writes, called with tritonclient over HTTP and gRPC."""
from __future__ import annotations

from pathlib import Path

import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from jupyter_triton.engine import EngineOptions
from jupyter_triton.standalone import start_in_thread

# Triton's docs/examples simple_sequence, served by a python model: OUTPUT = INPUT + START
# while READY (what NVIDIA's sequence example clients expect of it).
SIMPLE_SEQUENCE_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            start = pb_utils.get_input_tensor_by_name(request, "START").as_numpy()
            ready = pb_utils.get_input_tensor_by_name(request, "READY").as_numpy()
            out = ((x + start) * ready).astype(np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)]))
        return responses
'''

SIMPLE_SEQUENCE_CONFIG = '''
name: "{name}"
backend: "python"
max_batch_size: 8
sequence_batching {{
  {extra}
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] }} ] }}
  ]
}}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU }} ]
'''


def simple_sequence(root: Path, name: str = "simple_sequence", extra: str = "") -> Path:
    (root / name / "1").mkdir(parents=True, exist_ok=True)
    (root / name / "1" / "model.py").write_text(SIMPLE_SEQUENCE_PY)
    (root / name / "config.pbtxt").write_text(SIMPLE_SEQUENCE_CONFIG.format(name=name, extra=extra))
    return root / name


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    root.mkdir()
    return root


@pytest.fixture
def server(repo: Path):
    server = start_in_thread(EngineOptions(model_repository=repo, model_control_mode="explicit"),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0)
    yield server
    server.close()


def test_unimplemented_sequence_features_are_refused_at_load(repo: Path, server) -> None:
    simple_sequence(repo, "iterative", extra="iterative_sequence: true")
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    with pytest.raises(InferenceServerException) as err:
        client.load_model("iterative")
    assert "sequence_batching" in str(err.value)
    assert not client.is_model_ready("iterative")
