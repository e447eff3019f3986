"""What %%serve makes of notebook objects: the files and config it uploads (no server)."""
from __future__ import annotations

import io

import numpy as np
import onnx
import pytest
import torch
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc

from conftest import W
from jupyter_triton.kernel.artifacts import ArtifactError, build_artifact
from jupyter_triton.kernel.knobs import Knobs, apply_knobs
from onnx_models import linear

pytestmark = pytest.mark.timeout(120)


def _config(art) -> mc.ModelConfig:
    """What the server receives: the JSON config, parsed back."""
    return json_format.Parse(art.config_json(), mc.ModelConfig())


# ---- ONNX -----------------------------------------------------------------------------------

def test_onnx_bytes_proto_and_path_give_the_same_model(tmp_path):
    data = linear(W)
    path = tmp_path / "m.onnx"
    path.write_bytes(data)
    for obj in (data, onnx.load_from_string(data), path, str(path)):
        art = build_artifact(obj, "lin")
        assert art.format == "onnx"
        assert onnx.load_from_string(art.files["1/model.onnx"]) == onnx.load_from_string(data)
        cfg = _config(art)
        assert (cfg.name, cfg.backend, cfg.platform) == ("lin", "onnxruntime", "onnxruntime_onnx")
        # inputs/outputs and max_batch_size are left to the server's auto-complete
        assert cfg.max_batch_size == 0 and not cfg.input and not cfg.output
        assert art.inputs == [("INPUT0", "FP32", [-1, 16])] and art.batching is True
    assert _config(build_artifact(data, "lin", max_batch_size=32)).max_batch_size == 32


def test_bytes_that_are_not_onnx_are_refused_with_what_can_be_served():
    with pytest.raises(ArtifactError) as err:
        build_artifact(b"\x00\x01 definitely not a model", "junk")
    assert "model 'junk'" in str(err.value) and "not an ONNX model" in str(err.value)
    assert "torch.nn.Module" in str(err.value)
    with pytest.raises(ArtifactError, match="no such file"):
        build_artifact("/nonexistent/model.onnx", "gone")
    with pytest.raises(ArtifactError, match="cannot serve a builtins.int"):
        build_artifact(42, "answer")


# ---- torch ----------------------------------------------------------------------------------

def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.ReLU())


@pytest.mark.parametrize("rows", [1, 3])
def test_torch_module_with_example_is_exported_with_a_dynamic_batch(rows):
    model = _mlp()
    art = build_artifact(model, "mlp", example=torch.randn(rows, 8), max_batch_size=16)
    assert art.format == "torch_export" and art.notes == []
    cfg = _config(art)
    assert (cfg.backend, cfg.platform, cfg.max_batch_size) == ("pytorch", "torch_export", 16)
    assert art.inputs == [("input", "FP32", [-1, 8])]
    program = torch.export.load(io.BytesIO(art.files["1/model.pt2"]))
    x = torch.randn(7, 8)          # a batch size the example never had
    torch.testing.assert_close(program.module()(x), model(x))


def test_torch_module_falls_back_to_a_torchscript_trace(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("unsupported operator")
    monkeypatch.setattr(torch.export, "export", refuse)
    model = _mlp()
    art = build_artifact(model, "mlp", example=torch.randn(2, 8))
    assert art.format == "torchscript"
    assert "torch.export failed (RuntimeError: unsupported operator)" in art.notes[0]
    assert "TorchScript trace" in art.notes[0]
    cfg = _config(art)
    assert (cfg.platform, cfg.max_batch_size) == ("pytorch_libtorch", 4)
    assert [(t.name, list(t.dims)) for t in cfg.input] == [("INPUT__0", [8])]
    assert [(t.name, list(t.dims)) for t in cfg.output] == [("OUTPUT__0", [5])]
    script = torch.jit.load(io.BytesIO(art.files["1/model.pt"]))
    x = torch.randn(6, 8)
    torch.testing.assert_close(script(x), model(x))


def test_data_dependent_module_is_served_as_a_callable_not_a_wrong_trace():
    class Branchy(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x - 1
    art = build_artifact(Branchy(), "branchy", example=torch.ones(2, 3))
    assert art.format == "python"
    assert "trace would be wrong for other inputs" in art.notes[0]
    assert "served as a Python callable" in art.notes[0]
    assert set(art.files) == {"1/model.py", "1/model.pkl"}
    cfg = _config(art)
    assert [(t.name, list(t.dims)) for t in cfg.input] == [("x", [3])]


def test_sequential_without_example_reads_its_width_from_the_leading_linear():
    model = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.ReLU())
    model.train()
    art = build_artifact(model, "embedder", max_batch_size=64)
    assert art.format == "python" and model.training      # probing left the module as it was
    cfg = _config(art)
    assert (cfg.backend, cfg.max_batch_size) == ("python", 64)
    assert [(t.name, t.data_type, list(t.dims)) for t in cfg.input] == [("input", mc.TYPE_FP32, [256])]
    assert [(t.name, t.data_type, list(t.dims)) for t in cfg.output] == [("OUTPUT__0", mc.TYPE_FP32, [64])]
    assert "width 256 read from the leading nn.Linear" in art.notes[0]


def test_module_without_example_or_linear_says_what_to_pass():
    with pytest.raises(ArtifactError) as err:
        build_artifact(torch.nn.ReLU(), "relu")
    assert "model 'relu'" in str(err.value)
    assert "example=" in str(err.value) and "inputs=" in str(err.value)


def test_torchscript_module_needs_and_uses_an_example():
    scripted = torch.jit.script(_mlp())
    with pytest.raises(ArtifactError, match="does not record its tensor shapes"):
        build_artifact(scripted, "ts")
    art = build_artifact(scripted, "ts", example=torch.randn(2, 8))
    cfg = _config(art)
    assert art.format == "torchscript" and cfg.max_batch_size == 4
    assert [(t.name, list(t.dims)) for t in cfg.input] == [("INPUT__0", [8])]
    assert [(t.name, list(t.dims)) for t in cfg.output] == [("OUTPUT__0", [5])]


# ---- callables ------------------------------------------------------------------------------

def test_callable_signature_from_its_parameters_and_example():
    def add_mul(x, y):
        return x + y, x * y
    ex = (np.ones((2, 3), np.float32), np.ones((2, 3), np.int64))
    cfg = _config(build_artifact(add_mul, "am", example=ex))
    assert cfg.backend == "python" and cfg.max_batch_size == 4
    assert [(t.name, t.data_type, list(t.dims)) for t in cfg.input] == [
        ("x", mc.TYPE_FP32, [3]), ("y", mc.TYPE_INT64, [3])]
    # numpy promotes float32 with int64 to float64, and the config says what comes out
    assert [(t.name, t.data_type) for t in cfg.output] == [("OUTPUT__0", mc.TYPE_FP64),
                                                           ("OUTPUT__1", mc.TYPE_FP64)]


def test_callable_dict_example_and_dict_outputs_keep_their_names():
    def scores(tokens, weights):
        return {"total": (tokens * weights).sum(axis=1), "count": (tokens > 0).sum(axis=1)}
    ex = {"tokens": np.ones((2, 5), np.float32), "weights": np.ones((2, 5), np.float32)}
    cfg = _config(build_artifact(scores, "scores", example=ex))
    assert [t.name for t in cfg.input] == ["tokens", "weights"]
    assert [(t.name, t.data_type, list(t.dims)) for t in cfg.output] == [
        ("total", mc.TYPE_FP32, [1]), ("count", mc.TYPE_INT64, [1])]
    # one value per row: Triton's spelling is dims [1] with an empty reshape
    assert all(t.HasField("reshape") and not t.reshape.shape for t in cfg.output)


def test_callable_that_drops_the_batch_is_served_without_batching():
    def total(x):
        return x.sum()
    art = build_artifact(total, "total", example=np.ones((2, 3), np.float32))
    cfg = _config(art)
    assert cfg.max_batch_size == 0 and list(cfg.input[0].dims) == [2, 3]
    with pytest.raises(ArtifactError) as err:
        build_artifact(total, "total", example=np.ones((2, 3), np.float32), max_batch_size=8)
    assert "max_batch_size 8 needs a batch dimension" in str(err.value)
    assert "OUTPUT__0" in str(err.value)


def test_callable_declared_inputs_outputs_found_by_running_it():
    def norm(x):
        return x / np.linalg.norm(x, axis=1, keepdims=True)
    art = build_artifact(norm, "norm", inputs=[("x", "FP32", [-1, 4])])
    cfg = _config(art)
    assert cfg.max_batch_size == 4
    assert [(t.name, list(t.dims)) for t in cfg.output] == [("OUTPUT__0", [4])]


def test_callable_without_inputs_says_what_to_pass():
    def f(x):
        return x
    with pytest.raises(ArtifactError) as err:
        build_artifact(f, "f")
    assert "cannot tell the inputs of" in str(err.value) and "f()" in str(err.value)
    assert "example=" in str(err.value) and "inputs=[" in str(err.value)
    with pytest.raises(ArtifactError, match="tensor spec is"):
        build_artifact(f, "f", inputs=[("x", "FP32")])
    with pytest.raises(ArtifactError, match="unknown datatype"):
        build_artifact(f, "f", inputs=[("x", "FLOAT99", [-1, 2])])

    def broken(x):
        raise KeyError("boom")
    with pytest.raises(ArtifactError) as err:
        build_artifact(broken, "broken", example=np.ones((1, 2)))
    assert "calling broken() on the example failed (KeyError" in str(err.value)


# ---- knobs ----------------------------------------------------------------------------------

def test_knobs_map_to_config_fields_and_config_text_is_merged():
    art = build_artifact(linear(W), "lin")
    cfg = apply_knobs(art, Knobs(max_batch_size=64, preferred_batch_sizes=[16, 32],
                                 max_queue_delay_us=500, priority_levels=2, instances=2, kind="cpu",
                                 warmup=3, config='parameters { key: "k" value { string_value: "v" } }'))
    assert cfg.max_batch_size == 64
    assert list(cfg.dynamic_batching.preferred_batch_size) == [16, 32]
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 500
    assert cfg.dynamic_batching.priority_levels == 2 and cfg.dynamic_batching.default_priority_level == 2
    assert [(g.count, g.kind) for g in cfg.instance_group] == [(2, mc.ModelInstanceGroup.KIND_CPU)]
    warm = cfg.model_warmup[0]
    assert warm.count == 3 and list(warm.inputs["INPUT0"].dims) == [16] and warm.inputs["INPUT0"].zero_data
    assert cfg.parameters["k"].string_value == "v"
    with pytest.raises(ArtifactError, match="--config is not valid config.pbtxt"):
        apply_knobs(art, Knobs(config="max_batch_size: lots"))
    with pytest.raises(ArtifactError, match="may not rename"):
        apply_knobs(art, Knobs(config='name: "other"'))
