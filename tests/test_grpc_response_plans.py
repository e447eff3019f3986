"""gRPC ModelInfer's response plans (frontends/grpc_codec.py ``ResponsePlans``): a response
whose layout repeats an earlier one's is written from a cached prefix and its tensors' bytes,
byte for byte what protobuf writes for it; and over a real server, tritonclient reads them."""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as pb

from jupyter_triton.engine import EngineOptions
from jupyter_triton.frontends.grpc_codec import ResponsePlans, encode_grpc_response
from jupyter_triton.protocol.types import InferRequest, InferResponse, InferTensor

_RNG = np.random.default_rng(7)

_ARRAYS = {
    "FP32": lambda shape: _RNG.standard_normal(shape).astype(np.float32),
    "FP64": lambda shape: _RNG.standard_normal(shape),
    "FP16": lambda shape: _RNG.standard_normal(shape).astype(np.float16),
    "INT8": lambda shape: _RNG.integers(-128, 127, shape, dtype=np.int8),
    "INT64": lambda shape: _RNG.integers(-2**62, 2**62, shape, dtype=np.int64),
    "UINT16": lambda shape: _RNG.integers(0, 2**16, shape, dtype=np.uint16),
    "BOOL": lambda shape: _RNG.integers(0, 2, shape).astype(bool),
    "BF16": lambda shape: _RNG.standard_normal(shape).astype(np.float32),
    "BYTES": lambda shape: np.array([b"x" * int(n) for n in _RNG.integers(0, 9, int(np.prod(shape)))],
                                    dtype=object).reshape(shape),
}


def _response(model: str, version: str, rid: str, outputs, params=None) -> InferResponse:
    return InferResponse(model, version, rid,
                         [InferTensor(name, dt, tuple(shape), _ARRAYS[dt](shape), dict(p or {}))
                          for name, dt, shape, p in outputs], dict(params or {}))


def _same_bytes(plans: ResponsePlans, resp: InferResponse, request_id: str = "") -> bytes:
    request = InferRequest(resp.model_name, id=request_id)
    got = plans.encode(resp, request)
    assert got == encode_grpc_response(resp, request).SerializeToString()
    return got


LAYOUTS = [
    [("OUT", "FP32", (1, 256), None)],
    [("OUT", "FP32", (4, 3), None), ("IDX", "INT64", (4,), None), ("F", "BOOL", (2, 2), None)],
    [("E", "FP32", (0, 8), None), ("S", "FP64", (), None)],             # empty and scalar
    [("H", "FP16", (3, 5), None), ("B", "BF16", (2,), None), ("I", "INT8", (7,), None)],
    [("U", "UINT16", (300,), {"note": "w", "n": 3})],                   # a 2-byte length
    [("Y", "FP32", (2, 2), {"flag": True, "one": 1, "x": 0.5, "big": 2**63 + 1})],
    [],                                                                 # no outputs at all
]
PARAMS = [None, {"triton_final_response": True}, {"a": "é", "b": -7, "c": 2.5, "d": False}]
IDS = ["", "7", "req-é-" + "z" * 200]


def test_every_layout_id_and_parameter_map_is_written_as_protobuf_writes_it() -> None:
    plans = ResponsePlans()
    for layout, params, rid in itertools.product(LAYOUTS, PARAMS, IDS):
        for version in ("1", "12"):
            for _ in range(3):       # the first builds the plan, the next are written from it
                _same_bytes(plans, _response("m", version, rid, layout, params))
            # the id may come from the request only (the engine copies it, Triton's front too)
            _same_bytes(plans, _response("m", version, "", layout, params), request_id=rid)
    # the plan is used: responses of a known layout add none
    assert len(plans._plans) == len(LAYOUTS) * len(PARAMS) * 2


def test_same_names_with_other_shapes_types_or_values_are_other_plans() -> None:
    plans = ResponsePlans()
    for shape, dt, params in [((1, 4), "FP32", None), ((2, 4), "FP32", None),
                              ((1, 4), "INT64", None), ((1, 4), "FP32", {"k": 1}),
                              ((1, 4), "FP32", {"k": True}), ((1, 4), "FP32", {"k": 1.0}),
                              ((1, 4), "FP32", {"k": "1"}), ((1, 4), "FP32", {"k": 2})]:
        for _ in range(2):
            _same_bytes(plans, _response("m", "1", "r", [("Y", dt, shape, params)]))
            _same_bytes(plans, _response("m", "1", "r", [("Y", dt, shape, None)], params))
    assert len(plans._plans) == 3 + 5 * 2     # no parameters: one plan for both calls


@pytest.mark.parametrize("outputs, params", [
    ([("T", "BYTES", (3,), None)], None),                     # lengths vary: never planned
    ([("Y", "FP32", (2,), None), ("T", "BYTES", (2, 2), None)], None),
    ([("Y", "FP32", (2,), {"blob": b"\x00\xff"})], None),     # bytes: not a key the plan makes
    ([("Y", "FP32", (2,), None)], {"nan": float("nan")}),
    ([("Y", "FP32", (2,), None)], {"np": np.int32(3)}),
])
def test_layouts_the_plan_cannot_key_are_protobufs(outputs, params) -> None:
    plans = ResponsePlans()
    for _ in range(3):
        _same_bytes(plans, _response("m", "1", "r", outputs, params))
    assert not plans._plans


def test_outputs_in_shared_memory_or_with_data_that_does_not_fit_the_shape_are_protobufs() -> None:
    plans = ResponsePlans()
    resp = _response("m", "1", "", [("Y", "FP32", (2, 2), None), ("Z", "INT64", (3,), None)])
    resp.outputs[1].data = None                 # written to a region: an empty entry
    _same_bytes(plans, resp)
    assert not plans._plans
    resp = _response("m", "1", "", [("Y", "FP32", (2, 2), None)])
    _same_bytes(plans, resp)
    resp.outputs[0].data = np.zeros(5, np.float32)     # a shape the data does not have
    _same_bytes(plans, resp)


def test_data_in_another_dtype_or_layout_is_converted_as_protobuf_gets_it() -> None:
    plans = ResponsePlans()
    for data in (np.arange(12, dtype=np.float64).reshape(3, 4),          # widened: narrowed
                 np.arange(12, dtype=np.float32).reshape(4, 3).T,          # not C-contiguous
                 np.arange(12, dtype=">f4").reshape(3, 4)):                # big-endian
        resp = InferResponse("m", "1", "", [InferTensor("Y", "FP32", (3, 4), data)])
        _same_bytes(plans, resp)
        _same_bytes(plans, resp)


def test_plans_are_bounded() -> None:
    plans = ResponsePlans()
    for n in range(plans.MAX_PLANS + 10):
        _same_bytes(plans, _response("m", "1", "", [("Y", "FP32", (n,), None)]))
        assert len(plans._plans) <= plans.MAX_PLANS


MODEL = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", (x * 2).astype(np.float32)),
                pb_utils.Tensor("ROWS", np.full((x.shape[0], 1), x.shape[1], np.int64)),
                pb_utils.Tensor("WORDS", np.array([[b"w" * (i + 1)] for i in range(x.shape[0])],
                                                  dtype=object)),
                pb_utils.Tensor("NONE", np.zeros((x.shape[0], 0), np.float32)),
            ]))
        return responses
"""

CONFIG = """\
name: "outs"
backend: "python"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [
  { name: "SUM", data_type: TYPE_FP32, dims: [ -1 ] },
  { name: "ROWS", data_type: TYPE_INT64, dims: [ 1 ] },
  { name: "WORDS", data_type: TYPE_STRING, dims: [ 1 ] },
  { name: "NONE", data_type: TYPE_FP32, dims: [ -1 ] }
]
"""


def test_tritonclient_reads_planned_responses_of_every_shape_id_and_output_choice(
        tmp_path: Path) -> None:
    from jupyter_triton.standalone import start_in_thread
    repo = tmp_path / "models"
    (repo / "outs" / "1").mkdir(parents=True)
    (repo / "outs" / "1" / "model.py").write_text(MODEL)
    (repo / "outs" / "config.pbtxt").write_text(CONFIG)
    server = start_in_thread(EngineOptions(model_repository=repo, model_control_mode="explicit",
                                           load_models=["*"]),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0)
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        choices = [None, ["SUM", "ROWS"], ["NONE", "SUM"], ["WORDS"]]
        for rows, cols, rid, wanted in itertools.product((1, 3), (1, 5), ("", "q1", "q-22"),
                                                         choices):
            x = _RNG.standard_normal((rows, cols)).astype(np.float32)
            inp = grpcclient.InferInput("X", [rows, cols], "FP32")
            inp.set_data_from_numpy(x)
            for _ in range(2):
                result = client.infer("outs", [inp], request_id=rid, outputs=None if wanted is None
                                      else [grpcclient.InferRequestedOutput(n) for n in wanted])
                response = result.get_response()
                assert (response.model_name, response.model_version, response.id) == \
                    ("outs", "1", rid)
                names = [o.name for o in response.outputs]
                assert names == (wanted or ["SUM", "ROWS", "WORDS", "NONE"])
                if "SUM" in names:
                    np.testing.assert_array_equal(result.as_numpy("SUM"), x * 2)
                if "ROWS" in names:
                    np.testing.assert_array_equal(result.as_numpy("ROWS"), np.full((rows, 1), cols))
                if "WORDS" in names:
                    assert result.as_numpy("WORDS").reshape(-1).tolist() == \
                        [b"w" * (i + 1) for i in range(rows)]
                if "NONE" in names:
                    assert result.as_numpy("NONE").shape == (rows, 0)
        # an error after planned responses is still Triton's, and the server goes on
        with pytest.raises(grpcclient.InferenceServerException, match="unexpected"):
            bad = grpcclient.InferInput("Y", [1, 2], "FP32")
            bad.set_data_from_numpy(np.zeros((1, 2), np.float32))
            client.infer("outs", [bad])
        assert client.is_server_live()
        client.close()
    finally:
        server.close()


def test_a_shape_given_as_a_list_keys_the_same_plan_as_its_tuple() -> None:
    plans = ResponsePlans()
    for shape in ([2, 3], (2, 3), [2, 3]):
        resp = InferResponse("m", "1", "", [InferTensor("Y", "FP32", shape,
                                                        np.ones((2, 3), np.float32))])
        _same_bytes(plans, resp)
    assert len(plans._plans) == 1
