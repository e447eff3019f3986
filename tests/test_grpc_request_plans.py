"""gRPC ModelInfer's request plans (frontends/grpc_codec.py ``RequestPlans``): a message that
repeats an earlier one's layout decodes without protobuf to what decode_grpc_request gives."""
from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from jupyter_triton.frontends.grpc_codec import RequestPlans, decode_grpc_request, parse_infer_request
from jupyter_triton.protocol.errors import InvalidArgument


def _message(*inputs: tuple[str, str, np.ndarray], params: dict | None = None,
             name: str = "m") -> pb.ModelInferRequest:
    m = pb.ModelInferRequest(model_name=name, id="r")
    for key, value in (params or {}).items():
        m.parameters[key].int64_param = value
    for input_name, dt, arr in inputs:
        m.inputs.add(name=input_name, datatype=dt, shape=list(arr.shape))
        m.raw_input_contents.append(arr.tobytes())
    m.outputs.add(name="Y").parameters["classification"].int64_param = 2
    return m


def _same(a, b) -> None:
    assert (a.model_name, a.model_version, a.id, a.parameters, a.outputs) == \
        (b.model_name, b.model_version, b.id, b.parameters, b.outputs)
    assert len(a.inputs) == len(b.inputs)
    for x, y in zip(a.inputs, b.inputs):
        assert (x.name, x.datatype, x.shape, x.parameters) == (y.name, y.datatype, y.shape,
                                                               y.parameters)
        assert x.data.dtype == y.data.dtype
        np.testing.assert_array_equal(x.data, y.data)


def _check(plans: RequestPlans, raw: bytes):
    got = plans.decode(raw)
    _same(got, decode_grpc_request(parse_infer_request(raw)))
    return got


def test_a_repeated_layout_is_decoded_from_its_plan_with_its_own_values_and_dicts() -> None:
    plans = RequestPlans()
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    first = _check(plans, _message(("X", "FP32", x), ("I", "INT64", np.arange(2)),
                                   params={"priority": 1}).SerializeToString())
    assert plans._count == 1
    first.parameters["priority"] = 7
    first.outputs[0].parameters["classification"] = 9
    second = _check(plans, _message(("X", "FP32", x + 1), ("I", "INT64", np.arange(2) + 5),
                                    params={"priority": 1}).SerializeToString())
    assert plans._count == 1 and second.parameters == {"priority": 1}
    np.testing.assert_array_equal(second.inputs[0].data, x + 1)


def test_a_message_of_the_same_size_but_another_head_or_split_is_decoded_anew() -> None:
    plans = RequestPlans()
    a, b = np.zeros(4, np.int32), np.zeros(2, np.int64)
    _check(plans, _message(("A", "INT32", a), ("B", "INT64", b)).SerializeToString())
    _check(plans, _message(("C", "INT32", a), ("B", "INT64", b)).SerializeToString())
    _check(plans, _message(("A", "INT64", b), ("B", "INT32", a)).SerializeToString())
    _check(plans, _message(("A", "INT32", a), ("B", "INT64", b), name="n").SerializeToString())
    assert plans._count == 4
    # Contents that do not end the message (fields out of number order): not planned.
    m = _message(("A", "INT32", a))
    contents = pb.ModelInferRequest(raw_input_contents=m.raw_input_contents)
    del m.raw_input_contents[:]
    raw = contents.SerializeToString() + m.SerializeToString()
    _check(plans, raw)
    assert plans._count == 4


@pytest.mark.parametrize("dt, arr", [("BOOL", np.array([True, False])),
                                     ("BF16", np.zeros(2, np.uint16)),
                                     ("BYTES", np.frombuffer(b"\x01\0\0\0a", np.uint8))])
def test_inputs_whose_bytes_are_checked_or_converted_are_not_planned(dt, arr) -> None:
    plans = RequestPlans()
    m = pb.ModelInferRequest(model_name="m")
    m.inputs.add(name="X", datatype=dt, shape=[2] if dt != "BYTES" else [1])
    m.raw_input_contents.append(arr.tobytes())
    for _ in range(2):
        _check(plans, m.SerializeToString())
    assert plans._count == 0
    if dt == "BOOL":
        bad = m.SerializeToString()[:-2] + b"\x02\x01"
        with pytest.raises(InvalidArgument):
            plans.decode(bad)


def test_plans_are_bounded() -> None:
    plans = RequestPlans()
    for n in range(1, plans.MAX_PLANS + 10):
        _check(plans, _message(("X", "FP32", np.zeros(n, np.float32))).SerializeToString())
    assert plans._count <= plans.MAX_PLANS
