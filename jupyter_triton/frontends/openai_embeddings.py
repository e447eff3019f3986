"""OpenAI's ``v1/embeddings`` over any model or ensemble whose signature is text (or token
ids) in, one FP32 vector out: what RAG frameworks call (LangChain, LlamaIndex, LiteLLM).

The signature, read off the config as ``frontends.openai`` reads the text convention: exactly
one required input, BYTES (each ``input`` string is one element) or INT32/INT64 (each
``input`` is a list of token ids); exactly one FP32 output, or several and one of them named
``embedding``. Each input of the request is one inference request of batch one, all sent at
once, so the model's dynamic batcher merges them as it merges any other traffic (and a model
without batching still serves a list).

``usage``: tokens as the model counts them when it has an integer output
``num_input_tokens`` (the name vLLM's backend uses), else the token ids given, else the
whitespace-separated words of each text (an estimate: the server has no tokenizer of its own),
counted in slices and off the loop for a large text (``frontends.large_text``). The body is
bounded as the v2 infer route's is (``--http-max-input-size``); the per-element work on it
(token ids checked, tensors built) runs off the loop too when the inputs are large.

``dimensions`` shortens the vector to its first N values, renormalized to unit length, as
OpenAI's text-embedding-3 models do; only a model trained for it (Matryoshka) gives
meaningful short vectors, so a model allows it with the config parameter
``embedding_dimensions: "true"``; elsewhere a ``dimensions`` other than the model's width is
refused, as OpenAI refuses it for its older models.
"""
from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..engine import Engine
from ..protocol.errors import InvalidArgument
from ..protocol.types import InferRequest, RequestedOutput
from .generate import input_tensor
from .large_text import off_loop, word_count

EMBEDDING_OUTPUT = "embedding"
TOKEN_COUNT_OUTPUT = "num_input_tokens"
DIMENSIONS_PARAMETER = "embedding_dimensions"
MAX_INPUTS = 2048                 # OpenAI's own bound on one request's inputs
_ID_TYPES = (mc.TYPE_INT32, mc.TYPE_INT64)
_INT_TYPES = (mc.TYPE_INT8, mc.TYPE_INT16, mc.TYPE_INT32, mc.TYPE_INT64, mc.TYPE_UINT8,
              mc.TYPE_UINT16, mc.TYPE_UINT32, mc.TYPE_UINT64)


@dataclass
class Signature:
    input: mc.ModelInput
    output: str
    token_count: str | None         # the model's own count of tokens, if it has one

    @property
    def takes_ids(self) -> bool:
        return self.input.data_type in _ID_TYPES


def signature(config: mc.ModelConfig) -> Signature | None:
    """The model's embedding signature, or None if it has none."""
    required = [i for i in config.input if not i.optional]
    if len(required) != 1 or required[0].data_type not in (mc.TYPE_STRING, *_ID_TYPES):
        return None
    vectors = [o.name for o in config.output if o.data_type == mc.TYPE_FP32]
    if len(vectors) != 1:
        vectors = [n for n in vectors if n == EMBEDDING_OUTPUT]
    if len(vectors) != 1:
        return None
    counts = [o.name for o in config.output
              if o.name == TOKEN_COUNT_OUTPUT and o.data_type in _INT_TYPES]
    return Signature(required[0], vectors[0], counts[0] if counts else None)


def _inputs(value: object, ids: bool) -> list:
    """``input`` as a list of items: strings, or lists of token ids (each id is checked by
    ``_requests``, off the loop for large inputs)."""
    if isinstance(value, str):
        items: list = [value]
    elif isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool)
                                                   for v in value):
        items = [value]                     # one list of token ids
    elif isinstance(value, list) and value:
        items = value
    else:
        raise InvalidArgument("'input' must be a string, an array of strings, an array of token "
                              "ids or an array of arrays of token ids, not empty")
    if len(items) > MAX_INPUTS:
        raise InvalidArgument(f"'input' has {len(items)} items; at most {MAX_INPUTS} are allowed")
    for i, item in enumerate(items):
        if ids:
            if isinstance(item, str):
                raise InvalidArgument(
                    f"input[{i}] is text, but this model takes token ids (its input is integer)")
            if not isinstance(item, list) or not item:
                raise _not_ids(i)
        elif not isinstance(item, str):
            raise InvalidArgument(
                f"input[{i}] must be a string: this model takes text (its input is BYTES)")
        elif not item:
            raise InvalidArgument(f"input[{i}] is an empty string")
    return items


def _not_ids(index: int) -> InvalidArgument:
    return InvalidArgument(f"input[{index}] must be a non-empty array of token ids "
                           f"(integers from 0 to 2**31 - 1)")


@dataclass
class EmbeddingJob:
    model: str
    signature: Signature
    items: list                     # strings, or lists of token ids (as _inputs checks them)
    batching: bool
    base64: bool
    dimensions: int | None
    truncatable: bool


async def prepare(engine: Engine, body: dict) -> EmbeddingJob:
    """Check an embeddings request body: what costs no more than the number of its inputs.
    The model is found as the v2 infer route finds it (loaded on demand where opted in)."""
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidArgument("'model' must be the name of a model")
    served = await engine.resident_version(model)
    config = served.config
    sig = signature(config)
    if sig is None:
        raise InvalidArgument(
            f"model '{model}' is not an embedding model: it needs one required input (BYTES "
            f"text or INT32/INT64 token ids) and one FP32 output (or one named "
            f"'{EMBEDDING_OUTPUT}')")
    if served.decoupled:
        raise InvalidArgument(f"model '{model}' is decoupled; an embedding is one response")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64", None):
        raise InvalidArgument("'encoding_format' must be 'float' or 'base64'")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool)
                                   or dimensions < 1):
        raise InvalidArgument("'dimensions' must be a positive integer")
    items = _inputs(body.get("input"), sig.takes_ids)
    param = config.parameters.get(DIMENSIONS_PARAMETER)
    truncatable = param is not None and param.string_value.strip().lower() == "true"
    return EmbeddingJob(model, sig, items, config.max_batch_size > 0, encoding == "base64",
                        dimensions, truncatable)


def _requests(job: EmbeddingJob) -> tuple[list[InferRequest], list[int]]:
    """One inference request per input, and its tokens (unless the model counts them): the
    work that grows with the inputs' size."""
    sig = job.signature
    outputs = [RequestedOutput(sig.output)] + (
        [RequestedOutput(sig.token_count)] if sig.token_count else [])
    requests, counts = [], []
    for i, item in enumerate(job.items):
        if sig.takes_ids and not all(isinstance(t, int) and not isinstance(t, bool)
                                     and 0 <= t < 2 ** 31 for t in item):
            raise _not_ids(i)
        requests.append(InferRequest(job.model, "", "", [input_tensor(item, sig.input,
                                                                      job.batching)],
                                     list(outputs)))
        counts.append(len(item) if sig.takes_ids else
                      0 if sig.token_count is not None else word_count(item))
    return requests, counts


def _vector(job: EmbeddingJob, data: np.ndarray) -> np.ndarray:
    vector = np.asarray(data, dtype=np.float32)
    while vector.ndim > 1 and vector.shape[0] == 1:
        vector = vector[0]                  # the batch of one, a [1, d] output
    if vector.ndim != 1:
        raise InvalidArgument(f"model '{job.model}' output '{job.signature.output}' has shape "
                              f"{list(data.shape)} per input, not a vector")
    if job.dimensions is None or job.dimensions == vector.shape[0]:
        return vector
    if not job.truncatable:
        raise InvalidArgument(
            f"model '{job.model}' does not support 'dimensions' (its vectors have "
            f"{vector.shape[0]}; a model trained for shorter ones says so with the config "
            f"parameter '{DIMENSIONS_PARAMETER}: \"true\"')")
    if job.dimensions > vector.shape[0]:
        raise InvalidArgument(f"'dimensions' {job.dimensions} is more than model "
                              f"'{job.model}' gives ({vector.shape[0]})")
    short = vector[:job.dimensions]
    norm = float(np.linalg.norm(short))
    return short / norm if norm > 0 else short


async def embed(engine: Engine, job: EmbeddingJob) -> dict:
    """Run every input at once (the batcher merges them) and answer in OpenAI's shape."""
    # a token id is about as long as 8 characters of its JSON
    size = sum(len(item) * (8 if job.signature.takes_ids else 1) for item in job.items)
    requests, counts = await off_loop(size, _requests, job)
    tasks = [asyncio.ensure_future(engine.infer(r)) for r in requests]
    try:
        responses = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    data = []
    tokens = 0
    for index, (response, count) in enumerate(zip(responses, counts)):
        got = {t.name: t.data for t in response.outputs}
        vector = _vector(job, got[job.signature.output])
        if job.signature.token_count is not None:
            count = int(np.asarray(got[job.signature.token_count]).reshape(-1)[0])
        tokens += count
        value = (base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii") if job.base64
                 else vector.tolist())
        data.append({"object": "embedding", "index": index, "embedding": value})
    return {"object": "list", "data": data, "model": job.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
