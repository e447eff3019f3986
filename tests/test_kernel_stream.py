"""Streaming and stateful callables served from a notebook: a generator is a decoupled model
(``%%serve talker --decoupled``, inferred for generators), streamed over generate_stream with
raw HTTP, the handle's ``stream()``, the openai client and tritonclient's gRPC stream; a
``sequence=True`` callable keeps a state per correlation id."""
from __future__ import annotations

import asyncio
import json
import queue
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import INFER_KEY
from jupyter_triton.kernel.artifacts import ArtifactError, build_artifact
from test_kernel import AUTH, in_thread, server_kernel  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(240)

TALKER_CELL = """%%serve talker --decoupled
def talk(prompt: str):              # a generator: each yield is one response
    for word in prompt.split():
        yield word
talk"""

BRITTLE_CELL = """%%serve brittle
def brittle(prompt: str, limit: int = 1):
    for i, word in enumerate(prompt.split()):
        if i >= limit:
            raise ValueError(f"only {limit} word(s) allowed")
        yield word.upper()
brittle"""


@pytest.fixture
def jp_server_config(jp_server_config):
    """The Jupyter server of conftest, with its gRPC port open (a free one)."""
    jp_server_config["JupyterTriton"]["grpc_port"] = 0
    return jp_server_config


def generate_stream(url: str, body: dict, headers: dict) -> tuple[int, str, list[dict]]:
    """What ``curl -N .../generate_stream -d ...`` shows: the status, content type, events."""
    req = urllib.request.Request(url + "/generate_stream", data=json.dumps(body).encode(),
                                 method="POST", headers={**headers, "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        text = resp.read().decode()
        return resp.status, resp.headers["Content-Type"], [
            json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


async def test_a_generator_from_the_notebook_streams_over_generate_stream_and_openai(server_kernel):
    _, kernel = await server_kernel()
    await in_thread(kernel.ok, "%load_ext jupyter_triton")
    cell = await in_thread(kernel.ok, TALKER_CELL)
    url = cell.url("talker")
    assert "input    text_input BYTES [1]" in cell.text and "output   text_output BYTES [1]" in cell.text
    assert "decoupled" in cell.text
    # what the handle shows to call it from elsewhere: HTTP infer refuses a decoupled model
    assert f"curl -s -N" in cell.text and f"{url}/generate_stream" in cell.text
    assert "openai:" in cell.text and "client.chat.completions.create(model=\"talker\"" in cell.text

    status, kind, events = await in_thread(generate_stream, url, {"text_input": "a b c"}, AUTH)
    assert status == 200 and kind.startswith("text/event-stream")
    assert [e["text_output"] for e in events] == ["a", "b", "c"]
    assert {e["model_name"] for e in events} == {"talker"}

    # the handle, in the notebook
    shown = await in_thread(kernel.ok, "talker = _\nprint(list(talker.stream('one two three')))")
    assert shown.stdout.strip() == "['one', 'two', 'three']"
    # over the Jupyter server's gRPC port, which the kernel finds in the server's runtime file
    shown = await in_thread(kernel.ok, "print(list(talker.stream('by grpc', via='grpc')))")
    assert shown.stdout.strip() == "['by', 'grpc']"

    # the official openai client, an inference key as its api_key
    from openai import OpenAI
    parts = urlsplit(url)
    base = f"{parts.scheme}://{parts.netloc}{parts.path.split('/v2/models/')[0]}/v1"

    def chat() -> list[str]:
        client = OpenAI(base_url=base, api_key=INFER_KEY, timeout=60)
        stream = client.chat.completions.create(
            model="talker", messages=[{"role": "user", "content": "hello streaming world"}],
            stream=True)
        return [c.choices[0].delta.content or "" for c in stream if c.choices]

    text = "".join(await in_thread(chat))
    assert "hello" in text and "streaming" in text and "world" in text

    # an exception mid-stream: the responses before it, then an error event; parameters
    # that name a keyword of the function reach it
    cell = await in_thread(kernel.ok, BRITTLE_CELL)
    _, _, events = await in_thread(generate_stream, cell.url("brittle"),
                                   {"text_input": "x y z", "limit": 2}, AUTH)
    assert [e.get("text_output") for e in events[:2]] == ["X", "Y"]
    assert "ValueError: only 2 word(s) allowed" in events[2]["error"]


# ---- through a standalone server: what the kernel uploads, read back by tritonclient --------

def _upload(http_port: int, fn, name: str, instances: int = 1, **options) -> None:
    """The kernel's load request, as tritonclient makes it."""
    art = build_artifact(fn, name, **options)
    if instances > 1:
        art.config.instance_group.add(count=instances)
    client = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
    client.load_model(name, config=art.config_json(), files={f"file:{k}": v for k, v in art.files.items()})
    assert client.is_model_ready(name)


def repeat(x):
    for i in range(3):
        yield x * i


async def shout_words(prompt: str):
    for word in prompt.split():
        await asyncio.sleep(0)
        yield word.upper()


def counter(x, state):
    state["total"] = state.get("total", 0) + x
    return state["total"]


def slow_words(prompt: str, log: str = ""):
    try:
        for i in range(200):
            time.sleep(0.05)
            yield f"w{i}"
    finally:
        if log:                             # (the artifact's probe call passes none)
            Path(log).write_text("closed")  # the generator was closed: the request is over


@pytest.fixture
def grpc_server(tmp_path: Path):
    from jupyter_triton.engine import EngineOptions
    from jupyter_triton.standalone import start_in_thread
    (tmp_path / "models").mkdir()
    server = start_in_thread(EngineOptions(model_repository=tmp_path / "models",
                                           model_control_mode="explicit"),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0)
    yield server
    server.close()


def _stream_results(client: grpcclient.InferenceServerClient):
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    return results


def test_grpc_stream_gets_every_yield_and_the_final_flag(grpc_server):
    _upload(grpc_server.http_port, repeat, "repeat", example=np.ones(3, np.int32))
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_server.grpc_port}")
    results = _stream_results(client)
    try:
        tensor = grpcclient.InferInput("x", [3], "INT32")
        tensor.set_data_from_numpy(np.array([1, 2, 3], np.int32))
        client.async_stream_infer("repeat", [tensor], request_id="r7", enable_empty_final_response=True)
        got = []
        for _ in range(4):
            result, error = results.get(timeout=30)
            assert error is None, error
            response = result.get_response()
            assert response.id == "r7"
            got.append((result.as_numpy("OUTPUT__0").tolist() if response.outputs else None,
                        response.parameters["triton_final_response"].bool_param))
        assert got == [([0, 0, 0], False), ([1, 2, 3], False), ([2, 4, 6], False), (None, True)]
    finally:
        client.stop_stream()
        client.close()


def test_a_sequence_callable_keeps_one_state_per_correlation_id(grpc_server):
    # one sequence slot per instance (max_batch_size 0): two instances for two live sequences
    _upload(grpc_server.http_port, counter, "counter", example=np.ones(1, np.int32), sequence=True,
            instances=2)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_server.grpc_port}")
    results = _stream_results(client)
    try:
        # two sequences interleaved, the second starting again after its end
        steps = [(1, 1, True, False), (2, 100, True, False), (1, 2, False, False),
                 (2, 100, False, True), (1, 3, False, True), (2, 5, True, True)]
        totals = []
        for sequence_id, value, start, end in steps:
            tensor = grpcclient.InferInput("x", [1], "INT32")
            tensor.set_data_from_numpy(np.array([value], np.int32))
            client.async_stream_infer("counter", [tensor], sequence_id=sequence_id,
                                      sequence_start=start, sequence_end=end)
            result, error = results.get(timeout=30)
            assert error is None, (error.message(), error.status())
            totals.append(int(result.as_numpy("OUTPUT__0")[0]))
        assert totals == [1, 100, 3, 200, 6, 5]
    finally:
        client.stop_stream()
        client.close()
    # HTTP takes the same sequence parameters
    http = httpclient.InferenceServerClient(f"127.0.0.1:{grpc_server.http_port}")
    totals = []
    for value, start, end in [(4, True, False), (6, False, True)]:
        tensor = httpclient.InferInput("x", [1], "INT32")
        tensor.set_data_from_numpy(np.array([value], np.int32))
        totals.append(int(http.infer("counter", [tensor], sequence_id=9, sequence_start=start,
                                     sequence_end=end).as_numpy("OUTPUT__0")[0]))
    assert totals == [4, 10]
    # the notebook handle: one object per sequence
    from jupyter_triton.kernel import Connection, ServedModel
    handle = ServedModel.from_server("counter", Connection(grpc_server.url + "/", mode="standalone"))
    a, b = handle.sequence(5), handle.sequence("user-b")
    one = np.array([1], np.int32)
    assert [int(a.infer(one, start=True)[0]), int(b.infer(one * 7, start=True)[0]),
            int(a.infer(one * 2)[0]), int(b.infer(one, end=True)[0]), int(a.infer(one, end=True)[0])] == [1, 7, 3, 8, 4]
    # the calls the handle shows run as shown: a one-request sequence each
    shown = repr(handle)
    curl = shown.split("curl:\n")[1].split("tritonclient:")[0].replace("\\\n", " ")
    assert "sequence_start" in curl
    done = subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=30)
    assert json.loads(done.stdout)["outputs"][0]["data"] == [0], done.stdout + done.stderr
    snippet = "\n".join(line[2:] for line in shown.split("tritonclient:\n")[1].splitlines())
    assert "sequence_id=1, sequence_start=True, sequence_end=True" in snippet
    done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[0]", done.stdout + done.stderr


def test_a_text_function_is_called_with_a_string(grpc_server):
    _upload(grpc_server.http_port, lambda prompt: prompt.upper(), "shout", example="hi")
    from jupyter_triton.kernel import Connection, ServedModel
    handle = ServedModel.from_server("shout", Connection(grpc_server.url + "/", mode="standalone"))
    assert handle.infer("hey you") == "HEY YOU" and handle.generate("ok") == "OK"


def test_an_async_generator_streams_too(grpc_server):
    _upload(grpc_server.http_port, shout_words, "shout_words")
    status, _, events = generate_stream(f"{grpc_server.url}/v2/models/shout_words", {"text_input": "x y z"}, {})
    assert status == 200 and [e["text_output"] for e in events] == ["X", "Y", "Z"]


def test_a_client_that_leaves_mid_stream_ends_the_generator(grpc_server, tmp_path: Path):
    _upload(grpc_server.http_port, slow_words, "slow_words")
    log = tmp_path / "closed.txt"
    req = urllib.request.Request(
        f"http://127.0.0.1:{grpc_server.http_port}/v2/models/slow_words/generate_stream",
        data=json.dumps({"text_input": "go", "log": str(log)}).encode(), method="POST",
        headers={"Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=30)
    events = 0
    for line in resp:
        if line.startswith(b"data:"):
            events += 1
            if events == 2:
                break
    resp.close()                   # the client goes away after two of 200 responses
    deadline = time.monotonic() + 20
    while not log.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert log.exists(), "the generator kept running after its client left"


def test_what_cannot_stream_is_refused_with_what_to_pass():
    with pytest.raises(ArtifactError, match="parameter named 'state'"):
        build_artifact(lambda x: x, "nostate", example=np.ones(1), sequence=True)
    with pytest.raises(ArtifactError, match="takes a string but gave a int"):
        build_artifact(lambda prompt: 3, "notext", example="hello")
    with pytest.raises(ArtifactError, match="yielded nothing"):
        build_artifact(lambda x: (v for v in []), "empty", example=np.ones(1), decoupled=True)
    art = build_artifact(repeat, "repeat", example=np.ones(3, np.int32))
    assert art.config.model_transaction_policy.decoupled
    assert [t.name for t in art.config.output] == ["OUTPUT__0"]
    art = build_artifact(lambda prompt: prompt[::-1], "rev", example="abc")
    assert not art.config.model_transaction_policy.decoupled
    assert [t.name for t in art.config.input] == ["text_input"]
