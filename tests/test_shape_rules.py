"""An input's shape is refused by one rule (protocol/v2_rules.py ``check_shape``) whichever
protocol carries it: the same shapes pass, and a bad one is refused in the same words over
HTTP's JSON and gRPC's protobuf."""
from __future__ import annotations

import json

import pytest
from tritonclient.grpc import service_pb2

from jupyter_triton.frontends.grpc_codec import decode_grpc_request
from jupyter_triton.protocol import decode_infer_request
from jupyter_triton.protocol.errors import InvalidArgument

MAX_ELEMENTS = 1000

BAD_SHAPES = [
    ("a negative dimension", [2, -3]),
    ("more dimensions than numpy's", [1] * 65),
    ("more elements than the limit", [100, 100]),
    ("no elements, yet a dimension past the limit", [0, 1 << 40]),
]


def _http(shape: list[int]) -> None:
    body = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": shape,
                                   "data": []}]}).encode()
    decode_infer_request(body, None, "m", "", max_elements=MAX_ELEMENTS)


def _grpc(shape: list[int]) -> None:
    request = service_pb2.ModelInferRequest(model_name="m")
    request.inputs.add(name="X", datatype="FP32", shape=shape)
    request.raw_input_contents.append(b"")
    decode_grpc_request(request, max_elements=MAX_ELEMENTS)


@pytest.mark.parametrize("case,shape", BAD_SHAPES, ids=[c for c, _ in BAD_SHAPES])
def test_a_bad_shape_is_refused_in_the_same_words_by_both_codecs(case, shape):
    with pytest.raises(InvalidArgument) as http:
        _http(shape)
    with pytest.raises(InvalidArgument) as grpc:
        _grpc(shape)
    assert str(grpc.value) == str(http.value)
    assert "input 'X'" in str(grpc.value)


def test_a_shape_within_the_limits_passes_both_codecs():
    request = service_pb2.ModelInferRequest(model_name="m")
    request.inputs.add(name="X", datatype="FP32", shape=[0, 10])
    request.raw_input_contents.append(b"")
    assert decode_grpc_request(request, max_elements=MAX_ELEMENTS).inputs[0].shape == (0, 10)
    body = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [0, 10],
                                   "data": []}]}).encode()
    assert decode_infer_request(body, None, "m", "", max_elements=MAX_ELEMENTS
                                ).inputs[0].shape == (0, 10)
