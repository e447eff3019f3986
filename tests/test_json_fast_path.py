"""The JSON tensor path's shortcuts (issue 18) give what the full path gave: float outputs are
respelled as Python writes them only where orjson spells them otherwise (a test on the values
decides), float inputs skip the overflow check only where no value can overflow, and a request
read by orjson without a scan for integers past 64 bits is what json read wherever one shows."""
from __future__ import annotations

import json

import numpy as np
import pytest

from jupyter_triton.protocol.errors import InvalidArgument
from jupyter_triton.protocol import http_codec
from jupyter_triton.protocol.binary_data import encode_response
from jupyter_triton.protocol.http_codec import decode_infer_request, encode_infer_response
from jupyter_triton.protocol.types import InferRequest, InferResponse, InferTensor, RequestedOutput


def _encoded(x: np.ndarray, datatype: str) -> bytes:
    body, _ = encode_infer_response(
        InferResponse("m", "1", outputs=[InferTensor("O", datatype, x.shape, x)]), InferRequest("m"))
    return body


def _data_text(x: np.ndarray) -> bytes:
    return json.dumps(x.ravel().tolist(), separators=(",", ":")).encode()


# Each side of both ends of the magnitudes orjson spells otherwise (1e-9 <= |v| < 1e-4).
_EDGES = [1e-9, np.nextafter(1e-9, 0), 1e-4, np.nextafter(1e-4, 0), 1e-5, np.nextafter(1e-5, 0),
          -1e-9, -np.nextafter(1e-4, 0), 1e-10, 2.5e-7, 0.0, 1e16]


@pytest.mark.parametrize("value", _EDGES)
def test_each_value_at_the_edges_of_the_respelled_magnitudes_reads_as_python_writes_it(value):
    for x in (np.array([value]), np.array([3.0, value, 5e20, value])):
        assert _data_text(x) in _encoded(x, "FP64"), x


def _request(data: list, datatype: str) -> bytes:
    return json.dumps({"inputs": [{"name": "X", "datatype": datatype, "shape": [len(data)],
                                   "data": data}]}).encode()


def _decoded(data: list, datatype: str) -> np.ndarray:
    return decode_infer_request(_request(data, datatype), None, "m", "").inputs[0].data


def test_float_inputs_at_the_edge_of_their_range():
    top32, top16 = float(np.finfo(np.float32).max), float(np.finfo(np.float16).max)
    # Past the largest finite value, yet rounding down to it: accepted, as before.
    below = np.nextafter(top32, np.inf)
    got = _decoded([1.5, below, -top32], "FP32")
    assert got.dtype == np.float32 and got.tolist() == [1.5, top32, -top32]
    assert _decoded([top16, 65519.0], "FP16").tolist() == [top16, top16]
    with pytest.raises(InvalidArgument, match=r"element 1 \(3\.5e\+38\) is out of the range of datatype FP32"):
        _decoded([1.0, 3.5e38], "FP32")
    with pytest.raises(InvalidArgument, match=r"element 0 \(70000\) is out of the range of datatype FP16"):
        _decoded([70000, 1.0], "FP16")
    wide = _decoded([1e300, -2.5, 5e-324], "FP64")
    assert wide.dtype == np.float64 and wide.tolist() == [1e300, -2.5, 5e-324]



# orjson reads the document first, without the scan for integers past 64 bits (it reads them
# as floats); where that could show, the codec reads the document again as json reads it.
_BIG = 2 ** 70 + 1


def _big_request(**fields) -> bytes:
    doc = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [2], "data": [1.5, 2]}]}
    for path, value in fields.items():
        if path == "request":
            doc["parameters"] = value
        elif path == "input":
            doc["inputs"][0]["parameters"] = value
        elif path == "output":
            doc["outputs"] = [{"name": "Y", "parameters": value}]
        else:
            doc["inputs"][0][path] = value
    return json.dumps(doc).encode()


def test_an_integer_past_64_bits_in_a_parameter_reaches_the_model_as_sent():
    for where in ("request", "input", "output"):
        for value in (_BIG, -_BIG, [1, _BIG], {"k": _BIG}):
            request = decode_infer_request(_big_request(**{where: {"u": value}}), None, "m", "")
            params = {"request": request.parameters, "input": request.inputs[0].parameters,
                      "output": request.outputs[0].parameters if request.outputs else {}}[where]
            assert params["u"] == value and type(params["u"]) is type(value), (where, value)
    # floats that large are floats still
    request = decode_infer_request(_big_request(request={"u": 1e30}), None, "m", "")
    assert request.parameters["u"] == 1e30 and type(request.parameters["u"]) is float


def test_an_integer_past_64_bits_in_float_data_is_its_double_and_errors_name_it_as_sent():
    got = decode_infer_request(_big_request(data=[_BIG, -3 * _BIG], datatype="FP64"), None, "m", "")
    assert got.inputs[0].data.tolist() == [float(_BIG), float(-3 * _BIG)]
    with pytest.raises(InvalidArgument, match=rf"element 1 \({10 ** 20}\) is out of the range of datatype FP16"):
        decode_infer_request(_big_request(data=[1, 10 ** 20], datatype="FP16"), None, "m", "")
    with pytest.raises(InvalidArgument, match=rf"element 1 is an integer \({_BIG}\), expected an integer in"):
        decode_infer_request(_big_request(data=[1, _BIG], datatype="INT64"), None, "m", "")
    with pytest.raises(InvalidArgument, match=rf"shape \[{_BIG}\] with {_BIG} elements"):
        decode_infer_request(_big_request(shape=[_BIG]), None, "m", "")
    # json takes a priority past 64 bits as an unsigned integer (orjson's float would be refused)
    request = decode_infer_request(_big_request(request={"priority": _BIG}), None, "m", "")
    assert request.parameters["priority"] == _BIG


def test_json_outputs_written_from_a_plan_are_what_the_full_encoder_writes():
    """A JSON output's values go between the plan's pieces of header; one with a non-finite
    float is json's (NaN) both before and after its layout has a plan."""
    http_codec._RESPONSE_PLANS.clear()
    rng = np.random.default_rng(3)
    finite = lambda n: rng.standard_normal(n).astype(np.float32)       # noqa: E731
    odd = np.array([np.nan, 1e-6, -np.inf], np.float32)
    request = InferRequest("m", id="r", outputs=[RequestedOutput("A", {"binary_data": False}),
                                                 RequestedOutput("B", {"binary_data": True}),
                                                 RequestedOutput("C", {})])
    big = 300_000                       # past _SLICED_ELEMENTS: written in slices
    for a, c in [(odd, finite(4)), (finite(3), finite(4)), (odd, finite(4)), (finite(3), odd[:1].repeat(4)),
                 (finite(3), np.arange(4, dtype=np.float32) * 1e-7)]:
        for rid in ("", "x-é"):
            resp = InferResponse("m", "1", rid, [
                InferTensor("A", "FP32", (3,), a), InferTensor("B", "INT64", (2,), np.array([1, -2])),
                InferTensor("C", "FP32", (2, 2), c.reshape(2, 2))])
            assert encode_infer_response(resp, request) == encode_response(resp, request)
    assert len(http_codec._RESPONSE_PLANS) == 1
    for data in (np.array([True, False]), rng.standard_normal(big)):
        resp = InferResponse("m", "1", "", [InferTensor("Y", "BOOL" if data.dtype == bool else "FP64",
                                                        data.shape, data)])
        for _ in range(2):
            got = encode_infer_response(resp, InferRequest("m"))
            assert got == encode_response(resp, InferRequest("m")) and got[1] is None
