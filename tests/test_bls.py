"""BLS through the engine (engine/composition/bls.py): a thread-mode model calls other models with its
``server_calls`` (blocking, from its instance thread): one response, a stream from a
decoupled model, statistics counted in the called model, a timeout, the depth limit naming
the chain, and the in-flight bound refusing a call storm at once."""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jupyter_triton.backends.base import Backend
from jupyter_triton.engine.composition.bls import MAX_BLS_DEPTH, MAX_BLS_IN_FLIGHT
from jupyter_triton.protocol.errors import (DeadlineExceeded, Internal, InvalidArgument,
                                            TritonError, Unavailable)
from jupyter_triton.protocol.types import InferRequest, InferTensor
from test_streaming import Repeat, _model as _repeat_model, run

CALLER = """
name: "{name}"
backend: "python"
input [ {{ name: "X", data_type: TYPE_FP32, dims: [ -1 ] }} ]
output [ {{ name: "Y", data_type: TYPE_FP32, dims: [ -1 ] }} ]
parameters {{ key: "mode" value: {{ string_value: "{mode}" }} }}
{extra}
"""

ENSEMBLE = """
name: "ens_linear"
platform: "ensemble"
max_batch_size: 8
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] } ]
ensemble_scheduling { step [ { model_name: "linear" model_version: -1
  input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "OUT" } } ] }
"""

HOLD = threading.Event()      # the 'held' model waits on it (bounded)


class Models(Backend):
    """The models of these tests, by the config's ``mode`` parameter:

    * ``linear``: Y = linear(X) through BLS to the ONNX model 'linear';
    * ``ensemble``: the same through the ensemble 'ens_linear' (one step: 'linear');
    * ``stream``: Y = the values the decoupled 'repeat' streams back for X;
    * ``self``: calls itself with X until the depth limit fails the innermost call;
    * ``storm``: 2 x MAX_BLS_IN_FLIGHT concurrent calls to 'held'; Y = [ok, refused];
    * ``timeout``: calls 'held' with a 0.2 s timeout; Y = [seconds it took];
    * ``held``: waits for HOLD (at most 5 s), Y = X.
    """

    supports_decoupled = True
    errors: list[TritonError] = []

    def load(self) -> None:
        self.mode = self.config.parameters["mode"].string_value

    def execute_decoupled(self, requests, infer_requests, senders) -> None:
        Repeat.execute_decoupled(self, requests, infer_requests, senders)

    def _respond(self, *args) -> None:
        Repeat._respond(self, *args)

    def execute(self, requests, infer_requests=None):
        return [self._one(r["X"]) for r in requests]

    def _one(self, x: np.ndarray):
        calls = self.server_calls
        if self.mode == "held":
            HOLD.wait(5)
            return {"Y": x}
        if self.mode in ("linear", "ensemble"):
            data = np.tile(x.astype(np.float32), 16 // max(1, x.size) + 1)[:16].reshape(1, 16)
            model, name = ("linear", "INPUT0") if self.mode == "linear" else ("ens_linear", "IN")
            response = calls.infer(InferRequest(model, inputs=[InferTensor(name, "FP32", (1, 16), data)]))
            return {"Y": response.outputs[0].data.reshape(-1)}
        if self.mode in ("stream", "stream_slow"):
            ints = x.astype(np.int32)
            params = {"mode": "burst"} if self.mode == "stream_slow" else {}
            responses = []
            for response in calls.infer_stream(InferRequest("repeat", inputs=[
                    InferTensor("IN", "INT32", ints.shape, ints)], parameters=params)):
                responses.append(response)
                if self.mode == "stream_slow" and len(responses) % 10 == 0:
                    time.sleep(0.01)        # a reader slower than the callee
            assert responses[-1].final
            return {"Y": np.array([r.outputs[0].data[0] for r in responses if r.outputs], np.float32)}
        if self.mode == "self":
            try:
                response = calls.infer(InferRequest(self.config.name, inputs=[
                    InferTensor("X", "FP32", x.shape, x + 1)]))
            except TritonError as err:
                Models.errors.append(err)
                return err
            return {"Y": response.outputs[0].data}
        if self.mode == "storm":
            outcomes: list = []

            def call() -> None:
                try:
                    calls.infer(InferRequest("held", inputs=[InferTensor("X", "FP32", (1,), x[:1])]))
                    outcomes.append("ok")
                except Unavailable as err:
                    outcomes.append(err)
            threads = [threading.Thread(target=call) for _ in range(2 * MAX_BLS_IN_FLIGHT)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 5
            while sum(1 for o in outcomes if o != "ok") < MAX_BLS_IN_FLIGHT and time.monotonic() < deadline:
                time.sleep(0.01)
            refused = [o for o in outcomes if o != "ok"]
            Models.errors.extend(refused)
            HOLD.set()
            for t in threads:
                t.join(10)
            return {"Y": np.array([outcomes.count("ok"), len(refused)], np.float32)}
        if self.mode == "timeout":
            start = time.monotonic()
            try:
                calls.infer(InferRequest("held", inputs=[InferTensor("X", "FP32", (1,), x[:1])]),
                            timeout_s=0.2)
            except DeadlineExceeded as err:
                Models.errors.append(err)
            return {"Y": np.array([time.monotonic() - start], np.float32)}
        raise InvalidArgument(f"unknown mode {self.mode}")


@pytest.fixture
def repo(tmp_path, monkeypatch) -> Path:
    import jupyter_triton.engine.lifecycle.control as lifecycle
    import jupyter_triton.engine.model as model
    from conftest import build_repository
    real = model.backend_class
    pick = lambda name: Models if name == "python" else real(name)   # noqa: E731
    monkeypatch.setattr(model, "backend_class", pick)
    monkeypatch.setattr(lifecycle, "backend_class", pick)
    Models.errors, Repeat.batches, Repeat.cancelled_seen = [], [], []
    Repeat.sent, Repeat.send_errors = [], []
    HOLD.clear()
    root = build_repository(tmp_path / "models")
    _repeat_model(root, "repeat")
    for name, mode, extra in [
            ("bls_linear", "linear", ""), ("bls_ensemble", "ensemble", ""),
            ("bls_stream", "stream", ""), ("bls_stream_slow", "stream_slow", ""),
            ("bls_self", "self", f"instance_group [ {{ count: {MAX_BLS_DEPTH + 2} }} ]"),
            ("bls_storm", "storm", ""), ("bls_timeout", "timeout", ""), ("held", "held", "")]:
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text("# served by the test's Models backend\n")
        (root / name / "config.pbtxt").write_text(CALLER.format(name=name, mode=mode, extra=extra))
    (root / "ens_linear" / "1").mkdir(parents=True)
    (root / "ens_linear" / "config.pbtxt").write_text(ENSEMBLE)
    return root


def _call(model: str, *values: float) -> InferRequest:
    data = np.array(values, np.float32)
    return InferRequest(model, inputs=[InferTensor("X", "FP32", data.shape, data)])


def test_a_model_calls_another_and_the_call_counts_in_the_callees_statistics(repo, tmp_path):
    async def main(engine):
        via_bls = [await engine.infer(_call("bls_linear", float(i))) for i in range(3)]
        data = np.full((1, 16), 2.0, np.float32)
        direct = await engine.infer(InferRequest("linear", inputs=[
            InferTensor("INPUT0", "FP32", (1, 16), data)]))
        return via_bls, direct, engine.statistics("linear")["model_stats"][0]

    via_bls, direct, stats = run(main, tmp_path)
    np.testing.assert_allclose(via_bls[2].outputs[0].data, direct.outputs[0].data.reshape(-1))
    assert stats["inference_stats"]["success"]["count"] == 4     # 3 by BLS, 1 direct


def test_a_model_calls_an_ensemble(repo, tmp_path):
    async def main(engine):
        via_ensemble = await engine.infer(_call("bls_ensemble", 2.0))
        via_model = await engine.infer(_call("bls_linear", 2.0))
        return via_ensemble, via_model, engine.statistics("ens_linear")["model_stats"][0]

    via_ensemble, via_model, stats = run(main, tmp_path)
    np.testing.assert_allclose(via_ensemble.outputs[0].data, via_model.outputs[0].data)
    assert stats["inference_stats"]["success"]["count"] == 1


def test_a_model_reads_a_decoupled_models_stream(repo, tmp_path):
    async def main(engine):
        return await engine.infer(_call("bls_stream", 3, 1, 4))

    response = run(main, tmp_path)
    assert response.outputs[0].data.tolist() == [3.0, 1.0, 4.0]


def test_a_bls_stream_read_slowly_holds_back_its_callee_and_loses_nothing(repo, tmp_path, monkeypatch):
    import jupyter_triton.engine.composition.bls as bls
    monkeypatch.setattr(bls, "STREAM_BUFFER", 3)

    async def main(engine):
        engine._version("repeat").max_buffered = 2
        return await engine.infer(_call("bls_stream_slow", *range(100)))

    response = run(main, tmp_path)
    assert response.outputs[0].data.tolist() == [float(v) for v in range(100)]
    assert Repeat.sent == list(range(100)) and not Repeat.send_errors


def test_a_model_calling_itself_stops_at_the_depth_limit_naming_the_chain(repo, tmp_path):
    async def main(engine):
        with pytest.raises(InvalidArgument) as err:
            await engine.infer(_call("bls_self", 0))
        return str(err.value)

    message = run(main, tmp_path)
    assert f"more than the limit of {MAX_BLS_DEPTH}" in message
    assert "bls_self -> bls_self -> bls_self" in message
    assert len(Models.errors) == MAX_BLS_DEPTH + 1       # every level saw the innermost error


def test_a_call_storm_is_refused_at_the_in_flight_bound(repo, tmp_path):
    async def main(engine):
        return await engine.infer(_call("bls_storm", 1))

    response = run(main, tmp_path)
    ok, refused = response.outputs[0].data.tolist()
    assert (ok, refused) == (MAX_BLS_IN_FLIGHT, MAX_BLS_IN_FLIGHT)
    assert all("BLS requests in flight" in str(e) for e in Models.errors)


def test_a_bls_call_past_its_timeout_is_deadline_exceeded(repo, tmp_path):
    async def main(engine):
        response = await engine.infer(_call("bls_timeout", 1))
        HOLD.set()
        return response

    response = run(main, tmp_path)
    assert 0.15 < response.outputs[0].data[0] < 2.0
    assert len(Models.errors) == 1 and "timed out after 0.2 s" in str(Models.errors[0])


def test_bls_from_the_event_loop_is_refused(repo, tmp_path):
    async def main(engine):
        calls = engine._version("bls_linear").pool.instances[0].backend.server_calls
        with pytest.raises(Internal, match="event loop"):
            calls.infer(_call("linear", 1))
        return calls.in_flight

    assert run(main, tmp_path) == 0


def test_bls_after_the_server_loop_closed_is_unavailable(tmp_path):
    from jupyter_triton.engine import Engine, EngineOptions
    from jupyter_triton.engine.composition.bls import ModelCalls
    loop = asyncio.new_event_loop()
    engine = Engine(EngineOptions(model_repository=tmp_path))
    calls = ModelCalls(engine.server_calls, "caller", loop)
    loop.close()
    with pytest.raises(Unavailable, match="shutting down"):
        calls.infer(_call("linear", 1))
    with pytest.raises(Unavailable, match="shutting down"):
        calls.infer_stream(_call("linear", 1))
    assert calls.in_flight == 0
