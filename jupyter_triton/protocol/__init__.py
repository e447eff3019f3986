"""KServe v2 / Triton protocol: types, datatypes, codecs and errors. Knows no HTTP server.

Layer note: the bottom layer. It owns the v2 request/response types and rules, HTTP's JSON
and binary codecs, a tensor's bytes on the wire (which gRPC's codec, frontends/grpc_codec.py,
uses too), the datatype table and the Triton-shaped errors every other layer raises. It
imports nothing else of the package (numpy, orjson and Triton's protobuf stubs only) and
must not know a transport, the engine or a backend. Measured costs behind
its codecs' choices: benchmarks/results/notes-protocol.md.
"""
from .errors import (Cancelled, Internal, InvalidArgument, NotFound, TritonError,
                     Unavailable, Unsupported)
from .types import InferRequest, InferResponse, InferTensor, RequestedOutput

__all__ = [
    "Cancelled", "Internal", "InvalidArgument", "NotFound", "TritonError", "Unavailable",
    "Unsupported", "InferRequest", "InferResponse", "InferTensor", "RequestedOutput",
]

# Datatypes and the HTTP codec (gRPC's codec is its frontend's: frontends/grpc_codec.py).
from .datatypes import (config_to_triton, deserialize_bytes_tensor, element_size,
                        numpy_to_triton, serialize_bytes_tensor, triton_to_config,
                        triton_to_numpy)
from .binary_data import decode_raw_infer_request
from .http_codec import decode_infer_request, encode_error, encode_infer_response

__all__ += [
    "config_to_triton", "deserialize_bytes_tensor", "element_size", "numpy_to_triton",
    "serialize_bytes_tensor", "triton_to_config", "triton_to_numpy", "decode_infer_request",
    "decode_raw_infer_request", "encode_error", "encode_infer_response",
]
