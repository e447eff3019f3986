"""GPU discovery everywhere; the GPU paths (ONNX Runtime CUDA provider, torch on cuda,
TensorRT plans) where an NVIDIA GPU exists, skipped with the reason elsewhere."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from google.protobuf import text_format
from onnx import TensorProto, helper, numpy_helper
from tritonclient.grpc import model_config_pb2 as mc

from jupyter_triton.backends import devices
from jupyter_triton.backends.base import InstanceSpec, ModelFiles
from jupyter_triton.backends.devices import gpu_count, require_gpu, resolve_kind
from jupyter_triton.backends.onnxruntime import OnnxRuntimeBackend
from jupyter_triton.backends.tensorrt import TensorRTBackend
from jupyter_triton.engine.batching.instances import execute
from jupyter_triton.protocol.errors import InvalidArgument, Unavailable

NO_GPU = "no NVIDIA GPU on this machine"
requires_gpu = pytest.mark.skipif(gpu_count() == 0, reason=NO_GPU)
requires_tensorrt = pytest.mark.skipif(
    gpu_count() == 0 or importlib.util.find_spec("tensorrt") is None,
    reason=NO_GPU if gpu_count() == 0 else "the tensorrt package is not installed")

W = np.arange(6, dtype=np.float32).reshape(3, 2) / 10
B = np.array([1.0, -1.0], dtype=np.float32)


def linear_onnx() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
        initializer=[numpy_helper.from_array(W, "W"), numpy_helper.from_array(B, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def model_files(tmp_path: Path, name: str, filename: str) -> ModelFiles:
    version_dir = tmp_path / name / "1"
    version_dir.mkdir(parents=True, exist_ok=True)
    return ModelFiles(name, 1, tmp_path / name, version_dir, filename)


# -- discovery (runs everywhere) ---------------------------------------------------------------

def test_resolve_kind_follows_the_gpus_present(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "_physical_gpu_names", lambda: ())
    assert resolve_kind("KIND_AUTO") == "KIND_CPU"
    monkeypatch.setattr(devices, "_physical_gpu_names", lambda: ("NVIDIA H100",))
    assert resolve_kind("KIND_AUTO") == "KIND_GPU"
    assert resolve_kind(mc.ModelInstanceGroup.KIND_AUTO) == "KIND_GPU"
    assert resolve_kind("KIND_CPU") == "KIND_CPU"
    with pytest.raises(InvalidArgument, match="unknown instance group kind 'KIND_TPU'"):
        resolve_kind("KIND_TPU")


@pytest.mark.parametrize("visible, expected", [
    (None, ["A", "B", "C"]), ("", []), ("-1", []), ("2,0", ["C", "A"]), ("1,7,0", ["B"]),
    ("GPU-1234", ["GPU-1234"]),
])
def test_cuda_visible_devices_is_applied_like_cuda_does(monkeypatch, visible, expected):
    monkeypatch.setattr(devices, "_physical_gpu_names", lambda: ("A", "B", "C"))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert devices.gpu_names() == expected
    assert devices.gpu_count() == len(expected)


def test_require_gpu_names_the_problem(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "_physical_gpu_names", lambda: ())
    with pytest.raises(Unavailable, match=f"model 'm'.*{NO_GPU}"):
        require_gpu("m", 0)
    monkeypatch.setattr(devices, "_physical_gpu_names", lambda: ("A",))
    require_gpu("m", 0)
    with pytest.raises(InvalidArgument, match="specifies GPU 3 but only 1 GPU"):
        require_gpu("m", 3)


def test_gpu_discovery_loads_no_cuda_runtime():
    script = ("import sys\n"
              "from jupyter_triton.backends.devices import gpu_count\n"
              "gpu_count()\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] in "
              "('torch', 'onnxruntime', 'tensorrt', 'cupy')))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.skipif(gpu_count() > 0 and importlib.util.find_spec("tensorrt") is not None,
                    reason="checks the path without TensorRT or a GPU")
def test_tensorrt_without_runtime_or_gpu_is_unavailable_with_the_reason(tmp_path):
    files = model_files(tmp_path, "plan", "model.plan")
    (files.version_dir / "model.plan").write_bytes(b"\0" * 16)
    with pytest.raises(Unavailable, match="model 'plan': .*(tensorrt|NVIDIA GPU)"):
        TensorRTBackend.auto_complete_config(mc.ModelConfig(name="plan"), files)
    cfg = text_format.Parse('name: "plan" max_batch_size: 2 '
                            'input { name: "x" data_type: TYPE_FP32 dims: [3] } '
                            'output { name: "y" data_type: TYPE_FP32 dims: [2] }', mc.ModelConfig())
    cfg = TensorRTBackend.auto_complete_config(cfg, files)   # a complete config needs no engine
    assert cfg.platform == "tensorrt_plan" and cfg.backend == "tensorrt"
    with pytest.raises(Unavailable):
        TensorRTBackend(cfg, files, InstanceSpec("plan_0_0", kind="KIND_GPU")).load()


# -- ONNX Runtime on CUDA ----------------------------------------------------------------------

@requires_gpu
def test_onnx_on_the_cuda_provider_equals_numpy(tmp_path):
    files = model_files(tmp_path, "lin", "model.onnx")
    onnx.save(linear_onnx(), files.version_dir / "model.onnx")
    cfg = OnnxRuntimeBackend.auto_complete_config(
        text_format.Parse('name: "lin" instance_group { kind: KIND_GPU }', mc.ModelConfig()), files)
    backend = OnnxRuntimeBackend(cfg, files, InstanceSpec("lin_0_0", kind="KIND_GPU", device_id=0))
    backend.load()
    try:
        assert backend._session.get_providers()[0] == "CUDAExecutionProvider"
        requests = [{"x": np.random.default_rng(i).standard_normal((n, 3), dtype=np.float32)}
                    for i, n in enumerate((1, 3))]
        for request, result in zip(requests, execute(backend, requests)[0]):   # through io binding
            np.testing.assert_allclose(result["y"], request["x"] @ W + B, rtol=1e-4, atol=1e-5)
    finally:
        backend.unload()


@requires_gpu
def test_onnx_gpu_instance_on_a_missing_device_is_refused(tmp_path):
    files = model_files(tmp_path, "lin", "model.onnx")
    onnx.save(linear_onnx(), files.version_dir / "model.onnx")
    cfg = OnnxRuntimeBackend.auto_complete_config(mc.ModelConfig(name="lin"), files)
    backend = OnnxRuntimeBackend(cfg, files, InstanceSpec("lin_0_0", kind="KIND_GPU",
                                                          device_id=gpu_count()))
    with pytest.raises(InvalidArgument, match=f"specifies GPU {gpu_count()}"):
        backend.load()


# -- torch on cuda -----------------------------------------------------------------------------

@requires_gpu
def test_torch_export_and_torchscript_run_on_cuda(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip(f"torch {torch.__version__} is not a CUDA build")
    from jupyter_triton.backends.pytorch import PyTorchBackend

    class Scale(torch.nn.Module):
        def forward(self, x):
            return x * 3 + 1

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    files = model_files(tmp_path, "ex", "")
    program = torch.export.export(Scale(), (torch.ones(2, 3),),
                                  dynamic_shapes={"x": {0: torch.export.Dim("b")}})
    torch.export.save(program, files.version_dir / "model.pt2")
    cfg = PyTorchBackend.auto_complete_config(mc.ModelConfig(name="ex"), files)
    backend = PyTorchBackend(cfg, files, InstanceSpec("ex_0_0", kind="KIND_GPU"))
    backend.load()
    assert backend.device.type == "cuda"
    np.testing.assert_allclose(backend.run({"x": x})["OUTPUT__0"], x * 3 + 1)

    files = model_files(tmp_path, "ts", "model.pt")
    torch.jit.script(Scale()).save(str(files.version_dir / "model.pt"))
    cfg = text_format.Parse('name: "ts" max_batch_size: 4 '
                            'input { name: "INPUT__0" data_type: TYPE_FP32 dims: [3] } '
                            'output { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [3] }',
                            mc.ModelConfig())
    backend = PyTorchBackend(cfg, files, InstanceSpec("ts_0_0", kind="KIND_GPU"))
    backend.load()
    results, _ = execute(backend, [{"INPUT__0": x[:1]}, {"INPUT__0": x[1:]}])
    np.testing.assert_allclose(np.concatenate([r["OUTPUT__0"] for r in results]), x * 3 + 1)


# -- TensorRT ----------------------------------------------------------------------------------

def _build_plan(path: Path, max_batch: int) -> None:
    import tensorrt as trt
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)   # TensorRT 10: explicit batch is the only mode
    parser = trt.OnnxParser(network, logger)
    assert parser.parse(linear_onnx().SerializeToString()), parser.get_error(0)
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape("x", (1, 3), (2, 3), (max_batch, 3))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    assert plan is not None
    path.write_bytes(bytes(plan))


@requires_tensorrt
def test_tensorrt_plan_is_auto_completed_and_runs_batches(tmp_path):
    files = model_files(tmp_path, "plan", "model.plan")
    _build_plan(files.version_dir / "model.plan", max_batch=8)
    cfg = TensorRTBackend.auto_complete_config(mc.ModelConfig(name="plan"), files)
    assert cfg.platform == "tensorrt_plan" and cfg.max_batch_size == 4
    assert [(i.name, list(i.dims)) for i in cfg.input] == [("x", [3])]
    assert [(o.name, list(o.dims)) for o in cfg.output] == [("y", [2])]
    backend = TensorRTBackend(cfg, files, InstanceSpec("plan_0_0", kind="KIND_GPU"))
    backend.load()
    try:
        rng = np.random.default_rng(0)
        requests = [{"x": rng.standard_normal((n, 3), dtype=np.float32)} for n in (1, 3)]
        for request, result in zip(requests, execute(backend, requests)[0]):
            np.testing.assert_allclose(result["y"], request["x"] @ W + B, rtol=1e-3, atol=1e-3)
    finally:
        backend.unload()


@requires_tensorrt
def test_tensorrt_max_batch_beyond_the_profile_is_refused(tmp_path):
    files = model_files(tmp_path, "plan", "model.plan")
    _build_plan(files.version_dir / "model.plan", max_batch=2)
    with pytest.raises(InvalidArgument, match="max-batch 8 but the model only supports max-batch 2"):
        TensorRTBackend.auto_complete_config(
            text_format.Parse('name: "plan" max_batch_size: 8', mc.ModelConfig()), files)
