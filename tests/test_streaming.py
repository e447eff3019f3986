"""Decoupled models through the engine (Engine.infer_stream): zero or many responses per
request, the last one final, errors in-stream, cancellation when the reader goes away,
unload while streaming, dynamic batching, and Triton's response statistics.

The decoupled model is a thread-mode Backend written here: ``Repeat`` answers each request
with one response per element of its input IN (from a thread of its own, after execute has
returned, as Triton's repeat example does), then the final flag alone."""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jupyter_triton.backends.base import Backend
from jupyter_triton.engine import Engine, EngineOptions
from jupyter_triton.protocol.errors import InvalidArgument, TritonError, Unavailable
from jupyter_triton.protocol.types import InferRequest, InferTensor
from server_waits import until

REPEAT = """
name: "{name}"
backend: "python"
max_batch_size: {mbs}
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "IN", data_type: TYPE_INT32, dims: [ -1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] }} ]
{extra}
"""


class Repeat(Backend):
    """IN's elements, one response each, then the final flag. Request parameter ``mode``:
    ``error`` sends an error response between the values; ``raise`` makes execute raise;
    ``until_cancelled`` sends until the request is cancelled (bounded: 10 s); ``hang`` never
    sends the final flag; ``missing`` sends a response without OUT."""

    supports_decoupled = True
    batches: list[int] = []           # requests per execute_decoupled call, in call order
    cancelled_seen: list[bool] = []
    sent: list[int] = []              # mode burst: each send that has returned
    send_errors: list[TritonError] = []

    def load(self) -> None:
        pass

    def execute_decoupled(self, requests, infer_requests, senders) -> None:
        Repeat.batches.append(len(requests))
        modes = [r.parameters.get("mode", "") for r in infer_requests]
        if "raise" in modes:
            raise InvalidArgument("repeat: asked to raise")
        for inputs, mode, sender in zip(requests, modes, senders):
            threading.Thread(target=self._respond, args=(inputs["IN"], mode, sender),
                             daemon=True).start()

    def _respond(self, values: np.ndarray, mode: str, sender) -> None:
        if mode == "until_cancelled":
            deadline = time.monotonic() + 10
            while not sender.is_cancelled() and time.monotonic() < deadline:
                sender.send({"OUT": np.array([[7]] if self.config.max_batch_size else [7], np.int32)})
                time.sleep(0.005)
            Repeat.cancelled_seen.append(sender.is_cancelled())
            sender.send(final=True)
            return
        if mode == "burst":
            try:
                for i, v in enumerate(values.reshape(-1)):
                    sender.send({"OUT": np.full((1,), v, np.int32)})
                    Repeat.sent.append(i)
                sender.send(final=True)
            except TritonError as err:
                Repeat.send_errors.append(err)
            return
        if mode == "missing":
            sender.send({"OTHER": np.array([1], np.int32)}, final=True)
            return
        for i, v in enumerate(values.reshape(-1)):
            if mode == "error" and i == 1:
                sender.send(error=InvalidArgument("repeat: an error in the middle"))
            shape = (1, 1) if self.config.max_batch_size else (1,)
            sender.send({"OUT": np.full(shape, v, np.int32)})
        if mode != "hang":
            sender.send(final=True)


def _model(root: Path, name: str, mbs: int = 0, extra: str = "") -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text("# served by the test's Repeat backend\n")
    (root / name / "config.pbtxt").write_text(REPEAT.format(name=name, mbs=mbs, extra=extra))


@pytest.fixture
def repeat_backend(monkeypatch):
    import jupyter_triton.engine.lifecycle.control as lifecycle
    import jupyter_triton.engine.model as model
    real = model.backend_class
    pick = lambda name: Repeat if name == "python" else real(name)   # noqa: E731
    monkeypatch.setattr(model, "backend_class", pick)
    monkeypatch.setattr(lifecycle, "backend_class", pick)
    Repeat.batches, Repeat.cancelled_seen, Repeat.sent, Repeat.send_errors = [], [], [], []
    return Repeat


def _request(model: str, values: list[int], batched: bool = False, **params) -> InferRequest:
    data = np.array([values] if batched else values, np.int32)
    return InferRequest(model, inputs=[InferTensor("IN", "INT32", data.shape, data)],
                        parameters=dict(params))


def run(main, tmp_path: Path, **options):
    """``main(engine)`` with an engine serving the repository under tmp_path, bounded."""
    async def wrapper():
        engine = Engine(EngineOptions(model_repository=tmp_path / "models",
                                      model_control_mode="explicit", load_models=["*"], **options))
        await engine.start()
        try:
            return await asyncio.wait_for(main(engine), 20)
        finally:
            await engine.stop()
    return asyncio.run(wrapper())


async def _collect(engine: Engine, request: InferRequest) -> list:
    return [r async for r in engine.infer_stream(request)]


async def _stats(engine: Engine, model: str, executions: int) -> dict:
    """The model's statistics once ``executions`` executes have returned and their requests'
    outcomes are recorded (a model may send its final response before its execute returns;
    the execution and the request's success are counted at return)."""
    deadline = time.monotonic() + 5
    while True:
        stats = engine.statistics(model)["model_stats"][0]
        outcomes = sum(stats["inference_stats"][k]["count"] for k in ("success", "fail"))
        if (stats["execution_count"] >= executions and outcomes >= executions) \
                or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.01)


def test_a_decoupled_model_streams_each_response_then_an_empty_final(tmp_path, repeat_backend):
    _model(tmp_path / "models", "repeat")

    async def main(engine):
        assert engine.is_decoupled("repeat") and engine.is_decoupled("repeat", "1")
        responses = await _collect(engine, _request("repeat", [4, 5, 6]))
        values = [r.outputs[0].data.tolist() for r in responses if r.outputs]
        assert values == [[4], [5], [6]]
        assert [r.final for r in responses] == [False, False, False, True]
        assert responses[-1].outputs == [] and responses[-1].error is None
        assert all(r.model_name == "repeat" and r.model_version == "1" for r in responses)
        return await _stats(engine, "repeat", 1)

    stats = run(main, tmp_path)
    assert stats["inference_stats"]["success"]["count"] == 1
    assert stats["execution_count"] == 1 and stats["inference_count"] == 1
    rs = stats["response_stats"]
    assert sorted(rs) == ["0", "1", "2", "3"]
    for key in "012":
        assert rs[key]["success"]["count"] == 1 and rs[key]["compute_infer"]["count"] == 1
        assert rs[key]["empty_response"]["count"] == 0
    assert rs["3"]["empty_response"]["count"] == 1 and rs["3"]["success"]["count"] == 0


def test_infer_on_a_decoupled_model_is_refused_with_tritons_words(tmp_path, repeat_backend):
    _model(tmp_path / "models", "repeat")

    async def main(engine):
        with pytest.raises(InvalidArgument) as err:
            await engine.infer(_request("repeat", [1]))
        return str(err.value)

    assert "doesn't support models with decoupled transaction policy" in run(main, tmp_path)


def test_a_non_decoupled_model_through_the_stream_gives_its_one_response(tmp_path):
    from conftest import build_repository
    build_repository(tmp_path / "models")

    async def main(engine):
        data = np.ones((1, 16), np.float32)
        request = InferRequest("linear", inputs=[InferTensor("INPUT0", "FP32", (1, 16), data)])
        assert not engine.is_decoupled("linear")
        responses = await _collect(engine, request)
        direct = await engine.infer(request)
        return responses, direct

    responses, direct = run(main, tmp_path)
    assert len(responses) == 1 and responses[0].final
    np.testing.assert_allclose(responses[0].outputs[0].data, direct.outputs[0].data)


def test_refusals_raise_on_the_first_next(tmp_path, repeat_backend):
    _model(tmp_path / "models", "repeat")

    async def main(engine):
        stream = engine.infer_stream(InferRequest("repeat", inputs=[
            InferTensor("IN", "FP32", (1,), np.ones(1, np.float32))]))
        with pytest.raises(InvalidArgument, match="data-type is 'FP32'"):
            await stream.__anext__()
        with pytest.raises(TritonError, match="unknown model"):
            await engine.infer_stream(_request("nope", [1])).__anext__()
        return engine.statistics("repeat")["model_stats"][0]["inference_stats"]["fail"]["count"]

    assert run(main, tmp_path) == 1


def test_error_responses_come_in_stream_and_the_stream_goes_on(tmp_path, repeat_backend):
    _model(tmp_path / "models", "repeat")

    async def main(engine):
        responses = await _collect(engine, _request("repeat", [1, 2, 3], mode="error"))
        missing = await _collect(engine, _request("repeat", [1], mode="missing"))
        raised = await _collect(engine, _request("repeat", [1], mode="raise"))
        return responses, missing, raised, await _stats(engine, "repeat", 2)

    responses, missing, raised, stats = run(main, tmp_path)
    assert [r.outputs[0].data.tolist() if r.outputs else None for r in responses] == \
        [[1], None, [2], [3], None]
    assert isinstance(responses[1].error, InvalidArgument) and not responses[1].final
    assert "an error in the middle" in str(responses[1].error)
    assert responses[-1].final and responses[-1].error is None
    # a response the model built wrongly fails that response, named, and ends the stream
    assert len(missing) == 1 and missing[0].final and "did not produce output 'OUT'" in str(missing[0].error)
    # execute raising ends the request with its error
    assert len(raised) == 1 and raised[0].final and "asked to raise" in str(raised[0].error)
    assert stats["response_stats"]["1"]["fail"]["count"] == 1
    # Triton counts a decoupled request by how its execute ended, not by its responses
    assert stats["inference_stats"]["success"]["count"] == 2
    assert stats["inference_stats"]["fail"]["count"] == 1


def test_closing_the_iterator_cancels_the_request(tmp_path, repeat_backend):
    _model(tmp_path / "models", "repeat")

    async def main(engine):
        stream = engine.infer_stream(_request("repeat", [0], mode="until_cancelled"))
        first = await stream.__anext__()
        await stream.aclose()
        deadline = time.monotonic() + 5
        while not Repeat.cancelled_seen and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        # a task that iterates, cancelled, cancels the request too
        async def read():
            async for _ in engine.infer_stream(_request("repeat", [0], mode="until_cancelled")):
                pass
        task = asyncio.ensure_future(read())
        while len(Repeat.batches) < 2 and time.monotonic() < deadline:     # its execute began
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while len(Repeat.cancelled_seen) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        mv = engine._version("repeat")
        return first, mv, engine.statistics("repeat")["model_stats"][0]

    first, mv, stats = run(main, tmp_path)
    assert first.outputs[0].data.tolist() == [7] and not first.final
    assert Repeat.cancelled_seen == [True, True]
    assert mv._inflight == 0 and not mv._streams
    # counted once each: CANCELED if the reader left before execute returned, else success
    inference = stats["inference_stats"]
    assert inference["fail"]["count"] + inference["success"]["count"] == 2


def test_unload_ends_a_stream_the_model_never_finishes(tmp_path, repeat_backend):
    _model(tmp_path / "models", "repeat")

    async def main(engine):
        stream = engine.infer_stream(_request("repeat", [1, 2], mode="hang"))
        got = [await stream.__anext__(), await stream.__anext__()]
        unload = asyncio.ensure_future(engine.unload_model("repeat"))
        rest = [r async for r in stream]
        await unload
        return got, rest

    got, rest = run(main, tmp_path, unload_timeout_secs=0.3)
    assert [r.outputs[0].data.tolist() for r in got] == [[1], [2]]
    assert len(rest) == 1 and rest[0].final and isinstance(rest[0].error, Unavailable)
    # ended by the 0.3 s asked, as the server says (not the 30 s default: run() bounds it)
    assert "unloaded" in str(rest[0].error) and "past 0.3 s" in str(rest[0].error), rest[0].error


def test_decoupled_requests_are_batched_by_the_dynamic_batcher(tmp_path, repeat_backend):
    _model(tmp_path / "models", "repeat_batched", mbs=4,
           extra="dynamic_batching { max_queue_delay_microseconds: 200000 }")

    async def main(engine):
        requests = [_request("repeat_batched", [i, i], batched=True) for i in range(4)]
        results = await asyncio.gather(*(_collect(engine, r) for r in requests))
        return results, await _stats(engine, "repeat_batched", 1)

    results, stats = run(main, tmp_path)
    for i, responses in enumerate(results):
        assert [r.outputs[0].data.tolist() for r in responses if r.outputs] == [[[i]], [[i]]]
        assert responses[-1].final
    assert Repeat.batches == [4]
    assert stats["execution_count"] == 1 and stats["inference_count"] == 4
    assert stats["batch_stats"][0]["batch_size"] == 4


def test_first_response_histogram_counts_each_decoupled_request(tmp_path, repeat_backend):
    _model(tmp_path / "models", "repeat")

    async def main(engine):
        waited_ms = []                  # each request's whole stream, as its caller saw it
        for _ in range(3):
            start = time.monotonic()
            await _collect(engine, _request("repeat", [1, 2]))
            waited_ms.append((time.monotonic() - start) * 1000)
        return engine._version("repeat").stats.first_response_histogram(), waited_ms

    (buckets, total_ms, count), waited_ms = run(main, tmp_path)
    assert count == 3 and buckets[-1] == (float("inf"), 3)
    # a first response comes within its request's stream: in milliseconds, each in a bucket
    # at least as low as its caller's wait (a busy machine only moves both up)
    assert 0 < total_ms <= sum(waited_ms), (total_ms, waited_ms)
    for le, n in buckets:
        assert n >= sum(w <= le for w in waited_ms), (buckets, waited_ms)


def test_first_response_histogram_on_the_metrics_endpoint_when_enabled(tmp_path, repeat_backend):
    from conftest import build_repository
    from jupyter_triton.frontends.metrics import exposition, metrics_registry
    build_repository(tmp_path / "models")
    _model(tmp_path / "models", "repeat")

    async def main(engine):
        registry = metrics_registry(engine, cpu=False, gpu=False)
        off = exposition(registry)[0].decode()
        engine.options.histogram_latencies = True      # Triton: --metrics-config histogram_latencies=true
        for _ in range(2):
            await _collect(engine, _request("repeat", [1]))
        data = np.ones((1, 16), np.float32)
        await engine.infer(InferRequest("linear", inputs=[InferTensor("INPUT0", "FP32", (1, 16), data)]))
        return off, exposition(registry)[0].decode()

    off, on = run(main, tmp_path)
    name = "nv_inference_first_response_histogram_ms"
    assert name not in off
    assert f"# TYPE {name} histogram" in on
    assert f'{name}_count{{model="repeat",version="1"}} 2' in on
    assert f'{name}_bucket{{model="repeat",version="1",le="100"}} 2' in on
    assert f'{name}_bucket{{model="repeat",version="1",le="+Inf"}} 2' in on
    assert 'model="linear"' in on and f'{name}_count{{model="linear"' not in on   # decoupled only


def test_a_fast_model_waits_for_a_slow_reader_past_max_buffered_responses(tmp_path, repeat_backend):
    _model(tmp_path / "models", "repeat",
           extra='parameters { key: "max_buffered_responses" value: { string_value: "4" } }')

    async def main(engine):
        stream = engine.infer_stream(_request("repeat", list(range(40)), mode="burst"))
        first = await stream.__anext__()
        await until(lambda: len(Repeat.sent) >= 1 + 4, "the model filled the stream's buffer")
        await asyncio.sleep(0.3)        # room for a send past the bound: there is none
        ahead = len(Repeat.sent)
        rest = [r async for r in stream]
        return first, ahead, rest

    first, ahead, rest = run(main, tmp_path)
    assert ahead == 1 + 4               # the one read and the four buffered, no more
    values = [first.outputs[0].data[0]] + [r.outputs[0].data[0] for r in rest if r.outputs]
    assert values == list(range(40)) and rest[-1].final and rest[-1].error is None


def test_a_reader_that_stalls_past_the_wait_ends_the_request(tmp_path, repeat_backend, monkeypatch):
    import jupyter_triton.engine.composition.streaming as streaming
    monkeypatch.setattr(streaming, "SEND_WAIT_SECONDS", 0.2)
    _model(tmp_path / "models", "repeat",
           extra='parameters { key: "max_buffered_responses" value: { string_value: "2" } }')

    async def main(engine):
        stream = engine.infer_stream(_request("repeat", list(range(10)), mode="burst"))
        await stream.__anext__()
        # the reader stalls until the model's send has waited out SEND_WAIT_SECONDS
        await until(lambda: Repeat.send_errors, "the model's send refused", seconds=10)
        return [r async for r in stream], await _stats(engine, "repeat", 1)

    rest, stats = run(main, tmp_path)
    assert [r.outputs[0].data[0] for r in rest if r.outputs] == [1, 2]
    assert rest[-1].final and isinstance(rest[-1].error, Unavailable)
    assert "did not read the stream's responses" in str(rest[-1].error)
    # the model learns it too: its next send is refused as after a final response
    assert len(Repeat.send_errors) == 1 and "has been closed" in str(Repeat.send_errors[0])
    assert stats["response_stats"]["3"]["fail"]["count"] == 1


@pytest.mark.parametrize("key", ["max_buffered_responses", "max_open_streams"])
def test_stream_bounds_must_be_positive(tmp_path, repeat_backend, key):
    _model(tmp_path / "models", "repeat",
           extra=f'parameters {{ key: "{key}" value: {{ string_value: "0" }} }}')

    async def main(engine):
        return engine.repository_index()

    rows = run(main, tmp_path)
    assert f"'{key}' must be 1 or more" in rows[0]["reason"]


def test_open_streams_past_max_open_streams_are_refused_at_once(tmp_path, repeat_backend):
    _model(tmp_path / "models", "repeat",
           extra='parameters { key: "max_open_streams" value: { string_value: "2" } }')

    async def main(engine):
        # two streams the model never finishes: open after their execute returned
        held = [engine.infer_stream(_request("repeat", [1], mode="hang")) for _ in range(2)]
        for stream in held:
            await stream.__anext__()
        with pytest.raises(Unavailable) as refused:
            await engine.infer_stream(_request("repeat", [1])).__anext__()
        for stream in held:
            await stream.aclose()
        again = await _collect(engine, _request("repeat", [5]))
        return str(refused.value), again, engine._version("repeat").stats.failure_counts()

    message, again, failures = run(main, tmp_path)
    assert "Exceeds maximum open streams" in message and "max_open_streams 2" in message
    assert [r.outputs[0].data.tolist() for r in again if r.outputs] == [[5]]
    assert failures["REJECTED"] == 1


def test_tritonclient_grpc_stream_and_response_stats_through_a_real_server(tmp_path, repeat_backend):
    """The user's story: a standalone server, tritonclient's gRPC stream with the empty
    final response asked for, then the statistics over gRPC and HTTP."""
    import queue

    import requests as http
    import tritonclient.grpc as grpcclient
    from jupyter_triton.standalone import start_in_thread

    _model(tmp_path / "models", "repeat")
    server = start_in_thread(EngineOptions(model_repository=tmp_path / "models",
                                           model_control_mode="explicit", load_models=["*"]),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    results: queue.Queue = queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        inp = grpcclient.InferInput("IN", [3], "INT32")
        inp.set_data_from_numpy(np.array([8, 9, 10], np.int32))
        client.async_stream_infer("repeat", [inp], request_id="r1", enable_empty_final_response=True)
        got = []
        while len(got) < 4:
            result, error = results.get(timeout=10)
            assert error is None, error
            got.append(result)
        client.stop_stream()
        values = [r.as_numpy("OUT").tolist() for r in got[:3]]
        finals = [r.get_response().parameters["triton_final_response"].bool_param for r in got]
        assert values == [[8], [9], [10]] and finals == [False, False, False, True]
        assert all(r.get_response().id == "r1" for r in got)
        deadline = time.monotonic() + 5
        while True:
            grpc_stats = client.get_inference_statistics("repeat", as_json=True)["model_stats"][0]
            if int(grpc_stats.get("execution_count", 0)) == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        http_stats = http.get(f"http://127.0.0.1:{server.http_port}/v2/models/repeat/stats",
                              timeout=10).json()["model_stats"][0]
    finally:
        client.close()
        server.close()
    for stats in (grpc_stats, http_stats):
        rs = stats["response_stats"]
        assert sorted(rs) == ["0", "1", "2", "3"]
        assert int(rs["0"]["success"]["count"]) == 1
        assert int(rs["3"]["empty_response"]["count"]) == 1
        assert int(stats["inference_stats"]["success"]["count"]) == 1


def test_many_streams_some_left_early_leave_nothing_behind(tmp_path, repeat_backend):
    """50 concurrent streams through the dynamic batcher, every third closed after its first
    response: each ends, is counted once, and nothing stays pending or open."""
    _model(tmp_path / "models", "repeat_batched", mbs=4,
           extra="dynamic_batching { max_queue_delay_microseconds: 1000 }")

    async def one(i: int) -> list[int]:
        stream = engine_ref[0].infer_stream(_request("repeat_batched", list(range(5)), batched=True))
        got = []
        async for response in stream:
            if response.outputs:
                got.append(int(response.outputs[0].data.reshape(-1)[0]))
            if i % 3 == 0 and got:
                await stream.aclose()
                break
        return got

    engine_ref: list = []

    async def main(engine):
        engine_ref.append(engine)
        results = await asyncio.gather(*(one(i) for i in range(50)))
        mv = engine._version("repeat_batched")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            stats = engine.statistics("repeat_batched")["model_stats"][0]["inference_stats"]
            if stats["success"]["count"] + stats["fail"]["count"] == 50:
                break
            await asyncio.sleep(0.01)
        return results, mv, stats

    results, mv, stats = run(main, tmp_path)
    for i, got in enumerate(results):
        assert got == ([0] if i % 3 == 0 else [0, 1, 2, 3, 4])
    assert stats["success"]["count"] + stats["fail"]["count"] == 50
    assert mv._inflight == 0 and not mv._streams and mv.stats.pending == 0


def test_a_python_worker_dying_mid_stream_ends_the_stream_with_its_error(tmp_path):
    """The python backend (worker process) closes the open senders of a worker that dies;
    through the engine the stream ends with that error, counted, and the next request is
    served by a new worker."""
    from test_backend_python import write_model
    from test_python_decoupled import REPEAT_CONFIG, REPEAT_MODEL_PY
    write_model(tmp_path / "models", "repeat", REPEAT_MODEL_PY, REPEAT_CONFIG)

    def cmd(word: str, values: list[int]) -> InferRequest:
        data = np.array(values, np.int32)
        return InferRequest("repeat", inputs=[
            InferTensor("CMD", "BYTES", (1,), np.array([word.encode()], dtype=np.object_)),
            InferTensor("IN", "INT32", data.shape, data)])

    async def recovered(engine) -> list:
        for _ in range(3):           # a death may be noticed by the next batch at worst
            again = await _collect(engine, cmd("go", [2, 3]))
            if again[-1].error is None:
                break
        return again

    async def main(engine):
        died = await _collect(engine, cmd("die_later", [8]))
        first_again = await recovered(engine)
        killed = await _collect(engine, cmd("kill", [1]))
        again = await recovered(engine)
        return died, first_again, killed, again, await _stats(engine, "repeat", 3)

    died, first_again, killed, again, stats = run(main, tmp_path)
    # the model's first response carries OUT alone (no IDX): it comes as it was sent
    assert [t.name for t in died[0].outputs] == ["OUT"] and not died[0].final
    assert died[0].outputs[0].data.tolist() == [8]
    assert died[-1].final and isinstance(died[-1].error, Unavailable)
    assert "exit code 4" in str(died[-1].error)
    assert len(killed) == 1 and killed[0].final and "exit code 3" in str(killed[0].error)
    for responses in (first_again, again):
        assert [r.outputs[0].data.tolist() for r in responses if r.outputs] == [[2], [3]]
    assert stats["inference_stats"]["fail"]["count"] >= 1
