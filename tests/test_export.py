"""`jupyter-triton export`: a repository written here, copied into the form Triton and KServe
serve as is (scale-out), and served again from the copy with the same answers."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from conftest import W
from jupyter_triton.engine import EngineOptions
from jupyter_triton.kernel.artifacts import build_artifact
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
    # bytecode caches wherever Python leaves them: beside a version's model.py, in a model's
    # folder, at the repository's root
    for folder in (model_repo / "linear" / "1", model_repo / "linear", model_repo):
        (folder / "__pycache__").mkdir()
        (folder / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
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


# ---- the same exported callables in NVIDIA's tritonserver 2.51 -----------------------------

def talk(prompt: str, max_tokens: int = 100):
    for word in prompt.split()[:max_tokens]:
        yield word


async def shout_words(prompt: str):
    for word in prompt.split():
        await asyncio.sleep(0)
        yield word.upper()


def brittle(prompt: str):
    yield "first"
    raise RuntimeError(f"refused {prompt!r}")


def repeat(x):
    for i in range(3):
        yield x * i


def counter(x, state):
    state["total"] = state.get("total", 0) + x
    return state["total"]


NOTEBOOK_CALLABLES = [
    (talk, "talk", {}), (shout_words, "shout_words", {}), (brittle, "brittle", {}),
    (repeat, "repeat", {"example": np.ones(3, np.int32)}),
    (counter, "counter", {"example": np.ones(1, np.int32), "sequence": True}),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def nvidia_tritonserver(repository: Path, workdir: Path):
    """tritonserver 2.51 with its python backend, as nvidia-pytriton ships it (its own venv:
    it pins numpy<2). The python backend's stub builds its own sys.path (the base
    interpreter's site-packages, then the working directory), so the stub is started in a
    folder that holds the numpy and cloudpickle a Triton image would have installed."""
    venv = Path(os.environ.get("JUPYTER_TRITON_PYTRITON_VENV",
                               Path.home() / ".cache/jupyter-triton-bench/pytriton-venv"))
    site = next(iter(sorted(venv.glob("lib/python3*/site-packages"))), None)
    tritonserver = site / "pytriton/tritonserver" if site else None
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    if tritonserver is None or not (tritonserver / "bin/tritonserver").exists():
        pytest.skip(f"nvidia-pytriton's tritonserver is not installed in {venv} (./dev test installs it)")
    stub = tritonserver / "python_backend_stubs" / version / "triton_python_backend_stub"
    backends = workdir / "backends" / "python"
    backends.mkdir(parents=True)
    for f in (tritonserver / "backends/python").iterdir():
        if f.is_file():
            shutil.copy(f, backends / f.name)
    shutil.copy(stub, backends / stub.name)
    packages = workdir / "packages"
    packages.mkdir()
    import cloudpickle
    for source in (site / "numpy", site / "numpy.libs", Path(cloudpickle.__file__).parent):
        if source.exists():
            (packages / source.name).symlink_to(source)
    http = _free_port()
    grpc = _free_port()
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join(
        p for p in (sysconfig.get_config_var("LIBDIR"), str(site / "nvidia_pytriton.libs"),
                    env.get("LD_LIBRARY_PATH")) if p)
    log = open(workdir / "tritonserver.log", "wb")
    process = subprocess.Popen(
        [str(tritonserver / "bin/tritonserver"), f"--model-repository={repository}",
         f"--backend-directory={workdir / 'backends'}", "--http-address=127.0.0.1",
         f"--http-port={http}", "--grpc-address=127.0.0.1", f"--grpc-port={grpc}",
         "--allow-metrics=false"], cwd=packages, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        client = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
        while True:
            assert process.poll() is None, (workdir / "tritonserver.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "tritonserver did not become ready in 90 s"
            try:
                if client.is_server_ready():
                    break
            except Exception:  # not listening yet
                pass
            time.sleep(0.3)
        yield http, grpc
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def _sse(port: int, model: str, body: dict) -> tuple[int, list[dict]]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/{model}/generate_stream",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode()
    return status, [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


def test_exported_notebook_callables_load_and_stream_in_nvidia_tritonserver(tmp_path: Path):
    source = tmp_path / "models"
    repo = Repository(source)
    for fn, name, options in NOTEBOOK_CALLABLES:
        art = build_artifact(fn, name, **options)
        repo.write_upload(name, art.config_json(), {f"file:{k}": v for k, v in art.files.items()})
    config, files = pack_callable(lambda x: x + 1, name="plus_one", inputs=[("x", "FP32", [3])],
                                  outputs=[("y", "FP32", [3])], max_batch_size=4)
    repo.write_upload("plus_one", config, {f"file:{k}": v for k, v in files.items()})
    # an ensemble as %%ensemble writes it: plus_one twice
    from google.protobuf import json_format
    from jupyter_triton.kernel.ensemble import ensemble_artifact, ensemble_config
    twice = ensemble_artifact(ensemble_config(
        "plus_two", [("plus_one", {"x": "X"}, {"y": "mid"}), ("plus_one", {"x": "mid"}, {"y": "Y"})],
        lambda m: json_format.MessageToDict(repo.read_config(m), preserving_proto_field_name=True)))
    repo.write_upload("plus_two", twice.config_json(), {f"file:{k}": v for k, v in twice.files.items()})
    (source / "plus_one" / "1" / "__pycache__").mkdir()        # the python backend's import
    (source / "plus_one" / "1" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
    out = tmp_path / "exported"
    assert export("--model-repository", str(source), "--output", str(out)).returncode == 0
    assert sorted(p.name for p in (out / "plus_one" / "1").iterdir()) == ["model.pkl", "model.py"]

    with nvidia_tritonserver(out, tmp_path / "triton") as (http, grpc):
        client = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
        x = httpclient.InferInput("x", [2, 3], "FP32")
        x.set_data_from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
        np.testing.assert_array_equal(client.infer("plus_one", [x]).as_numpy("y"),
                                      np.arange(6, dtype=np.float32).reshape(2, 3) + 1)
        x = httpclient.InferInput("X", [2, 3], "FP32")
        x.set_data_from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
        np.testing.assert_array_equal(client.infer("plus_two", [x]).as_numpy("Y"),
                                      np.arange(6, dtype=np.float32).reshape(2, 3) + 2)

        # generators under the generate extension's text convention, request parameters too
        assert _sse(http, "talk", {"text_input": "a b c"}) == (200, [
            {"model_name": "talk", "model_version": "1", "text_output": w} for w in "abc"])
        assert [e["text_output"] for e in _sse(http, "talk", {"text_input": "a b c", "max_tokens": 2})[1]] == ["a", "b"]
        assert [e["text_output"] for e in _sse(http, "shout_words", {"text_input": "x y"})[1]] == ["X", "Y"]
        status, events = _sse(http, "brittle", {"text_input": "no"})
        assert events == [{"model_name": "brittle", "model_version": "1", "text_output": "first"},
                          {"error": "RuntimeError: refused 'no'"}]

        # tritonclient's gRPC stream: one response per yield, then the empty final one
        import tritonclient.grpc as grpcclient
        stream = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
        results: queue.Queue = queue.Queue()
        stream.start_stream(callback=lambda result, error: results.put((result, error)))
        try:
            tensor = grpcclient.InferInput("x", [3], "INT32")
            tensor.set_data_from_numpy(np.array([1, 2, 3], np.int32))
            stream.async_stream_infer("repeat", [tensor], request_id="r", enable_empty_final_response=True)
            got = []
            for _ in range(4):
                result, error = results.get(timeout=30)
                assert error is None, error
                response = result.get_response()
                final = response.parameters["triton_final_response"].bool_param
                got.append((result.as_numpy("OUTPUT__0").tolist() if response.outputs else None, final))
            assert got == [([0, 0, 0], False), ([1, 2, 3], False), ([2, 4, 6], False), (None, True)]

            # a state per correlation id: new at START, dropped at END
            totals = []
            for value, start, end in [(1, True, False), (2, False, False), (3, False, True), (10, True, True)]:
                tensor = grpcclient.InferInput("x", [1], "INT32")
                tensor.set_data_from_numpy(np.array([value], np.int32))
                stream.async_stream_infer("counter", [tensor], sequence_id=42,
                                          sequence_start=start, sequence_end=end)
                result, error = results.get(timeout=30)
                assert error is None, error
                totals.append(int(result.as_numpy("OUTPUT__0")[0]))
            assert totals == [1, 3, 6, 10]
        finally:
            stream.stop_stream()
            stream.close()
