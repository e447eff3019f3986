"""Tensors as v2 JSON text, both ways: a request's JSON parsed (orjson, json as the exact
fallback), an input's ``data`` checked and converted to its array, an output's values
written as JSON text, and the response header written as json would write it.
"""
from __future__ import annotations

import base64
import json
import re
from typing import Any, NoReturn

import numpy as np
import orjson

from .datatypes import element_count, round_to_bf16, triton_to_numpy
from .errors import InvalidArgument
from .types import InferTensor

_INT_TYPES = {"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"}
_FLOAT_TYPES = {"FP16", "FP32", "FP64", "BF16"}
_FINITE_MAX = {"FP16": float(np.finfo(np.float16).max), "FP32": float(np.finfo(np.float32).max)}


def json_type(v: Any) -> str:
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


def may_hold_big_integer(raw: bytes) -> bool:
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


def parse_json(raw: bytes) -> Any:
    if not raw:
        raise InvalidArgument("failed to parse the request JSON buffer: the document is empty")
    # orjson parses faster (benchmarks/results/notes-protocol.md); it is stricter than json (NaN,
    # Infinity, lone surrogates, depth past 1024), so what it refuses goes to json: the same
    # documents are accepted as before and a refusal carries json's message, as before. One thing
    # it reads otherwise: an integer past 64 bits becomes a float, so a document that may hold one
    # is json's too.
    if not may_hold_big_integer(raw):
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


def read_json(raw: bytes) -> tuple[Any, bool]:
    """The document, and whether orjson read it (``parse_json`` without its scan first)."""
    try:
        return orjson.loads(raw), True
    except orjson.JSONDecodeError:
        return parse_json(raw), False


# Parameter values orjson reads as json does: all but containers and floats of magnitude 2**63
# or more (what an integer past 64 bits becomes).
_AS_SENT = frozenset((str, int, bool, type(None)))


def read_as_sent(params: dict) -> bool:
    """Whether orjson read every value of ``params`` as json would have."""
    for v in params.values():
        if type(v) not in _AS_SENT and not (type(v) is float and -2.0 ** 63 < v < 2.0 ** 63):
            return False
    return True


# -- input data ---------------------------------------------------------------------------

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


def _fits_fp64(v: Any) -> bool:
    try:
        float(v)
    except OverflowError:
        return False
    return True


def json_data_to_array(data: Any, dt: str, shape: tuple[int, ...], name: str) -> np.ndarray:
    """The array for a JSON ``data`` field, checked against ``shape`` and ``dt``."""
    if not isinstance(data, list):
        raise InvalidArgument(
            f"unable to parse 'data' of input '{name}': expected an array, got {json_type(data)}")
    count = element_count(shape)
    types = set(map(type, data))        # every element's type at C speed, not a generator's
    values = _flatten(data, count, types)
    if len(values) != count:
        got = len(values) if values is data or len(values) < count else f"more than {count}"
        raise InvalidArgument(count_message(name, shape, count, got))
    return values_to_array(values, dt, name, 0, types if values is data else None).reshape(shape)


def count_message(name: str, shape: tuple[int, ...], count: int, got: int | str) -> str:
    return (f"unable to parse 'data' of input '{name}': shape {list(shape)} expects {count} "
            f"elements, got {got}")


def values_to_array(values: list, dt: str, name: str, first: int,
                    types: set[type] | None = None) -> np.ndarray:
    """A flat list of JSON values as an array of ``dt``; ``first`` is the index of
    ``values[0]`` in the whole tensor (so that errors name the element the client sent);
    ``types``: the distinct types of ``values``, when known."""
    try:
        return _convert(values, dt, name, set(map(type, values)) if types is None else types)
    except _BadElement as bad:
        raise InvalidArgument(
            f"unable to parse 'data' of input '{name}': element {first + bad.index} is "
            f"{json_type(bad.value)} ({json.dumps(bad.value)[:40]}), expected {bad.want} for "
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


# -- output data --------------------------------------------------------------------------

def _json_default(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="replace")
    raise TypeError(f"{type(v).__name__} is not JSON serializable")


def json_data(tensor: InferTensor) -> list | None:
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
    """A tensor kept for later reading (engine/observation/capture.py) as v2 JSON: name, datatype, shape
    and flat data (None where it stayed in shared memory); a BYTES tensor that is not UTF-8
    text carries base64 strings, with ``parameters.encoding`` "base64"."""
    doc: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype,
                           "shape": list(tensor.shape), "data": None}
    if tensor.data is not None:
        doc["data"] = json_data(tensor)
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


def json_numbers(tensor: InferTensor) -> list[bytes] | None:
    """The JSON text of a numeric output's values, without the outer brackets, in slices of
    at most _SLICED_ELEMENTS // 16 (orjson holds the GIL per call); None when a float is not
    finite (json's NaN/Infinity spelling is kept for those, through json_data).

    orjson writes numpy arrays natively, far faster than tolist() + json.dumps (see
    benchmarks/results/notes-protocol.md); floats go
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
        # The text is searched and respelled only where a value lies in orjson's other spelling:
        # the test on the values costs less than a search of their text (see
        # benchmarks/results/notes-protocol.md).
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


def plain_values(params: dict) -> bool:
    return all(type(v) in _PLAIN for v in params.values())


def encode_header(doc: dict, plain: bool) -> bytes:
    """The response's JSON header, byte for byte what ``_HEADER_ENCODER`` writes; orjson
    writes it (faster: benchmarks/results/notes-protocol.md) when ``plain`` says every value is one
    it spells the same."""
    if plain:
        try:
            header = orjson.dumps(doc)
        except orjson.JSONEncodeError:      # an integer past 64 bits, a key not a string
            pass
        else:
            if header.isascii() and b"\x7f" not in header:
                return header
    return _HEADER_ENCODER.encode(doc).encode()


