"""OpenAI-compatible routes (v1/models, v1/completions, v1/chat/completions) with the official
``openai`` client, on the standalone server's HTTP port (both skins) and under the Jupyter
server's base URL with an inference key as the api_key."""
from __future__ import annotations

import json

import openai
import pytest

from conftest import BOTH_FRONTS, INFER_KEY
from decoupled_models import write_echo, write_model, write_words
from jupyter_triton.engine import EngineOptions
from jupyter_triton.frontends.openai import DEFAULT_CHAT_TEMPLATE, render_chat
from jupyter_triton.standalone import start_in_thread
from conftest import LINEAR_CONFIG, W
from onnx_models import linear

PARAMS_MODEL = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
            "text_output", np.array([(r.parameters() or "{}").encode()], dtype=np.object_))])
            for r in requests]
'''

PARAMS_CONFIG = '''\
name: "params"
backend: "python"
input [ { name: "text_input", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "text_output", data_type: TYPE_STRING, dims: [ 1 ] } ]
'''

TEMPLATED_CONFIG = '''\
name: "templated"
backend: "python"
max_batch_size: 4
parameters { key: "chat_template" value: { string_value: "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}" } }
input [ { name: "text_input", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "text_output", data_type: TYPE_STRING, dims: [ 1 ] },
         { name: "parameters_seen", data_type: TYPE_STRING, dims: [ 1 ] } ]
'''


@pytest.fixture(scope="module", params=BOTH_FRONTS)
def server(request, tmp_path_factory):
    root = write_echo(write_words(tmp_path_factory.mktemp("models")))
    (root / "templated" / "1").mkdir(parents=True)
    (root / "templated" / "1" / "model.py").write_text((root / "echo" / "1" / "model.py").read_text())
    (root / "templated" / "config.pbtxt").write_text(TEMPLATED_CONFIG)
    write_model(root, "params", PARAMS_MODEL, PARAMS_CONFIG)
    linear(W, root / "linear" / "1" / "model.onnx")
    (root / "linear" / "config.pbtxt").write_text(LINEAR_CONFIG)
    served = start_in_thread(EngineOptions(model_repository=root, model_control_mode="explicit",
                                           load_models=["*"]),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=None,
                             http_front=request.param)
    yield served
    served.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="any",
                         max_retries=0, timeout=30)


def test_models_lists_those_that_follow_the_text_convention(client):
    assert sorted(m.id for m in client.models.list()) == ["echo", "params", "templated", "words"]
    assert client.models.retrieve("words").id == "words"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("linear")


def test_completion_with_parameters(client):
    completion = client.completions.create(model="echo", prompt="hello there", max_tokens=7,
                                           temperature=0.25, stop="zzz")
    choice = completion.choices[0]
    assert completion.object == "text_completion" and completion.model == "echo"
    assert completion.id.startswith("cmpl-")
    assert choice.text == "HELLO THERE" and choice.finish_reason == "stop"


def test_sampling_fields_reach_the_model_as_request_parameters(client):
    completion = client.completions.create(model="params", prompt="p", max_tokens=5,
                                           temperature=0.5, top_p=0.9, seed=3)
    assert json.loads(completion.choices[0].text) == {
        "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "seed": 3}
    # the stop sequences reach the model too; the text it echoes ends before the first one
    completion = client.completions.create(model="params", prompt="p", stop=["zz", "yy"])
    assert completion.choices[0].text.replace(" ", "") == '{"stop":"[\\"'


def test_streamed_completion_from_a_decoupled_model(client):
    chunks = list(client.completions.create(model="words", prompt="one two three", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "onetwothree"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_streamed_chat_completion(client):
    stream = client.chat.completions.create(
        model="words", stream=True,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    # the default template's prompt, one response per word of it
    assert text == "".join(render_chat([{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": "hi"}]).split())
    assert text == "system:bebriefuser:hiassistant:"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[0].object == "chat.completion.chunk"


def test_chat_completion_with_the_models_own_template(client):
    completion = client.chat.completions.create(
        model="templated", messages=[{"role": "user", "content": "hey"},
                                     {"role": "assistant", "content": "yo"}])
    assert completion.choices[0].message.content == "<USER>HEY<ASSISTANT>YO"
    assert completion.choices[0].message.role == "assistant"
    completion = client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}])
    assert completion.choices[0].message.content == "USER: A\nASSISTANT:"
    assert DEFAULT_CHAT_TEMPLATE      # documented in frontends/openai.py


def test_a_stop_sequence_ends_the_text_and_the_stream(client):
    chunks = list(client.completions.create(model="words", prompt="a b STOP c d", stream=True,
                                            stop=["bST"]))
    assert "".join(c.choices[0].text for c in chunks) == "a"
    completion = client.completions.create(model="words", prompt="a b c", stop="c")
    assert completion.choices[0].text == "ab"


def test_errors_are_openai_errors(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="echo", prompt="x", stream=True)
    assert "needs a decoupled model" in err.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="linear", prompt="x")
    assert "text convention" in err.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="echo", messages=[])
    with pytest.raises(openai.APIError) as err:          # an error response mid-stream
        list(client.completions.create(model="words", prompt="ok FAIL", stream=True))
    assert "the model failed on FAIL" in err.value.message


# -- the Jupyter server: {base_url}v1/, an inference key as the api_key -----------------------

@pytest.fixture
def model_repo(tmp_path):
    return write_words(tmp_path / "models")


async def test_openai_on_the_jupyter_server_with_an_inference_key(jp_triton, jp_base_url):
    import asyncio
    port = jp_triton.port
    url = f"http://127.0.0.1:{port}{jp_base_url}v1"

    def run():
        client = openai.OpenAI(base_url=url, api_key=INFER_KEY, max_retries=0, timeout=30)
        names = [m.id for m in client.models.list()]
        chunks = list(client.chat.completions.create(
            model="words", stream=True, messages=[{"role": "user", "content": "x y"}]))
        refused = openai.OpenAI(base_url=url, api_key="not-a-key", max_retries=0, timeout=30)
        try:
            refused.models.list()
            status = 200
        except openai.APIStatusError as err:
            status = err.status_code
        return names, chunks, status

    names, chunks, status = await asyncio.to_thread(run)
    assert names == ["words"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "user:xyassistant:"
    assert status == 403
