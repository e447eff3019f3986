"""Datatypes and both codecs, checked against the official tritonclient's own encoders and
decoders (what a real client sends and how it reads what we answer)."""
from __future__ import annotations

import json
import struct
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2
from tritonclient.grpc._utils import _get_inference_request
from tritonclient.utils import deserialize_bytes_tensor as client_deserialize

from jupyter_triton.frontends.grpc_codec import decode_grpc_request, encode_grpc_response
from jupyter_triton.protocol.datatypes import (
    config_to_triton, deserialize_bytes_tensor, element_size, float32_to_bf16_bits,
    numpy_to_triton, round_to_bf16, serialize_bytes_tensor, triton_to_config, triton_to_numpy)
from jupyter_triton.protocol.errors import InvalidArgument
from jupyter_triton.protocol import (decode_infer_request, decode_raw_infer_request, encode_error,
                                     encode_infer_response)
from jupyter_triton.protocol.types import InferRequest, InferResponse, InferTensor, RequestedOutput

# One sample array per datatype, as a client would hold it.
SAMPLES = {
    "BOOL": np.array([[True, False, True], [False, False, True]]),
    "UINT8": np.array([0, 255, 7], dtype=np.uint8),
    "UINT16": np.array([0, 65535], dtype=np.uint16),
    "UINT32": np.array([[4_000_000_000]], dtype=np.uint32),
    "UINT64": np.array([2**64 - 1, 3], dtype=np.uint64),
    "INT8": np.array([-128, 127], dtype=np.int8),
    "INT16": np.array([-32768, 5], dtype=np.int16),
    "INT32": np.arange(-3, 3, dtype=np.int32).reshape(2, 3),
    "INT64": np.array([-(2**63), 2**63 - 1], dtype=np.int64),
    "FP16": np.array([0.5, -1.25, 65504], dtype=np.float16),
    "FP32": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
    "FP64": np.array([1e300, -2.5e-300, np.pi]),
    "BF16": np.array([1.5, -2.0, 3.140625, 0.0], dtype=ml_dtypes.bfloat16),
    "BYTES": np.array([[b"hello", "h\u00e9llo".encode(), b""]], dtype=np.object_),
}


def _as_float32(arr: np.ndarray) -> np.ndarray:
    return arr.astype(np.float32) if arr.dtype.name == "bfloat16" else arr


def _http_body(inputs, outputs=None, **kwargs):
    return httpclient.InferenceServerClient.generate_request_body(inputs, outputs=outputs, **kwargs)


def _http_input(name, arr, datatype, binary=True):
    inp = httpclient.InferInput(name, list(arr.shape), datatype)
    inp.set_data_from_numpy(arr, binary_data=binary)
    return inp


def _json_body(doc) -> bytes:
    return json.dumps(doc).encode()


def _decode_doc(doc, **kwargs) -> InferRequest:
    return decode_infer_request(_json_body(doc), None, "m", "", **kwargs)


# -- datatypes ---------------------------------------------------------------------------

def test_datatype_table():
    assert triton_to_numpy("FP32") == np.float32
    assert triton_to_numpy("BF16") == np.float32
    assert triton_to_numpy("BYTES") == np.object_
    assert triton_to_numpy("BOOL") == np.bool_
    assert {dt: element_size(dt) for dt in ("BOOL", "INT16", "FP16", "BF16", "FP64", "BYTES")} == \
        {"BOOL": 1, "INT16": 2, "FP16": 2, "BF16": 2, "FP64": 8, "BYTES": None}
    for dt, arr in SAMPLES.items():
        assert numpy_to_triton(arr.dtype) == dt
    assert numpy_to_triton(np.array(["a"]).dtype) == "BYTES"
    with pytest.raises(InvalidArgument, match="FP8"):
        triton_to_numpy("FP8")
    with pytest.raises(InvalidArgument):
        numpy_to_triton(np.complex64)


def test_config_datatype_names_cover_the_model_config_enum():
    for name in mc.DataType.keys():
        if name == "TYPE_INVALID":
            continue
        dt = config_to_triton(name)
        assert triton_to_config(dt) == name
    assert config_to_triton("TYPE_STRING") == "BYTES"
    assert triton_to_config("BYTES") == "TYPE_STRING"
    with pytest.raises(InvalidArgument):
        config_to_triton("TYPE_INVALID")


def test_bf16_rounds_to_nearest_even_like_ml_dtypes():
    rng = np.random.default_rng(0)
    values = np.concatenate([
        rng.standard_normal(10_000).astype(np.float32) * 1e3,
        np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9 + 2**-20, np.inf, -np.inf, 0.0, -0.0,
                  3.4e38, 1e-40], dtype=np.float32)])
    ours = float32_to_bf16_bits(values)
    theirs = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)
    assert round_to_bf16(np.array([1 + 2**-8], np.float32))[0] == 1.0       # tie to even
    assert np.isnan(round_to_bf16(np.array([np.nan], np.float32))[0])


def test_bytes_tensor_round_trip_matches_tritonclient():
    arr = np.array([[b"a", b"\x00\xff"], ["caf\u00e9", b""]], dtype=np.object_)
    buf = serialize_bytes_tensor(arr)
    assert list(client_deserialize(buf)) == [b"a", b"\x00\xff", "caf\u00e9".encode(), b""]
    out = deserialize_bytes_tensor(buf, 4, "X")
    assert out.dtype == np.object_ and list(out) == list(client_deserialize(buf))
    assert serialize_bytes_tensor(np.empty((0, 3), np.object_)) == b""
    assert deserialize_bytes_tensor(b"", 0, "X").shape == (0,)


@pytest.mark.parametrize("buf,count,message", [
    (struct.pack("<I", 10) + b"abc", 1, "runs past"),
    (struct.pack("<I", 1) + b"a", 2, "expecting 2"),
    (struct.pack("<I", 1) + b"a" + b"xx", 1, "remain"),
    (b"\x01\x00", 1, "expecting 1"),
    (b"", 10**12, "expecting 1000000000000"),
])
def test_bytes_tensor_errors_name_the_input(buf, count, message):
    with pytest.raises(InvalidArgument, match=message) as e:
        deserialize_bytes_tensor(buf, count, "TEXT")
    assert "'TEXT'" in str(e.value)


# -- HTTP: requests ----------------------------------------------------------------------

@pytest.mark.parametrize("datatype", list(SAMPLES))
def test_http_binary_request_from_tritonclient(datatype):
    arr = SAMPLES[datatype]
    body, header_length = _http_body([_http_input("X", arr, datatype)])
    assert header_length is not None
    request = decode_infer_request(body, header_length, "m", "2")
    (t,) = request.inputs
    assert (t.name, t.datatype, t.shape) == ("X", datatype, arr.shape)
    assert t.data.dtype == triton_to_numpy(datatype)
    np.testing.assert_array_equal(t.data, _as_float32(arr))
    assert request.model_name == "m" and request.model_version == "2"
    assert request.parameters == {"binary_data_output": True}
    assert request.outputs is None


@pytest.mark.parametrize("datatype", [dt for dt in SAMPLES if dt != "BF16"])
def test_http_json_request_from_tritonclient(datatype):
    arr = SAMPLES[datatype]
    body, header_length = _http_body([_http_input("X", arr, datatype, binary=False)])
    assert header_length is None
    (t,) = decode_infer_request(body, None, "m", "").inputs
    assert t.shape == arr.shape and t.data.dtype == triton_to_numpy(datatype)
    np.testing.assert_array_equal(t.data, arr)


def test_http_fixed_size_binary_inputs_are_views_over_the_body():
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(4, dtype=np.int64)
    body, hl = _http_body([_http_input("A", a, "FP32"), _http_input("B", b, "INT64")])
    request = decode_infer_request(body, hl, "m", "")
    whole = np.frombuffer(body, np.uint8)
    for t in request.inputs:
        assert np.shares_memory(t.data, whole)


def test_http_request_keeps_id_parameters_and_outputs():
    arr = np.ones((1, 2), np.float32)
    outputs = [httpclient.InferRequestedOutput("Y", binary_data=False, class_count=2),
               httpclient.InferRequestedOutput("Z")]
    body, hl = _http_body([_http_input("X", arr, "FP32")], outputs=outputs, request_id="abc",
                          sequence_id=42, sequence_start=True, priority=3, timeout=500,
                          parameters={"user": "u1", "k": 1.5})
    request = decode_infer_request(body, hl, "m", "")
    assert request.id == "abc"
    assert request.parameters == {"sequence_id": 42, "sequence_start": True,
                                  "sequence_end": False, "priority": 3, "timeout": 500,
                                  "user": "u1", "k": 1.5}
    assert request.outputs == [
        RequestedOutput("Y", {"binary_data": False, "classification": 2}),
        RequestedOutput("Z", {"binary_data": True})]


def test_http_json_data_nested_unlike_its_shape_is_taken_when_the_count_matches():
    # tritonserver 2.51 answers each of these 200 with the row-major values ([[1, 2], [3, 4]]
    # for shape [1, 4], even ragged [[[1], [2, 3, 4]]]): it flattens any nesting
    doc = {"inputs": [
        {"name": "A", "datatype": "FP32", "shape": [1, 4], "data": [[1, 2], [3, 4]]},
        {"name": "B", "datatype": "INT32", "shape": [2, 4], "data": [[1, 2, 3, 4, 5, 6, 7, 8]]},
        {"name": "C", "datatype": "FP32", "shape": [1, 4], "data": [[[1], [2, 3, 4]]]},
        {"name": "D", "datatype": "BYTES", "shape": [2], "data": [["x"], ["y"]]},
        {"name": "E", "datatype": "FP32", "shape": [3], "data": [1, [2, [3]]]},
    ]}
    a, b, c, d, e = _decode_doc(doc).inputs
    np.testing.assert_array_equal(a.data, [[1, 2, 3, 4]])
    np.testing.assert_array_equal(b.data, [[1, 2, 3, 4], [5, 6, 7, 8]])
    np.testing.assert_array_equal(c.data, [[1, 2, 3, 4]])
    assert list(d.data) == [b"x", b"y"]
    np.testing.assert_array_equal(e.data, [1, 2, 3])


def test_http_nested_and_flat_json_data():
    doc = {"inputs": [
        {"name": "N", "datatype": "INT32", "shape": [2, 2], "data": [[1, 2], [3, 4]]},
        {"name": "F", "datatype": "FP32", "shape": [2, 2], "data": [1, 2.5, 3, 4]},
        {"name": "S", "datatype": "BYTES", "shape": [1], "data": ["\u00e9"]},
        {"name": "H", "datatype": "BF16", "shape": [2], "data": [1.0, 1.00390625]},
        {"name": "E", "datatype": "FP32", "shape": [0, 3], "data": []},
    ]}
    n, f, s, h, e = _decode_doc(doc).inputs
    np.testing.assert_array_equal(n.data, [[1, 2], [3, 4]])
    np.testing.assert_array_equal(f.data, [[1, 2.5], [3, 4]])
    assert s.data[0] == "\u00e9".encode()
    np.testing.assert_array_equal(h.data, [1.0, 1.0])      # narrowed to what BF16 can hold
    assert e.data.shape == (0, 3)


def _input_doc(**fields):
    doc = {"name": "X", "datatype": "FP32", "shape": [2], "data": [1, 2]}
    doc.update(fields)
    return {"inputs": [{k: v for k, v in doc.items() if v is not ...}]}


BAD_JSON_REQUESTS = [
    ("not json", b"{nope", "failed to parse the request JSON"),
    ("empty", b"", "empty"),
    ("array document", b"[1, 2]", "expected an object"),
    ("deep nesting", b"[" * 100_000 + b"]" * 100_000, "failed to parse"),
    ("deep nesting in data", _json_body(_input_doc())[:-3] + b"," + b"[" * 50_000
     + b"]" * 50_000 + b"]}]}", "failed to parse"),
    ("no inputs", _json_body({}), "unable to parse 'inputs'"),
    ("inputs not a list", _json_body({"inputs": {}}), "unable to parse 'inputs'"),
    ("input not an object", _json_body({"inputs": [3]}), "unable to parse 'inputs'"),
    ("name not a string", _json_body(_input_doc(name=5)), "unable to parse 'name'"),
    ("unknown datatype", _json_body(_input_doc(datatype="FP8")), "invalid datatype 'FP8'"),
    ("datatype missing", _json_body(_input_doc(datatype=...)), "'datatype' of input 'X'"),
    ("shape missing", _json_body(_input_doc(shape=...)), "'shape' of input 'X'"),
    ("shape not a list", _json_body(_input_doc(shape="2")), "'shape' of input 'X'"),
    ("negative shape", _json_body(_input_doc(shape=[-1])), "non-negative"),
    ("float in shape", _json_body(_input_doc(shape=[2.0])), "non-negative"),
    ("bool in shape", _json_body(_input_doc(shape=[True, 2])), "non-negative"),
    ("absurd shape", _json_body(_input_doc(shape=[2**62, 2**62])), "more than the limit"),
    ("too many dims", _json_body(_input_doc(shape=[1] * 65)), "dimensions"),
    ("data not a list", _json_body(_input_doc(data="12")), "unable to parse 'data' of input 'X'"),
    ("data too short", _json_body(_input_doc(data=[1])), "expects 2 elements, got 1"),
    ("data too long", _json_body(_input_doc(data=[1, 2, 3])), "expects 2 elements, got 3"),
    # Triton 2.51 answers these 500 "Unable to parse 'data': Shape does not match true
    # shape of 'data' field"; a client error is a 400 here
    ("nested, too few", _json_body(_input_doc(shape=[2, 2], data=[[1, 2], [3]])),
     "shape [2, 2] expects 4 elements, got 3"),
    ("nested, too many", _json_body(_input_doc(shape=[2], data=[[1, 2], [3, [4, 5]]])),
     "shape [2] expects 2 elements, got more than 2"),
    ("string for FP32", _json_body(_input_doc(data=[1, "a"])), "element 1 is a string"),
    ("null for FP32", _json_body(_input_doc(data=[1, None])), "element 1 is null"),
    ("FP32 overflow", _json_body(_input_doc(data=[1, 1e39])), "out of the range of datatype FP32"),
    ("300 for UINT8", _json_body(_input_doc(datatype="UINT8", data=[1, 300])),
     "expected an integer in [0, 255]"),
    ("-1 for UINT64", _json_body(_input_doc(datatype="UINT64", data=[-1, 0])), "element 0"),
    ("1.5 for INT32", _json_body(_input_doc(datatype="INT32", data=[1, 1.5])),
     "expected an integer"),
    ("true for INT32", _json_body(_input_doc(datatype="INT32", data=[True, 1])),
     "element 0 is a boolean"),
    ("1 for BOOL", _json_body(_input_doc(datatype="BOOL", data=[True, 1])), "expected a boolean"),
    ("number for BYTES", _json_body(_input_doc(datatype="BYTES", data=["a", 1])),
     "expected a string"),
    ("no data at all", _json_body(_input_doc(data=...)), "no field is set"),
    ("data and binary", _json_body(_input_doc(parameters={"binary_data_size": 8})),
     "set 'data' 'binary_data_size'"),
    ("duplicate input", _json_body({"inputs": _input_doc()["inputs"] * 2}),
     "input 'X' already exists in request"),
    ("id not a string", _json_body({"id": 7, **_input_doc()}), "unable to parse 'id'"),
    ("parameters not an object", _json_body({"parameters": [], **_input_doc()}),
     "unable to parse 'parameters'"),
    ("priority a string", _json_body({"parameters": {"priority": "high"}, **_input_doc()}),
     "unable to parse 'priority'"),
    ("binary_data_output a string",
     _json_body({"parameters": {"binary_data_output": "yes"}, **_input_doc()}),
     "unable to parse 'binary_data_output'"),
    ("reserved parameter", _json_body({"parameters": {"triton_x": 1}, **_input_doc()}),
     "reserved"),
    ("outputs not a list", _json_body({"outputs": {}, **_input_doc()}), "unable to parse 'outputs'"),
    ("output name missing", _json_body({"outputs": [{}], **_input_doc()}), "'name' of output 0"),
    ("output binary_data not bool",
     _json_body({"outputs": [{"name": "Y", "parameters": {"binary_data": 1}}], **_input_doc()}),
     "'binary_data' of output 'Y'"),
    ("duplicate output",
     _json_body({"outputs": [{"name": "Y"}, {"name": "Y"}], **_input_doc()}),
     "output 'Y' is requested more than once"),
    ("binary input without header length",
     _json_body(_input_doc(data=..., parameters={"binary_data_size": 8})),
     "Inference-Header-Content-Length"),
]


@pytest.mark.parametrize("body,message", [case[1:] for case in BAD_JSON_REQUESTS],
                         ids=[case[0] for case in BAD_JSON_REQUESTS])
def test_http_client_errors_are_invalid_argument(body, message):
    with pytest.raises(InvalidArgument) as e:
        decode_infer_request(body, None, "m", "")
    assert message in str(e.value)
    assert e.value.status == 400


def _binary_request(header: dict, payload: bytes) -> tuple[bytes, int]:
    head = json.dumps(header).encode()
    return head + payload, len(head)


def _binary_input(name="X", datatype="FP32", shape=(2,), size=8):
    return {"name": name, "datatype": datatype, "shape": list(shape),
            "parameters": {"binary_data_size": size}}


BAD_BINARY_REQUESTS = [
    ("size mismatch", {"inputs": [_binary_input(size=4)]}, b"\0" * 4,
     "input byte size mismatch for input 'X' for model 'm'. Expected 8, got 4"),
    ("body too short", {"inputs": [_binary_input()]}, b"\0" * 4,
     "unexpected size for input 'X', expecting 4 additional bytes for model 'm'"),
    ("leftover bytes", {"inputs": [_binary_input()]}, b"\0" * 12,
     "unexpected additional input data for model 'm'"),
    ("size not an int", {"inputs": [_binary_input(size="8")]}, b"\0" * 8,
     "unable to parse 'binary_data_size' of input 'X'"),
    ("negative size", {"inputs": [_binary_input(size=-8)]}, b"\0" * 8,
     "unable to parse 'binary_data_size' of input 'X'"),
    ("absurd shape, few bytes", {"inputs": [_binary_input(shape=(10**9,), size=8)]}, b"\0" * 8,
     "Expected 4000000000, got 8"),
    ("bytes length past the end", {"inputs": [_binary_input(datatype="BYTES", shape=(1,), size=7)]},
     struct.pack("<I", 100) + b"abc", "runs past"),
    ("bytes count mismatch", {"inputs": [_binary_input(datatype="BYTES", shape=(3,), size=10)]},
     struct.pack("<I", 1) + b"a" + struct.pack("<I", 1) + b"b", "expecting 3"),
    ("bool not 0/1", {"inputs": [_binary_input(datatype="BOOL", shape=(2,), size=2)]}, b"\x01\x07",
     "BOOL byte"),
]


@pytest.mark.parametrize("header,payload,message", [c[1:] for c in BAD_BINARY_REQUESTS],
                         ids=[c[0] for c in BAD_BINARY_REQUESTS])
def test_http_binary_client_errors(header, payload, message):
    body, hl = _binary_request(header, payload)
    with pytest.raises(InvalidArgument) as e:
        decode_infer_request(body, hl, "m", "")
    assert message in str(e.value)


def test_http_header_length_past_the_body():
    body, _ = _binary_request({"inputs": [_binary_input()]}, b"\0" * 8)
    for bad in (len(body) + 1, -1):
        with pytest.raises(InvalidArgument, match="inference header size should be in range"):
            decode_infer_request(body, bad, "m", "")


def test_http_shared_memory_input_decodes_without_data():
    doc = _input_doc(data=..., parameters={"shared_memory_region": "r",
                                           "shared_memory_byte_size": 8})
    (x,) = _decode_doc(doc).inputs
    assert x.data is None and x.parameters["shared_memory_region"] == "r"


@pytest.mark.parametrize("header,payload", [
    ({"inputs": [_binary_input(shape=(10**9,), datatype="FP64", size=8)]}, b"\0" * 8),
    ({"inputs": [_binary_input(shape=(10**8,), datatype="BYTES", size=8)]}, b"\0" * 8),
    ({"inputs": [_binary_input(shape=(10**8, 10**8), datatype="FP32", size=8)]}, b"\0" * 8),
])
def test_http_absurd_shapes_fail_before_allocating(header, payload):
    body, hl = _binary_request(header, payload)
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgument):
            decode_infer_request(body, hl, "m", "")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000


def test_http_max_elements_is_enforced():
    with pytest.raises(InvalidArgument, match="more than the limit of 1"):
        _decode_doc(_input_doc(), max_elements=1)


# -- HTTP: raw binary requests -------------------------------------------------------------

def test_raw_request_infers_the_batch_dimension():
    arr = np.arange(8, dtype=np.float32)
    request = decode_raw_infer_request(arr.tobytes(), "m", "1", "IN", "FP32", [-1, 4])
    (t,) = request.inputs
    assert t.name == "IN" and t.shape == (2, 4)
    np.testing.assert_array_equal(t.data, arr.reshape(2, 4))
    assert request.parameters == {"binary_data_output": True}

    text = serialize_bytes_tensor(np.array([b"a", b"bc", b"d"], dtype=np.object_))
    (s,) = decode_raw_infer_request(text, "m", "", "T", "BYTES", [-1]).inputs
    assert s.shape == (3,) and list(s.data) == [b"a", b"bc", b"d"]


@pytest.mark.parametrize("body,datatype,dims,message", [
    (b"\0" * 6, "FP32", [-1], "not a multiple"),
    (b"\0" * 12, "FP32", [-1, 2], "do not fill"),
    (b"\0" * 16, "FP32", [-1, -1], "more than one variable dimension"),
    (b"\0" * 16, "FP32", [2], "expects 2 elements, got 4"),
    (struct.pack("<I", 9) + b"x", "BYTES", [-1], "runs past"),
])
def test_raw_request_errors(body, datatype, dims, message):
    with pytest.raises(InvalidArgument, match=message):
        decode_raw_infer_request(body, "m", "", "IN", datatype, dims)


# -- HTTP: responses ----------------------------------------------------------------------

def _response(outputs: dict[str, np.ndarray], **kwargs) -> InferResponse:
    tensors = [InferTensor(name=n, datatype=numpy_to_triton(a.dtype), shape=a.shape,
                           data=_as_float32(a)) for n, a in outputs.items()]
    return InferResponse(model_name="m", model_version="1", outputs=tensors, **kwargs)


@pytest.mark.parametrize("binary", [True, False])
def test_http_response_read_by_tritonclient_for_every_datatype(binary):
    resp = _response({dt: arr for dt, arr in SAMPLES.items()})
    request = InferRequest(model_name="m", parameters={"binary_data_output": binary})
    body, hl = encode_infer_response(resp, request)
    assert (hl is not None) == binary
    result = httpclient.InferResult.from_response_body(body, header_length=hl)
    for dt, arr in SAMPLES.items():
        got = result.as_numpy(dt)
        assert got.shape == arr.shape, dt
        if dt == "BYTES" and not binary:
            # JSON carries text; tritonclient hands it back as str, as it does from Triton
            got = np.vectorize(str.encode, otypes=[object])(got)
        np.testing.assert_array_equal(_as_float32(got), _as_float32(arr), err_msg=dt)
        out = result.get_output(dt)
        assert out["datatype"] == dt
        assert ("data" in out) != binary


def test_http_response_per_output_choice_id_and_parameters():
    resp = _response({"A": np.ones(2, np.float32), "B": np.zeros(3, np.int8)},
                     parameters={"sequence_id": 5})
    request = InferRequest(model_name="m", id="req-1",
                           outputs=[RequestedOutput("A", {"binary_data": True}),
                                    RequestedOutput("B", {})])
    body, hl = encode_infer_response(resp, request)
    header = json.loads(body[:hl])
    assert header["id"] == "req-1" and header["parameters"] == {"sequence_id": 5}
    assert header["model_name"] == "m" and header["model_version"] == "1"
    a, b = header["outputs"]
    assert a == {"name": "A", "datatype": "FP32", "shape": [2],
                 "parameters": {"binary_data_size": 8}}
    assert b == {"name": "B", "datatype": "INT8", "shape": [3], "data": [0, 0, 0]}
    assert len(body) == hl + 8


def test_http_response_all_json_has_no_header_length_and_no_id_when_none_was_sent():
    body, hl = encode_infer_response(_response({"A": np.array([[1.5]], np.float32)}),
                                     InferRequest(model_name="m"))
    assert hl is None
    assert json.loads(body) == {"model_name": "m", "model_version": "1", "outputs": [
        {"name": "A", "datatype": "FP32", "shape": [1, 1], "data": [1.5]}]}


def test_http_response_non_utf8_bytes_go_binary_even_when_json_was_asked():
    resp = _response({"T": np.array([b"ok", b"\xff\xfe"], dtype=np.object_)})
    body, hl = encode_infer_response(resp, InferRequest(model_name="m"))
    assert hl is not None
    result = httpclient.InferResult.from_response_body(body, header_length=hl)
    assert list(result.as_numpy("T")) == [b"ok", b"\xff\xfe"]


def test_encode_error():
    assert json.loads(encode_error(InvalidArgument("bad 'x'"))) == {"error": "bad 'x'"}


# -- gRPC --------------------------------------------------------------------------------

def _grpc_request(inputs, outputs=None, **kwargs) -> service_pb2.ModelInferRequest:
    args = dict(model_name="m", inputs=inputs, model_version="", request_id="", outputs=outputs,
                sequence_id=0, sequence_start=False, sequence_end=False, priority=0,
                timeout=None, parameters=None)
    args.update(kwargs)
    return _get_inference_request(**args)


def _grpc_input(name, arr, datatype):
    inp = grpcclient.InferInput(name, list(arr.shape), datatype)
    inp.set_data_from_numpy(arr)
    return inp


@pytest.mark.parametrize("datatype", list(SAMPLES))
def test_grpc_round_trip_through_tritonclient(datatype):
    arr = SAMPLES[datatype]
    msg = _grpc_request([_grpc_input("X", arr, datatype)], request_id="r9", priority=4,
                        parameters={"flag": True, "ratio": 0.5, "name": "n"})
    msg.parameters["big"].uint64_param = 2**63 + 1      # beyond what the client's helper sends
    request = decode_grpc_request(service_pb2.ModelInferRequest.FromString(msg.SerializeToString()))
    assert request.id == "r9" and request.outputs is None
    assert request.parameters == {"priority": 4, "flag": True, "ratio": 0.5, "name": "n",
                                  "big": 2**63 + 1}
    (t,) = request.inputs
    assert t.shape == arr.shape and t.datatype == datatype
    np.testing.assert_array_equal(t.data, _as_float32(arr))

    response = InferResponse(model_name="m", model_version="3",
                             outputs=[InferTensor("Y", datatype, t.shape, t.data)],
                             parameters={"flag": True})
    out = encode_grpc_response(response, request)
    assert out.id == "r9" and out.model_version == "3"
    assert out.parameters["flag"].bool_param is True
    got = grpcclient.InferResult(out).as_numpy("Y")
    np.testing.assert_array_equal(_as_float32(got), _as_float32(arr))


def test_grpc_typed_contents():
    msg = service_pb2.ModelInferRequest(model_name="m")
    msg.inputs.add(name="I", datatype="INT16", shape=[2, 2]).contents.int_contents.extend(
        [1, -2, 3, -4])
    msg.inputs.add(name="S", datatype="BYTES", shape=[2]).contents.bytes_contents.extend(
        [b"a", b"\xff"])
    msg.inputs.add(name="B", datatype="BOOL", shape=[1]).contents.bool_contents.append(True)
    msg.inputs.add(name="D", datatype="FP64", shape=[1]).contents.fp64_contents.append(0.25)
    msg.outputs.add(name="O").parameters["classification"].int64_param = 3
    request = decode_grpc_request(msg)
    i, s, b, d = request.inputs
    np.testing.assert_array_equal(i.data, np.array([[1, -2], [3, -4]], np.int16))
    assert i.data.dtype == np.int16
    assert list(s.data) == [b"a", b"\xff"] and b.data.tolist() == [True] and d.data[0] == 0.25
    assert request.outputs == [RequestedOutput("O", {"classification": 3})]


def _typed(datatype, shape, field, values):
    msg = service_pb2.ModelInferRequest(model_name="m")
    getattr(msg.inputs.add(name="X", datatype=datatype, shape=shape).contents, field).extend(values)
    return msg


@pytest.mark.parametrize("msg,message", [
    (_typed("INT32", [3], "int_contents", [1, 2]), "expects 3, got 2"),
    (_typed("INT8", [1], "int_contents", [300]), "out of the range of datatype INT8"),
    (_typed("INT32", [1], "fp32_contents", [1.0]), "sets 'fp32_contents'"),
    (_typed("FP16", [1], "fp32_contents", [1.0]), "raw_input_contents"),
    (_typed("FP32", [-1], "fp32_contents", [1.0]), "non-negative"),
    (_typed("FP9", [1], "fp32_contents", [1.0]), "invalid datatype 'FP9'"),
    (_typed("FP32", [2**40, 2**40], "fp32_contents", [1.0]), "more than the limit"),
])
def test_grpc_typed_contents_errors(msg, message):
    with pytest.raises(InvalidArgument, match=message) as e:
        decode_grpc_request(msg)
    assert "'X'" in str(e.value)


def test_grpc_raw_contents_errors():
    arr = np.ones(2, np.float32)
    msg = _grpc_request([_grpc_input("X", arr, "FP32"), _grpc_input("Y", arr, "FP32")])
    del msg.raw_input_contents[1]
    with pytest.raises(InvalidArgument, match="expected 2 inputs but got 1"):
        decode_grpc_request(msg)

    msg = _grpc_request([_grpc_input("X", arr, "FP32")])
    msg.raw_input_contents[0] = b"\0" * 4
    with pytest.raises(InvalidArgument, match="Expected 8, got 4"):
        decode_grpc_request(msg)

    msg = _grpc_request([_grpc_input("X", arr, "FP32")])
    msg.inputs[0].contents.fp32_contents.extend([1.0, 2.0])
    with pytest.raises(InvalidArgument, match="contents field must not be specified"):
        decode_grpc_request(msg)

    msg = _grpc_request([_grpc_input("X", arr, "FP32"), _grpc_input("X", arr, "FP32")])
    with pytest.raises(InvalidArgument, match="input 'X' already exists in request"):
        decode_grpc_request(msg)

    msg = _grpc_request([_grpc_input("X", arr, "FP32")])
    msg.parameters["priority"].string_param = "high"
    with pytest.raises(InvalidArgument, match="'priority'"):
        decode_grpc_request(msg)


# -- large documents: decoded and encoded in slices (the GIL is free between them) -------------

def _large(data_text: bytes, shape: list[int], dt: str = "FP32", extra: bytes = b"") -> bytes:
    return (b'{"id":"big",' + extra + b'"inputs":[{"name":"I","shape":' + json.dumps(shape).encode()
            + b',"datatype":"' + dt.encode() + b'","data":[' + data_text + b"]}]}")


def test_large_json_decodes_exactly_as_small_json():
    from jupyter_triton.protocol.json_slices import SLICED_MIN
    x = (np.arange(400_000) % 97 / 8 - 6).astype(np.float32)
    body = _large(",".join(map(repr, x.tolist())).encode(), [100_000, 4],
                  extra=b'"parameters":{"pad":[' + b"1," * 40_000 + b'2]},')
    assert len(body) > SLICED_MIN
    request = decode_infer_request(body, None, "m", "")
    np.testing.assert_array_equal(request.inputs[0].data, x.reshape(100_000, 4))
    assert request.inputs[0].data.dtype == np.float32 and request.id == "big"
    assert request.parameters["pad"] == [1] * 40_000 + [2]     # a long run elsewhere stays a list


@pytest.mark.parametrize("data,count,needle", [
    (b"1," * 300_000 + b"1.5," + b"2," * 299_999 + b"2", 600_001, "element 300000 is a number (1.5)"),
    (b"1," * 300_000 + b"1", 600_000, "expects 600000 elements, got 300001"),
    (b"1,," + b"1," * 600_000 + b"1", 600_002, "failed to parse the request JSON buffer"),
    (b"1," * 600_000, 600_000, "failed to parse the request JSON buffer"),     # trailing comma
    (b"1," * 600_000 + b"99999999999", 600_001, "expected an integer in"),
])
def test_large_json_errors_name_the_element(data, count, needle):
    with pytest.raises(InvalidArgument) as err:
        decode_infer_request(_large(data, [count], "INT32"), None, "m", "")
    assert needle in str(err.value)


def test_a_number_run_inside_a_string_is_not_mistaken_for_data():
    text = b"[" + b"1," * 600_000 + b"2]"
    body = b'{"parameters":{"note":"' + text + b'"},"inputs":[{"name":"I","shape":[1],"datatype":"INT32","data":[5]}]}'
    request = decode_infer_request(body, None, "m", "")
    assert request.parameters["note"] == text.decode()
    np.testing.assert_array_equal(request.inputs[0].data, [5])


def test_large_json_output_encodes_exactly_as_json_dumps():
    x = np.random.default_rng(3).standard_normal((300_000, 2)).astype(np.float32)
    response = InferResponse("m", "1", outputs=[InferTensor("O", "FP32", x.shape, x)])
    body, header_length = encode_infer_response(response, InferRequest("m"))
    assert header_length is None
    expected = json.dumps({"model_name": "m", "model_version": "1", "outputs": [
        {"name": "O", "datatype": "FP32", "shape": [300_000, 2], "data": x.ravel().tolist()}]},
        separators=(",", ":")).encode()
    assert body == expected
