"""BLS from python models (Triton's ``pb_utils.InferenceRequest(...).exec()``) through the
engine's server calls, in the worker process and in thread mode: the call reaches an ONNX
model and counts in its statistics, and a model calling itself stops at the depth limit
with the error naming the chain."""
from __future__ import annotations

import asyncio
import textwrap

import numpy as np
import pytest

from jupyter_triton.engine import Engine, EngineOptions
from jupyter_triton.protocol.types import InferRequest, InferTensor

pytestmark = pytest.mark.timeout(120)

MODEL_PY = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.name = json.loads(args["model_config"])["name"]

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if self.name.startswith("py_self"):
                call = pb_utils.InferenceRequest(model_name=self.name, requested_output_names=["Y"],
                                                 inputs=[pb_utils.Tensor("X", x + 1)])
                name = "Y"
            else:
                data = np.tile(x, 16)[:16].reshape(1, 16).astype(np.float32)
                call = pb_utils.InferenceRequest(model_name="linear", requested_output_names=["OUTPUT0"],
                                                 inputs=[pb_utils.Tensor("INPUT0", data)])
                name = "OUTPUT0"
            answer = call.exec()
            if answer.has_error():
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(answer.error().message())))
                continue
            y = pb_utils.get_output_tensor_by_name(answer, name).as_numpy().reshape(-1)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y.astype(np.float32))]))
        return responses
'''

CONFIG = """
name: "{name}"
backend: "python"
input [ {{ name: "X", data_type: TYPE_FP32, dims: [ -1 ] }} ]
output [ {{ name: "Y", data_type: TYPE_FP32, dims: [ -1 ] }} ]
instance_group [ {{ count: {count}, kind: KIND_CPU }} ]
{extra}
"""

THREAD = 'parameters { key: "EXECUTION_MODE" value: { string_value: "thread" } }'


def _write(root, name: str, count: int = 1, extra: str = "") -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text(textwrap.dedent(MODEL_PY))
    (root / name / "config.pbtxt").write_text(CONFIG.format(name=name, count=count, extra=extra))


def _call(model: str, value: float) -> InferRequest:
    data = np.array([value], np.float32)
    return InferRequest(model, inputs=[InferTensor("X", "FP32", (1,), data)])


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_python_bls_reaches_a_model_and_stops_at_the_depth_limit(tmp_path, mode):
    from conftest import build_repository
    root = build_repository(tmp_path / "models")
    extra = THREAD if mode == "thread" else ""
    _write(root, "py_bls", extra=extra)
    # depth limit 2 (set below): the third nested call fails; three instances hold the chain
    _write(root, "py_self", count=3, extra=extra)

    async def main():
        engine = Engine(EngineOptions(model_repository=root, model_control_mode="explicit",
                                      load_models=["linear", "py_bls", "py_self"]))
        engine.server_calls.max_depth = 2
        await engine.start()
        try:
            via_bls = await engine.infer(_call("py_bls", 2.0))
            data = np.full((1, 16), 2.0, np.float32)
            direct = await engine.infer(InferRequest("linear", inputs=[
                InferTensor("INPUT0", "FP32", (1, 16), data)]))
            stats = engine.statistics("linear")["model_stats"][0]
            with pytest.raises(Exception) as err:
                await engine.infer(_call("py_self", 0.0))
            return via_bls, direct, stats, str(err.value)
        finally:
            await engine.stop()

    via_bls, direct, stats, message = asyncio.run(asyncio.wait_for(main(), 90))
    np.testing.assert_allclose(via_bls.outputs[0].data, direct.outputs[0].data.reshape(-1), rtol=1e-6)
    assert stats["inference_stats"]["success"]["count"] == 2
    assert "more than the limit of 2" in message and "py_self" in message
