"""KServe v2 / Triton protocol: types, datatypes, codecs and errors. Knows no HTTP server."""
from .errors import (Cancelled, Internal, InvalidArgument, NotFound, TritonError,
                     Unavailable, Unsupported)
from .types import InferRequest, InferResponse, InferTensor, RequestedOutput

__all__ = [
    "Cancelled", "Internal", "InvalidArgument", "NotFound", "TritonError", "Unavailable",
    "Unsupported", "InferRequest", "InferResponse", "InferTensor", "RequestedOutput",
]
