"""The HTTP codec: KServe v2 infer requests decoded and responses encoded, with Triton's
binary tensor data extension; a repeated request shape from its plan.

A client sends requests of one shape again and again (perf_analyzer, tritonclient, a
notebook's loop). A request whose JSON header was seen before, and a response whose layout
was, are decoded and written here from what the first one found, without leaving this
module. Anything else is decoded and written in full by the modules named for what they do:
``v2_rules`` (what each field of a request must be), ``json_tensors`` and ``json_slices``
(tensors as JSON text; large documents in slices), ``binary_data`` (the bytes after the JSON
header, raw requests, binary outputs).
"""
from __future__ import annotations

import json
from typing import Any, Iterator

import numpy as np
import orjson

from .binary_data import encode_parts, encode_response, joined
from .datatypes import (element_count, element_size, tensor_from_wire, tensor_wire_buffer,
                        wire_dtype)
from .errors import InvalidArgument
from .json_slices import SLICED_MIN, Hole, parse_large_json
from .json_tensors import (encode_header, json_data_to_array, json_numbers, may_hold_big_integer,
                           parse_json, read_as_sent, read_json)
from .types import InferRequest, InferResponse, InferTensor, RequestedOutput, scalar_values
from .v2_rules import DEFAULT_MAX_ELEMENTS, check_document

# -- requests ----------------------------------------------------------------------------

# A client sends the same JSON header with every request of one shape (perf_analyzer,
# tritonclient, a notebook's loop): what decoding a header found (its fields, checked) is kept,
# keyed by its bytes, the body's size and the model, for headers whose inputs are all binary
# data or shared memory (no tensor values in the JSON) and whose parameters are scalars. A
# repeat is then a lookup and one array view per input; each request gets its own
# parameter dicts. Bounded: entries of small headers, forgotten all at once when full.
_PLANS: dict[tuple, tuple] = {}
_PLANS_MAX = 256
_PLAN_HEADER_MAX = 4096


def _plain_view(dt: str, shape: tuple[int, ...], span: tuple[int, int] | None
                ) -> np.dtype | None:
    """The wire dtype of a binary input whose bytes are its values as they are (not BF16,
    widened, nor BOOL, whose bytes are checked), sized as its shape says."""
    size = element_size(dt)
    if span is None or size is None or dt in ("BF16", "BOOL"):
        return None
    return wire_dtype(dt) if span[1] - span[0] == element_count(shape) * size else None


def _from_plan(plan: tuple, view: memoryview, model_name: str, model_version: str
               ) -> InferRequest:
    request_id, parameters, specs, outputs, shared = plan
    inputs = []
    for name, dt, shape, tparams, span, plain in specs:
        if plain is not None:       # a view at its offset: its size was checked with the plan's
            arr = np.ndarray(shape, plain, view, span[0])     # (cheaper than frombuffer+reshape)
        else:
            arr = None if span is None else \
                tensor_from_wire(view[span[0]:span[1]], dt, shape, name, model_name)
        inputs.append(InferTensor(name, dt, shape, arr, dict(tparams) if tparams else {}))
    request = InferRequest(model_name, model_version, request_id, inputs,
                          [RequestedOutput(name, dict(params) if params else {})
                           for name, params in outputs] if outputs is not None else None,
                          dict(parameters) if parameters else {})
    if shared:
        request.shared_memory = True
    return request


def decode_infer_request(body: bytes | memoryview, header_length: int | None, model_name: str,
                         model_version: str, max_elements: int = DEFAULT_MAX_ELEMENTS
                         ) -> InferRequest:
    """Decode a v2 infer request body; ``header_length`` is Inference-Header-Content-Length
    (None: the whole body is JSON). Binary inputs become views over ``body``."""
    view = memoryview(body).cast("B")
    total = len(view)
    if header_length is None:
        header_length = total
    elif header_length < 0 or header_length > total:
        raise InvalidArgument(
            f"inference header size should be in range (0, {total}), got: {header_length}")
    text = body if isinstance(body, bytes) and header_length == total else bytes(view[:header_length])
    key = (text, total, model_name, max_elements) if header_length <= _PLAN_HEADER_MAX else None
    if key is not None:
        plan = _PLANS.get(key)
        if plan is not None:
            return _from_plan(plan, view, model_name, model_version)
    if header_length >= SLICED_MIN:
        return _decode_document(parse_large_json(text), view, header_length, model_name,
                                model_version, max_elements, key)
    # orjson first, without parse_json's scan for integers past 64 bits (which it reads as
    # floats): a float where json read an integer shows only in an error's words or in a
    # parameter, passed on as sent (a float value is the same either way), so only then is
    # the document read as json reads it, when it may hold such an integer.
    doc, loose = read_json(text)
    if not loose:
        return _decode_document(doc, view, header_length, model_name, model_version,
                                max_elements, key)
    try:
        request = _decode_document(doc, view, header_length, model_name, model_version,
                                   max_elements, key)
    except InvalidArgument:
        if not may_hold_big_integer(text):
            raise
    else:
        if all(map(read_as_sent, _parameter_maps(request))) or not may_hold_big_integer(text):
            return request
    if key is not None:
        _PLANS.pop(key, None)
    return _decode_document(parse_json(text), view, header_length, model_name, model_version,
                            max_elements, key)


def _parameter_maps(request: InferRequest) -> Iterator[dict]:
    yield request.parameters
    for t in request.inputs:
        yield t.parameters
    for o in request.outputs or ():
        yield o.parameters


def _decode_document(doc: Any, view: memoryview, header_length: int, model_name: str,
                     model_version: str, max_elements: int, key: tuple | None) -> InferRequest:
    """``doc`` checked (v2_rules), kept as the plan of ``key`` where a repeat can be built
    from the plan and the body alone, then its tensors built."""
    checked = check_document(doc, header_length, len(view), model_name, max_elements)
    specs, outputs = checked.inputs, checked.outputs
    # whether a tensor names a shared memory region: the request's mark for the engine
    shared = any("shared_memory_region" in tparams for _, _, _, tparams, _, _ in specs) or \
        any("shared_memory_region" in o.parameters for o in outputs or ())
    if key is not None and scalar_values(checked.parameters) and all(
            (span is not None or "shared_memory_region" in tparams) and scalar_values(tparams)
            for _, _, _, tparams, _, span in specs) and all(
            scalar_values(o.parameters) for o in outputs or ()):
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = (checked.id, dict(checked.parameters),
                       [(name, dt, shape, dict(tparams), span, _plain_view(dt, shape, span))
                        for name, dt, shape, tparams, _, span in specs],
                       None if outputs is None else [(o.name, dict(o.parameters)) for o in outputs],
                       shared)

    inputs = []
    for name, dt, shape, tparams, data, span in specs:
        if "shared_memory_region" in tparams:
            arr = None      # the engine reads it from the region (engine/shared_memory.py)
        elif span is None:
            arr = data.to_array(dt, shape, name) if isinstance(data, Hole) else \
                json_data_to_array(data, dt, shape, name)
        else:
            arr = tensor_from_wire(view[span[0]:span[1]], dt, shape, name, model_name)
        inputs.append(InferTensor(name=name, datatype=dt, shape=shape, data=arr,
                                  parameters=tparams))
    request = InferRequest(model_name=model_name, model_version=model_version, id=checked.id,
                           inputs=inputs, outputs=outputs, parameters=checked.parameters)
    if shared:
        request.shared_memory = True
    return request


# -- responses -------------------------------------------------------------------------

def encode_infer_response(response: InferResponse, request: InferRequest
                          ) -> tuple[bytes, int | None]:
    """The response body and its Inference-Header-Content-Length (None: all JSON).

    An output goes binary when its requested ``binary_data`` says so, else when the request's
    ``binary_data_output`` does. A BYTES output that is not UTF-8 cannot be JSON text and is
    sent binary whatever was asked: tritonclient reads either form.
    """
    planned = _planned_response(response, request)
    if planned is not None:
        return planned
    return encode_response(response, request)


# Responses whose layout repeats (model, version, each output's name, datatype, shape and
# whether it goes binary, no parameters, no BYTES): (the JSON header before the id, its text
# after the id cut where each JSON output's values go, each output's wire size and dtype or
# None for a JSON one), or None for a layout no plan can write. Bounded: forgotten when full.
_RESPONSE_PLANS: dict[tuple, tuple | None] = {}
_RESPONSE_PLANS_MAX = 256


def _planned_response(response: InferResponse, request: InferRequest
                      ) -> tuple[bytes, int | None] | None:
    """``encode_response``'s bytes from the plan of the response's layout: the header is the
    same but for the id and the JSON outputs' values, the rest is the binary outputs' bytes
    (an array already in its wire layout joined as it is). None: not planned."""
    if response.parameters:
        return None
    params = request.parameters
    default_binary = params.get("binary_data_output", False) if params else False
    requested = {o.name: o.parameters for o in request.outputs} if request.outputs else None
    layout = [response.model_name, response.model_version]
    for t in response.outputs:
        if t.parameters or t.datatype == "BYTES" or t.data is None:
            return None
        wanted = requested.get(t.name) if requested is not None else None
        shape = t.shape
        layout.append((t.name, t.datatype, shape if type(shape) is tuple else tuple(shape),
                       wanted.get("binary_data", default_binary) if wanted else default_binary))
    if len(layout) == 2:
        return None             # no outputs: an all-JSON reply
    key = tuple(layout)
    plan = _RESPONSE_PLANS.get(key, False)
    rid = response.id or request.id
    if rid and type(rid) is not str:
        return None
    if plan is False:           # encoded in full, and what it wrote is the plan
        header, spliced, buffers = encode_parts(response, request)
        plan = _response_plan(response, rid, [binary for *_, binary in layout[2:]], header,
                              spliced)
        if plan is not False:
            if len(_RESPONSE_PLANS) >= _RESPONSE_PLANS_MAX:
                _RESPONSE_PLANS.clear()
            _RESPONSE_PLANS[key] = plan
        return joined(header, spliced, buffers)
    if plan is None:
        return None
    head, pieces, wires = plan
    if rid:
        text = _id_text(rid)
        if text is None:
            return None
        parts = [head, b',"id":', text, pieces[0]]
    else:
        parts = [head, pieces[0]]
    buffers = []
    piece = 0
    for t, (size, wire) in zip(response.outputs, wires):
        if size is None:                # a JSON output: its values before the next piece
            numbers = json_numbers(t)
            if numbers is None:
                return None
            piece += 1
            parts += (b"[", b",".join(numbers), b"]", pieces[piece])
            continue
        arr = t.data
        if wire is None or type(arr) is not np.ndarray or arr.dtype != wire or \
                not arr.flags.c_contiguous:
            arr = tensor_wire_buffer(arr, t.datatype)
        if arr.nbytes != size:      # data that does not fit its shape: the header says so
            return None
        buffers.append(arr)
    if not buffers:
        return b"".join(parts), None
    length = sum(map(len, parts))
    parts += buffers
    return b"".join(parts), length


def _id_text(rid: str) -> bytes | None:
    """The id as JSON text, written here rather than by json_tensors.encode_header so that a
    planned response stays in this module; None for one that json escapes and orjson does
    not (non-ASCII, DEL) or that orjson refuses (a lone surrogate): written in full."""
    try:
        text = orjson.dumps(rid)
    except orjson.JSONEncodeError:
        return None
    return text if text.isascii() and b"\x7f" not in text else None


def _response_plan(response: InferResponse, rid: str, binary: list[bool], header: bytes,
                   spliced: dict[int, tuple[bytes, list[bytes]]]) -> tuple | None | bool:
    """The plan of ``response``'s layout (its outputs ``binary`` or not) from its full
    encoding (``encode_parts``'s ``header`` and ``spliced``); None: a layout no plan writes;
    False: nothing to learn from this one (its data does not fit its shapes, or non-finite
    floats of a JSON output were spelled by json, not written apart)."""
    wires = []
    for i, t in enumerate(response.outputs):
        if not binary[i]:
            if i not in spliced:
                return False
            wires.append((None, None))
            continue
        size = element_count(t.shape) * element_size(t.datatype)
        if memoryview(tensor_wire_buffer(t.data, t.datatype)).nbytes != size:
            return False
        wires.append((size, None if t.datatype == "BF16" else wire_dtype(t.datatype)))
    head = encode_header({"model_name": response.model_name,
                           "model_version": str(response.model_version)}, True)[:-1]
    start = head + b',"id":' + encode_header(rid, True) if rid else head
    if not header.startswith(start):
        return None
    pieces, rest = [], header[len(start):]
    for marker, _ in spliced.values():
        before, _, rest = rest.partition(marker)
        pieces.append(before)
    return head, [*pieces, rest], wires


def encode_error(err: Exception) -> bytes:
    """Triton's error body: ``{"error": "<message>"}``."""
    return json.dumps({"error": str(err)}).encode()
