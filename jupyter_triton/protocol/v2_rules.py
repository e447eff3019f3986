"""The KServe v2 request rules: what each field of an infer request's JSON header must be, and
the rules both protocols share (an input's shape, a model's version string: the gRPC codec and
the v2 operations ask them here).

Every client mistake becomes an InvalidArgument (400) naming the input and the rule, raised
before anything sized by the request is allocated: ``check_document`` checks a whole header
(and where the binary inputs lie in the body) and allocates nothing.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from .binary_data import binary_span
from .datatypes import element_count, is_valid_datatype
from .errors import InvalidArgument
from .json_tensors import json_type
from .types import RequestedOutput

# Far past any real tensor, far below what a shape product can claim.
DEFAULT_MAX_ELEMENTS = 1 << 32
# numpy's own limit on dimensions; a deeper shape could not be built anyway.
MAX_RANK = 64


def _is_uint(v: Any) -> bool:
    return type(v) is int and v >= 0


# -- request parameters ----------------------------------------------------------------

def check_request_parameters(params: Any) -> dict[str, Any]:
    if not isinstance(params, dict):
        raise InvalidArgument(
            f"unable to parse 'parameters': expected an object, got {json_type(params)}")
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
                f"unable to parse '{key}': expected {want}, got {json_type(value)}")
    return dict(params)


# -- inputs ------------------------------------------------------------------------------

def check_shape(shape: Any, name: str, max_elements: int) -> tuple[int, ...]:
    """An input's shape, JSON's or protobuf's, as the tuple of its dimensions."""
    if type(shape) is list and len(shape) <= MAX_RANK:
        count = 1       # one pass for a shape that passes every check below
        for d in shape:
            if type(d) is not int or d < 0 or d > max_elements:
                break
            count *= d
        else:
            if count <= max_elements:
                return tuple(shape)
    if not isinstance(shape, list):
        raise InvalidArgument(
            f"unable to parse 'shape' of input '{name}': expected an array of non-negative "
            f"integers, got {json_type(shape)}")
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


# -- model versions ----------------------------------------------------------------------

_VERSION = re.compile(r"\s*[+-]?\d+")


def check_model_version(version: str) -> None:
    """A request's version string as Triton's front reads it before any model is looked up
    (an integer, 0 or more; "" is the newest ready one), refused in its words."""
    if not version:
        return
    match = _VERSION.match(version)
    if match is None or match.end() != len(version):
        # std::stol's exception text is the "details" Triton quotes
        raise InvalidArgument(
            f"failed to get model version from specified version string '{version}' "
            "(details: stol), version should be an integral value > 0")
    if int(version) < 0:
        raise InvalidArgument(f"invalid model version specified '{version}' , version should "
                              "be an integral value > 0")


_CONTENT_FIELDS = "Input must set only one of the following fields: 'data', 'binary_data_size' " \
                  "in 'parameters', 'shared_memory_region' in 'parameters'. But"


def _decode_input(doc: Any, i: int, model_name: str, max_elements: int
                  ) -> tuple[str, str, tuple[int, ...], dict[str, Any], Any, int | None]:
    if not isinstance(doc, dict):
        raise InvalidArgument(
            f"unable to parse 'inputs': element {i} is {json_type(doc)}, expected an object")
    name = doc.get("name")
    if not isinstance(name, str):
        raise InvalidArgument(
            f"unable to parse 'name' of input {i}: expected a string, got {json_type(name)}")
    dt = doc.get("datatype")
    if not isinstance(dt, str):
        raise InvalidArgument(
            f"unable to parse 'datatype' of input '{name}': expected a string, got "
            f"{json_type(dt)}")
    if not is_valid_datatype(dt):
        raise InvalidArgument(f"invalid datatype '{dt}' for input '{name}'")
    if "shape" not in doc:
        raise InvalidArgument(f"unable to parse 'shape' of input '{name}': field is missing")
    shape = check_shape(doc["shape"], name, max_elements)
    params = doc.get("parameters", {})
    if not isinstance(params, dict):
        raise InvalidArgument(
            f"unable to parse 'parameters' of input '{name}': expected an object, got "
            f"{json_type(params)}")
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
            f"unable to parse 'outputs': expected an array, got {json_type(outputs)}")
    result: list[RequestedOutput] = []
    seen: set[str] = set()
    for i, doc in enumerate(outputs):
        if not isinstance(doc, dict):
            raise InvalidArgument(
                f"unable to parse 'outputs': element {i} is {json_type(doc)}, expected an object")
        name = doc.get("name")
        if not isinstance(name, str):
            raise InvalidArgument(
                f"unable to parse 'name' of output {i}: expected a string, got {json_type(name)}")
        if name in seen:
            raise InvalidArgument(f"output '{name}' is requested more than once")
        seen.add(name)
        params = doc.get("parameters", {})
        if not isinstance(params, dict):
            raise InvalidArgument(
                f"unable to parse 'parameters' of output '{name}': expected an object, got "
                f"{json_type(params)}")
        if "binary_data" in params and not isinstance(params["binary_data"], bool):
            raise InvalidArgument(
                f"unable to parse 'binary_data' of output '{name}': expected a boolean, got "
                f"{json_type(params['binary_data'])}")
        if "classification" in params and not _is_uint(params["classification"]):
            raise InvalidArgument(
                f"unable to set 'classification' of output '{name}': expected a non-negative "
                f"integer, got {json_type(params['classification'])}")
        result.append(RequestedOutput(name=name, parameters=dict(params)))
    return result or None


# An input as checked: name, datatype, shape, parameters (binary_data_size taken out), its
# JSON ``data`` (None when binary or in shared memory), and its (start, end) in the body.
InputSpec = tuple[str, str, tuple[int, ...], dict[str, Any], Any, tuple[int, int] | None]


@dataclass
class CheckedRequest:
    """An infer request's header, every field checked, no tensor built yet."""
    id: str
    parameters: dict[str, Any]
    inputs: list[InputSpec]
    outputs: list[RequestedOutput] | None


def check_document(doc: Any, header_length: int, total: int, model_name: str,
                   max_elements: int) -> CheckedRequest:
    """``doc``, the JSON header of a ``total``-byte body whose first ``header_length`` bytes
    it was, checked field by field and size by size."""
    if not isinstance(doc, dict):
        raise InvalidArgument(
            f"failed to parse the request JSON buffer: expected an object, got {json_type(doc)}")

    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgument(
            f"unable to parse 'id': expected a string, got {json_type(request_id)}")
    parameters = check_request_parameters(doc.get("parameters", {}))

    inputs_doc = doc.get("inputs")
    if not isinstance(inputs_doc, list):
        raise InvalidArgument(
            "unable to parse 'inputs': expected an array, got "
            + ("nothing" if inputs_doc is None else json_type(inputs_doc)))

    specs: list[InputSpec] = []
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
            span = binary_span(name, dt, shape, binary_size, offset, header_length, total,
                               model_name)
            offset = span[1]
        specs.append((name, dt, shape, tparams, data, span))
    if offset != total:
        raise InvalidArgument(f"unexpected additional input data for model '{model_name}'")

    outputs = _decode_outputs(doc["outputs"]) if "outputs" in doc else None
    return CheckedRequest(request_id, parameters, specs, outputs)
