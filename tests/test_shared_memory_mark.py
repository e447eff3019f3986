"""The codecs mark a request whose tensors name a shared memory region
(``InferRequest.shared_memory``): the engine reads and writes regions for marked requests
only, so a request decoded again from a kept plan (a repeat of the same layout) must carry
the mark as the first did. Requests as tritonclient builds them."""
from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc._utils import _get_inference_request

from jupyter_triton.frontends.grpc_codec import RequestPlans
from jupyter_triton.protocol import decode_infer_request

X = np.arange(4, dtype=np.float32).reshape(1, 4)


def _tensors(module, where: str):
    inp = module.InferInput("INPUT0", [1, 4], "FP32")
    if where == "input":
        inp.set_shared_memory("in_region", X.nbytes)
    else:
        inp.set_data_from_numpy(X, **({"binary_data": True} if module is httpclient else {}))
    out = module.InferRequestedOutput("OUTPUT0", **({"binary_data": True} if module is httpclient else {}))
    if where == "output":
        out.set_shared_memory("out_region", X.nbytes)
    return [inp], [out]


def _http(where: str) -> tuple[bytes, int | None]:
    inputs, outputs = _tensors(httpclient, where)
    body, json_size = httpclient.InferenceServerClient.generate_request_body(inputs, outputs)
    return body, json_size


def _grpc(where: str) -> bytes:
    inputs, outputs = _tensors(grpcclient, where)
    return _get_inference_request(model_name="m", inputs=inputs, model_version="", request_id="",
                                  outputs=outputs, sequence_id=0, sequence_start=False,
                                  sequence_end=False, priority=0, timeout=None,
                                  parameters=None).SerializeToString()


@pytest.mark.parametrize("where", ["input", "output", "nowhere"])
def test_http_marks_a_request_naming_a_region_every_time(where: str) -> None:
    body, json_size = _http(where)
    for _ in range(3):          # the first decode keeps a plan; the repeats come from it
        request = decode_infer_request(body, json_size, "m", "")
        assert request.shared_memory is (where != "nowhere")


@pytest.mark.parametrize("where", ["input", "output", "nowhere"])
def test_grpc_marks_a_request_naming_a_region_every_time(where: str) -> None:
    plans = RequestPlans()
    raw = _grpc(where)
    for _ in range(3):
        request = plans.decode(raw)
        assert request.shared_memory is (where != "nowhere")
