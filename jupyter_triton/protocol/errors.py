"""Triton's error kinds, each carrying the HTTP status and gRPC code it maps to.

Raised where the fault is known (codec, config, engine, backend) and rendered once,
at the frontend, as ``{"error": "<message>"}``.
"""
from __future__ import annotations


class TritonError(Exception):
    """Base of every error a client may see; ``str(err)`` is the message sent."""

    status: int = 500
    grpc_code: str = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidArgument(TritonError):
    status = 400
    grpc_code = "INVALID_ARGUMENT"


class URITooLong(TritonError):
    status = 414
    grpc_code = "INVALID_ARGUMENT"


class HeaderTooLarge(TritonError):
    status = 431
    grpc_code = "INVALID_ARGUMENT"


class NotFound(TritonError):
    status = 404
    grpc_code = "NOT_FOUND"


class Unavailable(TritonError):
    status = 503
    grpc_code = "UNAVAILABLE"


class Unsupported(TritonError):
    status = 400
    grpc_code = "UNIMPLEMENTED"


class Internal(TritonError):
    status = 500
    grpc_code = "INTERNAL"


class Cancelled(TritonError):
    # nginx's "client closed request": nobody reads it, but logs and stats can tell it apart.
    status = 499
    grpc_code = "CANCELLED"


class Unauthenticated(TritonError):
    """No credential, or one nobody issued."""
    status = 401
    grpc_code = "UNAUTHENTICATED"


class PermissionDenied(TritonError):
    """A valid credential whose scope does not reach the API asked for."""
    status = 403
    grpc_code = "PERMISSION_DENIED"


class DeadlineExceeded(TritonError):
    """A model (or a client's body) took longer than its bound."""
    status = 504
    grpc_code = "DEADLINE_EXCEEDED"
