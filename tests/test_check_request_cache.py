"""InputPlan.check keeps the input shapes it accepted (InputPlan.accepted): a repeat skips the
checks, and every refusal is still the one the full checks give."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from jupyter_triton.engine.model import InputPlan
from jupyter_triton.protocol.errors import InvalidArgument
from jupyter_triton.protocol.types import InferRequest, InferTensor

CONFIG = text_format.Parse("""
name: "m" max_batch_size: 8
input { name: "A" data_type: TYPE_FP32 dims: [ 4 ] }
input { name: "B" data_type: TYPE_INT32 dims: [ 2 ] reshape { shape: [ 1, 2 ] } }
output { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }
""", mc.ModelConfig())


def _request(rows_a: int, rows_b: int, shape_type=tuple) -> InferRequest:
    a = np.zeros((rows_a, 4), np.float32)
    b = np.zeros((rows_b, 2), np.int32)
    return InferRequest("m", inputs=[InferTensor("A", "FP32", shape_type(a.shape), a),
                                     InferTensor("B", "INT32", shape_type(b.shape), b)])


def test_repeats_are_accepted_reshaped_and_disagreements_still_refused() -> None:
    plan = InputPlan(CONFIG)
    for _ in range(3):
        inputs, rows = plan.check(_request(3, 3))
        assert rows == 3 and inputs["B"].shape == (3, 1, 2)
    assert len(plan.accepted) == 2
    inputs, rows = plan.check(_request(2, 2, list))
    assert rows == 2 and len(plan.accepted) == 2          # a list shape: checked, not kept
    plan.check(_request(5, 5))
    for shapes in ((3, 5), (5, 3)):                        # both shapes known, not together
        with pytest.raises(InvalidArgument, match="disagree on the batch size") as cached:
            plan.check(_request(*shapes))
        with pytest.raises(InvalidArgument) as fresh:
            InputPlan(CONFIG).check(_request(*shapes))
        assert str(cached.value) == str(fresh.value)


@pytest.mark.parametrize("tensor, words", [
    (InferTensor("A", "FP64", (1, 4), np.zeros((1, 4))), "data-type is 'FP64'"),
    (InferTensor("A", "FP32", (1, 5), np.zeros((1, 5), np.float32)), "unexpected shape"),
    (InferTensor("A", "FP32", (9, 4), np.zeros((9, 4), np.float32)), "batch-size must be <= 8"),
])
def test_a_refused_input_is_refused_every_time(tensor, words) -> None:
    plan = InputPlan(CONFIG)
    b = InferTensor("B", "INT32", (1, 2), np.zeros((1, 2), np.int32))
    for _ in range(2):
        with pytest.raises(InvalidArgument, match=words):
            plan.check(InferRequest("m", inputs=[tensor, b]))
