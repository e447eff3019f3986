"""The pytorch backend: TorchScript model.pt (Triton's naming rules) and torch.export model.pt2
(auto-completed like ONNX); outputs equal the torch module's own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from jupyter_triton.backends import backend_class, backend_name
from jupyter_triton.backends.base import InstanceSpec, ModelFiles
from jupyter_triton.engine.batching.instances import execute
from jupyter_triton.protocol.errors import Internal, InvalidArgument, Unsupported

torch = pytest.importorskip("torch")

from jupyter_triton.backends.pytorch import PyTorchBackend  # noqa: E402


class Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(3, 2)

    def forward(self, x, scale):
        y = self.fc(x) * scale
        return y, x.sum(dim=1, keepdim=True)


class Named(torch.nn.Module):
    def forward(self, x):
        return {"double": x * 2, "count": (x > 0).sum(dim=1, keepdim=True)}


class Casts(torch.nn.Module):
    def forward(self, x):
        return x.to(torch.float64) + 1


def files_for(tmp_path: Path, name: str, filename: str) -> ModelFiles:
    version_dir = tmp_path / name / "1"
    version_dir.mkdir(parents=True, exist_ok=True)
    return ModelFiles(name, 1, tmp_path / name, version_dir, filename)


def config(text: str, name: str) -> mc.ModelConfig:
    return text_format.Parse(f'name: "{name}" {text}', mc.ModelConfig())


def loaded(cfg: mc.ModelConfig, files: ModelFiles) -> PyTorchBackend:
    backend = PyTorchBackend(cfg, files, InstanceSpec(f"{cfg.name}_0_0"))
    backend.load()
    return backend


def export_linear(tmp_path: Path, max_batch: int | None = None) -> ModelFiles:
    files = files_for(tmp_path, "ex", "")
    batch = torch.export.Dim("batch", min=1, max=max_batch) if max_batch else torch.export.Dim("batch")
    program = torch.export.export(Linear().eval(), (torch.randn(2, 3), torch.ones(2, 2)),
                                  dynamic_shapes={"x": {0: batch}, "scale": {0: batch}})
    torch.export.save(program, files.version_dir / "model.pt2")
    return files


def script(tmp_path: Path, module: torch.nn.Module, name: str = "ts", trace_with=None) -> ModelFiles:
    files = files_for(tmp_path, name, "model.pt")
    scripted = torch.jit.trace(module, trace_with) if trace_with is not None else torch.jit.script(module)
    scripted.save(str(files.version_dir / "model.pt"))
    return files


def reference(x: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with torch.no_grad():
        y, s = Linear().eval()(torch.from_numpy(x), torch.from_numpy(scale))
    return y.numpy(), s.numpy()


RNG = np.random.default_rng(1)
X = RNG.standard_normal((5, 3), dtype=np.float32)
SCALE = RNG.standard_normal((5, 2), dtype=np.float32)

TS_CONFIG = """
  max_batch_size: 8
  input { name: "INPUT__1" data_type: TYPE_FP32 dims: [2] }
  input { name: "INPUT__0" data_type: TYPE_FP32 dims: [3] }
  output { name: "OUTPUT__1" data_type: TYPE_FP32 dims: [1] }
  output { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [2] }
"""


# -- torch.export ------------------------------------------------------------------------------

def test_registry_picks_pytorch_for_pt2_files(tmp_path):
    files = export_linear(tmp_path)
    assert backend_name(mc.ModelConfig(name="ex"), files.model_dir) == "pytorch"
    assert backend_class("pytorch") is PyTorchBackend


def test_exported_program_is_auto_completed_from_its_signature(tmp_path):
    files = export_linear(tmp_path)
    cfg = PyTorchBackend.auto_complete_config(mc.ModelConfig(name="ex"), files)
    assert cfg.backend == "pytorch" and cfg.platform == "torch_export"
    assert cfg.max_batch_size == 4 and cfg.HasField("dynamic_batching")
    assert [(i.name, i.data_type, list(i.dims)) for i in cfg.input] == [
        ("x", mc.TYPE_FP32, [3]), ("scale", mc.TYPE_FP32, [2])]
    assert [(o.name, list(o.dims)) for o in cfg.output] == [("OUTPUT__0", [2]), ("OUTPUT__1", [1])]


def test_exported_batch_bound_limits_max_batch_size(tmp_path):
    files = export_linear(tmp_path, max_batch=3)
    assert PyTorchBackend.auto_complete_config(mc.ModelConfig(name="ex"), files).max_batch_size == 3
    with pytest.raises(InvalidArgument, match="max-batch 8 but the model only supports max-batch 3"):
        PyTorchBackend.auto_complete_config(config("max_batch_size: 8", "ex"), files)


def test_exported_program_runs_and_splits_merged_batches(tmp_path):
    files = export_linear(tmp_path)
    backend = loaded(PyTorchBackend.auto_complete_config(mc.ModelConfig(name="ex"), files), files)
    results, _ = execute(backend, [{"x": X[:2], "scale": SCALE[:2]}, {"x": X[2:], "scale": SCALE[2:]}])
    y, s = reference(X, SCALE)
    np.testing.assert_allclose(np.concatenate([r["OUTPUT__0"] for r in results]), y, rtol=1e-5)
    np.testing.assert_allclose(np.concatenate([r["OUTPUT__1"] for r in results]), s, rtol=1e-5)
    assert [r["OUTPUT__0"].shape for r in results] == [(2, 2), (3, 2)]


def test_exported_program_accepts_triton_index_names(tmp_path):
    files = export_linear(tmp_path)
    cfg = PyTorchBackend.auto_complete_config(
        config('input { name: "INPUT__1" } input { name: "INPUT__0" }', "ex"), files)
    assert {i.name: list(i.dims) for i in cfg.input} == {"INPUT__0": [3], "INPUT__1": [2]}
    out = loaded(cfg, files).run({"INPUT__0": X, "INPUT__1": SCALE})
    np.testing.assert_allclose(out["OUTPUT__0"], reference(X, SCALE)[0], rtol=1e-5)


def test_exported_dict_outputs_are_named_by_key(tmp_path):
    files = files_for(tmp_path, "named", "")
    program = torch.export.export(Named(), (torch.randn(2, 4),),
                                  dynamic_shapes={"x": {0: torch.export.Dim("b")}})
    torch.export.save(program, files.version_dir / "model.pt2")
    cfg = PyTorchBackend.auto_complete_config(mc.ModelConfig(name="named"), files)
    assert {o.name: o.data_type for o in cfg.output} == {"double": mc.TYPE_FP32, "count": mc.TYPE_INT64}
    x = np.array([[1, -1, 2, 0]], np.float32)
    out = loaded(cfg, files).run({"x": x})
    np.testing.assert_array_equal(out["double"], x * 2)
    np.testing.assert_array_equal(out["count"], [[2]])


def test_program_exported_from_keyword_arguments_is_called_with_them(tmp_path):
    # what a dict example (`%%serve` with example={"x": ..., "scale": ...}) exports
    files = files_for(tmp_path, "kw", "")
    batch = torch.export.Dim("batch")
    program = torch.export.export(Linear().eval(), (),
                                  {"x": torch.randn(2, 3), "scale": torch.ones(2, 2)},
                                  dynamic_shapes={"x": {0: batch}, "scale": {0: batch}})
    torch.export.save(program, files.version_dir / "model.pt2")
    backend = loaded(PyTorchBackend.auto_complete_config(mc.ModelConfig(name="kw"), files), files)
    out = backend.run({"x": X, "scale": SCALE})
    y, s = reference(X, SCALE)
    np.testing.assert_allclose(out["OUTPUT__0"], y, rtol=1e-5)
    np.testing.assert_allclose(out["OUTPUT__1"], s, rtol=1e-5)


def test_exported_config_that_contradicts_the_program_is_refused(tmp_path):
    files = export_linear(tmp_path)
    with pytest.raises(InvalidArgument, match="model 'ex'.*datatype TYPE_INT32 for input 'x'"):
        PyTorchBackend.auto_complete_config(
            config('input { name: "x" data_type: TYPE_INT32 dims: [3] }', "ex"), files)


def test_a_file_that_is_not_an_exported_program_is_refused(tmp_path):
    files = files_for(tmp_path, "bad", "")
    (files.version_dir / "model.pt2").write_bytes(b"not a zip")
    with pytest.raises(InvalidArgument, match="model 'bad' version 1: 'model.pt2' is not a program"):
        PyTorchBackend.auto_complete_config(mc.ModelConfig(name="bad"), files)


# -- TorchScript -------------------------------------------------------------------------------

def test_torchscript_needs_its_tensors_in_the_config(tmp_path):
    files = script(tmp_path, Linear())
    with pytest.raises(InvalidArgument, match="TorchScript model does not record its tensor shapes"):
        PyTorchBackend.auto_complete_config(mc.ModelConfig(name="ts"), files)


def test_torchscript_index_names_follow_the_suffix_not_the_config_order(tmp_path):
    files = script(tmp_path, Linear())
    cfg = PyTorchBackend.auto_complete_config(config(TS_CONFIG, "ts"), files)
    assert cfg.platform == "pytorch_libtorch" and cfg.backend == "pytorch"
    backend = loaded(cfg, files)
    results, _ = execute(backend, [{"INPUT__0": X[:1], "INPUT__1": SCALE[:1]},
                                   {"INPUT__0": X[1:], "INPUT__1": SCALE[1:]}])
    y, s = reference(X, SCALE)
    np.testing.assert_allclose(np.concatenate([r["OUTPUT__0"] for r in results]), y, rtol=1e-5)
    np.testing.assert_allclose(np.concatenate([r["OUTPUT__1"] for r in results]), s, rtol=1e-5)


def test_torchscript_inputs_may_use_forward_argument_names(tmp_path):
    files = script(tmp_path, Linear(), trace_with=(torch.randn(2, 3), torch.ones(2, 2)))
    cfg = config("""max_batch_size: 8
      input { name: "scale" data_type: TYPE_FP32 dims: [2] }
      input { name: "x" data_type: TYPE_FP32 dims: [3] }
      output { name: "y" data_type: TYPE_FP32 dims: [2] }
      output { name: "s" data_type: TYPE_FP32 dims: [1] }""", "ts")
    out = loaded(cfg, files).run({"x": X, "scale": SCALE})
    y, s = reference(X, SCALE)
    np.testing.assert_allclose(out["y"], y, rtol=1e-5)   # outputs in config order
    np.testing.assert_allclose(out["s"], s, rtol=1e-5)


def test_torchscript_dict_outputs_and_dtype_casts(tmp_path):
    files = script(tmp_path, Named(), name="named")
    cfg = config("""max_batch_size: 4
      input { name: "x" data_type: TYPE_FP32 dims: [4] }
      output { name: "count" data_type: TYPE_INT32 dims: [1] }
      output { name: "double" data_type: TYPE_FP32 dims: [4] }""", "named")
    out = loaded(cfg, files).run({"x": np.array([[1, -1, 2, 0]], np.float32)})
    assert out["count"].dtype == np.int32 and out["count"].tolist() == [[2]]
    files = script(tmp_path, Casts(), name="casts")
    cfg = config("""input { name: "INPUT__0" data_type: TYPE_INT16 dims: [3] }
      output { name: "OUTPUT__0" data_type: TYPE_FP64 dims: [3] }""", "casts")
    out = loaded(cfg, files).run({"INPUT__0": np.array([1, 2, 3], np.int16)})
    assert out["OUTPUT__0"].dtype == np.float64 and out["OUTPUT__0"].tolist() == [2.0, 3.0, 4.0]


def test_torchscript_missing_output_and_too_many_inputs_are_named(tmp_path):
    files = script(tmp_path, Named(), name="named")
    cfg = config("""input { name: "x" data_type: TYPE_FP32 dims: [-1, 4] }
      output { name: "triple" data_type: TYPE_FP32 dims: [-1, 4] }""", "named")
    with pytest.raises(Internal, match="model 'named' did not produce output 'triple'"):
        loaded(cfg, files).run({"x": np.ones((1, 4), np.float32)})
    cfg = config("""input { name: "x" data_type: TYPE_FP32 dims: [4] }
      input { name: "y" data_type: TYPE_FP32 dims: [4] }
      output { name: "double" data_type: TYPE_FP32 dims: [4] }""", "named")
    with pytest.raises(InvalidArgument, match="configuration expects 2 inputs, model provides 1"):
        loaded(cfg, files)


def test_bytes_tensors_are_refused_clearly(tmp_path):
    files = script(tmp_path, Named(), name="named")
    cfg = config("""input { name: "x" data_type: TYPE_STRING dims: [4] }
      output { name: "double" data_type: TYPE_FP32 dims: [4] }""", "named")
    with pytest.raises(Unsupported, match="tensor 'x' is TYPE_STRING"):
        loaded(cfg, files)


def test_model_errors_fail_the_batch_with_torchs_message(tmp_path):
    files = script(tmp_path, Linear())
    backend = loaded(PyTorchBackend.auto_complete_config(config(TS_CONFIG, "ts"), files), files)
    with pytest.raises(InvalidArgument, match="PyTorch execute failure for model 'ts'"):
        backend.run({"INPUT__0": np.ones((2, 4), np.float32), "INPUT__1": np.ones((2, 2), np.float32)})


def test_thread_parameters_are_applied(tmp_path):
    files = script(tmp_path, Linear())
    before = torch.get_num_threads()
    try:
        cfg = config(TS_CONFIG + 'parameters { key: "INTRA_OP_THREAD_COUNT" value { string_value: "1" } }',
                     "ts")
        loaded(PyTorchBackend.auto_complete_config(cfg, files), files)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


LOAD_IN_A_FRESH_PROCESS = """
import json, os, sys
from pathlib import Path
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from jupyter_triton.backends.base import InstanceSpec, ModelFiles
from jupyter_triton.backends.pytorch import PyTorchBackend
assert "torch" not in sys.modules
files = ModelFiles("ts", 1, Path(sys.argv[1]).parent, Path(sys.argv[1]), "model.pt")
cfg = PyTorchBackend.auto_complete_config(text_format.Parse(sys.argv[2], mc.ModelConfig()), files)
backend = PyTorchBackend(cfg, files, InstanceSpec("ts_0_0"))
backend.load()
print(json.dumps(os.environ.get("OMP_WAIT_POLICY")))
"""


@pytest.mark.parametrize("environ, parameter, spins, environ_after", [
    (None, None, False, None),              # ours: PASSIVE, and the environment untouched
    ("PASSIVE", "ACTIVE", True, "PASSIVE"),  # the model's parameter wins over the environment
])
def test_openmp_threads_sleep_unless_the_model_asks_them_to_spin(tmp_path, environ, parameter,
                                                                  spins, environ_after):
    files = script(tmp_path, Linear())
    text = 'name: "ts" ' + TS_CONFIG
    if parameter:
        text += f'parameters {{ key: "OMP_WAIT_POLICY" value {{ string_value: "{parameter}" }} }}'
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"      # libgomp prints its settings when torch loads it
    if environ:
        env["OMP_WAIT_POLICY"] = environ
    done = subprocess.run([sys.executable, "-c", LOAD_IN_A_FRESH_PROCESS, str(files.version_dir), text],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr
    # PASSIVE is a spin count of 0; libgomp's default and ACTIVE spin
    assert ("GOMP_SPINCOUNT = '0'" not in done.stderr) == spins, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == environ_after


def test_a_wait_policy_other_than_passive_or_active_is_refused(tmp_path):
    files = script(tmp_path, Linear())
    cfg = config(TS_CONFIG + 'parameters { key: "OMP_WAIT_POLICY" value { string_value: "sometimes" } }',
                 "ts")
    with pytest.raises(InvalidArgument, match="'OMP_WAIT_POLICY' must be PASSIVE or ACTIVE"):
        PyTorchBackend.auto_complete_config(cfg, files)


def test_missing_artifact_names_model_version_and_file(tmp_path):
    files = files_for(tmp_path, "none", "model.pt")
    with pytest.raises(InvalidArgument, match=r"unable to find '.*1/model.pt' for model 'none' version 1"):
        PyTorchBackend.auto_complete_config(config(TS_CONFIG, "none"), files)
