"""Whatever bytes reach the gRPC port, the server keeps serving: our HTTP/2 front
(frontends/h2_connection.py under frontends/grpc_calls.py) parses frames itself, so a broken or hostile peer must cost only its
own connection. Each case opens a raw socket, sends the bytes, checks that the server ended
that connection as RFC 9113 says (GOAWAY with the error code it names), and then an unmodified
tritonclient.grpc client must still get correct answers."""
from __future__ import annotations

import random
import socket
import struct

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from conftest import W

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"", length: int | None = None) -> bytes:
    n = len(payload) if length is None else length
    return struct.pack(">BHBBL", n >> 16, n & 0xFFFF, ftype, flags, sid) + payload


PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, COMPRESSION_ERROR = 0x1, 0x3, 0x6, 0x9
rng = random.Random(7)
CASES = {
    "random bytes": bytes(rng.randrange(256) for _ in range(4096)),
    "bad preface": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "frame longer than allowed": PREFACE + frame(4, 0, 0) + frame(0, 0, 1, b"", length=(1 << 24) - 1),
    "settings of odd length": PREFACE + frame(4, 0, 0, b"\x00\x01\x00"),
    "headers with broken hpack": PREFACE + frame(4, 0, 0) + frame(1, 0x4 | 0x1, 1, b"\xff\xff\xff\xff\x0f"),
    "data on a stream never opened": PREFACE + frame(4, 0, 0) + frame(0, 0x1, 9, b"\x00\x00\x00\x00\x05hello"),
    "window update overflowing": PREFACE + frame(4, 0, 0) + frame(8, 0, 0, struct.pack(">L", 0x7FFFFFFF)) * 3,
    "padding longer than the frame": PREFACE + frame(4, 0, 0) + frame(1, 0x8 | 0x4, 1, b"\xff" + b"a" * 4),
    "headers on stream 0": PREFACE + frame(4, 0, 0) + frame(1, 0x4, 0, b"\x82"),
    "continuation without headers": PREFACE + frame(4, 0, 0) + frame(9, 0x4, 3, b"\x82"),
    "half a frame header then close": PREFACE + b"\x00\x00",
}
# The GOAWAY error code each case must get (None: the peer stalls, nothing to answer yet).
EXPECTED = {
    "random bytes": PROTOCOL_ERROR,
    "bad preface": PROTOCOL_ERROR,
    "frame longer than allowed": FRAME_SIZE_ERROR,
    "settings of odd length": FRAME_SIZE_ERROR,
    "headers with broken hpack": COMPRESSION_ERROR,
    "data on a stream never opened": PROTOCOL_ERROR,
    "window update overflowing": FLOW_CONTROL_ERROR,
    "padding longer than the frame": PROTOCOL_ERROR,
    "headers on stream 0": PROTOCOL_ERROR,
    "continuation without headers": PROTOCOL_ERROR,
    "half a frame header then close": None,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from conftest import build_repository
    from jupyter_triton.engine import EngineOptions
    from jupyter_triton.standalone import start_in_thread
    repo = build_repository(tmp_path_factory.mktemp("garbage") / "models")
    srv = start_in_thread(EngineOptions(model_repository=repo, model_control_mode="explicit",
                                        load_models=["*"]),
                          host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0)
    yield srv
    srv.close()


def _infer_ok(port: int) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    x = np.ones((2, 16), np.float32)
    inp = grpcclient.InferInput("INPUT0", [2, 16], "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("linear", [inp], client_timeout=20)
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), x @ W, rtol=1e-5)
    client.close()


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_bytes_cost_only_their_own_connection(server, case):
    with socket.create_connection(("127.0.0.1", server.grpc_port), timeout=5) as sock:
        sock.sendall(CASES[case])
        sock.settimeout(3)
        data, closed = b"", False
        try:                       # the server answers (GOAWAY) and closes; it never hangs us forever
            while chunk := sock.recv(65536):
                data += chunk
            closed = True
        except (socket.timeout, ConnectionResetError):
            pass
    goaways = [payload for ftype, _, _, payload in _frames(data) if ftype == 7]
    if EXPECTED[case] is not None:
        assert closed, "the server kept the connection open after a connection error"
        assert goaways, f"no GOAWAY; got {data[:200]!r}"
        assert struct.unpack(">L", goaways[0][4:8])[0] == EXPECTED[case]
    _infer_ok(server.grpc_port)


def _frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """The whole frames in ``data`` (type, flags, stream id, payload)."""
    out = []
    while len(data) >= 9 and len(data) >= 9 + int.from_bytes(data[:3], "big"):
        n = int.from_bytes(data[:3], "big")
        out.append((data[3], data[4], int.from_bytes(data[5:9], "big"), data[9:9 + n]))
        data = data[9 + n:]
    return out


def read_frame(sock: socket.socket, buf: bytes) -> tuple[tuple[int, int, int, bytes], bytes]:
    """The next frame (type, flags, stream id, payload) from ``buf`` and the socket, and
    what is left of ``buf`` after it."""
    while len(buf) < 9 or len(buf) < 9 + int.from_bytes(buf[:3], "big"):
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        buf += chunk
    n = int.from_bytes(buf[:3], "big")
    return (buf[3], buf[4], int.from_bytes(buf[5:9], "big"), buf[9:9 + n]), buf[9 + n:]


def _call(sock: socket.socket, sid: int, block: bytes, decoder) -> dict:
    """One unary call with the header block ``block`` (an empty request message); the
    response's headers and trailers, decoded."""
    sock.sendall(frame(1, 0x4, sid, block) + frame(0, 0x1, sid, b"\x00\x00\x00\x00\x00"))
    buf, headers = b"", {}
    while True:
        (ftype, flags, fsid, payload), buf = read_frame(sock, buf)
        if ftype == 1 and fsid == sid:
            headers.update(decoder.decode(payload))
            if flags & 0x1:
                return headers


def test_a_repeated_header_block_follows_the_hpack_table(server):
    """The same header block bytes mean other headers once the client's HPACK table has
    changed: the server must answer what the table says now, not what it said before."""
    from hpack import Decoder
    service = "/inference.GRPCInferenceService/"
    # :method POST, :scheme http, content-type and te as literals the table does not keep
    fixed = b"\x83\x86" + b"\x0f\x10\x10application/grpc" + b"\x00\x02te\x08trailers"
    # literal with incremental indexing, name ':path' (static 4): becomes dynamic entry 62
    def insert(path: str) -> bytes:
        return b"\x44" + bytes([len(path)]) + path.encode()
    newest = b"\xbe"                    # indexed: dynamic entry 62, the newest
    decoder = Decoder()
    with socket.create_connection(("127.0.0.1", server.grpc_port), timeout=10) as sock:
        sock.sendall(PREFACE + frame(4, 0, 0))
        sid = 1
        for path, status in ((service + "ServerLive", "0"), (service + "NoSuchMethod", "12"),
                             (service + "ServerReady", "0"), (service + "NoSuchMethod", "12")):
            # the path enters the table, then the same block bytes refer to it twice
            assert _call(sock, sid, fixed + insert(path), decoder)["grpc-status"] == status
            for _ in range(2):
                sid += 2
                assert _call(sock, sid, fixed + newest, decoder)["grpc-status"] == status, path
            sid += 2
        # a table size update to 0 empties the table: entry 62 is gone, a protocol error
        sock.sendall(frame(1, 0x5, sid, b"\x20" + fixed + newest))
        sock.settimeout(5)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except (socket.timeout, ConnectionResetError):
            pass
        goaways = [payload for ftype, _, _, payload in _frames(data) if ftype == 7]
        assert goaways and struct.unpack(">LL", goaways[0][:8]) == (sid, COMPRESSION_ERROR)
    _infer_ok(server.grpc_port)


def test_the_connection_window_is_given_back(server):
    """Received DATA is given back to the connection's flow-control window once the handlers
    took it (in batches of WINDOW_REFILL bytes): a client that sends more than that gets it
    back and goes on."""
    from jupyter_triton.frontends.h2_connection import WINDOW_REFILL
    from jupyter_triton.frontends.limits import HTTP2Limits
    window = HTTP2Limits().connection_window
    live = b"\x83\x86" + b"\x04\x2a/inference.GRPCInferenceService/ServerLive" + \
        b"\x0f\x10\x10application/grpc" + b"\x00\x02te\x08trailers"
    # a ServerLiveRequest carrying an unknown field (kept by the parser): 16 KiB a call
    body = b"\x7a" + bytes([0x80 | (16370 & 0x7F), 16370 >> 7]) + b"x" * 16370
    message = b"\x00" + struct.pack(">L", len(body)) + body
    calls = WINDOW_REFILL // len(message) + 8
    with socket.create_connection(("127.0.0.1", server.grpc_port), timeout=10) as sock:
        sock.sendall(PREFACE + frame(4, 0, 0))
        for k in range(calls):
            sid = 2 * k + 1
            sock.sendall(frame(1, 0x4, sid, live) + frame(0, 0x1, sid, message))
        given, done, buf = 0, 0, b""
        while done < calls:
            (ftype, flags, fsid, payload), buf = read_frame(sock, buf)
            if ftype == 8 and fsid == 0:
                given += struct.unpack(">L", payload)[0]
            elif ftype == 1 and flags & 0x1:
                assert b"grpc-status\x010" in payload, payload     # each call answered OK
                done += 1
    sent = calls * len(message)
    given -= window - 65535             # the first update: the window beyond RFC 9113's default
    assert given >= WINDOW_REFILL and 0 <= sent - given < WINDOW_REFILL, (sent, given)
