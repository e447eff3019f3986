"""Triton's ragged batching on the tensor backends: a ragged input reaches the model as one
1-D tensor of every request's elements, the server generates each ``batch_input`` kind, and a
``batch_output`` is scattered back by each request's input shape (backends/ragged.py).

The models are built here: an ONNX model whose every output depends on one batch input, and
a TorchScript module finding its requests by their accumulated element counts."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from batch_clients import client, start_server, together
from onnx_models import _save

F, I32, I64 = TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT64

BATCH_INPUTS = """
batch_input [
  { kind: BATCH_ELEMENT_COUNT target_name: "COUNT" data_type: TYPE_INT32 source_input: "INPUT" },
  { kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "ACC" data_type: TYPE_FP32
    source_input: "INPUT" },
  { kind: BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO target_name: "ACCZ" data_type: TYPE_INT32
    source_input: "INPUT" },
  { kind: BATCH_MAX_ELEMENT_COUNT_AS_SHAPE target_name: "MAXS" data_type: TYPE_FP32
    source_input: "INPUT" },
  { kind: BATCH_ITEM_SHAPE target_name: "ISHAPE" data_type: TYPE_INT32 source_input: "INPUT" },
  { kind: BATCH_ITEM_SHAPE_FLATTEN target_name: "IFLAT" data_type: TYPE_FP32 source_input: "INPUT" }
]
"""

OUTPUTS = ("SUM", "FIRST", "MAXLEN", "LEN", "LENF")


def ragged_config(name: str, batching: str) -> str:
    outputs = ", ".join(f'{{ name: "{o}" data_type: TYPE_FP32 dims: [ 1 ] }}' for o in OUTPUTS)
    return f"""
name: "{name}"
backend: "onnxruntime"
max_batch_size: 16
{batching}
input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true }} ]
{BATCH_INPUTS}
output [ {outputs}, {{ name: "SCATTER" data_type: TYPE_FP32 dims: [ -1 ] }} ]
batch_output [ {{ target_name: "SCATTER" kind: BATCH_SCATTER_WITH_INPUT_SHAPE
                 source_input: "INPUT" }} ]
"""


def _const(name: str, values, elem=I64):
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(
        name + "_v", elem, [len(values)], values))


def ragged_model(path: Path) -> None:
    """Every output per request (rows = requests: each sends one row), each from one batch input:
    SUM = its elements' sum (COUNT, ACC), FIRST = its first element (ACCZ), MAXLEN = the batch's
    largest element count (MAXS's shape), LEN = its length (ISHAPE), LENF = the same (IFLAT);
    SCATTER = 2 x INPUT, flat (a batch output)."""
    nodes = [
        _const("zero_f", [0.0], F), _const("one", [1]), _const("zero", [0]), _const("minus1", [-1]),
        _const("axis1", [1]),
        # SUM: cumulative sums with a leading 0; each request is [ACC - COUNT, ACC)
        helper.make_node("CumSum", ["INPUT", "zero"], ["cs"]),
        helper.make_node("Concat", ["zero_f", "cs"], ["cs0"], axis=0),
        helper.make_node("Cast", ["ACC"], ["end"], to=I64),
        helper.make_node("Cast", ["COUNT"], ["count"], to=I64),
        helper.make_node("Sub", ["end", "count"], ["start"]),
        helper.make_node("Gather", ["cs0", "end"], ["hi"], axis=0),
        helper.make_node("Gather", ["cs0", "start"], ["lo"], axis=0),
        helper.make_node("Sub", ["hi", "lo"], ["sum"]),
        helper.make_node("Unsqueeze", ["sum", "axis1"], ["SUM"]),
        # FIRST: INPUT at ACCZ[:-1]
        helper.make_node("Slice", ["ACCZ", "zero", "minus1"], ["starts"]),
        helper.make_node("Gather", ["INPUT", "starts"], ["first"], axis=0),
        helper.make_node("Unsqueeze", ["first", "axis1"], ["FIRST"]),
        # MAXLEN: MAXS's length, one per request
        helper.make_node("Shape", ["MAXS"], ["maxs_shape"]),
        helper.make_node("Cast", ["maxs_shape"], ["maxlen"], to=F),
        helper.make_node("Shape", ["COUNT"], ["requests"]),
        helper.make_node("Concat", ["requests", "one"], ["rows_by_1"], axis=0),
        helper.make_node("Expand", ["maxlen", "rows_by_1"], ["MAXLEN"]),
        # LEN, LENF: each row's shape without its batch dim
        helper.make_node("Cast", ["ISHAPE"], ["LEN"], to=F),
        helper.make_node("Unsqueeze", ["IFLAT", "axis1"], ["LENF"]),
        helper.make_node("Add", ["INPUT", "INPUT"], ["SCATTER"]),
    ]
    inputs = [helper.make_tensor_value_info("INPUT", F, ["n"]),
              helper.make_tensor_value_info("COUNT", I32, ["r"]),
              helper.make_tensor_value_info("ACC", F, ["r"]),
              helper.make_tensor_value_info("ACCZ", I32, ["r1"]),
              helper.make_tensor_value_info("MAXS", F, ["m"]),
              helper.make_tensor_value_info("ISHAPE", I32, ["rows", 1]),
              helper.make_tensor_value_info("IFLAT", F, ["rows"])]
    outputs = [helper.make_tensor_value_info(o, F, ["rows", 1]) for o in OUTPUTS]
    outputs.append(helper.make_tensor_value_info("SCATTER", F, ["n"]))
    _save(helper.make_graph(nodes, "ragged", inputs, outputs), path)


def item_shape_model(path: Path) -> None:
    """Rows of any request: ROWLEN = each row's length (BATCH_ITEM_SHAPE); SCATTER = INPUT + 1."""
    nodes = [helper.make_node("Cast", ["ISHAPE"], ["ROWLEN"], to=F),
             _const("one_f", [1.0], F),
             helper.make_node("Add", ["INPUT", "one_f"], ["SCATTER"])]
    _save(helper.make_graph(
        nodes, "item_shape",
        [helper.make_tensor_value_info("INPUT", F, ["n"]),
         helper.make_tensor_value_info("ISHAPE", I32, ["rows", 1])],
        [helper.make_tensor_value_info("ROWLEN", F, ["rows", 1]),
         helper.make_tensor_value_info("SCATTER", F, ["n"])]), path)


def scatter_config(name: str, backend: str, preferred: int, kind: str, target: str,
                   data_type: str, output: str) -> str:
    """A ragged INPUT, one batch input, an output per row and SCATTER, a batch output; one batch
    leaves once ``preferred`` rows are queued (a 30 s delay)."""
    return f"""
name: "{name}"
backend: "{backend}"
max_batch_size: 16
dynamic_batching {{ max_queue_delay_microseconds: 30000000 preferred_batch_size: [ {preferred} ] }}
input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true }} ]
batch_input [ {{ kind: {kind} target_name: "{target}" data_type: {data_type}
                source_input: "INPUT" }} ]
output [ {{ name: "{output}" data_type: TYPE_FP32 dims: [ 1 ] }},
         {{ name: "SCATTER" data_type: TYPE_FP32 dims: [ -1 ] }} ]
batch_output [ {{ target_name: "SCATTER" kind: BATCH_SCATTER_WITH_INPUT_SHAPE
                 source_input: "INPUT" }} ]
"""


ITEM_SHAPE_CONFIG = scatter_config("item_shape", "onnxruntime", 4, "BATCH_ITEM_SHAPE", "ISHAPE",
                                   "TYPE_INT32", "ROWLEN")
TORCH_CONFIG = scatter_config("ragged_torch", "pytorch", 3,
                              "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO", "ACCZ", "TYPE_INT32",
                              "SUM")

# A [batch, length] model with allow_ragged_batch: Triton's onnxruntime backend refuses it
PADDED_SHAPE_CONFIG = """
name: "not_flat"
backend: "onnxruntime"
max_batch_size: 16
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


def torch_model(path: Path) -> None:
    import torch

    class Segments(torch.nn.Module):
        def forward(self, INPUT: torch.Tensor, ACCZ: torch.Tensor):
            cs = torch.cat([torch.zeros(1), torch.cumsum(INPUT, 0)])
            bounds = ACCZ.long()
            return (cs[bounds[1:]] - cs[bounds[:-1]]).unsqueeze(1), INPUT * 3

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.jit.script(Segments()).save(str(path))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("ragged") / "models"
    for name, batching in (("ragged", "dynamic_batching { }"),
                           ("ragged_batch4", "dynamic_batching { max_queue_delay_microseconds: "
                                             "30000000 preferred_batch_size: [ 4 ] }")):
        ragged_model(repo / name / "1" / "model.onnx")
        (repo / name / "config.pbtxt").write_text(ragged_config(name, batching))
    item_shape_model(repo / "item_shape" / "1" / "model.onnx")
    (repo / "item_shape" / "config.pbtxt").write_text(ITEM_SHAPE_CONFIG)
    torch_model(repo / "ragged_torch" / "1" / "model.pt")
    (repo / "ragged_torch" / "config.pbtxt").write_text(TORCH_CONFIG)
    from onnx_models import identity
    identity(TensorProto.FLOAT, repo / "not_flat" / "1" / "model.onnx", dims="length")
    (repo / "not_flat" / "config.pbtxt").write_text(PADDED_SHAPE_CONFIG)
    srv = start_server(repo, ["ragged", "ragged_batch4", "item_shape", "ragged_torch"])
    yield srv
    srv.close()


@pytest.fixture
def http(server):
    return client(server)


def _clients(server, kinds: str) -> list:
    """A client per request ('h': HTTP, 'g': gRPC), each used by one thread."""
    return [client(server, grpc=kind == "g") for kind in kinds]


def _infer(caller, model: str, values: np.ndarray, outputs=OUTPUTS + ("SCATTER",)):
    mod = httpclient if isinstance(caller, httpclient.InferenceServerClient) else grpcclient
    tensor = mod.InferInput("INPUT", list(values.shape), "FP32")
    tensor.set_data_from_numpy(values)
    result = caller.infer(model, [tensor], outputs=[mod.InferRequestedOutput(o) for o in outputs])
    return {o: result.as_numpy(o) for o in outputs}


def _counts(caller, model: str) -> tuple[int, int]:
    stats = caller.get_inference_statistics(model)["model_stats"][0]
    return stats["execution_count"], stats["inference_count"]


def test_a_lone_request_sees_its_own_counts(http):
    values = np.array([[1.0, 2.0, 3.0, 4.0]], dtype=np.float32)
    out = _infer(http, "ragged", values)
    assert out["SUM"].tolist() == [[10.0]]
    assert out["FIRST"].tolist() == [[1.0]]
    assert out["MAXLEN"].tolist() == [[4.0]]
    assert out["LEN"].tolist() == [[4.0]] and out["LENF"].tolist() == [[4.0]]
    assert out["SCATTER"].tolist() == [[2.0, 4.0, 6.0, 8.0]]   # its input's shape [1, 4]


def test_one_batch_of_four_lengths_every_batch_input_kind(server, http):
    """Four requests of lengths 3, 5, 2, 4 run as one batch (preferred_batch_size 4, a 30 s
    delay: the statistics show one execution): each request's answer comes from the batch
    inputs the server generated, and MAXLEN is the batch's longest (5) for every one."""
    before = _counts(http, "ragged_batch4")
    lengths = [3, 5, 2, 4]
    requests = [np.arange(1, n + 1, dtype=np.float32)[None, :] * (i + 1)
                for i, n in enumerate(lengths)]
    clients = _clients(server, "hghg")
    answers = together(lambda i: _infer(clients[i], "ragged_batch4", requests[i]), 4)
    after = _counts(http, "ragged_batch4")
    assert (after[0] - before[0], after[1] - before[1]) == (1, 4)      # one batch of four
    for values, out in zip(requests, answers):
        n = values.shape[1]
        assert out["SUM"].tolist() == [[float(values.sum())]]
        assert out["FIRST"].tolist() == [[float(values[0, 0])]]
        assert out["MAXLEN"].tolist() == [[5.0]]
        assert out["LEN"].tolist() == [[float(n)]] and out["LENF"].tolist() == [[float(n)]]
        assert out["SCATTER"].shape == (1, n)
        np.testing.assert_array_equal(out["SCATTER"], values * 2)


def test_item_shape_repeats_per_row_and_scatter_keeps_each_shape(server, http):
    """BATCH_ITEM_SHAPE has one row per batch row (a request of 2 rows gives 2), and the batch
    output comes back in each request's own shape, from the grpc client too."""
    before = _counts(http, "item_shape")
    requests = [np.ones((2, 3), np.float32), np.full((1, 5), 2.0, np.float32),
                np.arange(4, dtype=np.float32)[None, :]]
    clients = _clients(server, "ghg")
    answers = together(lambda i: _infer(clients[i], "item_shape", requests[i],
                                             ("ROWLEN", "SCATTER")), 3)
    after = _counts(http, "item_shape")
    assert (after[0] - before[0], after[1] - before[1]) == (1, 4)   # one batch, 4 rows
    assert answers[0]["ROWLEN"].tolist() == [[3.0], [3.0]]
    assert answers[1]["ROWLEN"].tolist() == [[5.0]]
    assert answers[2]["ROWLEN"].tolist() == [[4.0]]
    for values, out in zip(requests, answers):
        np.testing.assert_array_equal(out["SCATTER"], values + 1)


def test_pytorch_finds_its_requests_by_accumulated_counts(server, http):
    """A TorchScript model takes the flat input and ACCZ (forward()'s names) the same way."""
    before = _counts(http, "ragged_torch")
    requests = [np.array([[1.0, 2.0]], np.float32), np.array([[3.0, 4.0, 5.0, 6.0]], np.float32),
                np.array([[10.0]], np.float32)]
    clients = _clients(server, "hgh")
    answers = together(lambda i: _infer(clients[i], "ragged_torch", requests[i],
                                             ("SUM", "SCATTER")), 3)
    after = _counts(http, "ragged_torch")
    assert (after[0] - before[0], after[1] - before[1]) == (1, 3)
    for values, out in zip(requests, answers):
        assert out["SUM"].tolist() == [[float(values.sum())]]
        np.testing.assert_array_equal(out["SCATTER"], values * 3)


def test_a_length_model_marked_ragged_is_refused_naming_padding(http):
    """Triton's onnxruntime backend takes a ragged input only as [-1]: a [batch, length] model
    is refused at load (every request failed with a 500 before), and the error says how to
    batch it (ragged_batching "pad")."""
    with pytest.raises(InferenceServerException) as err:
        http.load_model("not_flat")
    text = str(err.value)
    assert "ragged input 'INPUT0'" in text and "[-1,-1]" in text and "ragged_batching" in text


# -- TensorRT: the same merge and split, where a GPU and tensorrt are ------------------------

def _no_tensorrt() -> str:
    import importlib.util

    from jupyter_triton.backends.devices import gpu_count
    if gpu_count() == 0:
        return "no NVIDIA GPU on this machine: TensorRT's ragged batching runs only on one"
    if importlib.util.find_spec("tensorrt") is None:
        return "the tensorrt package is not installed"
    return ""


TRT_CONFIG = """
name: "ragged_trt"
platform: "tensorrt_plan"
max_batch_size: 8
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]
batch_input [ { kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "ACC" data_type: TYPE_INT32
                source_input: "INPUT" } ]
output [ { name: "END" data_type: TYPE_FP32 dims: [ 1 ] },
         { name: "SCATTER" data_type: TYPE_FP32 dims: [ -1 ] } ]
batch_output [ { target_name: "SCATTER" kind: BATCH_SCATTER_WITH_INPUT_SHAPE
                 source_input: "INPUT" } ]
"""


def _trt_plan(path: Path) -> None:
    """END = where each request ends in the flat input (ACC); SCATTER = INPUT + 1."""
    import tensorrt as trt
    graph = helper.make_graph(
        [_const("axis1", [1]), _const("one_f", [1.0], F),
         helper.make_node("Cast", ["ACC"], ["acc_f"], to=F),
         helper.make_node("Unsqueeze", ["acc_f", "axis1"], ["END"]),
         helper.make_node("Add", ["INPUT", "one_f"], ["SCATTER"])], "ragged_trt",
        [helper.make_tensor_value_info("INPUT", F, ["n"]),
         helper.make_tensor_value_info("ACC", I32, ["r"])],
        [helper.make_tensor_value_info("END", F, ["r", 1]),
         helper.make_tensor_value_info("SCATTER", F, ["n"])])
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    assert parser.parse(_save(graph, None)), parser.get_error(0)
    build = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape("INPUT", (1,), (16,), (256,))
    profile.set_shape("ACC", (1,), (4,), (8,))
    build.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, build)
    assert plan is not None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(plan))


@pytest.mark.skipif(bool(_no_tensorrt()), reason=_no_tensorrt() or "tensorrt is here")
def test_tensorrt_takes_the_same_concatenated_batch(tmp_path):
    from jupyter_triton.backends.base import InstanceSpec, ModelFiles
    from jupyter_triton.backends.tensorrt import TensorRTBackend
    from jupyter_triton.config import parse_config
    from jupyter_triton.engine.batching.instances import execute
    files = ModelFiles("ragged_trt", 1, tmp_path / "ragged_trt", tmp_path / "ragged_trt" / "1",
                       "model.plan")
    _trt_plan(files.version_dir / "model.plan")
    backend = TensorRTBackend(parse_config(TRT_CONFIG, "ragged_trt"), files,
                              InstanceSpec("ragged_trt_0_0", kind="KIND_GPU"))
    backend.load()
    try:
        requests = [{"INPUT": np.arange(3, dtype=np.float32)[None, :]},
                    {"INPUT": np.full((1, 2), 10.0, np.float32)}]
        (first, second), _ = execute(backend, requests)
    finally:
        backend.unload()
    assert first["END"].tolist() == [[3.0]] and second["END"].tolist() == [[5.0]]
    np.testing.assert_array_equal(first["SCATTER"], requests[0]["INPUT"] + 1)
    np.testing.assert_array_equal(second["SCATTER"], requests[1]["INPUT"] + 1)


# -- the batch inputs, without a server ------------------------------------------------------

def test_every_batch_input_kind_counts_as_triton_does():
    """Element counts include each request's batch dimension (a [2, 3] request holds 6), item
    shapes repeat per row; WITH_ZERO leads with 0, MAX_ELEMENT_COUNT_AS_SHAPE is a shape."""
    from jupyter_triton.backends.ragged import RaggedPlan
    from jupyter_triton.config import parse_config
    plan = RaggedPlan.from_config(parse_config(ragged_config("kinds", "dynamic_batching { }"), "kinds"))
    requests = [{"INPUT": np.ones((2, 3), np.float32)}, {"INPUT": np.ones((1, 4), np.float32)}]
    merged, _ = plan.merge(requests)
    assert merged["INPUT"].shape == (10,)
    assert merged["COUNT"].tolist() == [6, 4] and merged["COUNT"].dtype == np.int32
    assert merged["ACC"].tolist() == [6.0, 10.0] and merged["ACC"].dtype == np.float32
    assert merged["ACCZ"].tolist() == [0, 6, 10]
    assert merged["MAXS"].shape == (6,)
    assert merged["ISHAPE"].tolist() == [[3], [3], [4]]
    assert merged["IFLAT"].tolist() == [3.0, 3.0, 4.0]
