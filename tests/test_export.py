"""`jupyter-triton export`: a repository written here, copied into the form Triton and KServe
serve as is (scale-out), and served again from the copy with the same answers."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from conftest import W
from jupyter_triton.engine import EngineOptions
from jupyter_triton.repository import Repository
from jupyter_triton.repository.callable_format import pack_callable
from jupyter_triton.standalone import start_in_thread
from onnx_models import linear


def export(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "jupyter-triton"
    return subprocess.run([str(exe), "export", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def worked_repo(model_repo: Path) -> Path:
    """What a session leaves behind: uploads (versions 1 and 2, config history), a callable."""
    repo = Repository(model_repo)
    cfg = json.dumps({"name": "linear", "backend": "onnxruntime", "max_batch_size": 4,
                      "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]}],
                      "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}]})
    repo.write_upload("linear", cfg, {"file:1/model.onnx": linear(2 * W)})       # becomes version 2
    config, files = pack_callable(lambda x: x + 1, name="plus_one", inputs=[("x", "FP32", [3])],
                                  outputs=[("y", "FP32", [3])], max_batch_size=4)
    repo.write_upload("plus_one", config, {f"file:{k}": v for k, v in files.items()})
    (model_repo / "linear" / "1" / "__pycache__").mkdir()
    return model_repo


def test_export_writes_what_triton_needs(worked_repo: Path, tmp_path: Path):
    out = tmp_path / "for-triton"
    done = export("--model-repository", str(worked_repo), "--output", str(out),
                  "--kserve-name", "my-models", "--storage-uri", "s3://bucket/models")
    assert done.returncode == 0, done.stderr
    assert "tritonserver --model-repository=" in done.stdout
    assert "cloudpickle" in done.stdout                       # the callable's note
    assert sorted(p.name for p in out.iterdir()) == ["identity_int32", "linear", "plus_one", "simple"]
    # Only the versions the policy serves (latest 1), no history, caches or per-version configs.
    assert sorted(p.name for p in (out / "linear").iterdir()) == ["2", "config.pbtxt"]
    assert sorted(p.name for p in (out / "linear" / "2").iterdir()) == ["model.onnx"]
    parsed = text_format.Parse((out / "linear" / "config.pbtxt").read_text(), mc.ModelConfig())
    assert parsed.name == "linear" and parsed.max_batch_size == 4
    manifest = (tmp_path / "for-triton-kserve.yaml").read_text()
    assert "kind: InferenceService" in manifest and "s3://bucket/models" in manifest
    assert (worked_repo / "linear" / ".history").exists()     # the source is untouched
    # Never over an existing folder.
    again = export("--model-repository", str(worked_repo), "--output", str(out))
    assert again.returncode == 2 and "already exists" in again.stderr


def test_exported_repository_serves_the_same_answers(worked_repo: Path, tmp_path: Path):
    out = tmp_path / "copy"
    assert export("--model-repository", str(worked_repo), "--output", str(out)).returncode == 0
    x = np.ones((1, 16), np.float32)
    answers = []
    for root in (worked_repo, out):
        server = start_in_thread(EngineOptions(model_repository=root, model_control_mode="none"),
                                 host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=None)
        try:
            client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
            inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
            inp.set_data_from_numpy(x)
            answers.append(client.infer("linear", [inp]).as_numpy("OUTPUT0"))
            y = httpclient.InferInput("x", [1, 3], "FP32")
            y.set_data_from_numpy(np.zeros((1, 3), np.float32))
            answers.append(client.infer("plus_one", [y]).as_numpy("y"))
        finally:
            server.close()
    np.testing.assert_allclose(answers[0], x @ (2 * W), rtol=1e-5)
    np.testing.assert_array_equal(answers[0], answers[2])
    np.testing.assert_array_equal(answers[1], answers[3])
    np.testing.assert_array_equal(answers[1], np.ones((1, 3), np.float32))
