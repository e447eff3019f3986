"""Triton's generate extension (docs/protocol/extension_generate.md): a JSON object in, one
JSON object per response out, mapped to and from the model's tensors by name.

Request: a field named as a model input becomes that input (a string is one BYTES element,
a number or boolean one element of the input's datatype, an array keeps its nested shape;
a batching model gets a batch of one in front), and so does a key of ``parameters`` that
names an input the fields did not give; ``id`` is the request's id; every other field and
key of ``parameters`` becomes a request parameter (strings, numbers, booleans). Response:
``id`` (when the request had one), ``model_name``, ``model_version`` and a field per output
(one element: the value itself, a BYTES element decoded as UTF-8; more: a nested array,
without the batch of one the request was given).

The HTTP operations over this mapping (``/generate``, ``/generate_stream``) are in
``frontends.dataplane``; OpenAI's routes (``frontends.openai``) map onto it too.
"""
from __future__ import annotations

import json
import logging
from typing import Any, AsyncGenerator, AsyncIterator

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..protocol.datatypes import config_to_triton
from ..protocol.errors import InvalidArgument, TritonError
from ..protocol.json_tensors import json_data_to_array
from ..protocol.v2_rules import check_request_parameters
from ..protocol.types import InferRequest, InferResponse, InferTensor

log = logging.getLogger(__name__)

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"


def _shape_of(value: Any, name: str) -> tuple[int, ...]:
    """The nested-list shape of a JSON value (a scalar is one element)."""
    if not isinstance(value, list):
        return (1,)
    shape: list[int] = []
    level: Any = value
    while isinstance(level, list):
        shape.append(len(level))
        if not level:
            break
        level = level[0]
    if len(shape) > 64:
        raise InvalidArgument(f"field '{name}' is nested more than 64 levels deep")
    return tuple(shape)


def input_tensor(value: Any, spec: mc.ModelInput, batching: bool) -> InferTensor:
    name = spec.name
    datatype = config_to_triton(mc.DataType.Name(spec.data_type))
    if isinstance(value, dict) or value is None:
        raise InvalidArgument(
            f"field '{name}' (input '{name}') must be a string, a number, a boolean or an array")
    shape = _shape_of(value, name)
    data = value if isinstance(value, list) else [value]
    dims = [int(d) for d in spec.dims]
    if dims and all(d >= 0 for d in dims) and int(np.prod(dims)) == int(np.prod(shape)):
        shape = tuple(dims)     # a scalar for a [1, 1] input, a flat list for a [2, 3] one
    array = json_data_to_array(data, datatype, shape, name)
    if batching:
        shape = (1, *shape)
        array = array.reshape(shape)
    return InferTensor(name=name, datatype=datatype, shape=shape, data=array)


def generate_request(config: mc.ModelConfig, model: str, version: str,
                     body: dict) -> InferRequest:
    """The InferRequest of a generate request body (a JSON object) for a model of ``config``."""
    if not isinstance(body, dict):
        raise InvalidArgument("the generate request body must be a JSON object")
    specs = {spec.name: spec for spec in config.input}
    batching = config.max_batch_size > 0
    extra = body.get("parameters", {})
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise InvalidArgument("'parameters' must be a JSON object")
    request_id = body.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgument("'id' must be a string")
    parameters: dict[str, Any] = {}
    given: dict[str, Any] = {}
    for key, value in body.items():
        if key in specs:
            given[key] = value
        elif key not in ("parameters", "id"):
            parameters[key] = value
    for key, value in extra.items():
        # Triton's generate: a parameter that names a model input is that input
        if key in specs:
            given.setdefault(key, value)
        else:
            parameters[key] = value
    inputs = [input_tensor(value, specs[key], batching) for key, value in given.items()]
    for key, value in parameters.items():
        if not isinstance(value, (str, int, float, bool)):
            raise InvalidArgument(
                f"parameter '{key}' must be a string, a number or a boolean (it is neither a "
                f"model input of '{model}' nor a valid parameter)")
    missing = [name for name, spec in specs.items()
               if not spec.optional and name not in given]
    if missing:
        raise InvalidArgument(
            f"generate request for model '{model}' is missing the field(s) {missing} "
            f"(the model's inputs: {sorted(specs)})")
    return InferRequest(model_name=model, model_version=version, id=request_id, inputs=inputs,
                        parameters=check_request_parameters(parameters))


def _json_value(tensor: InferTensor, batched: bool) -> Any:
    data = tensor.data
    if data is None:
        return None
    if batched and data.ndim > 0 and data.shape[0] == 1:
        data = data[0]
    if data.dtype.kind in "OSU":
        def text(v: Any) -> Any:
            if isinstance(v, list):
                return [text(x) for x in v]
            return v.decode("utf-8", errors="replace") if isinstance(v, (bytes, np.bytes_)) \
                else str(v)
        values = text(np.asarray(data, dtype=object).tolist())
    else:
        values = data.tolist()
    if data.size == 1:
        while isinstance(values, list):
            values = values[0]
    return values


def generate_response(response: InferResponse, batched: bool) -> dict:
    """The generate response JSON object of one InferResponse (``batched``: the request
    was given a batch of one, taken off again here)."""
    out: dict[str, Any] = {"id": response.id} if response.id else {}
    out["model_name"] = response.model_name
    out["model_version"] = str(response.model_version)
    for tensor in response.outputs:
        out[tensor.name] = _json_value(tensor, batched)
    return out


def sse_event(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def error_message(err: BaseException) -> str:
    return str(err) if isinstance(err, TritonError) else f"internal error: {type(err).__name__}"


async def first_response(responses: AsyncGenerator[InferResponse, None]) -> InferResponse | None:
    """The first response of an engine stream (None: the model sent none); validation
    errors raise here, before a status line is written."""
    try:
        return await responses.__anext__()
    except StopAsyncIteration:
        return None
    except BaseException:
        await close_stream(responses)
        raise


async def close_stream(responses: AsyncGenerator[InferResponse, None]) -> None:
    """Close an engine stream early: the model sees ``is_cancelled()``."""
    await responses.aclose()


def is_empty_final(response: InferResponse) -> bool:
    """A decoupled model's COMPLETE_FINAL flag without a response of its own."""
    return response.final and not response.outputs and response.error is None


async def generate_events(first: InferResponse | None, responses: AsyncGenerator[InferResponse, None],
                          batched: bool) -> AsyncIterator[bytes]:
    """The SSE body of ``/generate_stream``: one ``data:`` event per response, an error
    (the model's error response, or a failure mid-stream) as an ``{"error": ...}`` event,
    after which the stream ends. Leaving early (the client went away) cancels the request."""
    try:
        response = first
        while response is not None:
            if response.error is not None:
                yield sse_event({"error": error_message(response.error)})
                return
            if not is_empty_final(response):
                yield sse_event(generate_response(response, batched))
            if response.final:
                return
            try:
                response = await responses.__anext__()
            except StopAsyncIteration:
                return
            except Exception as err:  # noqa: BLE001 - the status line is sent: an event
                if not isinstance(err, TritonError):
                    log.error("generate stream failed", exc_info=err)
                yield sse_event({"error": error_message(err)})
                return
    finally:
        await close_stream(responses)
