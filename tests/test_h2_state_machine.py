"""The HTTP/2 state machine alone (frontends/h2_connection.py), sans-IO: a client's bytes in,
the events it raises and the frames it answers with out. No socket, no loop, no gRPC; time is
a number the test sets."""
from __future__ import annotations

import struct
from dataclasses import replace

import pytest
from hpack import Encoder

from jupyter_triton.frontends.h2_connection import (
    ACK, CONTINUATION, DATA, END_HEADERS, END_STREAM, ENHANCE_YOUR_CALM, FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR, GOAWAY, HEADERS, KEEPALIVE_PING, NO_ERROR, PADDED, PING, PREFACE,
    PROTOCOL_ERROR, PUSH, REFUSED_STREAM, RST_STREAM, S_INITIAL_WINDOW_SIZE,
    S_MAX_CONCURRENT_STREAMS, SETTINGS, STREAM_CLOSED, WINDOW_UPDATE, H2Connection, H2Events,
    H2Stream, frame)
from jupyter_triton.frontends.limits import HTTP2Limits

REQUEST = [(":method", "POST"), (":scheme", "http"), (":path", "/pkg.Service/Method"),
           (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")]


class Recorder(H2Events):
    """Every event as a tuple; ``hold`` keeps data given to it untaken (``waiting``)."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.hold = False

    def request_received(self, st):
        self.events.append(("request", st.sid, st.head))

    def data_received(self, st, payload):
        if self.hold:
            st.waiting += 1
        self.events.append(("data", st.sid, payload))

    def stream_ended(self, st):
        self.events.append(("ended", st.sid))

    def stream_reset(self, st):
        self.events.append(("reset", st.sid))

    def stream_closed(self, st, was_open):
        self.events.append(("closed", st.sid, was_open))

    def stream_drained(self, st):
        self.events.append(("drained", st.sid))


class Peer:
    """A client's side, by hand: frames built, the server's answers parsed."""

    def __init__(self, limits: HTTP2Limits = HTTP2Limits(), handshake: bool = True) -> None:
        self.now = 100.0
        self.events = Recorder()
        self.conn = H2Connection(limits, self.events, lambda: self.now)
        self.conn.initiate_connection(self.now)
        self.encoder = Encoder()
        self.hello = self.frames()
        if handshake:
            self.send(PREFACE + frame(SETTINGS, 0, 0))
            assert (SETTINGS, ACK, 0, b"") in self.frames()

    def send(self, data: bytes) -> None:
        self.conn.receive_data(data)

    def frames(self) -> list[tuple[int, int, int, bytes]]:
        data, out = self.conn.data_to_send(), []
        while data:
            n = int.from_bytes(data[:3], "big")
            sid = int.from_bytes(data[5:9], "big") & 0x7FFFFFFF
            out.append((data[3], data[4], sid, data[9:9 + n]))
            data = data[9 + n:]
        return out

    def headers(self, sid: int, end_stream: bool = False, headers=REQUEST) -> None:
        flags = END_HEADERS | (END_STREAM if end_stream else 0)
        self.send(frame(HEADERS, flags, sid, self.encoder.encode(headers)))

    def goaway(self) -> tuple[int, int]:
        """The (last stream id, error code) of the GOAWAY the server sent."""
        frames = [f for f in self.frames() if f[0] == GOAWAY]
        assert frames, "no GOAWAY"
        return struct.unpack(">LL", frames[-1][3][:8])


def test_our_settings_come_first_and_a_bad_preface_is_a_protocol_error():
    limits = HTTP2Limits(stream_window=1 << 20, max_concurrent_streams=7)
    peer = Peer(limits, handshake=False)
    (ftype, flags, sid, payload), (wtype, _, wsid, inc) = peer.hello
    assert (ftype, flags, sid) == (SETTINGS, 0, 0)
    settings = dict(struct.iter_unpack(">HL", payload))
    assert settings[S_INITIAL_WINDOW_SIZE] == 1 << 20
    assert settings[S_MAX_CONCURRENT_STREAMS] == 7
    assert (wtype, wsid) == (WINDOW_UPDATE, 0)
    assert int.from_bytes(inc, "big") == limits.connection_window - 65535
    peer.send(b"GET / HTTP/1.1\r\n")
    assert peer.conn.dead and peer.goaway() == (0, PROTOCOL_ERROR)


def test_the_first_frame_must_be_settings():
    peer = Peer(handshake=False)
    peer.frames()
    peer.send(PREFACE + frame(PING, 0, 0, bytes(8)))
    assert peer.goaway() == (0, PROTOCOL_ERROR)


def test_a_request_is_events_in_order():
    peer = Peer()
    peer.headers(1)
    peer.send(frame(DATA, 0, 1, b"abc") + frame(DATA, PADDED | END_STREAM, 1, b"\x02de\x00\x00"))
    assert peer.events.events == [("request", 1, REQUEST), ("data", 1, b"abc"),
                                  ("data", 1, b"de"), ("ended", 1)]
    assert not peer.conn.dead


def test_continuation_is_one_header_block_and_nothing_may_come_between():
    peer = Peer()
    block = peer.encoder.encode(REQUEST)
    peer.send(frame(HEADERS, 0, 1, block[:5]) + frame(CONTINUATION, END_HEADERS, 1, block[5:]))
    assert peer.events.events == [("request", 1, REQUEST)]
    peer.send(frame(HEADERS, END_STREAM, 3, peer.encoder.encode(REQUEST)[:3])
              + frame(DATA, 0, 1, b"x"))
    assert peer.goaway() == (3, PROTOCOL_ERROR)


def test_header_blocks_past_the_header_list_limit_are_enhance_your_calm():
    limits = HTTP2Limits(max_header_list_size=1024)
    peer = Peer(limits)
    peer.send(frame(HEADERS, 0, 1, bytes(600)) + frame(CONTINUATION, 0, 1, bytes(600)))
    assert peer.goaway() == (1, ENHANCE_YOUR_CALM)
    peer = Peer(limits)             # one header decoded past the limit (HPACK's own check)
    peer.headers(1, headers=REQUEST + [("x-big", "y" * 1000)])
    assert peer.goaway() == (1, ENHANCE_YOUR_CALM)


def test_streams_past_the_concurrency_limit_are_refused_after_their_headers_decode():
    peer = Peer(HTTP2Limits(max_concurrent_streams=1))
    peer.headers(1)
    peer.headers(3)
    assert (RST_STREAM, 0, 3, struct.pack(">L", REFUSED_STREAM)) in peer.frames()
    assert [e[:2] for e in peer.events.events] == [("request", 1)]
    peer.headers(5)                 # HPACK's table was kept in step with the refused block
    assert not peer.conn.dead


def test_a_frame_larger_than_we_allow_is_a_frame_size_error():
    peer = Peer(HTTP2Limits(max_frame_size=16384))
    peer.send(struct.pack(">BHBBL", 0, 16385, DATA, 0, 1))
    assert peer.goaway() == (0, FRAME_SIZE_ERROR)


def test_data_on_an_idle_stream_or_past_the_connection_window_is_a_connection_error():
    peer = Peer()
    peer.send(frame(DATA, 0, 1, b"x"))
    assert peer.goaway() == (0, PROTOCOL_ERROR)
    peer = Peer(HTTP2Limits(connection_window=65535, stream_window=1 << 20, max_frame_size=1 << 16))
    peer.events.hold = True
    peer.headers(1)
    peer.send(frame(DATA, 0, 1, bytes(65536)))
    assert peer.goaway() == (1, FLOW_CONTROL_ERROR)


def test_a_stream_window_comes_back_only_once_its_data_is_taken():
    limits = HTTP2Limits(stream_window=65536, connection_window=1 << 20)
    peer = Peer(limits)
    peer.events.hold = True
    peer.headers(1)
    peer.send(frame(DATA, 0, 1, bytes(16384)) + frame(DATA, 0, 1, bytes(16384)))
    updates = [f for f in peer.frames() if f[0] == WINDOW_UPDATE]
    assert updates == []            # nothing taken yet, and the connection's is far from low
    st = peer.conn.streams[1]
    st.waiting = 0                  # the layer above took what it was given
    peer.conn.give_back(st)
    assert (WINDOW_UPDATE, 0, 1, struct.pack(">L", 32768)) in peer.frames()
    # the connection's window comes back as bytes arrive, whatever the streams hold
    peer.send(frame(DATA, 0, 1, bytes(16384)) * 30)
    updates = [f for f in peer.frames() if f[0] == WINDOW_UPDATE]
    assert [sid for _, _, sid, _ in updates] == [0]


def test_data_after_end_stream_resets_the_stream():
    peer = Peer()
    peer.headers(1, end_stream=True)
    peer.send(frame(DATA, 0, 1, b"x"))
    assert (RST_STREAM, 0, 1, struct.pack(">L", STREAM_CLOSED)) in peer.frames()
    assert ("reset", 1) in peer.events.events and 1 not in peer.conn.streams


def test_what_we_send_waits_for_the_peers_windows():
    peer = Peer()
    peer.send(frame(SETTINGS, 0, 0, struct.pack(">HL", S_INITIAL_WINDOW_SIZE, 10)))
    peer.headers(1, end_stream=True)
    peer.frames()
    st = peer.conn.streams[1]
    st.wants_drain = True
    peer.conn.send_headers(st, b"\x88")
    peer.conn.send_data(st, b"0123456789abcdef", trailers=b"\x40\x01a\x01b")
    frames = peer.frames()
    assert [(f[0], f[3]) for f in frames] == [(HEADERS, b"\x88"), (DATA, b"0123456789")]
    assert peer.conn.pending_total == 6 and 1 in peer.conn.blocked
    peer.send(frame(WINDOW_UPDATE, 0, 1, struct.pack(">L", 100)))
    frames = peer.frames()
    assert [(f[0], f[1], f[3]) for f in frames] == [
        (DATA, 0, b"abcdef"), (HEADERS, END_HEADERS | END_STREAM, b"\x40\x01a\x01b")]
    assert peer.events.events[-2:] == [("drained", 1), ("closed", 1, True)]
    assert peer.conn.pending_total == 0 and not peer.conn.streams


def test_a_whole_answer_goes_in_one_piece_only_when_the_windows_allow():
    peer = Peer()
    peer.headers(1, end_stream=True)
    peer.headers(3, end_stream=True)
    peer.frames()
    conn = peer.conn
    assert conn.send_whole(conn.streams[1], b"\x88", b"\x00", b"body", b"\x40\x01a\x01b")
    assert [f[0] for f in peer.frames()] == [HEADERS, DATA, HEADERS]
    conn.send_window = 3
    assert not conn.send_whole(conn.streams[3], b"\x88", b"\x00", b"body", b"\x40\x01a\x01b")
    assert peer.frames() == [] and 3 in conn.streams


def test_an_answer_to_a_peer_still_sending_ends_its_stream_with_no_error():
    peer = Peer()
    peer.headers(1)
    peer.frames()
    peer.conn.send_headers(peer.conn.streams[1], b"\x88", end_stream=True)
    assert (RST_STREAM, 0, 1, struct.pack(">L", NO_ERROR)) in peer.frames()
    assert peer.events.events[-1] == ("closed", 1, True)


def test_the_peers_reset_drops_the_stream():
    peer = Peer()
    peer.headers(1)
    peer.send(frame(RST_STREAM, 0, 1, struct.pack(">L", 8)))
    assert peer.events.events[-1] == ("reset", 1) and not peer.conn.streams
    peer.send(frame(RST_STREAM, 0, 9, struct.pack(">L", 8)))     # an idle stream
    assert peer.goaway() == (1, PROTOCOL_ERROR)


def test_floods_are_enhance_your_calm():
    peer = Peer(HTTP2Limits(max_control_frames=50))
    peer.send(frame(SETTINGS, 0, 0) * 51)
    assert peer.goaway() == (0, ENHANCE_YOUR_CALM)
    peer = Peer(HTTP2Limits(max_resets_per_second=5))
    for sid in range(1, 15, 2):
        peer.headers(sid)
        peer.send(frame(RST_STREAM, 0, sid, struct.pack(">L", 8)))
    assert peer.goaway()[1] == ENHANCE_YOUR_CALM
    peer = Peer()                   # control frames from a peer that does not read
    peer.conn.write_paused = True
    peer.send(frame(PING, 0, 0, bytes(8)) * 3 + frame(0xFA, 0, 0) * 1030)
    assert peer.goaway()[1] == ENHANCE_YOUR_CALM


def test_the_flood_count_is_per_second():
    peer = Peer(HTTP2Limits(max_control_frames=50))
    peer.send(frame(0xFA, 0, 0) * 50)
    peer.now += 1.5
    peer.conn.tick(peer.now)
    peer.send(frame(0xFA, 0, 0) * 50)
    assert not peer.conn.dead


def test_pings_are_policed_as_grpc_core_does():
    peer = Peer(HTTP2Limits(max_ping_strikes=2))
    for i in range(3):
        peer.send(frame(PING, 0, 0, bytes([i]) * 8))
        assert (PING, ACK, 0, bytes([i]) * 8) in peer.frames()
    peer.send(frame(PING, 0, 0, bytes(8)))
    assert peer.goaway()[1] == ENHANCE_YOUR_CALM


def test_handshake_idle_and_age_deadlines_follow_the_clock():
    limits = HTTP2Limits(handshake_timeout=5.0)
    peer = Peer(limits, handshake=False)
    peer.conn.tick(peer.now + 4.0)
    assert not peer.conn.dead
    peer.conn.tick(peer.now + 6.0)
    assert peer.goaway() == (0, PROTOCOL_ERROR)

    peer = Peer(HTTP2Limits(max_connection_idle=10.0))
    peer.conn.tick(peer.now + 1)
    peer.conn.tick(peer.now + 12)
    assert peer.goaway() == (0, NO_ERROR)

    peer = Peer(HTTP2Limits(max_connection_age=30.0, max_connection_age_grace=5.0))
    peer.headers(1)
    peer.conn.tick(peer.now + 31)
    assert not peer.conn.dead and peer.goaway() == (1, NO_ERROR)
    peer.headers(3)                 # past our GOAWAY: refused
    assert (RST_STREAM, 0, 3, struct.pack(">L", REFUSED_STREAM)) in peer.frames()
    peer.conn.tick(peer.now + 37)
    assert peer.conn.dead


def test_keepalive_pings_and_their_timeout():
    limits = HTTP2Limits(keepalive_time=10.0, keepalive_timeout=3.0,
                         keepalive_permit_without_calls=True)
    peer = Peer(limits)
    conn = peer.conn
    conn.tick(peer.now + 1)         # reads seen: the keep-alive clock starts
    conn.tick(peer.now + 12)
    assert (PING, 0, 0, KEEPALIVE_PING) in peer.frames()
    peer.send(frame(PING, ACK, 0, KEEPALIVE_PING))
    assert conn.keepalive_sent is None
    conn.tick(peer.now + 13)
    conn.tick(peer.now + 24)
    assert (PING, 0, 0, KEEPALIVE_PING) in peer.frames()
    conn.tick(peer.now + 28)        # no ACK within keepalive_timeout
    assert peer.goaway() == (0, NO_ERROR) and conn.dead


@pytest.mark.parametrize("bad, code", [
    (frame(SETTINGS, 0, 1), PROTOCOL_ERROR),
    (frame(SETTINGS, ACK, 0, bytes(6)), FRAME_SIZE_ERROR),
    (frame(SETTINGS, 0, 0, bytes(5)), FRAME_SIZE_ERROR),
    (frame(SETTINGS, 0, 0, struct.pack(">HL", S_INITIAL_WINDOW_SIZE, 1 << 31)), FLOW_CONTROL_ERROR),
    (frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", 0)), PROTOCOL_ERROR),
    (frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", (1 << 31) - 1)), FLOW_CONTROL_ERROR),
    (frame(PING, 0, 0, bytes(7)), FRAME_SIZE_ERROR),
    (frame(PING, 0, 1, bytes(8)), PROTOCOL_ERROR),
    (frame(PUSH, 0, 1, bytes(4)), PROTOCOL_ERROR),
    (frame(GOAWAY, 0, 1, bytes(8)), PROTOCOL_ERROR),
    (frame(HEADERS, END_HEADERS, 2, b"\x82"), PROTOCOL_ERROR),
    (frame(CONTINUATION, END_HEADERS, 1, b"\x82"), PROTOCOL_ERROR),
    (frame(HEADERS, END_HEADERS, 1, b"\xff\xff\xff\xff\xff"), 0x9),    # COMPRESSION_ERROR
])
def test_every_connection_error_is_goaway_with_its_code(bad, code):
    peer = Peer()
    peer.send(bad)
    assert peer.conn.dead and peer.goaway()[1] == code
    peer.send(frame(PING, 0, 0, bytes(8)))      # dead: nothing more is read
    assert peer.frames() == []


def test_a_layer_above_may_bring_its_own_streams_and_heads():
    class Call(H2Stream):
        __slots__ = ("method",)

        def __init__(self, sid, window, recv_window):
            super().__init__(sid, window, recv_window)
            self.method = None

    events = Recorder()
    parsed = []

    def parse(headers):
        parsed.append(headers)
        return dict(headers)[":path"]

    conn = H2Connection(replace(HTTP2Limits()), events, lambda: 0.0, parse, Call)
    conn.initiate_connection(0.0)
    encoder = Encoder()
    block = encoder.encode(REQUEST)
    conn.receive_data(PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, END_HEADERS, 1, block))
    again = encoder.encode(REQUEST)         # all indexed now: the same block every call
    conn.receive_data(frame(HEADERS, END_HEADERS, 3, again) + frame(HEADERS, END_HEADERS, 5, again))
    assert [e[2] for e in events.events] == ["/pkg.Service/Method"] * 3
    assert isinstance(conn.streams[5], Call)
    assert len(parsed) == 2                 # the repeated block was decoded once
