"""The gRPC port's operator settings in tritonserver's words: its keep-alive and connection-age
flags (milliseconds there, ``HTTP2Limits`` seconds here) and its TLS flags, read once by the
CLI and by the server extension's traits, and turned into what the HTTP/2 front takes
(``HTTP2Limits``, an ``ssl.SSLContext``).
"""
from __future__ import annotations

import dataclasses
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from .limits import HTTP2Limits

# tritonserver's flag (after "--grpc-") -> the HTTP2Limits field it sets, and its unit there
KEEPALIVE_FLAGS: dict[str, tuple[str, str]] = {
    "keepalive-time": ("keepalive_time", "ms"),
    "keepalive-timeout": ("keepalive_timeout", "ms"),
    "keepalive-permit-without-calls": ("keepalive_permit_without_calls", "bool"),
    "http2-max-pings-without-data": ("max_pings_without_data", "count"),
    "http2-min-recv-ping-interval-without-data": ("min_recv_ping_interval_without_data", "ms"),
    "http2-max-ping-strikes": ("max_ping_strikes", "count"),
    "max-connection-age": ("max_connection_age", "ms"),
    "max-connection-age-grace": ("max_connection_age_grace", "ms"),
}


def http2_limits(values: Mapping[str, int | bool | None],
                 base: HTTP2Limits = HTTP2Limits()) -> HTTP2Limits:
    """``base`` with tritonserver's flag values applied: ``values`` maps a flag of
    KEEPALIVE_FLAGS (``"keepalive-time"``) to its value as tritonserver takes it (None: unset)."""
    changes: dict[str, object] = {}
    for flag, value in values.items():
        field, unit = KEEPALIVE_FLAGS[flag]
        if value is None:
            continue
        if unit == "bool":
            changes[field] = bool(value)
        elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"--grpc-{flag} must be a whole number, 0 or more; got {value!r}")
        else:
            changes[field] = value / 1000.0 if unit == "ms" else value
    return dataclasses.replace(base, **changes)


@dataclass(frozen=True)
class GrpcTLS:
    """tritonserver's ``--grpc-use-ssl`` settings: PEM files of the server's certificate
    (chain) and key; with ``mutual`` (``--grpc-use-ssl-mutual``) every client must present a
    certificate that ``root_cert`` (``--grpc-root-cert``) signed."""
    server_cert: str
    server_key: str
    root_cert: str = ""
    mutual: bool = False

    def check(self) -> None:
        """Raise ValueError naming the flag whose file is missing or unreadable."""
        wanted = [("--grpc-server-cert", self.server_cert), ("--grpc-server-key", self.server_key)]
        if self.mutual:
            wanted.append(("--grpc-root-cert", self.root_cert))
        for flag, path in wanted:
            if not path:
                raise ValueError(f"gRPC TLS needs {flag}")
            if not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")
        try:
            self.ssl_context()
        except (ssl.SSLError, OSError) as err:
            raise ValueError(f"gRPC TLS: the certificate or key does not load: {err}") from None

    def ssl_context(self) -> ssl.SSLContext:
        """For the HTTP/2 front: TLS 1.2 or newer, ALPN "h2" (gRPC clients insist on it)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.server_cert, self.server_key)
        context.set_alpn_protocols(["h2"])
        if self.mutual:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(cafile=self.root_cert)
        return context
