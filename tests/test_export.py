"""`jupyter-triton export`: a repository written here, copied into the form Triton and KServe
serve as is (scale-out), and served again from the copy with the same answers."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import re
import shutil
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
from tritonclient.utils import np_to_triton_dtype

from conftest import W
from jupyter_triton.engine import EngineOptions
from jupyter_triton.kernel.artifacts import build_artifact
from jupyter_triton.repository import Repository
from jupyter_triton.repository.callable_format import pack_callable
from jupyter_triton.standalone import start_in_thread
from onnx_models import linear
from ports import free_port


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
    http = free_port()
    grpc = free_port()
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


# ---- torch models: converted to what Triton's pytorch and onnxruntime backends load --------

class _TwoInputs:
    """A module of two inputs and a dict output (built lazily: torch is imported by the test)."""

    @staticmethod
    def build():
        import torch

        class TwoInputs(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.proj = torch.nn.Linear(4, 4)

            def forward(self, a, b):
                return {"sum": self.proj(a) + b.to(a.dtype), "scaled": a * 2}
        return TwoInputs()


def _torch_repository(root: Path) -> dict[str, dict]:
    """The README's first example (a module without an example: a callable), a module given an
    example (torch.export: model.pt2), a TorchScript module and an ONNX model; returns each
    model's inputs, as numpy dtypes and per-row shapes."""
    import torch
    torch.manual_seed(0)
    repo = Repository(root)
    models = {
        "embedder": (torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.ReLU()),
                     {"max_batch_size": 64}),
        "two_inputs": (_TwoInputs.build(), {"example": (torch.randn(2, 4), torch.ones(2, 4, dtype=torch.int64))}),
        "scripted": (torch.jit.script(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh())),
                     {"example": torch.randn(2, 3)}),
        "linear": (linear(W), {}),
    }
    for name, (obj, options) in models.items():
        art = build_artifact(obj, name, **options)
        repo.write_upload(name, art.config_json(), {f"file:{k}": v for k, v in art.files.items()})
    assert (root / "embedder" / "1" / "model.pkl").exists()      # served as a callable here
    assert (root / "two_inputs" / "1" / "model.pt2").exists()    # torch_export: ours only
    return {"embedder": {"input": (np.float32, [256])},
            "two_inputs": {"a": (np.float32, [4]), "b": (np.int64, [4])},
            "scripted": {"INPUT__0": (np.float32, [3])},
            "linear": {"INPUT0": (np.float32, [16])}}


def _batches(inputs: dict[str, tuple], rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(rows)
    return {n: (rng.standard_normal([rows, *s]) if np.dtype(d).kind == "f"
                else rng.integers(-3, 3, [rows, *s])).astype(d) for n, (d, s) in inputs.items()}


def _served_answers(root: Path, models: dict[str, dict]) -> dict[tuple[str, int], dict[str, np.ndarray]]:
    server = start_in_thread(EngineOptions(model_repository=root, model_control_mode="none"),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=None)
    answers = {}
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        for name, inputs in models.items():
            outputs = [o["name"] for o in client.get_model_metadata(name)["outputs"]]
            for rows in (1, 3):
                tensors = []
                for tensor, value in _batches(inputs, rows).items():
                    t = httpclient.InferInput(tensor, list(value.shape), np_to_triton_dtype(value.dtype))
                    t.set_data_from_numpy(value)
                    tensors.append(t)
                result = client.infer(name, tensors)
                answers[name, rows] = {o: result.as_numpy(o) for o in outputs}
    finally:
        server.close()
    return answers


def _run_as_triton_does(model_dir: Path, inputs: dict[str, tuple], rows: int) -> dict[str, np.ndarray]:
    """What Triton's backend runs: the config's tensor names, TorchScript through torch.jit.load
    (inputs matched to forward()'s argument names, outputs in config order), ONNX through an
    onnxruntime session fed and read by name."""
    config = text_format.Parse((model_dir / "config.pbtxt").read_text(), mc.ModelConfig())
    version = next(p for p in model_dir.iterdir() if p.is_dir())
    feed = _batches(inputs, rows)
    in_names = [i.name for i in config.input]
    out_names = [o.name for o in config.output]
    assert sorted(in_names) == sorted(feed) or (not in_names and config.backend == "onnxruntime")
    if config.platform == "pytorch_libtorch":
        import torch
        module = torch.jit.load(str(version / "model.pt"), map_location="cpu")
        args = [a.name for a in module.forward.schema.arguments][1:]
        assert args == in_names or all("__" in n for n in in_names), (args, in_names)
        with torch.no_grad():
            result = module(*[torch.from_numpy(feed[n]) for n in (args if args == in_names else in_names)])
        values = result if isinstance(result, (tuple, list)) else [result]
        # outputs: by the index of OUTPUT__<i> names when all have one, else config order
        if all(re.fullmatch(r".*__\d+", n) for n in out_names):
            out_names = sorted(out_names, key=lambda n: int(n.rpartition("__")[2]))
        return {n: v.numpy() for n, v in zip(out_names, values)}
    assert config.platform == "onnxruntime_onnx", config.platform
    import onnxruntime
    session = onnxruntime.InferenceSession(str(version / "model.onnx"), providers=["CPUExecutionProvider"])
    if not in_names:          # a config Triton auto-completes from the model, as it does here
        out_names = [o.name for o in session.get_outputs()]
    return dict(zip(out_names, session.run(out_names, feed)))


@pytest.mark.parametrize("torch_format", ["torchscript", "onnx"])
def test_torch_models_export_to_what_tritons_backends_load(tmp_path: Path, torch_format: str):
    source = tmp_path / "models"
    models = _torch_repository(source)
    out = tmp_path / "for-triton"
    # torchscript is the command's default; onnx is asked for with --torch-format
    flags = [] if torch_format == "torchscript" else ["--torch-format", "onnx"]
    done = export("--model-repository", str(source), "--output", str(out), *flags)
    assert done.returncode == 0, done.stderr
    summary = done.stdout
    assert "torch.export program (model.pt2) converted" in summary
    assert "torch.nn.Module callable (model.pkl) converted" in summary
    expected_platform = {"torchscript": "pytorch_libtorch", "onnx": "onnxruntime_onnx"}[torch_format]
    for name, platform in [("embedder", expected_platform), ("two_inputs", expected_platform),
                           ("scripted", "pytorch_libtorch"), ("linear", "")]:
        config = text_format.Parse((out / name / "config.pbtxt").read_text(), mc.ModelConfig())
        assert config.platform == platform or (not platform and config.backend == "onnxruntime"), (name, config)
        assert not list((out / name).rglob("*.pt2")) and not list((out / name).rglob("*.pkl"))
    # TorchScript and ONNX models are copied as they are
    assert (out / "scripted/1/model.pt").read_bytes() == (source / "scripted/1/model.pt").read_bytes()
    assert (out / "linear/1/model.onnx").read_bytes() == (source / "linear/1/model.onnx").read_bytes()
    # the README's example keeps its batching for Triton's dynamic batcher
    embedder = text_format.Parse((out / "embedder" / "config.pbtxt").read_text(), mc.ModelConfig())
    assert embedder.max_batch_size == 64 and [i.name for i in embedder.input] == ["input"]

    ours = _served_answers(source, models)
    for name, inputs in models.items():
        for rows in (1, 3):
            theirs = _run_as_triton_does(out / name, inputs, rows)
            assert sorted(theirs) == sorted(ours[name, rows]), name
            for tensor, value in ours[name, rows].items():
                np.testing.assert_allclose(theirs[tensor], value, rtol=1e-5, atol=1e-6,
                                           err_msg=f"{name}.{tensor}, {rows} row(s)")
    # and this server serves the exported copy with the same answers
    again = _served_answers(out, models)
    for key, answer in ours.items():
        for tensor, value in answer.items():
            np.testing.assert_allclose(again[key][tensor], value, rtol=1e-5, atol=1e-6)


def test_a_program_its_trace_cannot_follow_is_refused(tmp_path: Path):
    import torch

    class RowNumbers(torch.nn.Module):      # the row count becomes a constant in a trace
        def forward(self, x):
            return x + torch.arange(x.shape[0], dtype=x.dtype).unsqueeze(1)
    source = tmp_path / "models"
    art = build_artifact(RowNumbers(), "rows", example=torch.randn(2, 3))
    assert art.format == "torch_export"
    Repository(source).write_upload("rows", art.config_json(), {f"file:{k}": v for k, v in art.files.items()})
    out = tmp_path / "for-triton"
    done = export("--model-repository", str(source), "--output", str(out))
    assert done.returncode == 2
    assert "model 'rows'" in done.stderr and "froze a shape" in done.stderr, done.stderr
    assert "Triton cannot load model.pt2" in done.stderr
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".for-triton")]


def test_a_module_callable_that_cannot_convert_stays_a_python_model(tmp_path: Path):
    import torch
    from jupyter_triton.repository.export import export_repository

    class Doubles(torch.nn.Module):          # float64 out, FP32 declared: this server casts it
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.proj(x).double()
    source = tmp_path / "models"
    art = build_artifact(Doubles(), "doubles", inputs=[("x", "FP32", [-1, 4])],
                         outputs=[("y", "FP32", [-1, 2])])
    Repository(source).write_upload("doubles", art.config_json(),
                                    {f"file:{k}": v for k, v in art.files.items()})
    report = export_repository(source, tmp_path / "out")
    [note] = report.models[0].notes
    assert "output 'y' is float64 converted where the config says TYPE_FP32" in note
    assert "needs torch, numpy and cloudpickle" in note
    assert sorted(p.name for p in (tmp_path / "out" / "doubles" / "1").iterdir()) == ["model.pkl", "model.py"]
