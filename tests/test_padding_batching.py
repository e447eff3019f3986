"""Padding batches (ours, config/padding.py): an ONNX ``[batch, length]`` model with
``ragged_batching: "pad"`` batches requests of different lengths, answers each exactly as it
would alone (outputs cut back to its length), keeps lengths of one bucket together and a
batch's padded tokens within its budget, refuses a request longer than ``max_length`` with a
400, and shows its padding in the statistics and the metrics.

The model is built here: token embeddings (small integers, so any summation order is exact)
masked by the attention mask, and their masked mean."""
from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from batch_clients import client, start_server, together
from jupyter_triton.backends.ragged import RaggedPlan
from jupyter_triton.config import parse_config
from jupyter_triton.config.padding import padding
from jupyter_triton.protocol.errors import InvalidArgument
from onnx_models import _save

VOCAB, HIDDEN = 200, 4
TABLE = (np.arange(VOCAB * HIDDEN) % 13 - 6).astype(np.float32).reshape(VOCAB, HIDDEN)


def embedder(path: Path) -> None:
    """last_hidden_state = TABLE[input_ids] x attention_mask; pooled = its masked mean."""
    nodes = [
        helper.make_node("Constant", [], ["axis1"], value=helper.make_tensor("a1", TensorProto.INT64, [1], [1])),
        helper.make_node("Constant", [], ["axis2"], value=helper.make_tensor("a2", TensorProto.INT64, [1], [2])),
        helper.make_node("Gather", ["TABLE", "input_ids"], ["emb"], axis=0),
        helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["maskf", "axis2"], ["mask3"]),
        helper.make_node("Mul", ["emb", "mask3"], ["last_hidden_state"]),
        helper.make_node("ReduceSum", ["last_hidden_state", "axis1"], ["summed"], keepdims=0),
        helper.make_node("ReduceSum", ["maskf", "axis1"], ["count"], keepdims=1),
        helper.make_node("Div", ["summed", "count"], ["pooled"]),
    ]
    _save(helper.make_graph(
        nodes, "embedder",
        [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "length"])
         for n in ("input_ids", "attention_mask")],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT,
                                       ["batch", "length", HIDDEN]),
         helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", HIDDEN])],
        [numpy_helper.from_array(TABLE, "TABLE")]), path)


def alone(ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
    """What the model answers a request run alone (no padding)."""
    hidden = TABLE[ids] * mask[..., None].astype(np.float32)
    return {"last_hidden_state": hidden,
            "pooled": hidden.sum(1) / mask.sum(1, keepdims=True).astype(np.float32)}


def config(name: str, batching: str, **parameters: str) -> str:
    params = {"ragged_batching": "pad", "pad_value.input_ids": "3", **parameters}
    listed = ", ".join(f'{{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in params.items())
    return f"""
name: "{name}"
backend: "onnxruntime"
max_batch_size: 16
dynamic_batching {{ {batching} }}
input [ {{ name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] }},
        {{ name: "attention_mask" data_type: TYPE_INT64 dims: [ -1 ] }} ]
output [ {{ name: "last_hidden_state" data_type: TYPE_FP32 dims: [ -1, {HIDDEN} ] }},
         {{ name: "pooled" data_type: TYPE_FP32 dims: [ {HIDDEN} ] }} ]
parameters [ {listed} ]
"""


MODELS = {
    # 16 clients: a batch leaves when 16 rows wait or its oldest waited 200 ms
    "embed": config("embed", "max_queue_delay_microseconds: 200000", max_length="128"),
    # buckets up to 16, 17 to 64, above 64; a batch leaves at 2 rows (a 30 s delay otherwise)
    "embed_buckets": config("embed_buckets", "max_queue_delay_microseconds: 30000000 "
                            "preferred_batch_size: [ 2 ]", length_buckets="16,64"),
    # at most 100 padded tokens a batch
    "embed_budget": config("embed_budget", "max_queue_delay_microseconds: 2000000 "
                           "preferred_batch_size: [ 3 ]", max_batch_tokens="100"),
    # inputs marked ragged as well: padded, not concatenated (the model takes [batch, length])
    "embed_ragged": config("embed_ragged", "max_queue_delay_microseconds: 30000000 "
                           "preferred_batch_size: [ 2 ]").replace(
                               "dims: [ -1 ] }", "dims: [ -1 ] allow_ragged_batch: true }"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("padding") / "models"
    for name, text in MODELS.items():
        embedder(repo / name / "1" / "model.onnx")
        (repo / name / "config.pbtxt").write_text(text)
    srv = start_server(repo, list(MODELS))
    yield srv
    srv.close()


@pytest.fixture
def http(server):
    return client(server)


def _request(rng: np.random.Generator, length: int) -> tuple[np.ndarray, np.ndarray]:
    ids = rng.integers(0, VOCAB, size=(1, length), dtype=np.int64)
    mask = np.ones((1, length), dtype=np.int64)
    mask[0, length - 1 - length // 4:length - 1] = rng.integers(0, 2, size=length // 4)
    mask[0, 0] = 1
    return ids, mask


def _infer(caller, model: str, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
    mod = grpcclient if isinstance(caller, grpcclient.InferenceServerClient) else httpclient
    inputs = []
    for name, value in (("input_ids", ids), ("attention_mask", mask)):
        tensor = mod.InferInput(name, list(value.shape), "INT64")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    result = caller.infer(model, inputs)
    return {name: result.as_numpy(name) for name in ("last_hidden_state", "pooled")}


def _stats(caller, model: str) -> dict:
    return caller.get_inference_statistics(model)["model_stats"][0]


def _check(answer: dict, ids: np.ndarray, mask: np.ndarray) -> None:
    want = alone(ids, mask)
    assert answer["last_hidden_state"].shape == (1, ids.shape[1], HIDDEN)
    np.testing.assert_array_equal(answer["last_hidden_state"], want["last_hidden_state"])
    np.testing.assert_array_equal(answer["pooled"], want["pooled"])


def test_sixteen_clients_of_mixed_lengths_batch_and_each_answer_is_its_own(server, http):
    """The issue's embedder: 16 clients, lengths 5 to 128. Each answer is exactly what the model
    answers the request alone (the hidden states cut to its length), and the statistics show
    batches of 3 requests or more on average (before: 1.01); the padding shows in v2 stats
    and the metrics."""
    before = _stats(http, "embed")
    per_client = 6
    lengths = np.random.default_rng(36).integers(5, 129, size=(16, per_client))

    def client_run(c: int) -> int:
        caller = client(server, grpc=c % 4 == 3)        # 4 of the 16 on gRPC
        rng = np.random.default_rng(c)
        for n in lengths[c]:
            ids, mask = _request(rng, int(n))
            _check(_infer(caller, "embed", ids, mask), ids, mask)
        return per_client

    assert sum(together(client_run, 16)) == 16 * per_client
    after = _stats(http, "embed")
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == 16 * per_client
    mean_batch = inferences / executions
    assert mean_batch >= 3, f"mean batch {mean_batch:.2f} ({executions} executions)"
    pad = after["padding"]
    assert pad["request_tokens"] - before["padding"]["request_tokens"] == int(lengths.sum())
    assert pad["batch_tokens"] >= pad["request_tokens"]
    assert pad["waste_ratio"] == pytest.approx(pad["batch_tokens"] / pad["request_tokens"], rel=1e-5)
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                     timeout=30).read().decode()
    assert f'nv_inference_request_tokens{{model="embed",version="1"}} {pad["request_tokens"]}' in metrics
    assert f'nv_inference_padded_tokens{{model="embed",version="1"}} {pad["batch_tokens"]}' in metrics
    assert 'nv_inference_padding_waste_ratio{model="embed",version="1"}' in metrics
    # the gRPC client reads the same statistics (the extra field left out)
    assert client(server, grpc=True).get_inference_statistics("embed").model_stats[0].execution_count


def test_a_batch_mixes_only_lengths_of_one_bucket(server, http):
    """Lengths 10 and 12 (bucket up to 16) and 100 and 110 (above 64), sent at once: two
    batches of two (a batch leaves at 2 rows), each padded within its bucket only: 2 x 12 +
    2 x 110 tokens run for 232 sent (one batch of all four would hold 4 x 110)."""
    before = _stats(http, "embed_buckets")
    rng = np.random.default_rng(7)
    sent = [_request(rng, n) for n in (10, 100, 12, 110)]
    answers = together(lambda i: _infer(client(server, grpc=i % 2 == 1), "embed_buckets",
                                             *sent[i]), 4)
    for answer, (ids, mask) in zip(answers, sent):
        _check(answer, ids, mask)
    after = _stats(http, "embed_buckets")
    assert after["execution_count"] - before["execution_count"] == 2
    assert after["padding"]["request_tokens"] - before["padding"]["request_tokens"] == 232
    assert after["padding"]["batch_tokens"] - before["padding"]["batch_tokens"] == 244


def _pending(server, model: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                  timeout=30).read().decode()
    line = f'nv_inference_pending_request_count{{model="{model}",version="1"}} '
    return float(text.split(line, 1)[1].split()[0]) if line in text else 0.0


def test_a_full_bucket_leaves_while_a_lone_request_of_another_waits(server, http):
    """A lone request of length 10 waits for a second of its bucket (a 30 s delay); two of
    lengths 100 and 110 that come meanwhile leave as their own batch at once, and the lone one
    leaves with the 12 that comes next."""
    before = _stats(http, "embed_buckets")
    rng = np.random.default_rng(17)
    lone, late = _request(rng, 10), _request(rng, 12)
    pair = [_request(rng, 100), _request(rng, 110)]
    answers: list = []
    waiting = threading.Thread(target=lambda: answers.append(_infer(client(server), "embed_buckets",
                                                                    *lone)))
    waiting.start()
    deadline = time.monotonic() + 30
    while _pending(server, "embed_buckets") < 1:        # queued: the server shows it
        assert time.monotonic() < deadline, "the lone request never reached the queue"
        time.sleep(0.02)
    for answer, sent in zip(together(lambda i: _infer(client(server), "embed_buckets", *pair[i]), 2),
                            pair):
        _check(answer, *sent)
    assert waiting.is_alive()                   # still waiting for its bucket
    assert _stats(http, "embed_buckets")["execution_count"] - before["execution_count"] == 1
    _check(_infer(http, "embed_buckets", *late), *late)
    waiting.join(60)
    _check(answers[0], *lone)
    assert _stats(http, "embed_buckets")["execution_count"] - before["execution_count"] == 2


def test_a_request_over_the_token_budget_runs_alone(server, http):
    """max_batch_tokens 100: three requests of 30 tokens may share a batch (90), one of 120
    never shares one (with a 30 it would hold 240): whatever order they come in, the batches
    held exactly the tokens sent, and the long one answered at once, alone."""
    before = _stats(http, "embed_budget")
    rng = np.random.default_rng(11)
    sent = [_request(rng, n) for n in (30, 120, 30, 30)]
    answers = together(lambda i: _infer(client(server, grpc=False), "embed_budget",
                                             *sent[i]), 4)
    for answer, (ids, mask) in zip(answers, sent):
        _check(answer, ids, mask)
    after = _stats(http, "embed_budget")
    assert after["execution_count"] - before["execution_count"] >= 2
    assert after["padding"]["request_tokens"] - before["padding"]["request_tokens"] == 210
    assert after["padding"]["batch_tokens"] - before["padding"]["batch_tokens"] == 210


def test_inputs_marked_ragged_are_padded_where_the_model_takes_lengths(server, http):
    before = _stats(http, "embed_ragged")
    rng = np.random.default_rng(5)
    sent = [_request(rng, n) for n in (9, 40)]
    answers = together(lambda i: _infer(client(server, grpc=i == 1), "embed_ragged", *sent[i]), 2)
    for answer, (ids, mask) in zip(answers, sent):
        _check(answer, ids, mask)
    after = _stats(http, "embed_ragged")
    assert after["execution_count"] - before["execution_count"] == 1
    assert after["padding"]["batch_tokens"] - before["padding"]["batch_tokens"] == 80


def test_a_request_the_model_fails_on_fails_alone_not_its_batch(server, http):
    """Inputs of one request that disagree in length (ids 12, mask 20) fail the model, alone
    or padded into a batch with a good request (ids and mask 15 and 20): the batch is run again
    request by request, so the good one answers and only the bad one gets the model's error."""
    before = _stats(http, "embed_ragged")
    rng = np.random.default_rng(23)
    good = _request(rng, 15)
    bad = (_request(rng, 12)[0], np.ones((1, 20), np.int64))

    def send(i: int):
        try:
            return _infer(client(server), "embed_ragged", *(good, bad)[i])
        except InferenceServerException as err:
            return str(err)
    answer, error = together(send, 2)
    _check(answer, *good)
    assert isinstance(error, str) and "Mul node" in error
    after = _stats(http, "embed_ragged")
    assert after["execution_count"] - before["execution_count"] == 1     # one batch executed
    assert after["inference_count"] - before["inference_count"] == 1     # one answered


@pytest.mark.parametrize("grpc", [False, True], ids=["http", "grpc"])
def test_a_request_longer_than_max_length_is_a_400_naming_it(server, http, grpc):
    caller = client(server, grpc)
    rng = np.random.default_rng(3)
    ids, mask = _request(rng, 128)
    _check(_infer(caller, "embed", ids, mask), ids, mask)      # the longest allowed answers
    ids, mask = _request(rng, 129)
    with pytest.raises(InferenceServerException) as err:
        _infer(caller, "embed", ids, mask)
    assert "max_length 128" in str(err.value) and "length 129" in str(err.value)
    assert err.value.status() == ("StatusCode.INVALID_ARGUMENT" if grpc else "400")


def test_a_bad_padding_parameter_refuses_the_load_naming_it(http):
    cfg = ({"name": "embed_budget", "backend": "onnxruntime",
                                 "max_batch_size": 16, "dynamic_batching": {},
                                 "input": [{"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1]},
                                           {"name": "attention_mask", "data_type": "TYPE_INT64",
                                            "dims": [-1]}],
                                 "output": [{"name": "pooled", "data_type": "TYPE_FP32", "dims": [HIDDEN]}],
                                 "parameters": {"ragged_batching": {"string_value": "pad"},
                                                "length_buckets": {"string_value": "64,16"}}})
    with pytest.raises(InferenceServerException) as err:
        http.load_model("embed_budget", config=json.dumps(cfg))
    assert "parameters.length_buckets" in str(err.value) and "increasing" in str(err.value)
    assert http.is_model_ready("embed_budget")      # the loaded version still serves


# -- the rules, without a server -----------------------------------------------------------

PLAIN = """
name: "m" backend: "onnxruntime" max_batch_size: 8
input [ { name: "ids" data_type: TYPE_INT64 dims: [ -1 ] },
        { name: "mask" data_type: TYPE_INT64 dims: [ -1 ] },
        { name: "scale" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "hidden" data_type: TYPE_FP32 dims: [ -1, 2 ] },
         { name: "topk" data_type: TYPE_FP32 dims: [ -1 ] },
         { name: "pooled" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


def _config(**parameters: str):
    listed = "".join(f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n'
                     for k, v in parameters.items())
    return parse_config(PLAIN + listed, "m")


def test_merge_pads_with_each_inputs_value_and_split_cuts_what_followed_the_length():
    plan = RaggedPlan.from_config(_config(ragged_batching="pad", **{"pad_value.ids": "7"}))
    requests = [{"ids": np.full((1, 3), 1), "mask": np.ones((1, 3), np.int64),
                 "scale": np.ones((1, 1), np.float32)},
                {"ids": np.full((2, 5), 2), "mask": np.ones((2, 5), np.int64),
                 "scale": np.ones((2, 1), np.float32)}]
    merged, layout = plan.merge(requests)
    assert merged["ids"].tolist()[0] == [1, 1, 1, 7, 7] and merged["ids"].shape == (3, 5)
    assert merged["mask"].tolist()[0] == [1, 1, 1, 0, 0]
    assert merged["scale"].shape == (3, 1)
    outputs = {"hidden": np.zeros((3, 5, 2), np.float32),
               "topk": np.zeros((3, 2), np.float32),      # -1, but not the batch's length: kept
               "pooled": np.zeros((3, 2), np.float32)}
    first, second = plan.split(outputs, layout)
    assert first["hidden"].shape == (1, 3, 2) and second["hidden"].shape == (2, 5, 2)
    assert first["topk"].shape == (1, 2) and first["pooled"].shape == (1, 2)
    assert plan.padding.tokens(requests) == (15, 13)


def test_without_pad_the_other_keys_are_the_models_own():
    """A Triton config may carry a 'max_length' of its own (a generator's): left alone."""
    assert padding(_config(max_length="20", length_buckets="x")) is None


@pytest.mark.parametrize("parameters, words", [
    ({"ragged_batching": "zip"}, ["parameters.ragged_batching", "\"pad\""]),
    ({"ragged_batching": "pad", "length_buckets": "32,16"}, ["increasing"]),
    ({"ragged_batching": "pad", "max_batch_tokens": "many"}, ["parameters.max_batch_tokens"]),
    ({"ragged_batching": "pad", "pad_value.scale": "1"}, ["names no padded input", "ids, mask"]),
    ({"ragged_batching": "pad", "pad_value.ids": "0.5"}, ["int64"]),
])
def test_padding_parameters_are_checked_naming_the_parameter(parameters, words):
    with pytest.raises(InvalidArgument) as err:
        padding(_config(**parameters))
    for word in words:
        assert word in str(err.value)
