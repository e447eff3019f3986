"""The gRPC codec: what every call of Triton's GRPCInferenceService meets on its way through,
in gRPC's words and the engine's. Its HEADERS become the admission's question
(``admit_on_headers``); a TritonError becomes the call's gRPC status (``rpc``); and the
inference RPCs, ModelInfer and ModelStreamInfer, decode Triton's ModelInferRequest into an
``InferRequest``, make one engine call and encode the ``InferResponse`` as Triton's
ModelInferResponse. The other RPCs (frontends/grpc.py) are cold and decode their own small
messages; the HTTP/2 call layer under all of them is frontends/grpc_calls.py.

ModelInfer and ModelStreamInfer take the raw request bytes: their size is charged to the
bytes-in-flight budget before anything is parsed (a message larger than its connection's
allowance was charged already, when its length prefix arrived: ``grpc_calls.Charged``), and a
message that does not parse is INVALID_ARGUMENT rather than grpc's INTERNAL. Inputs arrive
either all in ``raw_input_contents`` (what tritonclient sends) or each in its typed
``contents`` field; outputs always leave in ``raw_output_contents``, as Triton does. The
validation rules and messages are the HTTP codec's (protocol/v2_rules.py).
"""
from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from ..engine import Engine
from ..engine.composition.streaming import DecoupledRefused
from ..engine.observation.trace import trace_context
from ..protocol.datatypes import (DATATYPES, element_count, tensor_from_wire, tensor_to_wire,
                                  tensor_wire_buffer, wire_dtype)
from ..protocol.errors import InvalidArgument, TritonError
from ..protocol.types import InferRequest, InferResponse, InferTensor, RequestedOutput, scalar_values
from ..protocol.v2_rules import (DEFAULT_MAX_ELEMENTS, check_model_version,
                                 check_request_parameters, check_shape)
from . import operations
from .admission import INFERENCE, Admission, BodyBudget, Door, ResourceExhausted
from .grpc_calls import Admit, Charged

log = logging.getLogger(__name__)

# ModelStreamInfer requests of one stream in flight at once; further reads wait.
STREAM_CONCURRENCY = 64
# Responses of one stream ready but not yet written; past it, the models' streams wait.
STREAM_BUFFERED_RESPONSES = 256


# -- every call: its admission and its errors ---------------------------------------------

class _Headers:
    """A call's header list as the mapping the admission reads (keys arrive lower-case;
    binary ``-bin`` values are never credentials)."""
    __slots__ = ("pairs",)

    def __init__(self, pairs: list) -> None:
        self.pairs = pairs

    def get(self, key: str, default: Any = None) -> Any:
        for k, v in self.pairs:
            if k == key and isinstance(v, str):
                return v
        return default

    def items(self):
        return ((k, v) for k, v in self.pairs if isinstance(v, str) and not k.endswith("-bin"))


def admit_on_headers(admission: Admission, door: Door,
                     groups: dict[str, dict[str, str]]) -> Admit:
    """The h2 front's ``admit``: the admission's decision on a call's HEADERS, before its
    body is read, for the API group of its method (``groups``: service -> method -> group)."""
    def admit(name: str, method: str, headers: list):
        group = groups.get(name, {}).get(method)
        if group is None:
            return None
        return admission.admit(door, group, "POST", _Headers(headers), op=method)
    return admit


def _internal_message(err: BaseException) -> str:
    return f"internal error: {type(err).__name__}: {err}" if str(err) else \
        f"internal error: {type(err).__name__}"


def rpc(group: str) -> Callable[[Callable], Callable]:
    """A unary RPC of Triton's API ``group`` (what the admission is asked on its HEADERS),
    its errors mapped to gRPC statuses."""
    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext):
            try:
                return await method(self, request, context)
            except TritonError as err:
                await context.abort(grpc.StatusCode[err.grpc_code], str(err))
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - rendered without a traceback
                log.exception("gRPC %s failed", method.__name__)
                await context.abort(grpc.StatusCode.INTERNAL, _internal_message(err))
        wrapper.api_group = group           # what admission asks on the call's HEADERS
        return wrapper
    return decorate


# -- the inference RPCs ------------------------------------------------------------------

class _StreamFailure:
    """An error that ends a stream (``triton_grpc_error`` mode) rather than travel on it."""
    __slots__ = ("code", "message")

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code, self.message = code, message


def _headers(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """The call's metadata as headers (keys arrive lower-case; binary ``-bin`` values are
    never credentials)."""
    return {key: value for key, value in context.invocation_metadata() or ()
            if isinstance(value, str)}


class GrpcInference:
    """ModelInfer and ModelStreamInfer over ``engine`` (jupyter_triton.engine.Engine's public
    API), their request bytes charged to ``budget`` (the server's admission's, shared with
    its other listeners) while they are answered."""

    def __init__(self, engine: Engine, budget: BodyBudget, max_elements: int | None = None) -> None:
        self.engine = engine
        self.inflight = budget
        self._decode_kwargs = {} if max_elements is None else {"max_elements": max_elements}
        self._plans = RequestPlans()
        self._responses = ResponsePlans()

    @rpc(INFERENCE)
    async def ModelInfer(self, raw: bytes, context) -> bytes:
        # A Charged message (grpc_calls: larger than its connection's allowance) is on the budget
        # since its prefix arrived, until this call ends: not charged twice.
        size = 0 if type(raw) is Charged else len(raw)
        self.inflight.take(size)
        try:
            infer_request = self._plans.decode(raw, **self._decode_kwargs)
            if self.engine.tracing.on:     # engine/observation/trace.py: a client's W3C trace context
                infer_request.trace_context = trace_context(_headers(context))
            try:
                response = await self.engine.infer(infer_request)
            except DecoupledRefused as err:
                raise operations.decoupled_unsupported(err, "ModelInfer RPC") from None
            return self._responses.encode(response, infer_request)     # serialised already
        finally:
            self.inflight.give(size)

    def _stream_error(self, request: pb.ModelInferRequest, err: BaseException,
                      final: bool = True) -> bytes:
        """An error on the stream, as Triton writes it: ``error_message`` set, the request's
        model and id, and ``triton_final_response``; the stream itself goes on."""
        if isinstance(err, TritonError):
            message = str(err)
        else:
            log.error("gRPC ModelStreamInfer request failed", exc_info=err)
            message = _internal_message(err)
        response = pb.ModelInferResponse(model_name=request.model_name,
                                         model_version=request.model_version, id=request.id)
        response.parameters["triton_final_response"].bool_param = final
        return pb.ModelStreamInferResponse(error_message=message,
                                           infer_response=response).SerializeToString()

    def _failure(self, request: pb.ModelInferRequest, err: BaseException, final: bool,
                 grpc_error: bool) -> "bytes | _StreamFailure":
        if not grpc_error:
            return self._stream_error(request, err, final)
        if isinstance(err, TritonError):
            return _StreamFailure(grpc.StatusCode[err.grpc_code], str(err))
        log.error("gRPC ModelStreamInfer request failed", exc_info=err)
        return _StreamFailure(grpc.StatusCode.INTERNAL, _internal_message(err))

    async def _stream_one(self, raw: bytes, put: Callable[[Any], Awaitable[None]],
                          carrier: dict | None = None, grpc_error: bool = False) -> None:
        """Every response of one request onto the stream (``put``), each with Triton's
        ``triton_final_response`` parameter; a decoupled model's empty final response only
        when the request asked for it (``triton_enable_empty_final_response``). An error is
        an error response on the stream, or (``grpc_error``) the status that ends it."""
        request = pb.ModelInferRequest()
        try:
            request = parse_infer_request(raw)
            infer_request = decode_grpc_request(request, **self._decode_kwargs)
            if carrier is not None:        # engine/observation/trace.py: the stream's W3C trace context
                infer_request.trace_context = carrier
            # the frontend's to act on, as in Triton: the model never sees it
            empty_final = infer_request.parameters.pop("triton_enable_empty_final_response",
                                                       None) is True
            responses = self.engine.infer_stream(infer_request)
            try:
                async for response in responses:
                    if response.error is not None:
                        await put(self._failure(request, response.error, response.final,
                                                grpc_error))
                        continue
                    if response.final and not response.outputs and not empty_final and \
                            self.engine.is_decoupled(request.model_name, request.model_version):
                        continue        # COMPLETE_FINAL without a response: not asked for
                    await put(self._responses.encode_stream(response, infer_request))
            finally:
                # Early exit (the stream ended, a put cancelled): the model sees is_cancelled().
                await responses.aclose()
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - errors travel on the stream, as in Triton
            await put(self._failure(request, err, True, grpc_error))

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[bytes],
                               context) -> AsyncIterator[bytes]:
        """Each request's responses are written on the stream as soon as each is ready (so
        possibly interleaved across requests, as in Triton: clients match them by ``id``).
        A client that goes away cancels every request of the stream still running. With
        Triton's ``triton_grpc_error: true`` metadata, the first error ends the stream with
        its gRPC status instead of travelling on it."""
        grpc_error = dict(context.invocation_metadata() or ()).get(
            "triton_grpc_error", "").lower() == "true"
        carrier = trace_context(_headers(context)) if self.engine.tracing.on else None
        # Bounded: a model that answers faster than the client reads waits for the client.
        results: asyncio.Queue = asyncio.Queue(STREAM_BUFFERED_RESPONSES)
        slots = asyncio.Semaphore(STREAM_CONCURRENCY)
        tasks: set[asyncio.Task] = set()
        done = object()

        def answered(size: int, task: asyncio.Task) -> None:
            # a callback, not a finally: a task cancelled before it ever ran has none
            tasks.discard(task)
            self.inflight.give(size)
            slots.release()

        async def read() -> None:
            try:
                async for raw in request_iterator:
                    # A Charged message (grpc_calls) comes with its bytes on the budget already:
                    # this stream gives them back when its answer is done.
                    charged = type(raw) is Charged
                    try:
                        await slots.acquire()
                    except BaseException:
                        if charged:
                            self.inflight.give(len(raw))
                        raise
                    if not charged:
                        try:
                            self.inflight.take(len(raw))
                        except ResourceExhausted as err:
                            slots.release()
                            await results.put(pb.ModelStreamInferResponse(
                                error_message=str(err)).SerializeToString())
                            continue
                    task = asyncio.create_task(
                        self._stream_one(raw, results.put, carrier, grpc_error))
                    tasks.add(task)
                    task.add_done_callback(functools.partial(answered, len(raw)))
                if tasks:
                    await asyncio.gather(*list(tasks), return_exceptions=True)
            except asyncio.CancelledError:
                raise               # the stream is over: nobody waits for `done` (nor has room)
            except Exception:       # noqa: BLE001 - the client's half of the stream broke
                log.debug("gRPC ModelStreamInfer request stream failed", exc_info=True)
            await results.put(done)

        reader = asyncio.create_task(read())
        try:
            while (item := await results.get()) is not done:
                if type(item) is _StreamFailure:
                    await context.abort(item.code, item.message)
                yield item
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()


# -- ModelInferRequest -> InferRequest, InferResponse -> ModelInferResponse ---------------

_INT64_MAX = (1 << 63) - 1

# datatype -> (InferTensorContents field, numpy dtype of the values)
_CONTENTS: dict[str, tuple[str, Any]] = {
    "BOOL": ("bool_contents", np.bool_),
    "INT8": ("int_contents", np.int8),
    "INT16": ("int_contents", np.int16),
    "INT32": ("int_contents", np.int32),
    "INT64": ("int64_contents", np.int64),
    "UINT8": ("uint_contents", np.uint8),
    "UINT16": ("uint_contents", np.uint16),
    "UINT32": ("uint_contents", np.uint32),
    "UINT64": ("uint64_contents", np.uint64),
    "FP32": ("fp32_contents", np.float32),
    "FP64": ("fp64_contents", np.float64),
    "BYTES": ("bytes_contents", np.object_),
}
_CONTENT_FIELDS = sorted({f for f, _ in _CONTENTS.values()})


def parameter_value(param: Any) -> Any:
    """The Python value of an InferParameter / ModelRepositoryParameter oneof (None if unset)."""
    which = param.WhichOneof("parameter_choice")
    return None if which is None else getattr(param, which)


def _params(params: Any) -> dict[str, Any]:
    """A protobuf parameter map as a dict (by key: upb maps' items() is collections.abc's
    Python ItemsView, twice the cost)."""
    return {key: parameter_value(params[key]) for key in params}


def set_parameter(param: Any, value: Any) -> None:
    """Store a Python value in an InferParameter's matching oneof field."""
    if isinstance(value, (bool, np.bool_)):
        param.bool_param = bool(value)
    elif isinstance(value, (int, np.integer)):
        value = int(value)
        if value > _INT64_MAX:
            param.uint64_param = value
        else:
            param.int64_param = value
    elif isinstance(value, (float, np.floating)):
        param.double_param = float(value)
    elif isinstance(value, bytes):
        param.string_param = value.decode("utf-8", errors="replace")
    else:
        param.string_param = str(value)


def _from_contents(contents: Any, dt: str, shape: tuple[int, ...], name: str,
                   model_name: str) -> np.ndarray:
    if dt not in _CONTENTS:
        raise InvalidArgument(
            f"input '{name}' for model '{model_name}' has datatype {dt}, which has no typed "
            "'contents' field; send it in 'raw_input_contents'")
    field, np_dtype = _CONTENTS[dt]
    for other in _CONTENT_FIELDS:
        if other != field and len(getattr(contents, other)):
            raise InvalidArgument(
                f"input '{name}' for model '{model_name}' has datatype {dt} but sets "
                f"'{other}'; expected '{field}'")
    values = getattr(contents, field)
    count = element_count(shape)
    if len(values) != count:
        raise InvalidArgument(
            f"unexpected number of elements for input '{name}' for model '{model_name}': shape "
            f"{list(shape)} expects {count}, got {len(values)} in '{field}'")
    if dt == "BYTES":
        arr = np.empty(count, dtype=np.object_)
        arr[:] = list(values)
        return arr.reshape(shape)
    values = list(values)
    if dt in ("INT8", "INT16", "UINT8", "UINT16") and values:
        info = np.iinfo(np_dtype)
        lo, hi = min(values), max(values)
        if lo < info.min or hi > info.max:
            bad = lo if lo < info.min else hi
            raise InvalidArgument(
                f"input '{name}' for model '{model_name}': value {bad} is out of the range of "
                f"datatype {dt}")
    return np.array(values, dtype=np_dtype).reshape(shape)


# Fixed-size datatypes that np.frombuffer reads as they are (BF16 and BOOL need more):
# datatype -> (bytes per element, little-endian dtype)
_PLAIN: dict[str, tuple[int, np.dtype]] = {
    name: (d.size, d.numpy.newbyteorder("<")) for name, d in DATATYPES.items()
    if d.size is not None and name not in ("BF16", "BOOL")}


def decode_grpc_request(req: pb.ModelInferRequest,
                        max_elements: int = DEFAULT_MAX_ELEMENTS) -> InferRequest:
    """Decode a gRPC ModelInferRequest; raises InvalidArgument/Unsupported on client errors.

    Per-request Python work is kept to what the checks need (this runs for every call):
    empty parameter maps are not walked, and a fixed-size input is a view of its bytes."""
    model = req.model_name
    parameters = check_request_parameters(
        _params(req.parameters)) if req.parameters else {}
    if req.model_version:
        check_model_version(req.model_version)
    raw = req.raw_input_contents
    req_inputs = req.inputs
    tparams_of = [_params(inp.parameters)
                  if inp.parameters else {} for inp in req_inputs]
    # an input in a shared memory region has no entry in raw_input_contents
    in_body = [i for i, tparams in enumerate(tparams_of) if "shared_memory_region" not in tparams]

    specs = []
    names: set[str] = set()
    for i, inp in enumerate(req_inputs):
        name, dt = inp.name, inp.datatype
        if dt not in DATATYPES:
            raise InvalidArgument(f"invalid datatype '{dt}' for input '{name}'")
        if name in names:
            raise InvalidArgument(f"[request id: {req.id or '<id_unknown>'}] input '{name}' "
                                  f"already exists in request")      # tritonserver 2.51's words
        names.add(name)
        shape = check_shape(list(inp.shape), name, max_elements)
        if "shared_memory_region" in tparams_of[i] and inp.HasField("contents"):
            raise InvalidArgument(      # tritonserver 2.51's words
                f"unexpected 'content' provided when using shared memory for input tensor "
                f"'{name}' for model '{model}'")
        if len(raw) and inp.HasField("contents"):
            raise InvalidArgument(
                f"contents field must not be specified when using raw_input_contents for "
                f"'{name}' for model '{model}'")
        specs.append((inp, name, dt, shape, tparams_of[i], i))
    # after the per-input checks, as Triton's front: an input sent in both 'contents' and
    # 'raw_input_contents' is named by that error, not by the count below
    if len(raw) and len(raw) != len(in_body):
        raise InvalidArgument(
            f"expected {len(in_body)} inputs but got {len(raw)} inputs in "
            f"'raw_input_contents' for model '{model}'")
    raw_index = {i: k for k, i in enumerate(in_body)}

    inputs = []
    shared = False
    for inp, name, dt, shape, tparams, i in specs:
        if "shared_memory_region" in tparams:
            arr = None      # the engine reads it from the region (engine/shared_memory.py)
            shared = True
        elif len(raw):
            buf = raw[raw_index[i]]
            plain = _PLAIN.get(dt)
            count = element_count(shape)
            if plain is not None and len(buf) == count * plain[0]:
                arr = np.frombuffer(buf, dtype=plain[1], count=count).reshape(shape)
            else:           # BYTES, BF16, BOOL, and the size error's words
                arr = tensor_from_wire(buf, dt, shape, name, model)
        else:
            arr = _from_contents(inp.contents, dt, shape, name, model)
        inputs.append(InferTensor(name, dt, shape, arr, tparams))

    outputs: list[RequestedOutput] = []
    seen: set[str] = set()
    for out in req.outputs:
        if out.name in seen:
            raise InvalidArgument(f"output '{out.name}' is requested more than once")
        seen.add(out.name)
        if not out.parameters:
            outputs.append(RequestedOutput(out.name, {}))
            continue
        oparams = _params(out.parameters)
        shared = shared or "shared_memory_region" in oparams
        cls = oparams.get("classification")
        if cls is not None and (isinstance(cls, bool) or not isinstance(cls, int) or cls < 0):
            raise InvalidArgument(
                f"unable to set 'classification' of output '{out.name}': expected a "
                "non-negative integer")
        outputs.append(RequestedOutput(out.name, oparams))

    request = InferRequest(model, req.model_version, req.id, inputs, outputs or None, parameters)
    if shared:
        request.shared_memory = True
    return request


def encode_grpc_response(resp: InferResponse, request: InferRequest
                         ) -> pb.ModelInferResponse:
    """A ModelInferResponse with every output's data in ``raw_output_contents``."""
    msg = pb.ModelInferResponse(
        model_name=resp.model_name, model_version=str(resp.model_version),
        id=resp.id or request.id)
    for key, value in resp.parameters.items():
        set_parameter(msg.parameters[key], value)
    for t in resp.outputs:
        out = msg.outputs.add(name=t.name, datatype=t.datatype, shape=[int(d) for d in t.shape])
        for key, value in t.parameters.items():
            set_parameter(out.parameters[key], value)
        # an output written to a shared memory region keeps an empty entry, as in Triton
        msg.raw_output_contents.append(b"" if t.data is None else tensor_to_wire(t.data, t.datatype))
    return msg


def parse_infer_request(raw: bytes) -> pb.ModelInferRequest:
    try:
        return pb.ModelInferRequest.FromString(raw)
    except DecodeError as err:
        raise InvalidArgument(f"unable to parse the ModelInferRequest message: {err}") from None


_RAW_INPUT_TAG = b"\x3a"       # ModelInferRequest.raw_input_contents: field 7, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class RequestPlans:
    """ModelInfer requests that differ from an earlier one only in their tensors' bytes,
    decoded without protobuf: clients repeat one message layout (perf_analyzer, tritonclient
    for one shape), and decoding its fields costs more than the rest of the call on the loop.

    A plan is kept when a message ends with every input's ``raw_input_contents`` (protobuf
    writes fields in number order: 7 comes last), every input is a fixed-size numeric tensor
    (not BOOL nor BF16, whose bytes are checked or converted) and every parameter a scalar.
    A message of the same size whose bytes before those contents are the same, and whose
    contents have the same lengths, is the same request but for the tensor values: its
    inputs are views of its bytes at the same offsets. Bounded: 64 plans of heads up to
    4 KiB, forgotten all at once when full."""

    MAX_PLANS = 64
    MAX_HEAD = 4096

    def __init__(self) -> None:
        self._by_size: dict[int, list[tuple]] = {}
        self._count = 0

    def decode(self, raw: bytes, **decode_kwargs: Any) -> InferRequest:
        if not isinstance(raw, bytes):
            return decode_grpc_request(parse_infer_request(raw), **decode_kwargs)
        for plan in self._by_size.get(len(raw), ()):
            request = _from_plan(plan, raw)
            if request is not None:
                return request
        message = parse_infer_request(raw)
        request = decode_grpc_request(message, **decode_kwargs)
        plan = _plan(raw, message, request, self.MAX_HEAD)
        if plan is not None:
            if self._count >= self.MAX_PLANS:
                self._by_size.clear()
                self._count = 0
            self._by_size.setdefault(len(raw), []).append(plan)
            self._count += 1
        return request


def _plan(raw: bytes, message: pb.ModelInferRequest, request: InferRequest,
          max_head: int) -> tuple | None:
    contents = message.raw_input_contents
    inputs = request.inputs
    if (not contents or len(contents) != len(inputs) or not scalar_values(request.parameters)
            or request.shared_memory):      # (decoded in full: a plan would not mark it)
        return None
    frames = [_RAW_INPUT_TAG + _varint(len(c)) for c in contents]
    start = len(raw) - sum(len(f) + len(c) for f, c in zip(frames, contents))
    if not 0 <= start <= max_head:
        return None
    specs, pos = [], start
    for frame, content, tensor in zip(frames, contents, inputs):
        arr = tensor.data
        if (tensor.datatype in ("BOOL", "BF16") or type(arr) is not np.ndarray
                or arr.dtype.kind not in "iuf" or arr.nbytes != len(content)
                or not scalar_values(tensor.parameters)
                or not raw.startswith(frame, pos)
                or not raw.startswith(content, pos + len(frame))):
            return None
        specs.append((frame, pos + len(frame), tensor.name, tensor.datatype, tensor.shape,
                      arr.dtype, arr.size, dict(tensor.parameters)))
        pos += len(frame) + len(content)
    outputs = None
    if request.outputs is not None:
        if not all(scalar_values(o.parameters) for o in request.outputs):
            return None
        outputs = [(o.name, dict(o.parameters)) for o in request.outputs]
    return (raw[:start], specs, request.model_name, request.model_version, request.id,
            dict(request.parameters), outputs)


def _from_plan(plan: tuple, raw: bytes) -> InferRequest | None:
    head, specs, model, version, request_id, parameters, outputs = plan
    if not raw.startswith(head):
        return None
    for frame, offset, *_ in specs:
        if not raw.startswith(frame, offset - len(frame)):
            return None
    inputs = [InferTensor(name, dt, shape, np.ndarray(shape, dtype, raw, offset),
                          dict(tparams) if tparams else {})
              for _, offset, name, dt, shape, dtype, count, tparams in specs]
    return InferRequest(model, version, request_id, inputs,
                        None if outputs is None else
                        [RequestedOutput(name, dict(params) if params else {})
                         for name, params in outputs],
                        dict(parameters) if parameters else {})


_ID_TAG = b"\x1a"               # ModelInferResponse.id: field 3, length-delimited
_RAW_OUTPUT_TAG = b"\x32"       # ModelInferResponse.raw_output_contents: field 6
_INFER_RESPONSE_TAG = b"\x12"   # ModelStreamInferResponse.infer_response: field 2
_PARAM_TYPES = frozenset((str, int, bool, float))


def _params_key(params: dict) -> tuple | None:
    """A parameter map as part of a plan's key (types too: True and 1 are two oneofs), or
    None where a value is not one the plan can key (a plan is not made)."""
    key = []
    for name, value in params.items():
        kind = type(value)
        if kind not in _PARAM_TYPES or value != value:      # (NaN never equals its key)
            return None
        key.append((name, kind, value))
    return tuple(key)


class ResponsePlans:
    """ModelInferResponse bytes written from a plan: responses of one model repeat one layout
    (model, version, output names, datatypes, shapes, parameters) and differ in their id and
    outputs' bytes; building and serialising a protobuf for each cost more than the rest of
    the encode on the loop.

    A plan is the message protobuf writes without ``id`` and ``raw_output_contents``, split
    where the id goes (protobuf writes fields in number order: 1, 2 before id's 3; 4, 5 after;
    6 last), and each output's length-delimited prefix. A response is the plan's pieces around
    its own id and tensors' bytes: what SerializeToString writes for the same message. BYTES
    outputs (their length varies) and outputs in shared memory are encoded by protobuf.
    Bounded: 64 plans, forgotten all at once when full."""

    MAX_PLANS = 64

    def __init__(self) -> None:
        self._plans: dict[tuple, tuple] = {}

    def encode(self, resp: InferResponse, request: InferRequest) -> bytes:
        key = self._key(resp)
        if key is None:
            return encode_grpc_response(resp, request).SerializeToString()
        plan = self._plans.get(key)
        if plan is None:
            plan = _response_plan(resp)
            if len(self._plans) >= self.MAX_PLANS:
                self._plans.clear()
            self._plans[key] = plan
        head, tail, frames = plan
        rid = resp.id or request.id
        parts = [head]
        if rid:
            rid = rid.encode()
            parts += (_ID_TAG, _varint(len(rid)), rid)
        parts.append(tail)
        for t, (frame, size, wire) in zip(resp.outputs, frames):
            arr = t.data
            # an array already in its wire layout is joined as it is (a buffer: no copy)
            if wire is None or type(arr) is not np.ndarray or arr.dtype != wire or \
                    not arr.flags.c_contiguous:
                arr = tensor_wire_buffer(arr, t.datatype)
            if arr.nbytes != size:      # (a shape that does not fit its data: protobuf's)
                return encode_grpc_response(resp, request).SerializeToString()
            parts += (frame, arr)
        return b"".join(parts)

    def encode_stream(self, resp: InferResponse, request: InferRequest) -> bytes:
        """The ModelStreamInferResponse that carries ``resp`` on a stream, serialised: its
        ModelInferResponse written as ``encode`` writes it, with Triton's
        ``triton_final_response`` parameter (``resp.final``); an empty final response names
        the request's model."""
        named = resp.model_name
        message = self.encode(InferResponse(
            named or request.model_name, resp.model_version if named else request.model_version,
            resp.id, resp.outputs, {**resp.parameters, "triton_final_response": resp.final}),
            request)
        return _INFER_RESPONSE_TAG + _varint(len(message)) + message

    @staticmethod
    def _key(resp: InferResponse) -> tuple | None:
        layout = []
        for t in resp.outputs:
            if t.data is None or t.datatype == "BYTES" or t.datatype not in DATATYPES:
                return None
            params = _params_key(t.parameters) if t.parameters else ()
            if params is None:
                return None
            shape = t.shape
            layout.append((t.name, t.datatype, shape if type(shape) is tuple else tuple(shape),
                           params))
        params = _params_key(resp.parameters) if resp.parameters else ()
        if params is None:
            return None
        return resp.model_name, str(resp.model_version), params, tuple(layout)


def _response_plan(resp: InferResponse) -> tuple:
    msg = encode_grpc_response(
        InferResponse(resp.model_name, resp.model_version, "",
                      [InferTensor(t.name, t.datatype, t.shape, None, t.parameters)
                       for t in resp.outputs], resp.parameters),
        InferRequest(resp.model_name))
    del msg.raw_output_contents[:]
    layout = msg.SerializeToString()
    head = pb.ModelInferResponse(
        model_name=msg.model_name, model_version=msg.model_version).SerializeToString()
    assert layout.startswith(head)      # fields in number order: model_name, model_version
    frames = []
    for t in resp.outputs:
        size = element_count(t.shape) * DATATYPES[t.datatype].size
        frames.append((_RAW_OUTPUT_TAG + _varint(size), size,     # BF16: narrowed first
                       None if t.datatype == "BF16" else wire_dtype(t.datatype)))
    return head, layout[len(head):], frames
