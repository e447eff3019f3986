"""The python backend: Triton's model.py run unchanged, in worker processes that may die,
and notebook callables stored as python-backend models."""
from __future__ import annotations

import json
import os
import textwrap
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from jupyter_triton.backends import backend_class
from jupyter_triton.backends.base import BackendDead, InstanceSpec, ModelFiles
from jupyter_triton.backends.python import PythonBackend, triton_config_json
from jupyter_triton.protocol.errors import Internal, InvalidArgument, Unavailable
from jupyter_triton.protocol.types import InferRequest, RequestedOutput
from jupyter_triton.repository.callable_format import pack_callable, pack_model_py

pytestmark = pytest.mark.timeout(120)

# Triton's documented add_sub example (python_backend/examples/add_sub), unchanged.
ADD_SUB_MODEL_PY = '''
import json

import numpy as np

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = model_config = json.loads(args["model_config"])
        output0_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT0")
        output1_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT1")
        self.output0_dtype = pb_utils.triton_string_to_numpy(output0_config["data_type"])
        self.output1_dtype = pb_utils.triton_string_to_numpy(output1_config["data_type"])

    def execute(self, requests):
        output0_dtype = self.output0_dtype
        output1_dtype = self.output1_dtype
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            out_0, out_1 = (
                in_0.as_numpy() + in_1.as_numpy(),
                in_0.as_numpy() - in_1.as_numpy(),
            )
            out_tensor_0 = pb_utils.Tensor("OUTPUT0", out_0.astype(output0_dtype))
            out_tensor_1 = pb_utils.Tensor("OUTPUT1", out_1.astype(output1_dtype))
            inference_response = pb_utils.InferenceResponse(
                output_tensors=[out_tensor_0, out_tensor_1]
            )
            responses.append(inference_response)
        return responses

    def finalize(self):
        print("Cleaning up...")
'''

ADD_SUB_CONFIG = '''
name: "add_sub"
backend: "python"
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
instance_group [{ kind: KIND_CPU }]
'''

# Reports which process served it, echoes its args, and misbehaves on request.
PROBE_MODEL_PY = '''
import asyncio, json, os, signal
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.args = args
        self.initialized = os.getpid()
        pb_utils.Logger.log_info("probe initialized")
        if os.path.exists(os.path.join(os.path.dirname(__file__), "fail_init")):
            raise RuntimeError("cannot initialize probe: weights missing")

    def execute(self, requests):
        responses = []
        for request in requests:
            cmd = pb_utils.get_input_tensor_by_name(request, "CMD").as_numpy().reshape(-1)[0]
            if cmd == b"exit":
                os._exit(1)
            if cmd == b"kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if cmd == b"raise":
                raise ValueError("probe was asked to fail")
            if cmd == b"short":
                return responses
            if cmd == b"bad":
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError("CMD 'bad' is not allowed",
                                                                  pb_utils.TritonError.INVALID_ARG)))
                continue
            info = {"pid": os.getpid(), "args": self.args, "id": request.request_id(),
                    "parameters": json.loads(request.parameters()),
                    "requested": request.requested_output_names()}
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("INFO", np.array([json.dumps(info).encode()], dtype=np.object_))]))
        return responses

    def finalize(self):
        with open(os.path.join(os.path.dirname(__file__), "finalized"), "w") as f:
            f.write(str(os.getpid()))
'''

PROBE_CONFIG = '''
name: "probe"
backend: "python"
input [{ name: "CMD" data_type: TYPE_STRING dims: [ 1 ] }]
output [{ name: "INFO" data_type: TYPE_STRING dims: [ 1 ] }]
'''

THREAD_MODE = '\nparameters { key: "EXECUTION_MODE" value: { string_value: "thread" } }\n'


def write_model(root: Path, name: str, model_py: str, config_pbtxt: str,
                extra: dict[str, bytes] | None = None) -> tuple[mc.ModelConfig, ModelFiles]:
    version_dir = root / name / "1"
    version_dir.mkdir(parents=True, exist_ok=True)
    (version_dir / "model.py").write_text(textwrap.dedent(model_py))
    (root / name / "config.pbtxt").write_text(config_pbtxt)
    for rel, data in (extra or {}).items():
        (root / name / rel).write_bytes(data)
    config = text_format.Parse(config_pbtxt, mc.ModelConfig())
    return config, ModelFiles(name, 1, root / name, version_dir, "model.py")


@contextmanager
def loaded(config: mc.ModelConfig, files: ModelFiles, **attrs):
    backend = PythonBackend(config, files, InstanceSpec(f"{files.model_name}_0_0"))
    for key, value in attrs.items():
        setattr(backend, key, value)
    backend.load()
    try:
        yield backend
    finally:
        backend.unload()


def cmd(word: str) -> dict[str, np.ndarray]:
    return {"CMD": np.array([word.encode()], dtype=np.object_)}


def info(result) -> dict:
    assert isinstance(result, dict), result
    return json.loads(result["INFO"][0])


def our_shm() -> set[str]:
    # This process's segments only: test runs of other processes on the host come and go.
    from jupyter_triton.backends.python.shm import segment_prefix
    return {n for n in os.listdir("/dev/shm") if n.startswith(segment_prefix())}


def test_registry_finds_the_python_backend():
    assert backend_class("python") is PythonBackend


def test_add_sub_example_runs_unchanged(tmp_path, capfd):
    config, files = write_model(tmp_path, "add_sub", ADD_SUB_MODEL_PY, ADD_SUB_CONFIG)
    x = np.array([1, 2, 3, 4], dtype=np.float32)
    y = np.array([0.5, 0.5, 0.5, 0.5], dtype=np.float32)
    with loaded(config, files) as backend:
        results = backend.execute([{"INPUT0": x, "INPUT1": y}, {"INPUT0": y, "INPUT1": x}])
    assert len(results) == 2
    np.testing.assert_array_equal(results[0]["OUTPUT0"], x + y)
    np.testing.assert_array_equal(results[0]["OUTPUT1"], x - y)
    np.testing.assert_array_equal(results[1]["OUTPUT1"], y - x)
    assert results[0]["OUTPUT0"].dtype == np.float32
    assert "Cleaning up..." in capfd.readouterr().out   # finalize ran at unload


def test_initialize_gets_tritons_args_and_requests_their_metadata(tmp_path):
    config, files = write_model(tmp_path, "probe", PROBE_MODEL_PY, PROBE_CONFIG)
    request = InferRequest("probe", id="req-7", parameters={"temperature": 0.5, "priority": 1},
                           outputs=[RequestedOutput("INFO")])
    with loaded(config, files) as backend:
        got = info(backend.execute([cmd("hello")], [request])[0])
    assert got["pid"] != os.getpid()   # ran in a worker process
    args = got["args"]
    assert {k: args[k] for k in ("model_name", "model_version", "model_instance_kind",
                                 "model_instance_name", "model_instance_device_id")} == {
        "model_name": "probe", "model_version": "1", "model_instance_kind": "CPU",
        "model_instance_name": "probe_0_0", "model_instance_device_id": "0"}
    assert args["model_repository"] == str(tmp_path / "probe")
    model_config = json.loads(args["model_config"])
    assert model_config["input"][0]["dims"] == [1]        # numbers, as Triton writes them
    assert model_config["max_batch_size"] == 0
    assert got["id"] == "req-7"
    assert got["parameters"] == {"temperature": 0.5}
    assert got["requested"] == ["INFO"]


def test_config_json_is_tritons_shape():
    config = text_format.Parse(ADD_SUB_CONFIG + "max_batch_size: 8", mc.ModelConfig())
    as_dict = json.loads(triton_config_json(config))
    assert as_dict["max_batch_size"] == 8
    assert as_dict["output"][1] == {**as_dict["output"][1], "name": "OUTPUT1",
                                    "data_type": "TYPE_FP32", "dims": [4]}


@pytest.mark.parametrize("mode", ["", THREAD_MODE])
def test_async_execute(tmp_path, mode):
    source = '''
    import asyncio
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        async def execute(self, requests):
            await asyncio.sleep(0.01)
            return [pb_utils.InferenceResponse([pb_utils.Tensor(
                        "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2)])
                    for r in requests]
    '''
    config, files = write_model(tmp_path, "doubler", source, '''
        name: "doubler" backend: "python"
        input [{ name: "X" data_type: TYPE_INT32 dims: [ -1 ] }]
        output [{ name: "Y" data_type: TYPE_INT32 dims: [ -1 ] }]''' + mode)
    with loaded(config, files) as backend:
        out = backend.execute([{"X": np.arange(5, dtype=np.int32)}])
    np.testing.assert_array_equal(out[0]["Y"], np.arange(5, dtype=np.int32) * 2)


AUTO_COMPLETE_MODEL_PY = '''
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [3]})
        auto_complete_model_config.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [3]})
        auto_complete_model_config.set_max_batch_size(16)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() + 1)]) for r in requests]
'''


def test_auto_complete_config_fills_the_config(tmp_path):
    config, files = write_model(tmp_path, "auto", AUTO_COMPLETE_MODEL_PY,
                                'name: "auto" backend: "python"')
    completed = PythonBackend.auto_complete_config(config, files)
    assert completed.max_batch_size == 16
    assert completed.HasField("dynamic_batching")
    assert [(t.name, mc.DataType.Name(t.data_type), list(t.dims)) for t in completed.input] == [
        ("IN", "TYPE_FP32", [3])]
    assert [t.name for t in completed.output] == ["OUT"]
    with loaded(completed, files) as backend:
        out = backend.execute([{"IN": np.zeros((2, 3), np.float32)}])
    np.testing.assert_array_equal(out[0]["OUT"], np.ones((2, 3), np.float32))


def test_auto_complete_config_refuses_to_contradict_config_pbtxt(tmp_path):
    config, files = write_model(tmp_path, "auto", AUTO_COMPLETE_MODEL_PY, '''
        name: "auto" backend: "python"
        input [{ name: "IN" data_type: TYPE_FP32 dims: [ 5 ] }]''')
    with pytest.raises(InvalidArgument, match=r"model 'auto'.*expects dims \[3\].*specifies dims \[5\]"):
        PythonBackend.auto_complete_config(config, files)


def test_auto_complete_config_skipped_without_the_hook(tmp_path):
    config, files = write_model(tmp_path, "add_sub", ADD_SUB_MODEL_PY, ADD_SUB_CONFIG)
    assert PythonBackend.auto_complete_config(config, files) is config


@pytest.mark.parametrize("mode", ["", THREAD_MODE])
def test_a_model_that_raises_fails_only_its_requests(tmp_path, mode):
    config, files = write_model(tmp_path, "probe", PROBE_MODEL_PY, PROBE_CONFIG + mode)
    with loaded(config, files) as backend:
        failed = backend.execute([cmd("raise")])
        assert isinstance(failed[0], Internal) and failed[0].status == 500
        assert "model 'probe'" in str(failed[0])
        assert "ValueError: probe was asked to fail" in str(failed[0])
        # a response carrying an error fails that request alone, with the model's status
        mixed = backend.execute([cmd("bad"), cmd("hello")])
        assert isinstance(mixed[0], InvalidArgument)
        assert "model 'probe'" in str(mixed[0]) and "CMD 'bad' is not allowed" in str(mixed[0])
        assert info(mixed[1])["id"] == ""
        # too few responses for the batch is the model's bug: Internal for all
        short = backend.execute([cmd("short"), cmd("hello")])
        assert all(isinstance(r, Internal) and "InferenceResponse(s) size is:0" in str(r) for r in short)
        assert info(backend.execute([cmd("hello")])[0])


def test_thread_mode_runs_in_the_server_process(tmp_path):
    config, files = write_model(tmp_path, "probe", PROBE_MODEL_PY, PROBE_CONFIG + THREAD_MODE)
    with loaded(config, files) as backend:
        assert info(backend.execute([cmd("hello")])[0])["pid"] == os.getpid()
    assert (files.version_dir / "finalized").read_text() == str(os.getpid())


@pytest.mark.parametrize("how,code", [("exit", "exit code 1"), ("kill", "exit code -9, SIGKILL")])
def test_a_dying_worker_fails_its_requests_and_is_restarted(tmp_path, how, code):
    config, files = write_model(tmp_path, "probe", PROBE_MODEL_PY, PROBE_CONFIG)
    with loaded(config, files) as backend:
        first_pid = info(backend.execute([cmd("hello")])[0])["pid"]
        died = backend.execute([cmd(how), cmd("hello")])
        assert len(died) == 2
        for err in died:
            assert isinstance(err, Unavailable) and err.status == 503
            assert f"python worker for model 'probe' instance 'probe_0_0' died ({code}" in str(err)
        after = info(backend.execute([cmd("hello")])[0])   # initialize ran again, new process
        assert after["pid"] != first_pid


def test_a_worker_that_keeps_dying_makes_the_backend_dead(tmp_path):
    before = our_shm()
    config, files = write_model(tmp_path, "probe", PROBE_MODEL_PY, PROBE_CONFIG)
    with loaded(config, files, max_deaths=2) as backend:
        assert isinstance(backend.execute([cmd("exit")])[0], Unavailable)
        with pytest.raises(BackendDead, match=r"model 'probe'.*died \(exit code 1\).*2 times within 60 s"):
            backend.execute([cmd("exit")])
        with pytest.raises(BackendDead):   # stays dead: no restart loop
            backend.execute([cmd("hello")])
    assert our_shm() - before == set()


def test_initialize_error_fails_the_load_with_the_models_message(tmp_path):
    config, files = write_model(tmp_path, "probe", PROBE_MODEL_PY, PROBE_CONFIG,
                                extra={"1/fail_init": b""})
    backend = PythonBackend(config, files, InstanceSpec("probe_0_0"))
    with pytest.raises(Internal, match=r"model 'probe'.*initialize failed: RuntimeError: cannot "
                                       r"initialize probe: weights missing"):
        backend.load()


def test_import_error_fails_the_load(tmp_path):
    config, files = write_model(tmp_path, "broken", "import not_a_module_anywhere\n",
                                'name: "broken" backend: "python"' + THREAD_MODE)
    with pytest.raises(InvalidArgument, match=r"model 'broken': cannot import model.py: "
                                              r"ModuleNotFoundError"):
        PythonBackend(config, files, InstanceSpec("broken_0_0")).load()


def test_unknown_execution_mode_is_refused(tmp_path):
    config, files = write_model(tmp_path, "probe", PROBE_MODEL_PY, PROBE_CONFIG +
                                'parameters { key: "EXECUTION_MODE" value: { string_value: "gpu" } }')
    with pytest.raises(InvalidArgument, match="EXECUTION_MODE must be one of process, thread"):
        PythonBackend(config, files, InstanceSpec("probe_0_0"))


BLAS_MODEL_PY = '''
import json, os
import numpy as np
import triton_python_backend_utils as pb_utils
from jupyter_triton.backends.python import blas

class TritonPythonModel:
    def execute(self, requests):
        w = np.ones((256, 256), np.float32)
        outs = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            info = {"threads": blas.threads(), "env": os.environ.get("OPENBLAS_NUM_THREADS"),
                    "sum": float((x @ w).sum())}
            outs.append(pb_utils.InferenceResponse([pb_utils.Tensor(
                "INFO", np.array([json.dumps(info).encode()], dtype=np.object_))]))
        return outs
'''

BLAS_CONFIG = '''
name: "blas"
backend: "python"
input [{ name: "X" data_type: TYPE_FP32 dims: [ 32, 256 ] }]
output [{ name: "INFO" data_type: TYPE_STRING dims: [ 1 ] }]
'''


def blas_threads_of_worker(tmp_path: Path, parameter: str | None) -> dict:
    config_text = BLAS_CONFIG
    if parameter is not None:
        config_text += f'parameters {{ key: "blas_thread_count" value: {{ string_value: "{parameter}" }} }}'
    config, files = write_model(tmp_path / (parameter or "default"), "blas", BLAS_MODEL_PY, config_text)
    with loaded(config, files) as backend:
        out = info(backend.execute([{"X": np.ones((32, 256), np.float32)}])[0])
    assert out["sum"] == 32 * 256 * 256   # the product ran, whatever the threads
    return out


def test_a_workers_blas_gets_one_thread_unless_configured(tmp_path, monkeypatch):
    from jupyter_triton.backends.python import blas
    for key in blas.ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    default = blas_threads_of_worker(tmp_path, None)
    assert default["threads"] and set(default["threads"]) == {1}, default
    assert default["env"] == "1"     # BLAS libraries the model loads later read it
    assert set(blas_threads_of_worker(tmp_path, "3")["threads"]) == {3}
    library_default = blas_threads_of_worker(tmp_path, "0")
    assert library_default["env"] is None
    if len(os.sched_getaffinity(0)) > 1:   # one thread per core, the library's own choice
        assert set(library_default["threads"]) != {1}, library_default


def test_the_environment_chooses_blas_threads_when_the_config_does_not(tmp_path, monkeypatch):
    from jupyter_triton.backends.python import blas
    for key in blas.ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")   # the worker inherits it; OpenBLAS reads it at load
    assert set(blas_threads_of_worker(tmp_path, None)["threads"]) == {2}


def test_a_bad_blas_thread_count_is_refused(tmp_path):
    config, files = write_model(tmp_path, "blas", BLAS_MODEL_PY, BLAS_CONFIG +
                                'parameters { key: "blas_thread_count" value: { string_value: "many" } }')
    with pytest.raises(InvalidArgument, match="blas_thread_count must be a number of threads"):
        PythonBackend(config, files, InstanceSpec("blas_0_0"))


KEEPER_MODEL_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.kept = None

    def execute(self, requests):
        outs = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            previous = x if self.kept is None else self.kept
            self.kept = x          # an input kept past its batch, as a stateful model does
            outs.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", previous)]))
        return outs
'''

KEEPER_CONFIG = '''
name: "keeper"
backend: "python"
input [{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }]
output [{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }]
'''


@pytest.mark.parametrize("size", [16, 300_000])   # one copy of a small batch; a copy per large tensor
def test_tensors_kept_past_their_batch_are_not_overwritten_by_the_next(tmp_path, size):
    config, files = write_model(tmp_path, "keeper", KEEPER_MODEL_PY, KEEPER_CONFIG)
    with loaded(config, files) as backend:
        first = [np.full(size, i, np.float32) for i in range(3)]
        results = backend.execute([{"X": x} for x in first])
        kept_outputs = [r["Y"] for r in results]
        second = backend.execute([{"X": np.full(size, 9, np.float32)}])
        assert np.array_equal(second[0]["Y"], first[2])   # kept in the worker across batches
        third = backend.execute([{"X": np.full(size, 7, np.float32)}, {"X": np.full(size, 8, np.float32)}])
        assert np.array_equal(third[0]["Y"], np.full(size, 9, np.float32))
        assert np.array_equal(third[1]["Y"], np.full(size, 7, np.float32))
        # outputs handed back earlier do not change when later batches reuse the region
        assert [float(y[0]) for y in kept_outputs] == [0.0, 0.0, 1.0]
        assert all(y.shape == (size,) for y in kept_outputs)


def test_tensors_cross_through_shared_memory_and_nothing_leaks(tmp_path):
    before = our_shm()
    config, files = write_model(tmp_path, "add_sub", ADD_SUB_MODEL_PY, ADD_SUB_CONFIG.replace(
        "dims: [ 4 ]", "dims: [ -1 ]"))
    with loaded(config, files) as backend:
        small = np.ones(4, np.float32)
        big = np.arange(3 << 20, dtype=np.float32)      # 12 MiB: both regions must grow
        out = backend.execute([{"INPUT0": small, "INPUT1": small}, {"INPUT0": big, "INPUT1": big}])
        np.testing.assert_array_equal(out[1]["OUTPUT0"], big * 2)
        assert len(our_shm() - before) == 2             # one region each way
        backend.execute([{"INPUT0": small, "INPUT1": small}])
        os.kill(backend._worker.pid, 9)                 # an unexpected death mid-life
        assert isinstance(backend.execute([{"INPUT0": small, "INPUT1": small}])[0], Unavailable)
        np.testing.assert_array_equal(
            backend.execute([{"INPUT0": small, "INPUT1": small}])[0]["OUTPUT0"], small * 2)
    assert our_shm() - before == set()
    assert (files.version_dir / "model.py").exists()


def test_bytes_tensors(tmp_path):
    source = '''
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                words = pb_utils.get_input_tensor_by_name(r, "TEXT").as_numpy()
                upper = np.array([w.upper() + b"!" for w in words.reshape(-1)],
                                 dtype=np.object_).reshape(words.shape)
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("UPPER", upper)]))
            return out
    '''
    config, files = write_model(tmp_path, "shout", source, '''
        name: "shout" backend: "python"
        input [{ name: "TEXT" data_type: TYPE_STRING dims: [ -1, -1 ] }]
        output [{ name: "UPPER" data_type: TYPE_STRING dims: [ -1, -1 ] }]''')
    words = np.array([[b"ab", b""], [b"\x00bin\x00", "é".encode()]], dtype=np.object_)
    with loaded(config, files) as backend:
        out = backend.execute([{"TEXT": words}])[0]["UPPER"]
    assert out.dtype == np.object_ and out.shape == (2, 2)
    assert out.tolist() == [[b"AB!", b"!"], [b"\x00BIN\x00!", "é".encode().upper() + b"!"]]


# ------------------------------------------------------------------- notebook callables

def load_packed(tmp_path: Path, config_json: str, files: dict[str, bytes]):
    config = json_format.Parse(config_json, mc.ModelConfig())
    model_dir = tmp_path / config.name
    for rel, data in files.items():
        (model_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (model_dir / rel).write_bytes(data)
    return loaded(config, ModelFiles(config.name, 1, model_dir, model_dir / "1", "model.py"))


def softplus(x):
    return np.log1p(np.exp(x))


def test_pack_callable_config_and_files():
    config_json, files = pack_callable(
        softplus, name="sp", inputs=[("x", "FP32", [3])], outputs=[("y", "FP32", [3])],
        max_batch_size=8, extra_config="dynamic_batching { max_queue_delay_microseconds: 500 }")
    config = json_format.Parse(config_json, mc.ModelConfig())
    assert config.backend == "python" and config.max_batch_size == 8
    assert config.dynamic_batching.max_queue_delay_microseconds == 500
    assert mc.DataType.Name(config.input[0].data_type) == "TYPE_FP32"
    assert sorted(files) == ["1/model.pkl", "1/model.py"]
    # the generic model.py speaks only Triton's API: it loads in NVIDIA Triton as well
    source = files["1/model.py"].decode()
    assert "jupyter_triton" not in source.split('"""', 2)[2]
    assert "import triton_python_backend_utils as pb_utils" in source


def test_packed_module_function_with_dynamic_batching(tmp_path):
    config_json, files = pack_callable(
        softplus, name="sp", inputs=[("x", "FP32", [3])], outputs=[("y", "FP32", [3])],
        max_batch_size=8)
    batch = [np.random.default_rng(i).normal(size=(i + 1, 3)).astype(np.float32) for i in range(3)]
    with load_packed(tmp_path, config_json, files) as backend:
        out = backend.execute([{"x": b} for b in batch])
    for b, r in zip(batch, out):
        np.testing.assert_allclose(r["y"], softplus(b), rtol=1e-6)
        assert r["y"].dtype == np.float32


def test_packed_closure_sees_the_whole_batch(tmp_path):
    scale = 10

    def rows_seen(x):
        return x * scale, np.full((len(x), 1), len(x), dtype=np.int64)

    config_json, files = pack_callable(
        rows_seen, name="rows", inputs=[("x", "INT32", [2])],
        outputs=[("scaled", "INT32", [2]), ("n", "INT64", [1])], max_batch_size=16)
    with load_packed(tmp_path, config_json, files) as backend:
        out = backend.execute([{"x": np.ones((2, 2), np.int32)}, {"x": np.ones((3, 2), np.int32)}])
    assert [r["n"].reshape(-1).tolist() for r in out] == [[5, 5], [5, 5, 5]]   # one call, 5 rows
    np.testing.assert_array_equal(out[1]["scaled"], np.full((3, 2), 10, np.int32))


def test_packed_lambda_per_row_with_keywords_and_dict_output(tmp_path):
    config_json, files = pack_callable(
        lambda a, b: {"total": np.array([a.sum() + b.sum()])},
        name="rowsum", inputs=[("b", "FP64", [2]), ("a", "FP64", [2])],
        outputs=[("total", "FP64", [1])], max_batch_size=4, batched=False)
    with load_packed(tmp_path, config_json, files) as backend:
        out = backend.execute([{"a": np.array([[1.0, 2.0], [3.0, 4.0]]), "b": np.ones((2, 2))}])
    np.testing.assert_array_equal(out[0]["total"], [[5.0], [9.0]])


def test_packed_callable_failure_names_the_error(tmp_path):
    config_json, files = pack_callable(
        lambda x: x[:1], name="lossy", inputs=[("x", "FP32", [1])], outputs=[("y", "FP32", [1])],
        max_batch_size=4)
    with load_packed(tmp_path, config_json, files) as backend:
        out = backend.execute([{"x": np.ones((3, 1), np.float32)}])
    assert isinstance(out[0], Internal)
    assert "model 'lossy'" in str(out[0]) and "returned 1 rows for output 'y' but the batch had 3" in str(out[0])


def test_packed_torch_module(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
    config_json, files = pack_callable(
        net, name="net", inputs=[("input", "FP32", [4])], outputs=[("output", "FP32", [3])],
        max_batch_size=8)
    x1, x2 = np.random.default_rng(0).normal(size=(2, 2, 4)).astype(np.float32)
    with load_packed(tmp_path, config_json, files) as backend:
        out = backend.execute([{"input": x1}, {"input": x2}])
    with torch.no_grad():
        expected = net(torch.from_numpy(np.concatenate([x1, x2]))).numpy()
    np.testing.assert_allclose(np.concatenate([out[0]["output"], out[1]["output"]]), expected, rtol=1e-5)


def test_pack_model_py_round_trip(tmp_path):
    config_json, files = pack_model_py(
        ADD_SUB_MODEL_PY, name="add_sub", inputs=[("INPUT0", "FP32", [4]), ("INPUT1", "FP32", [4])],
        outputs=[("OUTPUT0", "FP32", [4]), ("OUTPUT1", "FP32", [4])], extra_config=THREAD_MODE)
    x = np.arange(4, dtype=np.float32)
    with load_packed(tmp_path, config_json, files) as backend:
        assert backend.mode == "thread"
        np.testing.assert_array_equal(backend.execute([{"INPUT0": x, "INPUT1": x}])[0]["OUTPUT0"], 2 * x)


def test_pack_callable_rejects_unknown_datatype():
    with pytest.raises(ValueError, match="tensor 'x': unknown datatype 'FP99'"):
        pack_callable(softplus, name="sp", inputs=[("x", "FP99", [1])], outputs=[("y", "FP32", [1])])
