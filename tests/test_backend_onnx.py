"""The onnxruntime backend: Triton's auto-complete, the load-time checks, and execution."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from google.protobuf import text_format
from onnx import TensorProto, helper, numpy_helper
from tritonclient.grpc import model_config_pb2 as mc

from jupyter_triton.backends import backend_class
from jupyter_triton.backends.base import InstanceSpec, ModelFiles
from jupyter_triton.backends.devices import gpu_count
from jupyter_triton.backends.onnxruntime import OnnxRuntimeBackend
from jupyter_triton.engine.batching.instances import execute
from jupyter_triton.protocol.errors import Internal, InvalidArgument, Unavailable, Unsupported

W = np.arange(6, dtype=np.float32).reshape(3, 2) / 10
B = np.array([1.0, -1.0], dtype=np.float32)


def _model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def linear_model(batch: str | int = "N") -> onnx.ModelProto:
    """y = x @ W + b, x: [batch, 3] -> y: [batch, 2]."""
    return _model(
        [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 2])],
        [numpy_helper.from_array(W, "W"), numpy_helper.from_array(B, "b")])


def two_input_model() -> onnx.ModelProto:
    """sum = a + b, diff = a - b on INT32 [N, 4]."""
    return _model(
        [helper.make_node("Add", ["a", "b"], ["sum"]), helper.make_node("Sub", ["a", "b"], ["diff"])],
        [helper.make_tensor_value_info(n, TensorProto.INT32, ["N", 4]) for n in ("a", "b")],
        [helper.make_tensor_value_info(n, TensorProto.INT32, ["N", 4]) for n in ("sum", "diff")])


def identity_model(onnx_type: int, batch: str = "N") -> onnx.ModelProto:
    return _model([helper.make_node("Identity", ["x"], ["y"])],
                  [helper.make_tensor_value_info("x", onnx_type, [batch, 2])],
                  [helper.make_tensor_value_info("y", onnx_type, [batch, 2])])


def write(tmp_path: Path, model: onnx.ModelProto, name: str = "m") -> ModelFiles:
    version_dir = tmp_path / name / "1"
    version_dir.mkdir(parents=True)
    onnx.save(model, version_dir / "model.onnx")
    return ModelFiles(name, 1, tmp_path / name, version_dir, "model.onnx")


def config(text: str = "", name: str = "m") -> mc.ModelConfig:
    return text_format.Parse(f'name: "{name}" {text}', mc.ModelConfig())


def loaded(cfg: mc.ModelConfig, files: ModelFiles, kind: str = "KIND_CPU") -> OnnxRuntimeBackend:
    backend = OnnxRuntimeBackend(cfg, files, InstanceSpec(f"{cfg.name}_0_0", kind=kind))
    backend.load()
    return backend


# -- auto-complete -----------------------------------------------------------------------------

def test_registry_finds_the_onnx_backend():
    assert backend_class("onnxruntime") is OnnxRuntimeBackend


def test_dynamic_batch_model_gets_max_batch_size_4_and_a_dynamic_batcher(tmp_path):
    files = write(tmp_path, linear_model())
    cfg = OnnxRuntimeBackend.auto_complete_config(config(), files)
    assert cfg.backend == "onnxruntime" and cfg.platform == "onnxruntime_onnx"
    assert cfg.max_batch_size == 4
    assert cfg.HasField("dynamic_batching")
    assert [(i.name, i.data_type, list(i.dims)) for i in cfg.input] == [("x", mc.TYPE_FP32, [3])]
    assert [(o.name, o.data_type, list(o.dims)) for o in cfg.output] == [("y", mc.TYPE_FP32, [2])]


def test_auto_complete_does_not_change_the_callers_config(tmp_path):
    files = write(tmp_path, linear_model())
    original = config()
    OnnxRuntimeBackend.auto_complete_config(original, files)
    assert original.max_batch_size == 0 and not original.input


def test_given_max_batch_size_is_kept_and_dims_exclude_the_batch_dim(tmp_path):
    files = write(tmp_path, linear_model())
    cfg = OnnxRuntimeBackend.auto_complete_config(config("max_batch_size: 16"), files)
    assert cfg.max_batch_size == 16
    assert list(cfg.input[0].dims) == [3] and list(cfg.output[0].dims) == [2]


def test_a_scheduler_in_the_config_is_not_replaced(tmp_path):
    files = write(tmp_path, linear_model())
    cfg = OnnxRuntimeBackend.auto_complete_config(config("sequence_batching {}"), files)
    assert cfg.max_batch_size == 4
    assert cfg.WhichOneof("scheduling_choice") == "sequence_batching"


def test_fixed_batch_model_is_not_batched(tmp_path):
    files = write(tmp_path, linear_model(batch=2))
    cfg = OnnxRuntimeBackend.auto_complete_config(config(), files)
    assert cfg.max_batch_size == 0 and not cfg.HasField("dynamic_batching")
    assert list(cfg.input[0].dims) == [2, 3]


def test_max_batch_size_on_a_model_that_cannot_batch_is_refused(tmp_path):
    files = write(tmp_path, linear_model(batch=2))
    with pytest.raises(InvalidArgument, match="model 'm': model does not support batching"):
        OnnxRuntimeBackend.auto_complete_config(config("max_batch_size: 8"), files)


def test_config_that_spells_full_dims_keeps_max_batch_size_0(tmp_path):
    files = write(tmp_path, linear_model())
    cfg = OnnxRuntimeBackend.auto_complete_config(
        config('input { name: "x" data_type: TYPE_FP32 dims: [-1, 3] }'), files)
    assert cfg.max_batch_size == 0
    assert list(cfg.output[0].dims) == [-1, 2]   # the missing output is filled in


def test_partial_tensors_are_filled_from_the_model(tmp_path):
    files = write(tmp_path, two_input_model())
    cfg = OnnxRuntimeBackend.auto_complete_config(
        config('input { name: "b" } output { name: "diff" data_type: TYPE_INT32 }'), files)
    assert cfg.max_batch_size == 4
    assert [(i.name, i.data_type, list(i.dims)) for i in cfg.input] == [
        ("b", mc.TYPE_INT32, [4]), ("a", mc.TYPE_INT32, [4])]
    assert sorted(o.name for o in cfg.output) == ["diff", "sum"]


@pytest.mark.parametrize("text, message", [
    ('input { name: "x" data_type: TYPE_INT64 dims: [3] } max_batch_size: 4',
     "configuration expects datatype TYPE_INT64 for input 'x', model provides TYPE_FP32"),
    ('input { name: "x" data_type: TYPE_FP32 dims: [4] } max_batch_size: 4',
     "tensor 'x': the model expects 2 dimensions \\(shape \\[-1,3\\]\\) but the model "
     "configuration specifies 2 dimensions \\(an initial batch dimension"),
    ('input { name: "z" data_type: TYPE_FP32 dims: [3] } max_batch_size: 4',
     "unexpected inference input 'z', allowed inputs are: x"),
    ('output { name: "y" data_type: TYPE_FP32 dims: [2, 1] } max_batch_size: 4',
     "tensor 'y': the model expects 2 dimensions"),
])
def test_config_that_contradicts_the_model_is_refused_naming_the_tensor(tmp_path, text, message):
    files = write(tmp_path, linear_model())
    with pytest.raises(InvalidArgument, match=f"model 'm'.*{message}"):
        OnnxRuntimeBackend.auto_complete_config(config(text), files)


def test_load_checks_the_config_even_without_auto_complete(tmp_path):
    files = write(tmp_path, linear_model())
    cfg = config('max_batch_size: 4 input { name: "x" data_type: TYPE_FP64 dims: [3] } '
                 'output { name: "y" data_type: TYPE_FP32 dims: [2] }')
    with pytest.raises(InvalidArgument, match="TYPE_FP64 for input 'x'"):
        loaded(cfg, files)


def test_missing_and_broken_artifacts_name_model_version_and_file(tmp_path):
    empty = tmp_path / "m" / "1"
    empty.mkdir(parents=True)
    files = ModelFiles("m", 1, tmp_path / "m", empty, "model.onnx")
    with pytest.raises(InvalidArgument, match=r"unable to find '.*1/model.onnx' for model 'm' version 1"):
        OnnxRuntimeBackend.auto_complete_config(config(), files)
    (empty / "model.onnx").write_bytes(b"this is not a protobuf")
    with pytest.raises(InvalidArgument, match="model 'm' version 1: 'model.onnx' could not be loaded"):
        OnnxRuntimeBackend.auto_complete_config(config(), files)


def test_model_directory_with_external_data_loads(tmp_path):
    model = linear_model()
    model_dir = tmp_path / "m" / "1" / "model.onnx"
    model_dir.mkdir(parents=True)
    onnx.save(model, model_dir / "model.onnx", save_as_external_data=True,
              all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    assert (model_dir / "weights.bin").exists()
    files = ModelFiles("m", 1, tmp_path / "m", tmp_path / "m" / "1", "model.onnx")
    cfg = OnnxRuntimeBackend.auto_complete_config(config(), files)
    x = np.ones((1, 3), np.float32)
    out = loaded(cfg, files).run({"x": x})
    np.testing.assert_allclose(out["y"], x @ W + B, rtol=1e-6)


# -- execution ---------------------------------------------------------------------------------

def test_execution_equals_numpy_and_merged_batches_split_per_request(tmp_path):
    files = write(tmp_path, linear_model())
    backend = loaded(OnnxRuntimeBackend.auto_complete_config(config(), files), files)
    rng = np.random.default_rng(0)
    requests = [{"x": rng.standard_normal((n, 3), dtype=np.float32)} for n in (1, 3, 2)]
    results, _ = execute(backend, requests)     # merged into one run, split per request
    assert len(results) == 3
    for request, result in zip(requests, results):
        assert result["y"].shape == (len(request["x"]), 2) and result["y"].dtype == np.float32
        np.testing.assert_allclose(result["y"], request["x"] @ W + B, rtol=1e-5, atol=1e-6)


def test_two_inputs_two_outputs(tmp_path):
    files = write(tmp_path, two_input_model())
    backend = loaded(OnnxRuntimeBackend.auto_complete_config(config(), files), files)
    a = np.arange(8, dtype=np.int32).reshape(2, 4)
    b = np.full((2, 4), 3, dtype=np.int32)
    out = backend.run({"a": a, "b": b})
    np.testing.assert_array_equal(out["sum"], a + b)
    np.testing.assert_array_equal(out["diff"], a - b)


@pytest.mark.parametrize("onnx_type, dtype, config_type", [
    (TensorProto.BOOL, np.bool_, mc.TYPE_BOOL),
    (TensorProto.INT8, np.int8, mc.TYPE_INT8),
    (TensorProto.UINT16, np.uint16, mc.TYPE_UINT16),
    (TensorProto.INT64, np.int64, mc.TYPE_INT64),
    (TensorProto.FLOAT16, np.float16, mc.TYPE_FP16),
    (TensorProto.DOUBLE, np.float64, mc.TYPE_FP64),
])
def test_identity_keeps_every_numeric_dtype(tmp_path, onnx_type, dtype, config_type):
    files = write(tmp_path, identity_model(onnx_type))
    cfg = OnnxRuntimeBackend.auto_complete_config(config(), files)
    assert cfg.input[0].data_type == config_type
    x = (np.arange(4).reshape(2, 2) % 2).astype(dtype)
    out = loaded(cfg, files).run({"x": x})
    assert out["y"].dtype == dtype
    np.testing.assert_array_equal(out["y"], x)


def test_bytes_tensors_round_trip_as_bytes(tmp_path):
    files = write(tmp_path, identity_model(TensorProto.STRING))
    cfg = OnnxRuntimeBackend.auto_complete_config(config(), files)
    assert cfg.input[0].data_type == mc.TYPE_STRING
    x = np.array([[b"hello", "h\u00e9".encode()], [b"", b"x y"]], dtype=object)
    results, _ = execute(loaded(cfg, files), [{"x": x[:1]}, {"x": x[1:]}])
    assert results[0]["y"].dtype == np.object_
    assert results[0]["y"].tolist() == [[b"hello", "h\u00e9".encode()]]
    assert results[1]["y"].tolist() == [[b"", b"x y"]]


def test_non_utf8_bytes_for_a_string_input_fail_that_request(tmp_path):
    files = write(tmp_path, identity_model(TensorProto.STRING))
    backend = loaded(OnnxRuntimeBackend.auto_complete_config(config(), files), files)
    with pytest.raises(InvalidArgument, match="input 'x' of model 'm'.*UTF-8"):
        backend.run({"x": np.array([[b"\xff", b"a"]], dtype=object)})


def test_scalar_output_is_served_with_dims_1(tmp_path):
    model = _model([helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                   [helper.make_tensor_value_info("total", TensorProto.FLOAT, [])])
    files = write(tmp_path, model)
    cfg = OnnxRuntimeBackend.auto_complete_config(config(), files)
    assert cfg.max_batch_size == 0 and list(cfg.output[0].dims) == [1]
    out = loaded(cfg, files).run({"x": np.array([1, 2, 3.5], np.float32)})
    assert out["total"].shape == (1,) and out["total"][0] == pytest.approx(6.5)


def test_runtime_shape_error_is_an_error_not_a_crash(tmp_path):
    files = write(tmp_path, two_input_model())
    cfg = config('input { name: "a" data_type: TYPE_INT32 dims: [-1, 4] } '
                 'input { name: "b" data_type: TYPE_INT32 dims: [-1, 4] }')
    backend = loaded(OnnxRuntimeBackend.auto_complete_config(cfg, files), files)
    with pytest.raises(Internal, match="onnx runtime error running model 'm': .*broadcast"):
        backend.run({"a": np.ones((2, 4), np.int32), "b": np.ones((3, 4), np.int32)})


# -- session options ---------------------------------------------------------------------------

def test_triton_session_parameters_are_applied(tmp_path):
    files = write(tmp_path, linear_model())
    cfg = OnnxRuntimeBackend.auto_complete_config(config(
        'parameters { key: "intra_op_thread_count" value { string_value: "1" } } '
        'parameters { key: "inter_op_thread_count" value { string_value: "2" } } '
        'parameters { key: "execution_mode" value { string_value: "1" } } '
        'parameters { key: "enable_mem_pattern" value { string_value: "0" } } '
        'parameters { key: "enable_mem_arena" value { string_value: "0" } } '
        'optimization { graph { level: -1 } }'), files)
    import onnxruntime as ort
    options = loaded(cfg, files)._session.get_session_options()
    assert options.intra_op_num_threads == 1
    assert options.inter_op_num_threads == 2
    assert options.execution_mode == ort.ExecutionMode.ORT_PARALLEL
    assert options.enable_mem_pattern is False
    assert options.enable_cpu_mem_arena is False
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC


def test_runtime_threads_do_not_spin_unless_the_config_asks(tmp_path):
    files = write(tmp_path, linear_model())
    spinning = ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning")

    def entries(text: str = "") -> list[str]:
        cfg = OnnxRuntimeBackend.auto_complete_config(config(text), files)
        options = loaded(cfg, files)._session.get_session_options()
        return [options.get_session_config_entry(key) for key in spinning]

    assert entries() == ["0", "0"]
    assert entries('parameters { key: "session.intra_op.allow_spinning" value { string_value: "1" } } '
                   'parameters { key: "session.inter_op.allow_spinning" value { string_value: "1" } }'
                   ) == ["1", "1"]
    # any other ORT session entry passes through as given
    cfg = OnnxRuntimeBackend.auto_complete_config(config(
        'parameters { key: "session.set_denormal_as_zero" value { string_value: "1" } }'), files)
    options = loaded(cfg, files)._session.get_session_options()
    assert options.get_session_config_entry("session.set_denormal_as_zero") == "1"


def test_several_cpu_instances_share_the_cores(tmp_path):
    files = write(tmp_path, linear_model())
    cores = len(os.sched_getaffinity(0))
    one = OnnxRuntimeBackend.auto_complete_config(
        config("instance_group { kind: KIND_CPU count: 1 }"), files)
    many = OnnxRuntimeBackend.auto_complete_config(
        config("instance_group { kind: KIND_CPU count: 2 } instance_group { kind: KIND_CPU count: 2 }"),
        files)
    assert loaded(one, files)._session.get_session_options().intra_op_num_threads == 0  # ORT default
    assert loaded(many, files)._session.get_session_options().intra_op_num_threads == max(1, cores // 4)


@pytest.mark.parametrize("text, error, message", [
    ('parameters { key: "execution_mode" value { string_value: "2" } }', InvalidArgument,
     "'execution_mode' must be 0"),
    ('parameters { key: "intra_op_thread_count" value { string_value: "many" } }', InvalidArgument,
     "'intra_op_thread_count' must be an integer"),
    ('optimization { graph { level: 7 } }', InvalidArgument, "level must be -1, 0, 1 or 2"),
    ('parameters { key: "session.intra_op.allow_spinning" value { string_value: "yes" } }',
     InvalidArgument, "'session.intra_op.allow_spinning' must be \"0\" or \"1\""),
    ('optimization { execution_accelerators { cpu_execution_accelerator { name: "openvino" } } }',
     Unsupported, "'openvino' needs onnxruntime-openvino"),
    ('optimization { execution_accelerators { cpu_execution_accelerator { name: "fast" } } }',
     Unsupported, "unknown cpu_execution_accelerator 'fast'"),
])
def test_bad_options_are_refused_at_load(tmp_path, text, error, message):
    files = write(tmp_path, linear_model())
    cfg = OnnxRuntimeBackend.auto_complete_config(config(text), files)
    with pytest.raises(error, match=message):
        loaded(cfg, files)


@pytest.mark.skipif(gpu_count() > 0, reason="checks the GPU-less path")
def test_gpu_instance_without_a_gpu_is_unavailable(tmp_path):
    files = write(tmp_path, linear_model())
    cfg = OnnxRuntimeBackend.auto_complete_config(config(), files)
    with pytest.raises(Unavailable, match="no NVIDIA GPU on this machine"):
        loaded(cfg, files, kind="KIND_GPU")


@pytest.mark.skipif(gpu_count() > 0, reason="checks the GPU-less path")
def test_cpu_load_prints_no_cuda_errors(tmp_path):
    files = write(tmp_path, linear_model())
    script = (
        "import numpy as np\n"
        "from pathlib import Path\n"
        "from tritonclient.grpc import model_config_pb2 as mc\n"
        "from jupyter_triton.backends.base import InstanceSpec, ModelFiles\n"
        "from jupyter_triton.backends.devices import resolve_kind\n"
        "from jupyter_triton.backends.onnxruntime import OnnxRuntimeBackend as B\n"
        f"files = ModelFiles('m', 1, Path({str(files.model_dir)!r}), Path({str(files.version_dir)!r}), 'model.onnx')\n"
        "cfg = B.auto_complete_config(mc.ModelConfig(name='m'), files)\n"
        "b = B(cfg, files, InstanceSpec('m_0_0', kind=resolve_kind('KIND_AUTO')))\n"
        "b.load()\n"
        "print(b.run({'x': np.ones((1, 3), np.float32)})['y'].shape)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(1, 2)"
    assert "cuda" not in done.stderr.lower(), done.stderr
