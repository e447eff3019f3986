"""HTTP responses written from a plan (protocol/http_codec.py ``_planned_response``): a reply
whose layout repeats is the cached JSON header around its own id and its JSON outputs' values,
then its binary outputs' bytes: byte for byte what the full encoder writes; and over a real
server, tritonclient reads them, binary, JSON and mixed."""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from jupyter_triton.engine import EngineOptions
from jupyter_triton.protocol import http_codec
from jupyter_triton.protocol.binary_data import encode_response
from jupyter_triton.protocol.http_codec import encode_infer_response
from jupyter_triton.protocol.types import InferRequest, InferResponse, InferTensor, RequestedOutput
from test_grpc_response_plans import _ARRAYS, CONFIG, MODEL, _RNG


def _response(rid: str, outputs, model: str = "m", version="1") -> InferResponse:
    return InferResponse(model, version, rid, [InferTensor(name, dt, tuple(shape), _ARRAYS[dt](shape))
                                               for name, dt, shape in outputs])


def _same(resp: InferResponse, request: InferRequest):
    got = encode_infer_response(resp, request)
    assert got == encode_response(resp, request)
    return got


LAYOUTS = [
    [("OUT", "FP32", (1, 256))],
    [("OUT", "FP32", (4, 3)), ("IDX", "INT64", (4,)), ("F", "BOOL", (2, 2))],
    [("E", "FP32", (0, 8)), ("S", "FP64", ())],
    [("H", "FP16", (3, 5)), ("B", "BF16", (2,)), ("I", "INT8", (7,)), ("U", "UINT16", (300,))],
]
IDS = ["", "7", "req-é-\x7f-\"q\"-" + "z" * 100]


@pytest.fixture(autouse=True)
def _fresh_plans():
    http_codec._RESPONSE_PLANS.clear()
    yield
    http_codec._RESPONSE_PLANS.clear()


def _requests(outputs, rid: str):
    names = [name for name, _, _ in outputs]
    yield InferRequest("m", id=rid, parameters={"binary_data_output": True})
    yield InferRequest("m", id=rid, outputs=[RequestedOutput(n, {"binary_data": True}) for n in names])
    yield InferRequest("m", id=rid, parameters={"binary_data_output": True},
                       outputs=[RequestedOutput(n, {}) for n in names])
    # some or all outputs in JSON (their values are in the header)
    yield InferRequest("m", id=rid, parameters={"binary_data_output": True},
                       outputs=[RequestedOutput(n, {"binary_data": i > 0}) for i, n in enumerate(names)])
    yield InferRequest("m", id=rid)


def test_every_layout_id_and_binary_choice_is_written_as_the_full_encoder_writes_it() -> None:
    for layout, rid, version in itertools.product(LAYOUTS, IDS, ("1", 3)):
        for request in _requests(layout, rid):
            for _ in range(3):
                _same(_response(rid, layout, version=version), request)
                _same(_response("", layout, version=version), request)     # the request's id
    # a plan for each layout, version and choice of binary outputs (all, all but the first, none)
    assert 0 < len(http_codec._RESPONSE_PLANS) <= 3 * 2 * len(LAYOUTS)


def test_names_that_json_escapes_and_other_shapes_are_their_own_plans() -> None:
    request = InferRequest("m", parameters={"binary_data_output": True})
    for model, name in [("m", "OUT"), ("mé", "OUT"), ("m", "O\"UT\u2028"), ("m\x7f", "OUT")]:
        for shape in ((2, 2), (4,), (1, 4)):
            for _ in range(2):
                _same(_response("x", [(name, "FP32", shape)], model=model), request)
    assert len(http_codec._RESPONSE_PLANS) == 12


def test_what_the_plan_cannot_write_is_the_full_encoders() -> None:
    request = InferRequest("m", parameters={"binary_data_output": True})
    cases = []
    resp = _response("", [("T", "BYTES", (3,))])
    cases.append(resp)
    resp = _response("", [("Y", "FP32", (2,))])
    resp.parameters = {"k": 1}
    cases.append(resp)
    resp = _response("", [("Y", "FP32", (2,))])
    resp.outputs[0].parameters = {"k": "v"}
    cases.append(resp)
    resp = _response("", [("Y", "FP32", (2,)), ("Z", "INT64", (3,))])
    resp.outputs[1].data = None                  # in a shared memory region
    cases.append(resp)
    cases.append(InferResponse("m", "1", "", []))
    for resp in cases:
        for _ in range(2):
            _same(resp, request)
    assert not any(http_codec._RESPONSE_PLANS.values())
    # data that does not fit its shape, before and after the layout has a plan
    resp = _response("", [("Y", "FP32", (2, 2))])
    resp.outputs[0].data = np.zeros(5, np.float32)
    _same(resp, request)
    _same(_response("", [("Y", "FP32", (2, 2))]), request)
    _same(resp, request)
    for data in (np.arange(4, dtype=np.float64).reshape(2, 2), np.arange(4, dtype=">f4").reshape(2, 2),
                 np.arange(4, dtype=np.float32).reshape(2, 2).T):
        _same(InferResponse("m", "1", "", [InferTensor("Y", "FP32", (2, 2), data)]), request)


def test_plans_are_bounded() -> None:
    request = InferRequest("m", parameters={"binary_data_output": True})
    for n in range(http_codec._RESPONSE_PLANS_MAX + 10):
        _same(_response("", [("Y", "FP32", (n,))]), request)
        assert len(http_codec._RESPONSE_PLANS) <= http_codec._RESPONSE_PLANS_MAX


def test_tritonclient_reads_planned_replies_binary_json_and_mixed(tmp_path: Path) -> None:
    from jupyter_triton.standalone import start_in_thread
    repo = tmp_path / "models"
    (repo / "outs" / "1").mkdir(parents=True)
    (repo / "outs" / "1" / "model.py").write_text(MODEL)
    (repo / "outs" / "config.pbtxt").write_text(CONFIG)
    server = start_in_thread(EngineOptions(model_repository=repo, model_control_mode="explicit",
                                           load_models=["*"]),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=None)
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        choices = [None, [("SUM", True), ("ROWS", True)], [("NONE", True), ("SUM", False)],
                   [("WORDS", True), ("SUM", True)], [("ROWS", False)]]
        for rows, cols, rid, wanted in itertools.product((1, 3), (1, 5), ("", "q1", "q-é"),
                                                         choices):
            x = _RNG.standard_normal((rows, cols)).astype(np.float32)
            inp = httpclient.InferInput("X", [rows, cols], "FP32")
            inp.set_data_from_numpy(x)
            for _ in range(2):
                result = client.infer("outs", [inp], request_id=rid, outputs=None if wanted is None
                                      else [httpclient.InferRequestedOutput(n, binary_data=b)
                                            for n, b in wanted])
                response = result.get_response()
                assert (response["model_name"], response["model_version"],
                        response.get("id", "")) == ("outs", "1", rid)
                names = [o["name"] for o in response["outputs"]]
                assert names == ([n for n, _ in wanted] if wanted else
                                 ["SUM", "ROWS", "WORDS", "NONE"])
                if "SUM" in names:
                    np.testing.assert_allclose(result.as_numpy("SUM"), x * 2, rtol=1e-6)
                if "ROWS" in names:
                    np.testing.assert_array_equal(result.as_numpy("ROWS"), np.full((rows, 1), cols))
                if "WORDS" in names:
                    assert result.as_numpy("WORDS").reshape(-1).tolist() == \
                        [b"w" * (i + 1) for i in range(rows)]
                if "NONE" in names:
                    assert result.as_numpy("NONE").shape == (rows, 0)
        with pytest.raises(httpclient.InferenceServerException, match="unexpected"):
            bad = httpclient.InferInput("Y", [1, 2], "FP32")
            bad.set_data_from_numpy(np.zeros((1, 2), np.float32))
            client.infer("outs", [bad])
        assert client.is_server_live()
        client.close()
    finally:
        server.close()


@pytest.mark.parametrize("dt, shape", [("FP32", (1, 256)), ("INT64", (3,)), ("FP16", (2, 2)),
                                       ("UINT16", (5,)), ("FP64", ()), ("INT8", (0, 4)),
                                       ("BOOL", (4,)), ("BF16", (3,))])
def test_a_planned_request_decodes_its_own_bytes_as_the_first_did(dt, shape) -> None:
    """The decode plan's inputs are views of each body at the plan's offsets (a dtype and a
    shape straight onto the bytes where nothing is to be checked or widened)."""
    import json
    from jupyter_triton.protocol.datatypes import tensor_from_wire, tensor_wire_buffer
    from jupyter_triton.protocol.http_codec import decode_infer_request
    http_codec._PLANS.clear()
    header = json.dumps({"inputs": [
        {"name": "A", "datatype": dt, "shape": list(shape),
         "parameters": {"binary_data_size": len(tensor_wire_buffer(_ARRAYS[dt](shape), dt))}},
        {"name": "B", "datatype": "INT8", "shape": [3], "parameters": {"binary_data_size": 3}}]}
    ).encode()
    for i in range(3):
        a, b = _ARRAYS[dt](shape), np.array([i, -i, 7], np.int8)
        body = header + bytes(tensor_wire_buffer(a, dt)) + b.tobytes()
        request = decode_infer_request(body, len(header), "m", "")
        got_a, got_b = (t.data for t in request.inputs)
        assert got_a.shape == shape and got_b.shape == (3,)
        wire = bytes(tensor_wire_buffer(a, dt))
        np.testing.assert_array_equal(got_a, tensor_from_wire(wire, dt, shape, "A", "m"))
        if dt != "BF16":        # (BF16 is rounded on the way)
            np.testing.assert_array_equal(got_a, a)
        np.testing.assert_array_equal(got_b, b)
    assert len(http_codec._PLANS) == 1
    if dt == "BOOL":            # a planned layout still checks a BOOL's bytes
        from jupyter_triton.protocol.errors import InvalidArgument
        with pytest.raises(InvalidArgument, match="BOOL"):
            decode_infer_request(header + b"\x02" * 4 + b"\0" * 3, len(header), "m", "")


def test_a_shape_given_as_a_list_keys_the_same_plan_as_its_tuple() -> None:
    request = InferRequest("m", parameters={"binary_data_output": True})
    for shape in ([2, 3], (2, 3), [2, 3]):
        _same(InferResponse("m", "1", "", [InferTensor("Y", "FP32", shape,
                                                       np.ones((2, 3), np.float32))]), request)
    assert len(http_codec._RESPONSE_PLANS) == 1
