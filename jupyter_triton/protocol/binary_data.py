"""Triton's binary tensor data extension: with ``Inference-Header-Content-Length``, a body is
a JSON header followed by the bytes of the inputs that carry ``parameters.binary_data_size``,
in input order; a header length of 0 is a raw request, the whole body one input's bytes. A
response puts the outputs asked for as binary after its JSON header the same way.
"""
from __future__ import annotations

import json
import secrets
from typing import Any

from .datatypes import (count_bytes_elements, element_count, element_size, tensor_from_wire,
                        tensor_wire_buffer)
from .errors import InvalidArgument
from .json_tensors import encode_header, json_data, json_numbers, plain_values
from .types import InferRequest, InferResponse, InferTensor


def binary_span(name: str, dt: str, shape: tuple[int, ...], binary_size: int, offset: int,
                header_length: int, total: int, model_name: str) -> tuple[int, int]:
    """Where in a ``total``-byte body the ``binary_size`` bytes of input ``name`` lie, the
    bytes before ``offset`` taken by the header and the inputs before it."""
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
    return offset, offset + binary_size


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

def encode_response(response: InferResponse, request: InferRequest
                    ) -> tuple[bytes, int | None]:
    """The response body in full (no plan) and its Inference-Header-Content-Length."""
    return joined(*encode_parts(response, request))


def encode_parts(response: InferResponse, request: InferRequest
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
    plain = not response.parameters or plain_values(response.parameters)
    for i, t in enumerate(response.outputs):
        wanted = requested.get(t.name)
        binary = wanted.get("binary_data", default_binary) if wanted else default_binary
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype,
                                 "shape": [int(d) for d in t.shape]}
        params = dict(t.parameters) if t.parameters else {}
        numbers = None if binary or t.data is None or t.datatype == "BYTES" else json_numbers(t)
        if numbers is not None:
            nonce = nonce or secrets.token_hex(8)
            key = f"\x01data-{nonce}-{len(spliced)}"
            spliced[i] = (json.dumps(key).encode(), numbers)
            entry["data"] = key
            data: list | None = []
        else:
            data = None if binary or t.data is None else json_data(t)
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
            plain = plain and plain_values(params)
        outputs.append(entry)
    doc: dict[str, Any] = {"model_name": response.model_name,
                           "model_version": str(response.model_version)}
    rid = response.id or request.id
    if rid:
        doc["id"] = rid
    if response.parameters:
        doc["parameters"] = response.parameters
    doc["outputs"] = outputs
    return encode_header(doc, plain and (not rid or type(rid) is str)), spliced, buffers


def joined(header: bytes, spliced: dict[int, tuple[bytes, list[bytes]]], buffers: list
           ) -> tuple[bytes, int | None]:
    """``encode_parts``'s pieces as one body: the JSON values spliced in where their markers
    stand, the binary outputs after the header; and the header's length (None: all JSON)."""
    for marker, slices in spliced.values():
        before, _, after = header.partition(marker)
        header = b"".join([before, b"[", b",".join(slices), b"]", after])
    if not buffers:
        return header, None
    return b"".join([header, *buffers]), len(header)

