"""KServe v2 JSON inference requests/responses, with Triton's binary tensor data extension.

A request body is a JSON header, optionally followed (when the client sends
``Inference-Header-Content-Length``) by the binary data of the inputs that carry
``parameters.binary_data_size``, in input order. Every client mistake becomes an
InvalidArgument (400) naming the input and the rule, raised before anything sized by the
request is allocated.
"""
from __future__ import annotations

import json
from typing import Any, NoReturn

import numpy as np

from .datatypes import (count_bytes_elements, element_count, element_size, is_valid_datatype, round_to_bf16,
                        tensor_from_wire, tensor_wire_buffer, triton_to_numpy)
from .errors import InvalidArgument
from .types import InferRequest, InferResponse, InferTensor, RequestedOutput

# Far past any real tensor, far below what a shape product can claim.
DEFAULT_MAX_ELEMENTS = 1 << 32
# numpy's own limit on dimensions; a deeper shape could not be built anyway.
MAX_RANK = 64

_INT_TYPES = {"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"}
_FLOAT_TYPES = {"FP16", "FP32", "FP64", "BF16"}


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


def _parse_json(raw: bytes) -> Any:
    if not raw:
        raise InvalidArgument("failed to parse the request JSON buffer: the document is empty")
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


def _flatten(data: list, shape: tuple[int, ...], name: str) -> list:
    """Row-major leaves of ``data``: flat, or nested exactly as ``shape``."""
    if not any(isinstance(x, list) for x in data):
        return data
    level = [data]
    for depth, d in enumerate(shape):
        nxt: list = []
        for x in level:
            if not isinstance(x, list) or len(x) != d:
                got = f"an array of length {len(x)}" if isinstance(x, list) else _json_type(x)
                raise InvalidArgument(
                    f"unable to parse 'data' of input '{name}': nested data must match shape "
                    f"{list(shape)}; expected an array of length {d} at depth {depth}, got {got}")
            nxt.extend(x)
        level = nxt
    for x in level:
        if isinstance(x, list):
            raise InvalidArgument(
                f"unable to parse 'data' of input '{name}': data is nested deeper than shape "
                f"{list(shape)}")
    return level


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
    if not isinstance(data, list):
        raise InvalidArgument(
            f"unable to parse 'data' of input '{name}': expected an array, got {_json_type(data)}")
    count = element_count(shape)
    values = _flatten(data, shape, name)
    if len(values) != count:
        raise InvalidArgument(
            f"unable to parse 'data' of input '{name}': shape {list(shape)} expects {count} "
            f"elements, got {len(values)}")
    if dt == "BOOL":
        if not all(type(v) is bool for v in values):
            _bad_element(values, lambda v: type(v) is bool, name, dt, "a boolean")
        arr = np.array(values, dtype=np.bool_)
    elif dt in _INT_TYPES:
        if not all(type(v) is int for v in values):
            _bad_element(values, lambda v: type(v) is int, name, dt, "an integer")
        info = np.iinfo(triton_to_numpy(dt))
        if values and (min(values) < info.min or max(values) > info.max):
            _bad_element(values, lambda v: info.min <= v <= info.max, name, dt,
                         f"an integer in [{info.min}, {info.max}]")
        arr = np.array(values, dtype=triton_to_numpy(dt))
    elif dt in _FLOAT_TYPES:
        if not all(type(v) in (int, float) for v in values):
            _bad_element(values, lambda v: type(v) in (int, float), name, dt, "a number")
        try:
            wide = np.array(values, dtype=np.float64)
        except OverflowError:
            _bad_element(values, _fits_fp64, name, dt,
                         "a number within the range of FP64")
        with np.errstate(over="ignore"):
            arr = wide.astype(triton_to_numpy(dt))
            if dt == "BF16":
                arr = round_to_bf16(arr)
        overflow = np.isinf(arr) & np.isfinite(wide)
        if overflow.any():
            i = int(np.argmax(overflow))
            raise InvalidArgument(
                f"unable to parse 'data' of input '{name}': element {i} ({values[i]}) is out of "
                f"the range of datatype {dt}")
    elif dt == "BYTES":
        if not all(type(v) is str for v in values):
            _bad_element(values, lambda v: type(v) is str, name, dt, "a string")
        arr = np.empty(count, dtype=np.object_)
        arr[:] = [v.encode("utf-8") for v in values]
    else:  # pragma: no cover - datatype validated by the caller
        raise InvalidArgument(f"invalid datatype '{dt}' for input '{name}'")
    return arr.reshape(shape)


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
    doc = _parse_json(bytes(view[:header_length]))
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
            raise InvalidArgument(f"input '{name}' appears more than once in the request")
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


def encode_infer_response(response: InferResponse, request: InferRequest
                          ) -> tuple[bytes, int | None]:
    """The response body and its Inference-Header-Content-Length (None: all JSON).

    An output goes binary when its requested ``binary_data`` says so, else when the request's
    ``binary_data_output`` does. A BYTES output that is not UTF-8 cannot be JSON text and is
    sent binary whatever was asked: tritonclient reads either form.
    """
    requested = {o.name: o.parameters for o in (request.outputs or [])}
    default_binary = bool(request.parameters.get("binary_data_output", False))
    outputs = []
    buffers: list[bytes | memoryview] = []
    for t in response.outputs:
        binary = requested.get(t.name, {}).get("binary_data", default_binary)
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype,
                                 "shape": [int(d) for d in t.shape]}
        params = dict(t.parameters)
        data = None if binary or t.data is None else _json_data(t)
        if t.data is None:      # written to a shared memory region: no data in the body
            pass
        elif data is None:
            buf = tensor_wire_buffer(t.data, t.datatype)
            params["binary_data_size"] = memoryview(buf).nbytes
            buffers.append(buf)
        else:
            entry["data"] = data
        if params:
            entry["parameters"] = params
        outputs.append(entry)
    doc: dict[str, Any] = {"model_name": response.model_name,
                           "model_version": str(response.model_version)}
    rid = response.id or request.id
    if rid:
        doc["id"] = rid
    if response.parameters:
        doc["parameters"] = response.parameters
    doc["outputs"] = outputs
    header = json.dumps(doc, separators=(",", ":"), default=_json_default).encode()
    if not buffers:
        return header, None
    return b"".join([header, *buffers]), len(header)


def encode_error(err: Exception) -> bytes:
    """Triton's error body: ``{"error": "<message>"}``."""
    return json.dumps({"error": str(err)}).encode()
