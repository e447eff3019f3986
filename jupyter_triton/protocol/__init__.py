"""KServe v2 / Triton protocol: types, datatypes, codecs and errors. Knows no HTTP server."""
from .errors import (Cancelled, Internal, InvalidArgument, NotFound, TritonError,
                     Unavailable, Unsupported)
from .types import InferRequest, InferResponse, InferTensor, RequestedOutput

__all__ = [
    "Cancelled", "Internal", "InvalidArgument", "NotFound", "TritonError", "Unavailable",
    "Unsupported", "InferRequest", "InferResponse", "InferTensor", "RequestedOutput",
]

# Datatypes and the HTTP codec (the gRPC codec lives in .grpc_codec, imported by its frontend
# only, so that importing the protocol does not load the gRPC stubs).
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
