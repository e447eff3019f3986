"""KServe v2 JSON inference requests/responses, with Triton's binary tensor data extension.

A request body is a JSON header, optionally followed (when the client sends
``Inference-Header-Content-Length``) by the binary data of the inputs that carry
``parameters.binary_data_size``, in input order. Every client mistake becomes an
InvalidArgument (400) naming the input and the rule, raised before anything sized by the
request is allocated.
"""
from __future__ import annotations

import base64
import json
import re
import secrets
from typing import Any, Iterator, NoReturn

import numpy as np
import orjson

from .datatypes import (count_bytes_elements, element_count, element_size, is_valid_datatype, round_to_bf16,
                        tensor_from_wire, tensor_wire_buffer, triton_to_numpy, wire_dtype)
from .errors import InvalidArgument
from .types import InferRequest, InferResponse, InferTensor, RequestedOutput, scalar_values

# Far past any real tensor, far below what a shape product can claim.
DEFAULT_MAX_ELEMENTS = 1 << 32
# numpy's own limit on dimensions; a deeper shape could not be built anyway.
MAX_RANK = 64

_INT_TYPES = {"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"}
_FLOAT_TYPES = {"FP16", "FP32", "FP64", "BF16"}
_FINITE_MAX = {"FP16": float(np.finfo(np.float16).max), "FP32": float(np.finfo(np.float32).max)}


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


# Digits as b"0", what continues a number past its integer part (. e E) as b".", a minus
# sign as b"-", the rest b"1".
_NUMBER_CHARS = bytes(48 if 48 <= i <= 57 else 46 if i in b".eE" else 45 if i == 45 else 49
                      for i in range(256))
_INTEGER_START = b"1" + b"0" * 20      # 2**64 has 20 digits
_NEGATIVE_START = b"-" + b"0" * 19     # -2**63 has 19: orjson reads -2**63 - 1 as a float


def _may_hold_big_integer(raw: bytes) -> bool:
    """Whether ``raw`` has a run of 20 or more digits after a delimiter, or of 19 or more
    after a minus sign, that ends at a delimiter: an integer past 64 bits, or below -2**63
    (or such digits inside a string). Found at C speed; a run that goes on into a fraction
    or an exponent (rapidjson writes 4.4e20 as 440059843361160300000.0) is a float."""
    text = raw.translate(_NUMBER_CHARS)
    return (text.startswith(_INTEGER_START[1:]) and _ends_an_integer(text, 0, 20)
            or _has_run(text, _INTEGER_START) or _has_run(text, _NEGATIVE_START))


def _has_run(text: bytes, marker: bytes) -> bool:
    start = text.find(marker) + 1       # the run's first digit; 0: none
    while start:
        if _ends_an_integer(text, start, len(marker) - 1):
            return True
        start = text.find(marker, start) + 1
    return False


def _ends_an_integer(text: bytes, start: int, digits: int) -> bool:
    """Whether the run of at least ``digits`` digits at ``start`` ends the number."""
    end, n = start + digits, len(text)
    while end < n and text[end] == 48:
        end += 1
    return end == n or text[end] != 46


def _parse_json(raw: bytes) -> Any:
    if not raw:
        raise InvalidArgument("failed to parse the request JSON buffer: the document is empty")
    # orjson parses 5-6x faster; it is stricter than json (NaN, Infinity, lone surrogates,
    # depth past 1024), so what it refuses goes to json: the same documents are accepted as
    # before and a refusal carries json's message, as before. One thing it reads otherwise:
    # an integer past 64 bits becomes a float, so a document that may hold one is json's too.
    if not _may_hold_big_integer(raw):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    try:
        return json.loads(raw)
    except RecursionError:
        raise InvalidArgument(
            "failed to parse the request JSON buffer: JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise InvalidArgument(f"failed to parse the request JSON buffer: {e}") from None


def _is_uint(v: Any) -> bool:
    return type(v) is int and v >= 0


# -- request parameters ----------------------------------------------------------------

def check_request_parameters(params: Any) -> dict[str, Any]:
    if not isinstance(params, dict):
        raise InvalidArgument(
            f"unable to parse 'parameters': expected an object, got {_json_type(params)}")
    for key, value in params.items():
        if key == "sequence_id":
            ok = _is_uint(value) or isinstance(value, str)
            want = "an unsigned integer or a string"
        elif key in ("sequence_start", "sequence_end", "binary_data_output"):
            ok, want = isinstance(value, bool), "a boolean"
        elif key in ("priority", "timeout"):
            ok, want = _is_uint(value), "an unsigned integer"
        elif key == "triton_enable_empty_final_response":
            # the one reserved key Triton accepts (perf_analyzer sends it over gRPC)
            ok, want = isinstance(value, bool), "a boolean"
        elif key.startswith("triton_"):
            raise InvalidArgument(
                "parameter keys starting with 'triton_' are reserved for Triton usage and "
                "should not be specified.")
        else:
            continue
        if not ok:
            raise InvalidArgument(
                f"unable to parse '{key}': expected {want}, got {_json_type(value)}")
    return dict(params)


# -- inputs ------------------------------------------------------------------------------

def _check_shape(shape: Any, name: str, max_elements: int) -> tuple[int, ...]:
    if not isinstance(shape, list):
        raise InvalidArgument(
            f"unable to parse 'shape' of input '{name}': expected an array of non-negative "
            f"integers, got {_json_type(shape)}")
    if len(shape) > MAX_RANK:
        raise InvalidArgument(
            f"input '{name}' has {len(shape)} dimensions, more than the limit of {MAX_RANK}")
    for d in shape:
        if not _is_uint(d):
            raise InvalidArgument(
                f"unable to parse 'shape' of input '{name}': dimensions must be non-negative "
                f"integers, got {json.dumps(d)} in {json.dumps(shape)}")
    count = element_count(shape)
    if count > max_elements:
        raise InvalidArgument(
            f"input '{name}' has shape {json.dumps(shape)} with {count} elements, more than the "
            f"limit of {max_elements}")
    if any(d > max_elements for d in shape):   # [0, 2**62]: no elements, yet no array has it
        raise InvalidArgument(
            f"input '{name}' has shape {json.dumps(shape)} with a dimension larger than the "
            f"limit of {max_elements} elements")
    return tuple(shape)


def _flatten(data: list, count: int, types: set[type]) -> list:
    """Row-major leaves of ``data``, however it is nested: Triton 2.51 takes any nesting
    whose element count matches the shape ([[1, 2], [3, 4]] for [1, 4] as for [2, 2]).
    One pass over the nodes, stopping once past ``count`` leaves (a huge body costs no more
    than its elements; JSON's own depth limit bounds the stack). ``types``: the distinct
    types of ``data``'s elements; a flat list (the common case) is returned as is."""
    if not any(issubclass(t, list) for t in types):
        return data
    leaves: list = []
    stack = [iter(data)]
    while stack:
        for x in stack[-1]:
            if isinstance(x, list):
                stack.append(iter(x))
                break
            leaves.append(x)
        else:
            stack.pop()
            continue
        if len(leaves) > count:
            break
    return leaves


def _bad_element(values: list, ok, name: str, dt: str, want: str) -> NoReturn:
    for i, v in enumerate(values):
        if not ok(v):
            raise InvalidArgument(
                f"unable to parse 'data' of input '{name}': element {i} is {_json_type(v)} "
                f"({json.dumps(v)[:40]}), expected {want} for datatype {dt}")
    raise InvalidArgument(f"unable to parse 'data' of input '{name}' as datatype {dt}")


def _fits_fp64(v: Any) -> bool:
    try:
        float(v)
    except OverflowError:
        return False
    return True


def json_data_to_array(data: Any, dt: str, shape: tuple[int, ...], name: str) -> np.ndarray:
    """The array for a JSON ``data`` field, checked against ``shape`` and ``dt``."""
    if isinstance(data, _Hole):
        return data.to_array(dt, shape, name)
    if not isinstance(data, list):
        raise InvalidArgument(
            f"unable to parse 'data' of input '{name}': expected an array, got {_json_type(data)}")
    count = element_count(shape)
    types = set(map(type, data))        # every element's type at C speed (3x a generator)
    values = _flatten(data, count, types)
    if len(values) != count:
        got = len(values) if values is data or len(values) < count else f"more than {count}"
        raise InvalidArgument(_count_message(name, shape, count, got))
    return _values_to_array(values, dt, name, 0, types if values is data else None).reshape(shape)


def _count_message(name: str, shape: tuple[int, ...], count: int, got: int | str) -> str:
    return (f"unable to parse 'data' of input '{name}': shape {list(shape)} expects {count} "
            f"elements, got {got}")


def _values_to_array(values: list, dt: str, name: str, first: int,
                     types: set[type] | None = None) -> np.ndarray:
    """A flat list of JSON values as an array of ``dt``; ``first`` is the index of
    ``values[0]`` in the whole tensor (so that errors name the element the client sent);
    ``types``: the distinct types of ``values``, when known."""
    try:
        return _convert(values, dt, name, set(map(type, values)) if types is None else types)
    except _BadElement as bad:
        raise InvalidArgument(
            f"unable to parse 'data' of input '{name}': element {first + bad.index} is "
            f"{_json_type(bad.value)} ({json.dumps(bad.value)[:40]}), expected {bad.want} for "
            f"datatype {dt}") from None
    except _OutOfRange as bad:
        raise InvalidArgument(
            f"unable to parse 'data' of input '{name}': element {first + bad.index} "
            f"({bad.value}) is out of the range of datatype {dt}") from None


class _BadElement(Exception):
    def __init__(self, index: int, value: Any, want: str) -> None:
        self.index, self.value, self.want = index, value, want


class _OutOfRange(Exception):
    def __init__(self, index: int, value: Any) -> None:
        self.index, self.value = index, value


def _first_bad(values: list, ok, want: str) -> NoReturn:
    for i, v in enumerate(values):
        if not ok(v):
            raise _BadElement(i, v, want)
    raise _BadElement(0, values[0] if values else None, want)  # pragma: no cover


def _convert(values: list, dt: str, name: str, types: set[type]) -> np.ndarray:
    # bool is its own type, so True is not taken for an integer nor a number.
    if dt == "BOOL":
        if not types <= {bool}:
            _first_bad(values, lambda v: type(v) is bool, "a boolean")
        return np.array(values, dtype=np.bool_)
    if dt in _INT_TYPES:
        if not types <= {int}:
            _first_bad(values, lambda v: type(v) is int, "an integer")
        info = np.iinfo(triton_to_numpy(dt))
        if values and (min(values) < info.min or max(values) > info.max):
            _first_bad(values, lambda v: info.min <= v <= info.max,
                       f"an integer in [{info.min}, {info.max}]")
        return np.array(values, dtype=triton_to_numpy(dt))
    if dt in _FLOAT_TYPES:
        if not types <= {int, float}:
            _first_bad(values, lambda v: type(v) in (int, float), "a number")
        try:
            wide = np.array(values, dtype=np.float64)
        except OverflowError:
            _first_bad(values, _fits_fp64, "a number within the range of FP64")
        if dt == "FP64":
            return wide
        if dt != "BF16" and np.abs(wide).max(initial=0) <= _FINITE_MAX[dt]:
            return wide.astype(triton_to_numpy(dt))     # no value overflows: nothing to check
        with np.errstate(over="ignore"):
            arr = wide.astype(triton_to_numpy(dt))
            if dt == "BF16":
                arr = round_to_bf16(arr)
        overflow = np.isinf(arr) & np.isfinite(wide)
        if overflow.any():
            i = int(np.argmax(overflow))
            raise _OutOfRange(i, values[i])
        return arr
    if dt == "BYTES":
        if not types <= {str}:
            _first_bad(values, lambda v: type(v) is str, "a string")
        arr = np.empty(len(values), dtype=np.object_)
        arr[:] = [v.encode("utf-8") for v in values]
        return arr
    raise InvalidArgument(f"invalid datatype '{dt}' for input '{name}'")  # pragma: no cover


# -- large JSON documents, decoded in slices ----------------------------------------------
#
# json.loads holds the GIL for the whole document: 60 MiB of numbers is a second or more
# during which no other thread (the server's event loop included) runs, even when the
# decode was handed to a worker thread. So a large document is decoded in slices of a few
# milliseconds each: the long runs of numbers inside arrays (what makes a request large) are
# cut out and replaced by a marker, the small remaining skeleton is parsed in one go, and
# each run is parsed and converted slice by slice, the GIL free for others in between.

SLICED_MIN = 1 << 20          # documents below this are parsed in one go
_RUN_MIN = 64 * 1024          # a run of numbers must fill a whole window of this size
_SLICE = 64 * 1024            # bytes of numbers parsed per slice (a few ms)
_NUMERIC = b"0123456789+-.eE,\t\n\r "
_NOT_SPACE = re.compile(rb"[^ \t\n\r]")
_MASK = bytes(48 if i in _NUMERIC else 49 for i in range(256))    # b"0" numeric, b"1" not


class _Hole:
    """The text of one long run of numbers (an array's inside), decoded on demand."""

    def __init__(self, text: bytes, start: int, end: int) -> None:
        self.text, self.start, self.end = text, start, end

    def slices(self):
        """The run's values, one list per slice (each a short json.loads)."""
        text, pos, end = self.text, self.start, self.end
        if _NOT_SPACE.search(text, pos, end) is None:        # "[ ]": an empty array
            return
        while pos < end:
            cut = end if end - pos <= _SLICE else text.rfind(b",", pos, pos + _SLICE)
            if cut <= pos:                      # no comma in a whole slice: not a number list
                cut = end
            piece = text[pos:cut]
            if not piece.strip():
                raise InvalidArgument("failed to parse the request JSON buffer: an array "
                                      "element is missing")
            yield _parse_json(b"[" + piece + b"]")
            pos = cut + 1
        if text[end - 1:end] == b",":
            raise InvalidArgument("failed to parse the request JSON buffer: trailing comma "
                                  "in an array")

    def to_list(self) -> list:
        out: list = []
        for values in self.slices():
            out.extend(values)
        return out

    def to_array(self, dt: str, shape: tuple[int, ...], name: str) -> np.ndarray:
        count = element_count(shape)
        parts, seen = [], 0
        for values in self.slices():
            if seen + len(values) <= count:
                parts.append(_values_to_array(values, dt, name, seen))
            seen += len(values)
        if seen != count:
            raise InvalidArgument(_count_message(name, shape, count, seen))
        if not parts:
            return np.zeros(shape, dtype=triton_to_numpy(dt))
        return (parts[0] if len(parts) == 1 else np.concatenate(parts)).reshape(shape)


def _number_runs(text: bytes) -> list[tuple[int, int]]:
    """(start, end) of each long run of number text directly inside ``[`` ... ``]``."""
    runs = []
    n, w = len(text), _RUN_MIN
    k = 0
    while k * w < n:
        if b"1" in text[k * w:(k + 1) * w].translate(_MASK):
            k += 1
            continue
        j = k + 1
        while j * w < n and b"1" not in text[j * w:(j + 1) * w].translate(_MASK):
            j += 1
        left = text[max(0, (k - 1) * w):k * w].translate(_MASK).rfind(b"1")
        left = -1 if left < 0 else left + max(0, (k - 1) * w)
        right = text[j * w:(j + 1) * w].translate(_MASK).find(b"1")
        right = -1 if right < 0 else right + j * w
        if left >= 0 and right >= 0 and text[left] == 0x5B and text[right] == 0x5D:
            runs.append((left + 1, right))
        k = j + 1
    return runs


def _parse_large_json(text: bytes) -> Any:
    """json.loads(text), except that a long number run which is an input's ``data`` stays
    a _Hole (decoded later, slice by slice, straight into its array)."""
    runs = _number_runs(text)
    if not runs:
        return _parse_json(text)
    # A marker cannot stand for a run that was really inside a string: its quote would end
    # that string and the backslash after it is invalid JSON outside one.
    key = "\\u0001hole-" + secrets.token_hex(8)
    parts, pos = [], 0
    for i, (start, end) in enumerate(runs):
        parts += [text[pos:start], b'{"%s":%d}' % (key.encode(), i)]
        pos = end
    parts.append(text[pos:])
    try:
        doc = _parse_json(b"".join(parts))
    except InvalidArgument:
        return _parse_json(text)    # the whole parse names the error exactly
    marker = "\x01hole-" + key[len("\\u0001hole-"):]
    holes = [_Hole(text, s, e) for s, e in runs]
    found: list[int] = []

    def fill(node: Any, as_data: bool = False) -> Any:
        if isinstance(node, list):
            if len(node) == 1 and isinstance(node[0], dict) and marker in node[0]:
                i = node[0][marker]
                found.append(i)
                if type(i) is not int or not 0 <= i < len(holes):
                    return node
                return holes[i] if as_data else holes[i].to_list()
            return [fill(x) for x in node]
        if isinstance(node, dict):
            return {k: fill(v) for k, v in node.items()}
        return node

    if isinstance(doc, dict) and isinstance(doc.get("inputs"), list):
        doc = {k: ([{kk: fill(vv, kk == "data") for kk, vv in item.items()}
                    if isinstance(item, dict) else fill(item) for item in v]
                   if k == "inputs" else fill(v))
               for k, v in doc.items()}
    else:
        doc = fill(doc)
    if sorted(found) != list(range(len(holes))):
        return _parse_json(text)
    return doc


_CONTENT_FIELDS = "Input must set only one of the following fields: 'data', 'binary_data_size' " \
                  "in 'parameters', 'shared_memory_region' in 'parameters'. But"


def _decode_input(doc: Any, i: int, model_name: str, max_elements: int
                  ) -> tuple[str, str, tuple[int, ...], dict[str, Any], Any, int | None]:
    if not isinstance(doc, dict):
        raise InvalidArgument(
            f"unable to parse 'inputs': element {i} is {_json_type(doc)}, expected an object")
    name = doc.get("name")
    if not isinstance(name, str):
        raise InvalidArgument(
            f"unable to parse 'name' of input {i}: expected a string, got {_json_type(name)}")
    dt = doc.get("datatype")
    if not isinstance(dt, str):
        raise InvalidArgument(
            f"unable to parse 'datatype' of input '{name}': expected a string, got "
            f"{_json_type(dt)}")
    if not is_valid_datatype(dt):
        raise InvalidArgument(f"invalid datatype '{dt}' for input '{name}'")
    if "shape" not in doc:
        raise InvalidArgument(f"unable to parse 'shape' of input '{name}': field is missing")
    shape = _check_shape(doc["shape"], name, max_elements)
    params = doc.get("parameters", {})
    if not isinstance(params, dict):
        raise InvalidArgument(
            f"unable to parse 'parameters' of input '{name}': expected an object, got "
            f"{_json_type(params)}")
    has = [f for f, present in (("data", "data" in doc),
                                ("binary_data_size", "binary_data_size" in params),
                                ("shared_memory_region", "shared_memory_region" in params))
           if present]
    if len(has) != 1:
        detail = " no field is set" if not has else " set " + " ".join(f"'{f}'" for f in has)
        raise InvalidArgument(f"{_CONTENT_FIELDS}{detail} for input '{name}'")
    binary_size = None
    if has[0] == "binary_data_size":
        binary_size = params["binary_data_size"]
        if not _is_uint(binary_size):
            raise InvalidArgument(
                f"unable to parse 'binary_data_size' of input '{name}': expected a "
                f"non-negative integer, got {json.dumps(binary_size)[:40]}")
    tensor_params = {k: v for k, v in params.items() if k != "binary_data_size"}
    return name, dt, shape, tensor_params, doc.get("data"), binary_size


def _decode_outputs(outputs: Any) -> list[RequestedOutput] | None:
    if not isinstance(outputs, list):
        raise InvalidArgument(
            f"unable to parse 'outputs': expected an array, got {_json_type(outputs)}")
    result: list[RequestedOutput] = []
    seen: set[str] = set()
    for i, doc in enumerate(outputs):
        if not isinstance(doc, dict):
            raise InvalidArgument(
                f"unable to parse 'outputs': element {i} is {_json_type(doc)}, expected an object")
        name = doc.get("name")
        if not isinstance(name, str):
            raise InvalidArgument(
                f"unable to parse 'name' of output {i}: expected a string, got {_json_type(name)}")
        if name in seen:
            raise InvalidArgument(f"output '{name}' is requested more than once")
        seen.add(name)
        params = doc.get("parameters", {})
        if not isinstance(params, dict):
            raise InvalidArgument(
                f"unable to parse 'parameters' of output '{name}': expected an object, got "
                f"{_json_type(params)}")
        if "binary_data" in params and not isinstance(params["binary_data"], bool):
            raise InvalidArgument(
                f"unable to parse 'binary_data' of output '{name}': expected a boolean, got "
                f"{_json_type(params['binary_data'])}")
        if "classification" in params and not _is_uint(params["classification"]):
            raise InvalidArgument(
                f"unable to set 'classification' of output '{name}': expected a non-negative "
                f"integer, got {_json_type(params['classification'])}")
        result.append(RequestedOutput(name=name, parameters=dict(params)))
    return result or None


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
    request_id, parameters, specs, outputs = plan
    inputs = []
    for name, dt, shape, tparams, span, plain in specs:
        if plain is not None:       # a view at its offset: its size was checked with the plan's
            arr = np.ndarray(shape, plain, view, span[0])     # (frombuffer + reshape: 1.5x)
        else:
            arr = None if span is None else \
                tensor_from_wire(view[span[0]:span[1]], dt, shape, name, model_name)
        inputs.append(InferTensor(name, dt, shape, arr, dict(tparams) if tparams else {}))
    return InferRequest(model_name, model_version, request_id, inputs,
                        [RequestedOutput(name, dict(params) if params else {})
                         for name, params in outputs] if outputs is not None else None,
                        dict(parameters) if parameters else {})


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
        return _decode_document(_parse_large_json(text), view, header_length, model_name,
                                model_version, max_elements, key)
    # orjson first, without _parse_json's scan for integers past 64 bits (which it reads as
    # floats): a float where json read an integer shows only in an error's words or in a
    # parameter, passed on as sent (a float value is the same either way), so only then is
    # the document read as json reads it, when it may hold such an integer.
    doc, loose = _read_json(text)
    if not loose:
        return _decode_document(doc, view, header_length, model_name, model_version,
                                max_elements, key)
    try:
        request = _decode_document(doc, view, header_length, model_name, model_version,
                                   max_elements, key)
    except InvalidArgument:
        if not _may_hold_big_integer(text):
            raise
    else:
        if all(map(_read_as_sent, _parameter_maps(request))) or not _may_hold_big_integer(text):
            return request
    if key is not None:
        _PLANS.pop(key, None)
    return _decode_document(_parse_json(text), view, header_length, model_name, model_version,
                            max_elements, key)


def _read_json(raw: bytes) -> tuple[Any, bool]:
    """The document, and whether orjson read it (``_parse_json`` without its scan first)."""
    try:
        return orjson.loads(raw), True
    except orjson.JSONDecodeError:
        return _parse_json(raw), False


def _parameter_maps(request: InferRequest) -> Iterator[dict]:
    yield request.parameters
    for t in request.inputs:
        yield t.parameters
    for o in request.outputs or ():
        yield o.parameters


# Parameter values orjson reads as json does: all but containers and floats of magnitude 2**63
# or more (what an integer past 64 bits becomes).
_AS_SENT = frozenset((str, int, bool, type(None)))


def _read_as_sent(params: dict) -> bool:
    for v in params.values():
        if type(v) not in _AS_SENT and not (type(v) is float and -2.0 ** 63 < v < 2.0 ** 63):
            return False
    return True


def _decode_document(doc: Any, view: memoryview, header_length: int, model_name: str,
                     model_version: str, max_elements: int, key: tuple | None) -> InferRequest:
    total = len(view)
    if not isinstance(doc, dict):
        raise InvalidArgument(
            f"failed to parse the request JSON buffer: expected an object, got {_json_type(doc)}")

    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgument(
            f"unable to parse 'id': expected a string, got {_json_type(request_id)}")
    parameters = check_request_parameters(doc.get("parameters", {}))

    inputs_doc = doc.get("inputs")
    if not isinstance(inputs_doc, list):
        raise InvalidArgument(
            "unable to parse 'inputs': expected an array, got "
            + ("nothing" if inputs_doc is None else _json_type(inputs_doc)))

    # First pass: validate every header field and every size; nothing is allocated yet.
    specs = []
    names: set[str] = set()
    offset = header_length
    for i, item in enumerate(inputs_doc):
        name, dt, shape, tparams, data, binary_size = _decode_input(
            item, i, model_name, max_elements)
        if name in names:
            raise InvalidArgument(f"[request id: {request_id or '<id_unknown>'}] input '{name}' "
                                  f"already exists in request")      # tritonserver 2.51's words
        names.add(name)
        span = None
        if binary_size is not None:
            if binary_size > 0 and header_length == total:
                raise InvalidArgument(
                    "must specify valid 'Inference-Header-Content-Length' in request header and "
                    f"'binary_data_size' when passing inputs in binary data format (input "
                    f"'{name}')")
            if offset + binary_size > total:
                raise InvalidArgument(
                    f"unexpected size for input '{name}', expecting "
                    f"{offset + binary_size - total} additional bytes for model '{model_name}'")
            size = element_size(dt)
            count = element_count(shape)
            if size is not None and binary_size != count * size:
                raise InvalidArgument(
                    f"input byte size mismatch for input '{name}' for model '{model_name}'. "
                    f"Expected {count * size}, got {binary_size}")
            span = (offset, offset + binary_size)
            offset += binary_size
        specs.append((name, dt, shape, tparams, data, span))
    if offset != total:
        raise InvalidArgument(f"unexpected additional input data for model '{model_name}'")

    outputs = _decode_outputs(doc["outputs"]) if "outputs" in doc else None
    if key is not None and scalar_values(parameters) and all(
            (span is not None or "shared_memory_region" in tparams) and scalar_values(tparams)
            for _, _, _, tparams, _, span in specs) and all(
            scalar_values(o.parameters) for o in outputs or ()):
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = (request_id, dict(parameters),
                       [(name, dt, shape, dict(tparams), span, _plain_view(dt, shape, span))
                        for name, dt, shape, tparams, _, span in specs],
                       None if outputs is None else [(o.name, dict(o.parameters)) for o in outputs])

    inputs = []
    for name, dt, shape, tparams, data, span in specs:
        if "shared_memory_region" in tparams:
            arr = None      # the engine reads it from the region (engine/shared_memory.py)
        elif span is None:
            arr = json_data_to_array(data, dt, shape, name)
        else:
            arr = tensor_from_wire(view[span[0]:span[1]], dt, shape, name, model_name)
        inputs.append(InferTensor(name=name, datatype=dt, shape=shape, data=arr,
                                  parameters=tparams))
    return InferRequest(model_name=model_name, model_version=model_version, id=request_id,
                        inputs=inputs, outputs=outputs, parameters=parameters)


def decode_raw_infer_request(body: bytes | memoryview, model_name: str, model_version: str,
                             input_name: str, datatype: str, dims: list[int]) -> InferRequest:
    """A raw binary request (Inference-Header-Content-Length: 0): the whole body is the data of
    the model's single input. The one variable (-1) dimension is inferred from the size."""
    view = memoryview(body).cast("B")
    size = element_size(datatype)
    if size is None:
        count = count_bytes_elements(view, input_name)
    else:
        if len(view) % size:
            raise InvalidArgument(
                f"raw input '{input_name}' for model '{model_name}' has {len(view)} bytes, not a "
                f"multiple of the {size}-byte size of datatype {datatype}")
        count = len(view) // size
    variable = [i for i, d in enumerate(dims) if d < 0]
    known = element_count([d for d in dims if d >= 0])
    shape = list(dims)
    if len(variable) > 1:
        raise InvalidArgument(
            f"raw binary request for model '{model_name}': cannot infer the shape of input "
            f"'{input_name}' with dims {list(dims)}, which has more than one variable dimension; "
            "send a JSON header with the shape instead")
    if variable:
        if known == 0 or count % known:
            raise InvalidArgument(
                f"raw binary request for model '{model_name}': {count} elements do not fill "
                f"input '{input_name}' with dims {list(dims)}")
        shape[variable[0]] = count // known
    elif count != known:
        raise InvalidArgument(
            f"raw binary request for model '{model_name}': input '{input_name}' with shape "
            f"{list(dims)} expects {known} elements, got {count}")
    arr = tensor_from_wire(view, datatype, tuple(shape), input_name, model_name)
    tensor = InferTensor(name=input_name, datatype=datatype, shape=tuple(shape), data=arr)
    # Triton answers a raw request in binary too.
    return InferRequest(model_name=model_name, model_version=model_version, inputs=[tensor],
                        parameters={"binary_data_output": True})


# -- responses -------------------------------------------------------------------------

def _json_default(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="replace")
    raise TypeError(f"{type(v).__name__} is not JSON serializable")


def _json_data(tensor: InferTensor) -> list | None:
    """Flat JSON values of an output; None when a BYTES element is not UTF-8 text."""
    arr = np.asarray(tensor.data)
    if tensor.datatype == "BYTES":
        out = []
        try:
            for v in arr.ravel():
                out.append(v.decode("utf-8") if isinstance(v, bytes) else str(v))
        except UnicodeDecodeError:
            return None
        return out
    if tensor.datatype == "BF16":
        return round_to_bf16(arr.astype(np.float32)).ravel().tolist()
    return np.asarray(arr, dtype=triton_to_numpy(tensor.datatype)).ravel().tolist()


def tensor_to_json(tensor: InferTensor) -> dict:
    """A tensor kept for later reading (engine/capture.py) as v2 JSON: name, datatype, shape
    and flat data (None where it stayed in shared memory); a BYTES tensor that is not UTF-8
    text carries base64 strings, with ``parameters.encoding`` "base64"."""
    doc: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype,
                           "shape": list(tensor.shape), "data": None}
    if tensor.data is not None:
        doc["data"] = _json_data(tensor)
        if doc["data"] is None:
            doc["data"] = [base64.b64encode(v if isinstance(v, bytes) else str(v).encode()).decode()
                           for v in np.asarray(tensor.data).ravel()]
            doc["parameters"] = {"encoding": "base64"}
    return doc


def tensor_from_json(doc: dict) -> np.ndarray | None:
    """``tensor_to_json``'s array back (BYTES as an object array of bytes)."""
    data, shape = doc.get("data"), tuple(doc["shape"])
    if data is None:
        return None
    if doc["datatype"] == "BYTES":
        b64 = doc.get("parameters", {}).get("encoding") == "base64"
        values = [base64.b64decode(v) if b64 else v.encode("utf-8") for v in data]
        return np.array(values, dtype=object).reshape(shape)
    return np.array(data, dtype=triton_to_numpy(doc["datatype"])).reshape(shape)


_SLICED_ELEMENTS = 1 << 18      # outputs with more elements than this are encoded in slices


def _json_numbers(tensor: InferTensor) -> list[bytes] | None:
    """The JSON text of a numeric output's values, without the outer brackets, in slices of
    at most _SLICED_ELEMENTS // 16 (orjson holds the GIL per call); None when a float is not
    finite (json's NaN/Infinity spelling is kept for those, through _json_data).

    orjson writes numpy arrays natively, 20-30x faster than tolist() + json.dumps; floats go
    as float64, so each value is written as the double the client reads (what json.dumps of
    tolist() wrote, and Triton's writer), not float32's shorter text."""
    arr = np.asarray(tensor.data)
    if tensor.datatype == "BF16":
        arr = round_to_bf16(arr.astype(np.float32))
    flat = np.asarray(arr, dtype=triton_to_numpy(tensor.datatype)).ravel()
    respell = False
    if flat.dtype.kind == "f":
        if not np.isfinite(flat).all():
            return None
        flat = flat.astype(np.float64)
        # Searching the text costs ~1 ns a byte, the test on the values a few ns an element.
        magnitude = np.abs(flat)
        respell = bool(((magnitude >= _RESPELLED[0]) & (magnitude < _RESPELLED[1])).any())
    step = _SLICED_ELEMENTS // 16
    texts = [orjson.dumps(np.ascontiguousarray(flat[i:i + step]),
                          option=orjson.OPT_SERIALIZE_NUMPY)[1:-1]
             for i in range(0, flat.size, step)]
    return [_python_float_text(text) for text in texts] if respell else texts


# The magnitudes orjson spells otherwise than Python: exponents -9..-5 (below: both e-10 on;
# above: both positional up to e+15, then e+16 on).
_RESPELLED = (1e-9, 1e-4)


_ONE_DIGIT_EXPONENT = re.compile(rb"e([+-])(\d)(?![0-9])")


def _python_float_text(text: bytes) -> bytes:
    """orjson's numbers spelled as Python's repr (json.dumps), byte for byte: the same
    shortest digits, but Python writes an exponent of at least two digits (1.5e-07, not
    1.5e-7) and 1e-05..9.9e-05 in exponent form (orjson: 0.00001)."""
    if b"e" in text:
        text = _ONE_DIGIT_EXPONENT.sub(rb"e\g<1>0\2", text)
    at = text.find(b"0.0000")
    if at < 0:
        return text
    parts, start = [], 0
    while at >= 0:
        end = at + 6
        while end < len(text) and 48 <= text[end] <= 57:
            end += 1
        if at == 0 or text[at - 1] in b",-":     # a whole number 0.0000ddd, not 170.00001
            digits = text[at + 6:end]
            zeros = len(digits) - len(digits.lstrip(b"0"))
            d = digits[zeros:]
            parts += [text[start:at], d[:1], b"." + d[1:] if len(d) > 1 else b"", b"e-%02d" % (5 + zeros)]
            start = end
        at = text.find(b"0.0000", end)
    parts.append(text[start:])
    return b"".join(parts)


# json.dumps with any argument builds a new encoder per call; this one is built once (the
# same settings, the same text; encode keeps no state between calls, so threads may share it).
_HEADER_ENCODER = json.JSONEncoder(separators=(",", ":"), default=_json_default)
# Values orjson writes as json does: its strings differ only where json escapes (non-ASCII,
# DEL: checked on its output), its ints past 64 bits raise; floats are spelled otherwise
# (1e-05, 1e+16) and containers may hold them, so a document with those is json's.
_PLAIN = frozenset((str, int, bool, type(None)))


def _plain(params: dict) -> bool:
    return all(type(v) in _PLAIN for v in params.values())


def _encode_header(doc: dict, plain: bool) -> bytes:
    """The response's JSON header, byte for byte what ``_HEADER_ENCODER`` writes; orjson
    writes it (10x faster) when ``plain`` says every value is one it spells the same."""
    if plain:
        try:
            header = orjson.dumps(doc)
        except orjson.JSONEncodeError:      # an integer past 64 bits, a key not a string
            pass
        else:
            if header.isascii() and b"\x7f" not in header:
                return header
    return _HEADER_ENCODER.encode(doc).encode()


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
    return _encode_response(response, request)


# Responses whose layout repeats (model, version, each output's name, datatype, shape and
# whether it goes binary, no parameters, no BYTES): (the JSON header before the id, its text
# after the id cut where each JSON output's values go, each output's wire size and dtype or
# None for a JSON one), or None for a layout no plan can write. Bounded: forgotten when full.
_RESPONSE_PLANS: dict[tuple, tuple | None] = {}
_RESPONSE_PLANS_MAX = 256


def _planned_response(response: InferResponse, request: InferRequest
                      ) -> tuple[bytes, int | None] | None:
    """``_encode_response``'s bytes from the plan of the response's layout: the header is the
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
        header, spliced, buffers = _encode_parts(response, request)
        plan = _response_plan(response, rid, [binary for *_, binary in layout[2:]], header,
                              spliced)
        if plan is not False:
            if len(_RESPONSE_PLANS) >= _RESPONSE_PLANS_MAX:
                _RESPONSE_PLANS.clear()
            _RESPONSE_PLANS[key] = plan
        return _joined(header, spliced, buffers)
    if plan is None:
        return None
    head, pieces, wires = plan
    parts = [head, b',"id":', _encode_header(rid, True), pieces[0]] if rid else [head, pieces[0]]
    buffers = []
    piece = 0
    for t, (size, wire) in zip(response.outputs, wires):
        if size is None:                # a JSON output: its values before the next piece
            numbers = _json_numbers(t)
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


def _response_plan(response: InferResponse, rid: str, binary: list[bool], header: bytes,
                   spliced: dict[int, tuple[bytes, list[bytes]]]) -> tuple | None | bool:
    """The plan of ``response``'s layout (its outputs ``binary`` or not) from its full
    encoding (``_encode_parts``'s ``header`` and ``spliced``); None: a layout no plan writes;
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
    head = _encode_header({"model_name": response.model_name,
                           "model_version": str(response.model_version)}, True)[:-1]
    start = head + b',"id":' + _encode_header(rid, True) if rid else head
    if not header.startswith(start):
        return None
    pieces, rest = [], header[len(start):]
    for marker, _ in spliced.values():
        before, _, rest = rest.partition(marker)
        pieces.append(before)
    return head, [*pieces, rest], wires


def _encode_response(response: InferResponse, request: InferRequest
                     ) -> tuple[bytes, int | None]:
    return _joined(*_encode_parts(response, request))


def _encode_parts(response: InferResponse, request: InferRequest
                  ) -> tuple[bytes, dict[int, tuple[bytes, list[bytes]]], list]:
    """The JSON header with a marker string where each numeric JSON output's values go
    (output index -> (marker, the values' text)), and the binary outputs' buffers."""
    requested = {o.name: o.parameters for o in request.outputs} if request.outputs else {}
    default_binary = bool(request.parameters.get("binary_data_output", False))
    outputs = []
    buffers: list[bytes | memoryview] = []
    # Numeric JSON outputs are written apart (by orjson, large ones slice by slice), then
    # spliced into the document where their marker string stands.
    spliced: dict[int, tuple[bytes, list[bytes]]] = {}
    nonce = ""
    plain = not response.parameters or _plain(response.parameters)
    for i, t in enumerate(response.outputs):
        wanted = requested.get(t.name)
        binary = wanted.get("binary_data", default_binary) if wanted else default_binary
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype,
                                 "shape": [int(d) for d in t.shape]}
        params = dict(t.parameters) if t.parameters else {}
        numbers = None if binary or t.data is None or t.datatype == "BYTES" else _json_numbers(t)
        if numbers is not None:
            nonce = nonce or secrets.token_hex(8)
            key = f"\x01data-{nonce}-{len(spliced)}"
            spliced[i] = (json.dumps(key).encode(), numbers)
            entry["data"] = key
            data: list | None = []
        else:
            data = None if binary or t.data is None else _json_data(t)
        if t.data is None:      # written to a shared memory region: no data in the body
            pass
        elif data is None:
            buf = tensor_wire_buffer(t.data, t.datatype)
            params["binary_data_size"] = memoryview(buf).nbytes
            buffers.append(buf)
        elif "data" not in entry:
            entry["data"] = data
            plain = plain and t.datatype == "BYTES"     # (else non-finite floats)
        if params:
            entry["parameters"] = params
            plain = plain and _plain(params)
        outputs.append(entry)
    doc: dict[str, Any] = {"model_name": response.model_name,
                           "model_version": str(response.model_version)}
    rid = response.id or request.id
    if rid:
        doc["id"] = rid
    if response.parameters:
        doc["parameters"] = response.parameters
    doc["outputs"] = outputs
    return _encode_header(doc, plain and (not rid or type(rid) is str)), spliced, buffers


def _joined(header: bytes, spliced: dict[int, tuple[bytes, list[bytes]]], buffers: list
            ) -> tuple[bytes, int | None]:
    for marker, slices in spliced.values():
        before, _, after = header.partition(marker)
        header = b"".join([before, b"[", b",".join(slices), b"]", after])
    if not buffers:
        return header, None
    return b"".join([header, *buffers]), len(header)


def encode_error(err: Exception) -> bytes:
    """Triton's error body: ``{"error": "<message>"}``."""
    return json.dumps({"error": str(err)}).encode()
