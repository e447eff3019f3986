"""The JSON tensor path on orjson (issue 18): numbers read and written 5-30x faster, yet every
document is accepted or refused as json accepted or refused it, and every output is the same
text, byte for byte, that json.dumps of tolist() wrote (Python's spelling of each double)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto

from conftest import serve
from jupyter_triton.protocol.datatypes import round_to_bf16
from jupyter_triton.protocol.errors import InvalidArgument
from jupyter_triton.protocol.http_codec import decode_infer_request, encode_infer_response
from jupyter_triton.protocol.json_tensors import may_hold_big_integer
from jupyter_triton.protocol.types import InferRequest, InferResponse, InferTensor
from onnx_models import identity


def _as_before(x: np.ndarray, datatype: str) -> bytes:
    """What the codec wrote before orjson: json.dumps of the document with tolist()."""
    return json.dumps({"model_name": "m", "model_version": "1", "outputs": [
        {"name": "O", "datatype": datatype, "shape": list(x.shape), "data": x.ravel().tolist()}]},
        separators=(",", ":")).encode()


def _encoded(x: np.ndarray, datatype: str) -> bytes:
    body, header_length = encode_infer_response(
        InferResponse("m", "1", outputs=[InferTensor("O", datatype, x.shape, x)]), InferRequest("m"))
    assert header_length is None
    return body


def _wide_doubles(n: int, seed: int) -> np.ndarray:
    """Doubles over the whole range, with the spellings where orjson and Python differ
    (1e-05..1e-04, one-digit exponents), subnormals and the extremes."""
    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore"):
        v = rng.standard_normal(n) * 10.0 ** rng.uniform(-330, 310, n)
    edge = [0.0, -0.0, 1e-4, 9.99e-5, 1e-5, -1.234e-5, 1e-6, 1.5e-7, 1e16, 9.999999999999998e15,
            1e22, 5e-324, 1e-310, 1.7976931348623157e308, 123.0, 2.0 ** 53, 170.00001]
    return np.concatenate([edge, v[np.isfinite(v)], edge])


@pytest.mark.parametrize("datatype,dtype", [("FP64", np.float64), ("FP32", np.float32),
                                            ("FP16", np.float16)])
def test_float_outputs_are_json_dumps_byte_for_byte(datatype, dtype):
    with np.errstate(over="ignore"):
        x = _wide_doubles(200_000, seed=len(datatype)).astype(dtype)
    x = x[np.isfinite(x)]
    assert _encoded(x, datatype) == _as_before(x, datatype)
    small = np.array([[1e-5, 0.5, -2e-7]], dtype=dtype)          # one short output, unsliced
    assert _encoded(small, datatype) == _as_before(small, datatype)


def test_integer_bool_and_bf16_outputs_are_unchanged():
    for datatype, dtype in [("INT8", np.int8), ("UINT8", np.uint8), ("INT32", np.int32),
                            ("INT64", np.int64), ("UINT64", np.uint64), ("UINT16", np.uint16)]:
        info = np.iinfo(dtype)
        x = np.array([info.min, info.max, 0, 1, 7], dtype=dtype).reshape(5, 1)
        assert _encoded(x, datatype) == _as_before(x, datatype), datatype
    b = np.array([True, False, True])
    assert _encoded(b, "BOOL") == _as_before(b, "BOOL")
    bf = np.array([1.0, 3.14159, -2.5e-6, 1e-5], dtype=np.float32)
    expected = _as_before(round_to_bf16(bf), "BF16")
    assert _encoded(bf, "BF16") == expected and b"3.140625" in expected


def test_non_finite_outputs_keep_json_spelling():
    x = np.array([np.nan, np.inf, -np.inf, 0.5], dtype=np.float32)
    assert _encoded(x, "FP32") == _as_before(x, "FP32")
    assert b"[NaN,Infinity,-Infinity,0.5]" in _encoded(x, "FP32")


def _json_request(data_text: bytes, datatype: str = "FP32", shape: str = "[1,3]") -> bytes:
    return (b'{"inputs":[{"name":"INPUT0","shape":' + shape.encode() + b',"datatype":"'
            + datatype.encode() + b'","data":' + data_text + b"}]}")


def test_documents_orjson_refuses_are_read_as_json_read_them():
    # NaN and 1e400 are not JSON, but json read them and so does the codec still.
    got = decode_infer_request(_json_request(b"[NaN,1e400,2]", "FP64"), None, "m", "")
    assert np.isnan(got.inputs[0].data[0, 0]) and got.inputs[0].data[0, 1] == np.inf
    with pytest.raises(InvalidArgument, match=r"element 1 \(123456789012345678901234567890\) is out "
                                              "of the range of datatype INT64|expected an integer in"):
        decode_infer_request(_json_request(b"[1,123456789012345678901234567890,3]", "INT64"), None, "m", "")
    with pytest.raises(InvalidArgument) as err:
        decode_infer_request(b'{"inputs": [', None, "m", "")
    assert str(err.value) == ("failed to parse the request JSON buffer: Expecting value: "
                              "line 1 column 13 (char 12)")
    with pytest.raises(InvalidArgument, match="nested too deeply"):
        decode_infer_request(b"[" * 100_000 + b"]" * 100_000, None, "m", "")
    with pytest.raises(InvalidArgument, match=r"element 1 is a boolean \(true\), expected a number"):
        decode_infer_request(_json_request(b"[1,true,2]"), None, "m", "")


@pytest.fixture
def identity_server(tmp_path: Path):
    repo = tmp_path / "models"
    identity(TensorProto.FLOAT, repo / "identity_fp32" / "1" / "model.onnx", dims=3)
    (repo / "identity_fp32" / "config.pbtxt").write_text(
        'name: "identity_fp32"\nbackend: "onnxruntime"\nmax_batch_size: 8\n'
        'input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 3 ] } ]\n'
        'output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 3 ] } ]\n')
    server, client = serve(repo)
    yield server, client
    server.close()


def _post(server, body: bytes) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v2/models/identity_fp32/infer",
                                 data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_json_tensors_through_the_server(identity_server):
    server, client = identity_server
    x = np.array([[1e-5, -1.5e-7, 3.25], [1e16, 0.1, -0.0]], dtype=np.float32)
    # tritonclient with JSON tensors both ways: the values come back exactly.
    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=False)
    out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)
    result = client.infer("identity_fp32", [inp], outputs=[out])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)
    # A plain JSON post (curl, requests): the output text is what json.dumps wrote.
    status, body = _post(server, _json_request(json.dumps(x.ravel().tolist()).encode(), shape="[2,3]"))
    assert status == 200
    assert json.dumps(x.ravel().tolist(), separators=(",", ":")).encode() in body
    # NaN is not JSON but was served before orjson: still served, spelled as before.
    status, body = _post(server, _json_request(b"[NaN,1,2]"))
    assert status == 200 and b'"data":[NaN,1.0,2.0]' in body
    status, body = _post(server, _json_request(b"[1,2,"))
    assert status == 400 and json.loads(body)["error"].startswith("failed to parse the request JSON buffer")


@pytest.mark.parametrize("text,big", [
    (b"[1,123456789012345678901234567890,3]", True),
    (b"12345678901234567890", True),
    (b'{"id":"123456789012345678901"}', True),            # digits in a string: json's, to be safe
    (b"[440059843361160300000.0,-0.000008415989213972353]", False),   # rapidjson's floats
    (b"[12345678901234567890e3,1234567890123456789]", False),
    (b"[440059843361160300000.0,12345678901234567890]", True),
    (b"", False),
])
def test_only_integers_past_64_bits_keep_a_document_from_orjson(text, big):
    assert may_hold_big_integer(text) is big


def test_floats_as_rapidjson_writes_them_decode_as_json_read_them():
    # perf_analyzer's and tritonclient C++'s JSON: 0.0000084... and 440059843361160300000.0.
    x = np.random.default_rng(7).integers(0, 2**32, 256, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = x[np.isfinite(x)]
    text = b"[" + b",".join(b"%.17g" % v if abs(v) >= 1e21 or v == 0 or abs(v) < 1e-7 else
                            (b"%.25f" % v).rstrip(b"0") + b"0" for v in x.astype(np.float64)) + b"]"
    got = decode_infer_request(_json_request(text, "FP64", f"[1,{len(x)}]"), None, "m", "")
    np.testing.assert_array_equal(got.inputs[0].data.ravel(), np.array(json.loads(text), dtype=np.float64))
