"""Every backend behind the real server, called with unmodified tritonclient: TorchScript,
torch.export, Triton-style python model.py (in worker processes), notebook callables."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import TOKEN, in_thread
from jupyter_triton.repository.callable_format import pack_callable
from test_backend_python import ADD_SUB_CONFIG, ADD_SUB_MODEL_PY

CRASHY_MODEL_PY = '''
import os, signal, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x.reshape(-1)[0] < 0:                 # the user's bug: a hard crash mid-request
                time.sleep(0.2)
                os.kill(os.getpid(), signal.SIGKILL)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)]))
        return responses
'''

CRASHY_CONFIG = '''
name: "crashy"
backend: "python"
max_batch_size: 4
input [{ name: "X" data_type: TYPE_FP32 dims: [ 2 ] }]
output [{ name: "Y" data_type: TYPE_FP32 dims: [ 2 ] }]
'''

TORCHSCRIPT_CONFIG = '''
name: "torchscript"
platform: "pytorch_libtorch"
max_batch_size: 8
input [{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ 8 ] }]
output [{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 3 ] }]
'''


def torch_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 3), torch.nn.Tanh()).eval()


def build(root: Path) -> Path:
    for name, source, config in (("add_sub", ADD_SUB_MODEL_PY, ADD_SUB_CONFIG),
                                 ("crashy", CRASHY_MODEL_PY, CRASHY_CONFIG)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(source)
        (root / name / "config.pbtxt").write_text(config)
    net = torch_net()
    (root / "torchscript" / "1").mkdir(parents=True)
    torch.jit.trace(net, torch.zeros(1, 8)).save(str(root / "torchscript" / "1" / "model.pt"))
    (root / "torchscript" / "config.pbtxt").write_text(TORCHSCRIPT_CONFIG)
    (root / "exported" / "1").mkdir(parents=True)
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(net, (torch.zeros(2, 8),), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(root / "exported" / "1" / "model.pt2"))
    return root


@pytest.fixture
def model_repo(tmp_path: Path) -> Path:
    return build(tmp_path / "models")


@pytest.fixture
def client(standalone):
    c = httpclient.InferenceServerClient(f"127.0.0.1:{standalone.http_port}")
    yield c
    c.close()


def call(client, model: str, **arrays: np.ndarray) -> httpclient.InferResult:
    inputs = []
    for name, value in arrays.items():
        inp = httpclient.InferInput(name, list(value.shape), "FP32")
        inp.set_data_from_numpy(value)
        inputs.append(inp)
    return client.infer(model, inputs)


def test_triton_add_sub_model_py_runs_unchanged(client):
    a = np.random.default_rng(0).standard_normal(4).astype(np.float32)
    b = np.random.default_rng(1).standard_normal(4).astype(np.float32)
    result = call(client, "add_sub", INPUT0=a, INPUT1=b)
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b, rtol=1e-6)
    np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b, rtol=1e-6)


def test_torchscript_and_torch_export(client):
    x = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)   # within the default max_batch_size 4
    with torch.inference_mode():
        ref = torch_net()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(call(client, "torchscript", INPUT__0=x).as_numpy("OUTPUT__0"), ref, rtol=1e-5)
    meta = client.get_model_metadata("exported")
    assert meta["inputs"][0]["shape"] == [-1, 8]            # auto-completed from the program
    name_in, name_out = meta["inputs"][0]["name"], meta["outputs"][0]["name"]
    np.testing.assert_allclose(call(client, "exported", **{name_in: x}).as_numpy(name_out), ref, rtol=1e-5)


def test_notebook_callable_loaded_through_the_repository_api(client, model_repo):
    offset = np.float32(3.0)

    def scale_and_shift(x: np.ndarray) -> np.ndarray:        # a closure, pickled by value
        return x * 2 + offset

    config, files = pack_callable(scale_and_shift, name="fn", inputs=[("x", "FP32", [3])],
                                  outputs=[("y", "FP32", [3])], max_batch_size=8,
                                  extra_config="dynamic_batching { max_queue_delay_microseconds: 2000 }")
    client.load_model("fn", config=config, files={f"file:{k}": v for k, v in files.items()})
    assert (model_repo / "fn" / "1" / "model.pkl").exists()
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(call(client, "fn", x=x).as_numpy("y"), x * 2 + 3)


def test_killed_worker_fails_its_request_and_the_next_succeeds(client):
    ok = np.ones((1, 2), np.float32)
    np.testing.assert_array_equal(call(client, "crashy", X=ok).as_numpy("Y"), ok * 2)
    with pytest.raises(InferenceServerException) as err:
        call(client, "crashy", X=-ok)
    assert "crashy" in str(err.value) and "died" in str(err.value)
    np.testing.assert_array_equal(call(client, "crashy", X=ok).as_numpy("Y"), ok * 2)
    assert client.is_model_ready("crashy")


async def test_jupyter_server_survives_a_killed_worker(jp_triton, jp_http_port, jp_base_url):
    headers = {"Authorization": f"token {TOKEN}"}

    def story():
        c = httpclient.InferenceServerClient(f"127.0.0.1:{jp_http_port}{jp_base_url.rstrip('/')}")
        ok = np.ones((1, 2), np.float32)
        outcomes = []
        for x in (ok, -ok, ok):
            inp = httpclient.InferInput("X", [1, 2], "FP32")
            inp.set_data_from_numpy(x)
            try:
                outcomes.append(c.infer("crashy", [inp], headers=dict(headers)).as_numpy("Y").tolist())
            except InferenceServerException as e:
                outcomes.append(e.status())
        return outcomes, c.is_server_live(headers=dict(headers)), c.is_model_ready("crashy", headers=dict(headers))

    outcomes, live, ready = await in_thread(story)
    assert outcomes[0] == [[2.0, 2.0]] and outcomes[2] == [[2.0, 2.0]]
    assert outcomes[1] == "503"
    assert live and ready
