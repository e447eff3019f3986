"""ModelStreamInfer's responses are written from the same plans as ModelInfer's
(frontends/grpc_codec.py ``ResponsePlans.encode_stream``): the ModelStreamInferResponse that
protobuf wrote for them, Triton's ``triton_final_response`` set, an empty final response named
after the request's model. (Byte for byte but for the order of a parameter map's entries,
which protobuf does not fix: its own order depends on the map's history.)"""
from __future__ import annotations

import itertools

from tritonclient.grpc import service_pb2 as pb

from jupyter_triton.frontends.grpc_codec import ResponsePlans, encode_grpc_response
from jupyter_triton.protocol.types import InferRequest, InferResponse
from test_grpc_response_plans import IDS, LAYOUTS, PARAMS, _response


def _protobufs(resp: InferResponse, request: InferRequest, model: str, version: str) -> bytes:
    """What the stream wrote before it had plans: the message built field by field."""
    message = encode_grpc_response(resp, request)
    if not message.model_name:
        message.model_name, message.model_version = model, version
    message.parameters["triton_final_response"].bool_param = resp.final
    return pb.ModelStreamInferResponse(infer_response=message).SerializeToString()


def _same(got: bytes, expected: bytes) -> None:
    assert len(got) == len(expected)
    assert pb.ModelStreamInferResponse.FromString(got) == \
        pb.ModelStreamInferResponse.FromString(expected)


def test_stream_responses_are_what_protobuf_writes_final_or_not() -> None:
    plans = ResponsePlans()
    for layout, params, rid, final in itertools.product(LAYOUTS, PARAMS, IDS, (True, False)):
        request = InferRequest("m", "", id=rid)
        for _ in range(3):
            resp = _response("m", "1", "", layout, params)
            resp.final = final
            got = plans.encode_stream(resp, request)
            expected = _protobufs(resp, request, "m", "")
            _same(got, expected)
            if not params and all(p is None for *_, p in layout):      # one map entry
                assert got == expected
            parsed = pb.ModelStreamInferResponse.FromString(got).infer_response
            assert parsed.parameters["triton_final_response"].bool_param is final
    # one plan a layout, parameter map and final flag (a response's own triton_final_response
    # is the stream's: None and {"triton_final_response": True} are one map)
    assert len(plans._plans) == len(LAYOUTS) * 2 * 2


def test_an_empty_final_response_names_the_requests_model_and_version() -> None:
    plans = ResponsePlans()
    for rid in IDS:
        request = InferRequest("dec", "3", id=rid)
        resp = InferResponse("", "", "", [], final=True)
        got = plans.encode_stream(resp, request)
        assert got == _protobufs(resp, request, "dec", "3")
        parsed = pb.ModelStreamInferResponse.FromString(got).infer_response
        assert (parsed.model_name, parsed.model_version, parsed.id) == ("dec", "3", rid)
