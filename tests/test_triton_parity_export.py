"""Scale-out, verified in real Triton: a repository made here (python models, an ensemble of
them, a BLS model calling another, a notebook callable) goes through ``jupyter-triton export``
and NVIDIA's tritonserver 2.51 (nvidia-pytriton's, on CPU) serves the copy; every model must
load there and answer each request as we answer it from the source. Skipped, with the
reason, where nvidia-pytriton's venv is not installed (./dev test installs it)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import serve
from jupyter_triton.repository import Repository
from jupyter_triton.repository.callable_format import pack_callable
from tritonserver_peer import TritonServer, tritonserver_dist

pytestmark = pytest.mark.timeout(300)


def _python_model(root: Path, name: str, body: str, extra: str = "") -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text(f'''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
{body}
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", y)]))
        return responses
''')
    (root / name / "config.pbtxt").write_text(f'''name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
{extra}''')


# BLS as NVIDIA's examples/bls writes it: a request to another model, its error checked
BLS_BODY = '''            y = x
            for _ in range(2):
                call = pb_utils.InferenceRequest(
                    model_name="add", requested_output_names=["OUTPUT0"],
                    inputs=[pb_utils.Tensor("INPUT0", y)])
                answer = call.exec()
                if answer.has_error():
                    raise pb_utils.TritonModelException(answer.error().message())
                y = pb_utils.get_output_tensor_by_name(answer, "OUTPUT0").as_numpy()'''

PIPELINE = '''name: "pipeline"
platform: "ensemble"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "add" model_version: -1
    input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "h" } },
  { model_name: "double" model_version: -1
    input_map { key: "INPUT0" value: "h" } output_map { key: "OUTPUT0" value: "Y" } } ] }
'''

# (model, input name, output name): what both servers are asked
CALLS = [("add", "INPUT0", "OUTPUT0"), ("double", "INPUT0", "OUTPUT0"),
         ("pipeline", "X", "Y"), ("bls_add_twice", "INPUT0", "OUTPUT0"), ("scaled", "x", "y")]


def build(root: Path) -> Path:
    _python_model(root, "add", "            y = x + 1")
    _python_model(root, "double", "            y = x * 2")
    _python_model(root, "bls_add_twice", BLS_BODY)
    (root / "pipeline" / "1").mkdir(parents=True)
    (root / "pipeline" / "config.pbtxt").write_text(PIPELINE)
    # a notebook callable, as %%serve / jupyter_triton.serve() uploads it
    config, files = pack_callable(lambda x: x * 3 - 1, name="scaled",
                                  inputs=[("x", "FP32", [4])], outputs=[("y", "FP32", [4])],
                                  max_batch_size=8)
    Repository(root).write_upload("scaled", config, {f"file:{k}": v for k, v in files.items()})
    return root


def _ask(url: str, model: str, input_name: str, output_name: str, x: np.ndarray):
    client = httpclient.InferenceServerClient(url, network_timeout=60)
    try:
        tensor = httpclient.InferInput(input_name, list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer(model, [tensor])
        meta = client.get_model_metadata(model)
        return result.as_numpy(output_name), {k: meta[k] for k in ("inputs", "outputs")}
    finally:
        client.close()


def test_an_exported_repository_answers_in_tritonserver_as_here(tmp_path: Path):
    tritonserver_dist()                 # skips with the reason where the venv is absent
    source = build(tmp_path / "models")
    (source / "add" / "1" / "__pycache__").mkdir()        # what a served model leaves behind
    (source / "add" / "1" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
    exported = tmp_path / "exported"
    done = subprocess.run([str(Path(sys.executable).parent / "jupyter-triton"), "export",
                           "--model-repository", str(source), "--output", str(exported)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert not (exported / "add" / "1" / "__pycache__").exists()

    import cloudpickle
    triton = TritonServer(exported, tmp_path / "triton", control="none",
                          extra_args=["--exit-on-error=false"],
                          packages=[Path(cloudpickle.__file__).parent])
    server, client = serve(source, model_control_mode="none")
    client.close()
    try:
        theirs_index = {r["name"]: r for r in httpclient.InferenceServerClient(
            triton.url).get_model_repository_index()}
        not_ready = {name: row.get("reason", "") for name, row in theirs_index.items()
                     if row.get("state") != "READY"}
        assert not not_ready, f"tritonserver did not load: {not_ready}\n" + \
            triton.log.read_text(errors="replace")[-3000:]
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        for model, input_name, output_name in CALLS:
            theirs, their_meta = _ask(triton.url, model, input_name, output_name, x)
            ours, our_meta = _ask(f"127.0.0.1:{server.http_port}", model, input_name,
                                  output_name, x)
            np.testing.assert_array_equal(theirs, ours, err_msg=model)
            assert their_meta == our_meta, model
        np.testing.assert_array_equal(ours, x * 3 - 1)       # the last: the callable
    finally:
        server.close()
        triton.close()
