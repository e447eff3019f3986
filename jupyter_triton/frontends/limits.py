"""Every limit a listener enforces against its peers, named once (as hypercorn's ``Config``
and grpc core's channel arguments name theirs) and read from here by every skin.

The gRPC names follow tritonserver's flags (``--grpc-keepalive-time`` is ``keepalive_time``,
in seconds here where Triton takes milliseconds); the HTTP/1 ones follow nginx's
(``large_client_header_buffers``, ``client_header_timeout``, ``keepalive_timeout``,
``send_timeout``).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HTTP1Limits:
    """What one HTTP/1.1 connection may send before it is refused or closed (read by
    ``fasthttp`` and ``shared_port``; tornado's own limits hold for what it serves). Sizes are
    counted as the bytes arrive, before the parser has a whole head; each refusal is a Triton
    error reply with the status named here, then a close."""
    max_request_line: int = 16 * 1024       # 414 past it (nginx: large_client_header_buffers)
    max_header_line: int = 16 * 1024        # 431: one header (or trailer) line
    max_header_bytes: int = 64 * 1024       # 431: all header lines of one request
    max_headers: int = 128                  # 431: header lines of one request
    header_timeout: float = 60.0            # 408: seconds for a whole request head (slowloris)
    idle_timeout: float = 300.0             # seconds a kept-alive connection may sit idle
    max_connections: int = 4096             # per listener (the admission counts its door's);
                                            # beyond, a 503 and a close
    max_pending_reply_bytes: int = 1 << 20  # write buffer past which the peer is not read
    max_pipelined: int = 1024               # 503: requests received and not yet answered
    send_timeout: float = 60.0              # seconds unread replies may make no progress


@dataclass(frozen=True)
class HTTP2Limits:
    """What one HTTP/2 (gRPC) connection may send; advertised in SETTINGS where HTTP/2 can."""
    # SETTINGS_MAX_CONCURRENT_STREAMS, past it REFUSED_STREAM (nginx: 128): well under the
    # server's RPC cap (1,024), so one connection cannot take every RPC slot.
    max_concurrent_streams: int = 128
    max_header_list_size: int = 16 * 1024   # SETTINGS_MAX_HEADER_LIST_SIZE (grpc core: 16 KiB)
    max_frame_size: int = 16 * 1024         # SETTINGS_MAX_FRAME_SIZE we accept
    stream_window: int = 4 * 1024 * 1024    # receive window of one stream, given back as read
    connection_window: int = 16 * 1024 * 1024   # receive window of one connection
    # Wire bytes of messages one connection may hold (arriving, or not yet taken by their
    # handlers) without charging the server's bytes-in-flight budget; a message past it is
    # charged to the budget when its length prefix arrives, or refused (RESOURCE_EXHAUSTED).
    # Every byte a connection holds is one or the other, so this (not the windows, which are
    # flow control only) bounds memory: all peers together hold at most max_connections x
    # this (4,096 x 1 MiB = 4 GiB, every connection kept just under it) plus the budget.
    connection_allowance: int = 1024 * 1024
    # Control frames (PING, SETTINGS, RST_STREAM, empty DATA, ...) a peer may send before it
    # has read our answers; past it, GOAWAY ENHANCE_YOUR_CALM (h2o, nginx's "flood" checks).
    max_control_frames: int = 10_000
    max_resets_per_second: int = 1_000      # rapid reset (CVE-2023-44487)
    max_connections: int = 4096            # per listener (the admission counts its door's);
                                           # beyond, accepted then closed at once
    # Write buffer past which the peer is not read until it reads (back-pressure).
    max_pending_reply_bytes: int = 1 << 20
    # Response bytes one connection holds behind the peer's flow control; past it a unary
    # response is RESOURCE_EXHAUSTED and a stream's handler waits.
    max_pending_bytes: int = 32 * 1024 * 1024
    # Seconds a message charged to the budget may take to arrive, from its length prefix on
    # (the HTTP fronts' body_timeout): past it DEADLINE_EXCEEDED and its charge goes back, so
    # a peer trickling bytes cannot hold the budget.
    message_timeout: float = 60.0
    handshake_timeout: float = 10.0         # seconds for the preface and first SETTINGS
    max_connection_idle: float = 120.0      # seconds without a stream; tritonserver: 120 s
    keepalive_time: float = 7200.0          # --grpc-keepalive-time (ms there)
    keepalive_timeout: float = 20.0         # --grpc-keepalive-timeout
    keepalive_permit_without_calls: bool = False    # --grpc-keepalive-permit-without-calls
    max_pings_without_data: int = 2         # --grpc-http2-max-pings-without-data
    min_recv_ping_interval_without_data: float = 300.0  # --grpc-http2-min-recv-ping-interval-without-data
    max_ping_strikes: int = 2               # --grpc-http2-max-ping-strikes
    max_connection_age: float | None = None         # --grpc-max-connection-age
    max_connection_age_grace: float | None = None   # --grpc-max-connection-age-grace
