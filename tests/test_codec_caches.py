"""The HTTP codec's shortcuts keep its answers: a repeated JSON header decoded from what the
first decode found (``http_codec._PLANS``), and the response header written by orjson where
json would write the same bytes (``json_tensors.encode_header``), in full and from a plan."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from jupyter_triton.protocol import binary_data, http_codec, json_tensors
from jupyter_triton.protocol.errors import InvalidArgument
from jupyter_triton.protocol.http_codec import decode_infer_request, encode_infer_response
from jupyter_triton.protocol.types import InferRequest, InferResponse, InferTensor, RequestedOutput


def _binary(header: dict, *arrays: np.ndarray) -> tuple[bytes, int]:
    text = json.dumps(header).encode()
    return text + b"".join(a.tobytes() for a in arrays), len(text)


HEADER = {"id": "r1", "parameters": {"priority": 1, "note": "x"},
          "inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32",
                      "parameters": {"binary_data_size": 16, "tag": 1.5}},
                     {"name": "B", "shape": [2], "datatype": "BOOL",
                      "parameters": {"binary_data_size": 2}}],
          "outputs": [{"name": "Y", "parameters": {"binary_data": True}}]}


def test_a_repeated_header_decodes_the_same_with_its_own_dicts() -> None:
    http_codec._PLANS.clear()
    first = np.arange(4, dtype=np.float32)
    body, length = _binary(HEADER, first, np.array([1, 0], np.uint8))
    a = decode_infer_request(body, length, "m", "")
    assert len(http_codec._PLANS) == 1
    a.parameters["priority"] = 9
    a.inputs[0].parameters["tag"] = 0
    a.outputs[0].parameters["binary_data"] = False
    second = np.arange(4, 8, dtype=np.float32)
    body2, _ = _binary(HEADER, second, np.array([0, 1], np.uint8))
    b = decode_infer_request(body2, length, "m", "2")
    assert b.id == "r1" and b.model_version == "2"
    assert b.parameters == {"priority": 1, "note": "x"}
    assert b.inputs[0].parameters == {"tag": 1.5} and b.inputs[1].parameters == {}
    assert b.outputs == [RequestedOutput("Y", {"binary_data": True})]
    np.testing.assert_array_equal(b.inputs[0].data, second.reshape(1, 4))
    np.testing.assert_array_equal(b.inputs[1].data, [False, True])
    # The values are still checked on a repeat: a BOOL byte other than 0 or 1.
    bad, _ = _binary(HEADER, second, np.array([2, 1], np.uint8))
    with pytest.raises(InvalidArgument, match="BOOL byte"):
        decode_infer_request(bad, length, "m", "")


def test_plans_are_bounded_and_long_headers_not_kept() -> None:
    """A client that never repeats a header (ids of its own) fills the plans to their bound
    and no further; a header past 4 KiB is decoded, never kept."""
    http_codec._PLANS.clear()
    for i in range(http_codec._PLANS_MAX + 40):
        body, length = _binary({**HEADER, "id": f"r{i}"}, np.zeros(4, np.float32),
                               np.zeros(2, np.uint8))
        assert decode_infer_request(body, length, "m", "").id == f"r{i}"
        assert len(http_codec._PLANS) <= http_codec._PLANS_MAX
    http_codec._PLANS.clear()
    body, length = _binary({**HEADER, "id": "x" * 5000}, np.zeros(4, np.float32),
                           np.zeros(2, np.uint8))
    decode_infer_request(body, length, "m", "")
    assert not http_codec._PLANS


def test_a_header_is_not_kept_for_another_body_size_or_model() -> None:
    http_codec._PLANS.clear()
    body, length = _binary(HEADER, np.zeros(4, np.float32), np.zeros(2, np.uint8))
    decode_infer_request(body, length, "m", "")
    with pytest.raises(InvalidArgument, match="additional input data for model 'n'"):
        decode_infer_request(body + b"\0", length, "n", "")
    with pytest.raises(InvalidArgument, match="expecting 1 additional bytes"):
        decode_infer_request(body[:-1], length, "m", "")


def test_json_values_and_nested_parameters_are_not_kept() -> None:
    http_codec._PLANS.clear()
    for values in ([1.0, 2.0], [3.0, 4.0]):
        doc = {"inputs": [{"name": "X", "shape": [2], "datatype": "FP32", "data": values}]}
        request = decode_infer_request(json.dumps(doc).encode(), None, "m", "")
        np.testing.assert_array_equal(request.inputs[0].data, values)
    nested = dict(HEADER, parameters={"user": {"k": [1]}})
    body, length = _binary(nested, np.zeros(4, np.float32), np.zeros(2, np.uint8))
    decode_infer_request(body, length, "m", "")
    assert not http_codec._PLANS


def _by_json(response: InferResponse, request: InferRequest, monkeypatch: pytest.MonkeyPatch
             ) -> tuple[bytes, int | None]:
    """The response encoded in full, every header written by json."""
    def by_json(doc, plain):
        return json_tensors.encode_header(doc, False)

    with monkeypatch.context() as m:
        m.setattr(binary_data, "encode_header", by_json)
        return binary_data.encode_response(response, request)


@pytest.mark.parametrize("name, rid, params, out_params, data", [
    ("plain", "", {}, {}, np.ones((1, 3), np.float32)),
    ("caf\u00e9", "id-\u2028", {}, {}, np.ones((1, 3), np.float32)),
    ("del\x7f", "", {}, {"k": "\x01\n"}, np.ones((1, 3), np.float32)),
    ("floats", "7", {"p": 1e-05, "q": 1e16}, {"r": 0.1}, np.ones((1, 3), np.float32)),
    ("bigint", "", {"p": 2 ** 70}, {}, np.ones((1, 3), np.int64)),
    ("intkey", "", {1: "a"}, {}, np.ones((1, 3), np.int64)),
    ("nested", "", {"p": [1.5, {"x": None}]}, {}, np.ones((1, 3), np.int64)),
    ("nonfinite", "", {}, {}, np.array([[np.nan, np.inf, 1.0]], np.float32)),
    ("bytes", "", {}, {}, np.array([b"a\xc3\xa9", b"\x7f"], dtype=object)),
])
@pytest.mark.parametrize("binary", [True, False])
def test_the_response_header_is_what_json_writes(name, rid, params, out_params, data,
                                                 binary, monkeypatch) -> None:
    dt = {"f": "FP32", "i": "INT64", "O": "BYTES"}[data.dtype.kind]
    response = InferResponse(name, "1", rid, [InferTensor("Y", dt, data.shape, data, out_params)],
                             params)
    request = InferRequest(name, outputs=[RequestedOutput("Y", {"binary_data": binary})])
    http_codec._RESPONSE_PLANS.clear()
    by_json = _by_json(response, request, monkeypatch)
    assert encode_infer_response(response, request) == by_json      # in full, the plan learnt
    assert encode_infer_response(response, request) == by_json      # from the plan


def test_a_repeated_binary_request_is_decoded_and_answered_by_its_plans_alone() -> None:
    """The fast path of a repeat (an id, binary in and out) runs in protocol/http_codec.py
    only: the files one inference calls into do not grow with the codec's modules."""
    header = {"id": "r1", "inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32",
                                       "parameters": {"binary_data_size": 16}}],
              "outputs": [{"name": "Y", "parameters": {"binary_data": True}}]}
    body, length = _binary(header, np.zeros(4, np.float32))
    protocol = Path(http_codec.__file__).parent
    called: set[str] = set()

    def record(frame, event, arg) -> None:
        if event == "call" and Path(frame.f_code.co_filename).parent == protocol:
            called.add(Path(frame.f_code.co_filename).name)

    for step in range(2):
        if step:
            sys.setprofile(record)
        try:
            request = decode_infer_request(body, length, "m", "")
            response = InferResponse("m", "1", "", [InferTensor("Y", "FP32", (1, 4),
                                                                request.inputs[0].data)])
            encode_infer_response(response, request)
        finally:
            sys.setprofile(None)
    assert called == {"http_codec.py"}
