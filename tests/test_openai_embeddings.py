"""OpenAI's ``v1/embeddings`` with the official ``openai`` client: a text-in, vector-out
python model behind the dynamic batcher, a token-ids model, and a tokenize -> embed ensemble;
on both HTTP skins of the standalone server and under the Jupyter server's base URL with an
inference key as the api_key. Also the completion routes' ``usage`` and ``finish_reason``."""
from __future__ import annotations

import asyncio
import base64

import numpy as np
import openai
import pytest
import tritonclient.http as httpclient

from conftest import BOTH_FRONTS, INFER_KEY
from decoupled_models import write_model, write_words
from jupyter_triton.engine import EngineOptions
from jupyter_triton.standalone import start_in_thread

DIM = 8

# A bag of words hashed into DIM buckets, unit length: texts that share words are close.
BOW_MODEL = '''\
import zlib

import numpy as np
import triton_python_backend_utils as pb_utils


def embed(text):
    v = np.zeros(8, np.float32)
    for word in text.lower().split():
        v[zlib.crc32(word.encode()) % 8] += 1.0
    return v / max(np.linalg.norm(v), 1e-9)


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            texts = pb_utils.get_input_tensor_by_name(r, "TEXT").as_numpy().reshape(-1)
            vectors = np.stack([embed(t.decode()) for t in texts])
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("VECTOR", vectors)]))
        return out
'''

BOW_CONFIG = '''\
name: "bow"
backend: "python"
max_batch_size: 8
dynamic_batching { max_queue_delay_microseconds: 200000 }
parameters { key: "embedding_dimensions" value: { string_value: "true" } }
input [ { name: "TEXT", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "VECTOR", data_type: TYPE_FP32, dims: [ 8 ] } ]
'''

# token ids -> [count, sum, min, max]: what came in, visibly
IDS_MODEL = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            ids = pb_utils.get_input_tensor_by_name(r, "input_ids").as_numpy().astype(np.float32)
            v = np.array([ids.size, ids.sum(), ids.min(), ids.max()], np.float32)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("embedding", v)]))
        return out
'''

IDS_CONFIG = '''\
name: "ids"
backend: "python"
max_batch_size: 0
input [ { name: "input_ids", data_type: TYPE_INT64, dims: [ -1 ] } ]
output [ { name: "embedding", data_type: TYPE_FP32, dims: [ 4 ] } ]
'''

# text -> token ids (the word lengths) and their count
TOKENIZE_MODEL = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            text = pb_utils.get_input_tensor_by_name(r, "text").as_numpy().reshape(-1)[0].decode()
            ids = np.array([len(w) for w in text.split()] + [0] * 3, np.int64)  # 3 special tokens
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("input_ids", ids),
                pb_utils.Tensor("num_input_tokens", np.array([ids.size], np.int32))]))
        return out
'''

TOKENIZE_CONFIG = '''\
name: "tokenize"
backend: "python"
max_batch_size: 0
input [ { name: "text", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "input_ids", data_type: TYPE_INT64, dims: [ -1 ] },
         { name: "num_input_tokens", data_type: TYPE_INT32, dims: [ 1 ] } ]
'''

PIPELINE_CONFIG = '''\
name: "pipeline"
platform: "ensemble"
max_batch_size: 0
input [ { name: "text", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "embedding", data_type: TYPE_FP32, dims: [ 4 ] },
         { name: "num_input_tokens", data_type: TYPE_INT32, dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "tokenize" model_version: -1
    input_map { key: "text" value: "text" }
    output_map [ { key: "input_ids" value: "ids" }, { key: "num_input_tokens" value: "num_input_tokens" } ] },
  { model_name: "ids" model_version: -1
    input_map { key: "input_ids" value: "ids" }
    output_map { key: "embedding" value: "embedding" } } ] }
'''


def _bow(text: str) -> np.ndarray:
    import zlib
    v = np.zeros(DIM, np.float32)
    for word in text.lower().split():
        v[zlib.crc32(word.encode()) % DIM] += 1.0
    return v / max(np.linalg.norm(v), 1e-9)


def write_repository(root):
    write_model(root, "bow", BOW_MODEL, BOW_CONFIG)
    write_model(root, "ids", IDS_MODEL, IDS_CONFIG)
    write_model(root, "tokenize", TOKENIZE_MODEL, TOKENIZE_CONFIG)
    (root / "pipeline" / "1").mkdir(parents=True)
    (root / "pipeline" / "config.pbtxt").write_text(PIPELINE_CONFIG)
    return write_words(root)


@pytest.fixture(scope="module", params=BOTH_FRONTS)
def server(request, tmp_path_factory):
    root = write_repository(tmp_path_factory.mktemp("models"))
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


def test_a_list_of_texts_is_embedded_through_the_dynamic_batcher(server, client):
    texts = [f"passage {i} about {'cats' if i % 2 else 'dogs'}" for i in range(8)]
    triton = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    before = triton.get_inference_statistics("bow")["model_stats"][0]
    result = client.embeddings.create(model="bow", input=texts, encoding_format="float")
    after = triton.get_inference_statistics("bow")["model_stats"][0]
    assert result.model == "bow" and result.object == "list"
    assert [d.index for d in result.data] == list(range(8))
    for text, item in zip(texts, result.data):
        np.testing.assert_allclose(item.embedding, _bow(text), rtol=1e-6)
    assert result.usage.prompt_tokens == sum(len(t.split()) for t in texts)
    assert result.usage.total_tokens == result.usage.prompt_tokens
    # eight requests of one row each, merged by the batcher into fewer executions
    rows = after["inference_count"] - before["inference_count"]
    runs = after["execution_count"] - before["execution_count"]
    assert rows == 8 and runs < 8


def test_a_single_string_and_base64(client):
    # the openai client asks for base64 unless told otherwise, and decodes it
    one = client.embeddings.create(model="bow", input="hello world")
    np.testing.assert_allclose(one.data[0].embedding, _bow("hello world"), rtol=1e-6)
    raw = client.embeddings.with_raw_response.create(model="bow", input="hello world",
                                                     encoding_format="base64")
    body = raw.http_response.json()
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, _bow("hello world"), rtol=1e-6)


def test_dimensions_shorten_a_model_that_allows_it(client):
    short = client.embeddings.create(model="bow", input="a b c d e f", dimensions=4,
                                     encoding_format="float").data[0].embedding
    full = _bow("a b c d e f")[:4]
    np.testing.assert_allclose(short, full / np.linalg.norm(full), rtol=1e-6)
    with pytest.raises(openai.BadRequestError) as err:      # ids has no such parameter
        client.embeddings.create(model="ids", input=[1, 2], dimensions=2)
    assert "does not support 'dimensions'" in err.value.message


def test_token_ids_and_an_ensemble_that_counts_its_tokens(client):
    result = client.embeddings.create(model="ids", input=[[3, 4, 5], [7]],
                                      encoding_format="float")
    assert [d.embedding for d in result.data] == [[3, 12, 3, 5], [1, 7, 7, 7]]
    assert result.usage.prompt_tokens == 4
    one = client.embeddings.create(model="ids", input=[9, 1], encoding_format="float")
    assert one.data[0].embedding == [2, 10, 1, 9]
    # tokenize -> ids as one ensemble; usage is the tokenizer's own count (3 special tokens)
    piped = client.embeddings.create(model="pipeline", input=["hi there", "x"],
                                     encoding_format="float")
    assert [d.embedding for d in piped.data] == [[5, 7, 0, 5], [4, 1, 0, 1]]
    assert piped.usage.prompt_tokens == 5 + 4


def test_models_list_the_embedding_models(client):
    names = sorted(m.id for m in client.models.list())
    assert names == ["bow", "ids", "pipeline", "words"]     # not tokenize: two outputs, no FP32


@pytest.mark.parametrize("kwargs, text", [
    ({"model": "words", "input": "x"}, "not an embedding model"),
    ({"model": "bow", "input": []}, "'input' must be"),
    ({"model": "bow", "input": [[1, 2]]}, "must be a string"),
    ({"model": "ids", "input": "text"}, "takes token ids"),
    ({"model": "bow", "input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"model": "bow", "input": ""}, "empty string"),
    ({"model": "bow", "input": "x", "dimensions": 0}, "'dimensions'"),
])
def test_bad_requests_are_openai_errors(client, kwargs, text):
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(**kwargs)
    assert text in err.value.message
    assert err.value.body["type"] == "invalid_request_error"


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="x")


# -- usage and finish_reason on the completion routes ------------------------------------------

def test_completion_usage_and_length(client):
    done = client.completions.create(model="words", prompt="one two three")
    assert done.choices[0].text == "onetwothree" and done.choices[0].finish_reason == "stop"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (3, 3)
    cut = client.completions.create(model="words", prompt="a b c d e", max_tokens=2)
    assert cut.choices[0].text == "ab" and cut.choices[0].finish_reason == "length"
    assert cut.usage.completion_tokens == 2 and cut.usage.total_tokens == 7
    chunks = list(client.chat.completions.create(
        model="words", stream=True, max_tokens=3, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "a b c d"}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "user:ab"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert chunks[-1].usage.prompt_tokens == len("user: a b c d assistant:".split())


# -- the Jupyter server: {base_url}v1/embeddings with an inference key ---------------------------

@pytest.fixture
def model_repo(tmp_path):
    return write_repository(tmp_path / "models")


async def test_embeddings_on_the_jupyter_server_with_an_inference_key(jp_triton, jp_base_url):
    url = f"http://127.0.0.1:{jp_triton.port}{jp_base_url}v1"

    def run():
        client = openai.OpenAI(base_url=url, api_key=INFER_KEY, max_retries=0, timeout=30)
        deadline = 60
        for _ in range(deadline * 10):      # the extension loads the repository as it starts
            if "pipeline" in [m.id for m in client.models.list()]:
                break
            import time
            time.sleep(0.1)
        vectors = client.embeddings.create(model="bow", input=["red fox", "blue fox"])
        piped = client.embeddings.create(model="pipeline", input="hi there")
        chat = client.chat.completions.create(model="words", max_tokens=2,
                                              messages=[{"role": "user", "content": "a b c"}])
        refused = openai.OpenAI(base_url=url, api_key="not-a-key", max_retries=0, timeout=30)
        try:
            refused.embeddings.create(model="bow", input="x")
            status = 200
        except openai.APIStatusError as err:
            status = err.status_code
        return vectors, piped, chat, status

    vectors, piped, chat, status = await asyncio.to_thread(run)
    assert chat.choices[0].message.content == "user:a" and chat.choices[0].finish_reason == "length"
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (5, 2)
    np.testing.assert_allclose(vectors.data[1].embedding, _bow("blue fox"), rtol=1e-6)
    assert piped.data[0].embedding == [5, 7, 0, 5] and piped.usage.prompt_tokens == 5
    assert status == 403
