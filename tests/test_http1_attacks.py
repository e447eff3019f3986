"""Issue 17, HTTP/1: what a hostile HTTP/1 client gets from every port that speaks it: the
standalone server's fast front (on uvloop, its default, and on asyncio), the Jupyter server's
own port (the fast routes claim a request that carries an inference key; what they do not
claim is tornado's), and the extension's data port. Servers run in subprocesses (``hostile``),
with short deadlines and a small connection cap. Each attack runs twice while a legitimate
tritonclient calls the server, and asserts: the hostile connection was refused (a Triton error
reply, then a close) or closed, the server is alive and answers within 2 s during and after,
its RSS grew less than 100 MiB, and the repeat added (next to) nothing.

On the Jupyter port a head past one of our limits is not ours to refuse: it goes to tornado,
whose limits answer it (a close, or its 4xx), as does every chunked body (never claimed);
there only "refused or closed" is asserted."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import pytest

from conftest import INFER_KEY, W
from hostile import (LEGIT_DEADLINE_S, MAX_GROWTH_MIB, ServerProcess, legit_http_infer,
                     legit_infer, probing, repeats_add_nothing, start_jupyter,
                     start_standalone)
from ports import free_port

MAX_INPUT = 4 * 1024 * 1024
LIMITS = {"header_timeout": 1.0, "idle_timeout": 1.0, "max_connections": 48,
          "send_timeout": 1.0}
REPEAT_GROWTH_MIB = 24.0        # what a second run of an attack may add (allocator noise)


@dataclass
class Target:
    """One HTTP/1 port: ``fast`` when our front answers every request on it (standalone,
    data port); the Jupyter port hands what it does not claim to tornado."""
    name: str
    server: ServerProcess       # http_port: this target's port; headers: a legitimate client's
    fast: bool
    key: bytes                  # the credential line a hostile request carries (claimed)

    @property
    def port(self) -> int:
        return self.server.http_port

    def head(self, method: str, path: str, *lines: bytes) -> bytes:
        """A request head's start (then ``lines``): request line, Host, the credential."""
        return b"".join([method.encode(), b" ", path.encode(), b" HTTP/1.1\r\nHost: 127.0.0.1\r\n",
                         self.key, *lines])


def _standalone(loop: str | None) -> Iterator[ServerProcess]:
    server = start_standalone(http1_limits=LIMITS, loop=loop,
                              extra_args=("--http-max-input-size", str(MAX_INPUT)))
    yield server
    server.close()


@pytest.fixture(scope="module")
def standalone_server() -> Iterator[ServerProcess]:
    """On the server's default loop: uvloop where installed."""
    yield from _standalone(None)


@pytest.fixture(scope="module")
def standalone_asyncio_server() -> Iterator[ServerProcess]:
    yield from _standalone("asyncio")


@pytest.fixture(scope="module")
def jupyter_server() -> Iterator[tuple[ServerProcess, int]]:
    data_port = free_port()
    server = start_jupyter(http1_limits=LIMITS, extra_args=(
        f"--JupyterTriton.http_data_port={data_port}",
        f"--JupyterTriton.http_max_input_size={MAX_INPUT}"))
    yield server, data_port
    server.close()


KEY = f"Authorization: Bearer {INFER_KEY}\r\n".encode()


@pytest.fixture(params=["standalone", "standalone-asyncio", "jupyter", "data_port"])
def target(request) -> Target:
    if request.param.startswith("standalone"):
        server = request.getfixturevalue(request.param.replace("-", "_") + "_server")
        return Target(request.param, server, True, b"")
    server, data_port = request.getfixturevalue("jupyter_server")
    if request.param == "jupyter":
        return Target("jupyter", server, False, KEY)
    return Target("data_port", dataclasses.replace(server, http_port=data_port), True, KEY)


# -- a raw client ------------------------------------------------------------------------------
@dataclass
class Outcome:
    status: int | None          # of the first reply, if one came
    body: bytes
    closed: bool                # the server closed (or reset) the connection
    sent: int                   # bytes sent before the reply or the close
    seconds: float              # from the first byte sent to the reply or the close

    def error(self) -> str:
        try:
            return json.loads(self.body)["error"]
        except (ValueError, KeyError, TypeError):
            return ""


def attack(port: int, pieces: Iterable[bytes], *, pace: float = 0.0, timeout: float = 10.0,
           rcvbuf: int | None = None, linger: float = 1.5) -> Outcome:
    """Send ``pieces`` (``pace`` seconds apart) until the server answers or closes, then read
    what comes until it closes (at most ``linger`` s more; ``timeout`` in all). With ``rcvbuf``
    nothing is read: a peer that never reads its replies."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    pieces = iter(pieces)
    received, closed, sent = bytearray(), False, 0
    started = time.monotonic()
    deadline = started + timeout
    answered: float | None = None
    pending = memoryview(b"")
    next_at: float | None = started          # None: nothing more to send
    try:
        while not closed and (now := time.monotonic()) < deadline:
            if answered is None and not pending and next_at is not None and now >= next_at:
                piece = next(pieces, None)
                next_at = None if piece is None else now + pace
                pending = memoryview(piece or b"")
            sending = answered is None and bool(pending)
            wake = deadline if sending or next_at is None or answered is not None else next_at
            readable, writable, _ = select.select(
                [sock] if rcvbuf is None or answered is not None else [],
                [sock] if sending else [], [sock], max(0.0, min(wake - now, 0.5)))
            if readable:
                try:
                    chunk = sock.recv(1 << 20)
                except OSError:
                    chunk = b""
                if not chunk:
                    closed = True
                    break
                received += chunk
                if answered is None and b"\r\n\r\n" in received:
                    answered = time.monotonic()
                    deadline = min(deadline, answered + linger)
            if writable and pending:
                try:
                    n = sock.send(pending[:1 << 20])
                except BlockingIOError:
                    n = 0
                except OSError:             # reset or broken pipe: the server closed
                    closed = True
                    break
                sent += n
                pending = pending[n:]
    finally:
        sock.close()
    status, body = None, b""
    if received.startswith(b"HTTP/1."):
        head, _, body = bytes(received).partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
    return Outcome(status, body, closed, sent, (answered or time.monotonic()) - started)


def assert_refused(t: Target, got: Outcome, status: int, phrase: str = "") -> None:
    """Fast fronts: a Triton error reply with ``status``, then a close. The Jupyter port: a
    4xx (its own or tornado's) or a close."""
    if t.fast:
        assert got.status == status, f"{t.name}: expected {status}, got {got}"
        assert phrase in got.error(), got.error()
        assert got.closed, f"{t.name}: the connection stayed open after {got.status}"
    else:
        assert got.closed or (got.status is not None and 400 <= got.status < 500), got
        assert got.status is None or 400 <= got.status < 500, got


def run_twice(t: Target, hostile: Callable[[], Outcome], check: Callable[[Outcome], None],
              *, http_probe: bool = True) -> None:
    """The attack twice under a legitimate client's eye; RSS and liveness after each."""
    server = t.server
    before = server.rss()

    def once() -> float:
        with probing(server, http=http_probe):
            check(hostile())
        assert server.alive(), server.log_tail()
        assert legit_http_infer(server) < LEGIT_DEADLINE_S
        assert legit_infer(server) < LEGIT_DEADLINE_S
        growth = settled_growth(server, before)
        assert growth < MAX_GROWTH_MIB, f"{t.name}: RSS grew {growth:.0f} MiB"
        return growth

    repeats_add_nothing(once, t.name, REPEAT_GROWTH_MIB)


def settled_growth(server: ServerProcess, before: float, settle_s: float = 2.0) -> float:
    deadline = time.monotonic() + settle_s
    while True:
        growth = server.rss() - before
        if growth < MAX_GROWTH_MIB or time.monotonic() > deadline:
            return growth
        time.sleep(0.2)


# -- heads ----------------------------------------------------------------------------------
def test_a_1_mib_header_line_is_refused(target):
    t = target
    request = t.head("GET", "/v2/health/live", b"X-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
    run_twice(t, lambda: attack(t.port, [request]),
              lambda got: assert_refused(t, got, 431, "header"))


def endless_line_is_refused(t, head: bytes, what: str) -> None:
    """``head`` then a line that never ends (64 MiB at most): 431 naming ``what``, after a
    few MiB at most (what the kernel buffers on both sides is in ``sent`` too)."""
    def endless() -> Iterator[bytes]:
        yield head
        for _ in range(1024):
            yield b"a" * 65536

    def check(got: Outcome) -> None:
        assert_refused(t, got, 431, what)
        assert got.sent < 16 << 20, f"{got.sent >> 20} MiB sent before the refusal"

    run_twice(t, lambda: attack(t.port, endless()), check)


def test_an_endless_header_line_is_refused_early(target):
    endless_line_is_refused(target, target.head("GET", "/v2/health/live", b"X-Endless: "), "header")


def test_many_copies_of_one_header_are_refused_quickly(target):
    t = target
    request = t.head("GET", "/v2/health/live", b"X-A: b\r\n" * 400_000, b"\r\n")    # 3.2 MB

    def check(got: Outcome) -> None:
        assert_refused(t, got, 431, "header lines")
        # refused at the limit, not after parsing 400,000 lines (a head parsed again per line
        # never answers); generous beside a busy machine's stalls
        assert got.seconds < 5.0, f"answered after {got.seconds:.1f} s"

    run_twice(t, lambda: attack(t.port, [request]), check)


def test_too_many_headers_are_refused(target):
    if not target.fast:
        pytest.skip("a head the fast routes do not take is tornado's, which has no count limit")
    t = target
    lines = b"".join(b"X-H%d: v\r\n" % i for i in range(200))
    run_twice(t, lambda: attack(t.port, [t.head("GET", "/v2/health/live", lines, b"\r\n")]),
              lambda got: assert_refused(t, got, 431, "more than 128 header lines"))


def test_a_long_url_is_refused(target):
    t = target
    request = t.head("GET", "/v2/models/" + "a" * 32 * 1024, b"\r\n")
    run_twice(t, lambda: attack(t.port, [request]),
              lambda got: assert_refused(t, got, 414, "request line"))


def test_http_0_9_is_refused(target):
    t = target
    request = b"GET /v2/health/live\r\n" + t.key + b"\r\n"

    def check(got: Outcome) -> None:
        assert got.status != 200, got
        assert got.closed, got
        if t.fast:
            assert got.status == 400 and "HTTP/0.9" in got.error(), got

    run_twice(t, lambda: attack(t.port, [request]), check)


def test_a_slow_head_is_closed_by_the_header_deadline(target):
    t = target

    def slowloris() -> Iterator[bytes]:
        yield t.head("GET", "/v2/health/live")
        for _ in range(40):                         # 8 s at most
            yield b"X-Slow: 1\r\n"

    def check(got: Outcome) -> None:
        assert got.closed, got
        # on the head's deadline, long before the 8 s its lines would take
        assert got.seconds < LIMITS["header_timeout"] + 5.0, f"closed after {got.seconds:.1f} s"
        assert got.status == 408 and "head" in got.error(), got

    run_twice(t, lambda: attack(t.port, slowloris(), pace=0.2), check)


def test_idle_connections_are_closed(target):
    """A kept-alive connection after its reply, and one that never sent a byte: both closed
    after the idle (header) deadline."""
    t = target
    deadline = LIMITS["idle_timeout"] + 5.0     # only catches never: a busy machine is late

    def idle() -> tuple[Outcome, float | None]:
        silent = socket.create_connection(("127.0.0.1", t.port))
        try:
            silent.settimeout(deadline)
            started = time.monotonic()
            got = attack(t.port, [t.head("GET", "/v2/health/live", b"\r\n")], timeout=deadline,
                         linger=deadline)
            try:
                silent_closed = silent.recv(100) == b""
            except ConnectionResetError:
                silent_closed = True
            except socket.timeout:
                silent_closed = False
            return got, time.monotonic() - started if silent_closed else None
        finally:
            silent.close()

    def check(outcome: tuple[Outcome, float | None]) -> None:
        got, silent_after = outcome
        assert got.status == 200 and got.closed, got
        assert silent_after is not None and silent_after < deadline, silent_after

    run_twice(t, idle, check)


# -- bodies -----------------------------------------------------------------------------------
def test_an_endless_chunked_body_is_refused_at_the_cap(target):
    t = target

    def chunked() -> Iterator[bytes]:
        yield t.head("POST", "/v2/models/linear/infer", b"Content-Type: application/json\r\n",
                     b"Transfer-Encoding: chunked\r\n\r\n")
        piece = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
        for _ in range(512):                        # 512 MiB at most
            yield piece

    def check(got: Outcome) -> None:
        assert_refused(t, got, 400, "maximum input size")
        assert got.sent < MAX_INPUT + (16 << 20), f"{got.sent >> 20} MiB sent before the refusal"

    run_twice(t, lambda: attack(t.port, chunked(), timeout=20.0), check)


def test_an_endless_trailer_line_is_refused_early(target):
    head = target.head("POST", "/v2/models/linear/infer", b"Content-Type: application/json\r\n",
                       b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-Trailer: ")
    endless_line_is_refused(target, head, "trailer")


def test_chunked_bodies_past_the_cap_leave_nothing_held(target):
    """Each refused body's bytes leave the server's bytes-in-flight budget (4 x the cap):
    five refusals later a legitimate request is still admitted."""
    t = target
    body = b" " * (MAX_INPUT + (1 << 20))
    request = t.head("POST", "/v2/models/linear/infer", b"Content-Type: application/json\r\n",
                     b"Transfer-Encoding: chunked\r\n\r\n",
                     b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))

    def five() -> list[Outcome]:
        return [attack(t.port, [request]) for _ in range(5)]

    def check(got: list[Outcome]) -> None:
        for one in got:
            assert_refused(t, one, 400, "maximum input size")

    run_twice(t, five, check)


@pytest.mark.parametrize("framing", [
    b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
    b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
], ids=["cl-te", "te-cl", "duplicate-cl"])
def test_ambiguous_body_framing_is_refused(target, framing):
    t = target
    smuggled = t.head("GET", "/v2/health/live", b"\r\n")
    request = t.head("POST", "/v2/models/linear/infer", framing) + smuggled
    run_twice(t, lambda: attack(t.port, [request]),
              lambda got: assert_refused(t, got, 400, "malformed HTTP request"))


# -- replies nobody reads, connections --------------------------------------------------------
def test_pipelined_requests_whose_replies_are_never_read(target):
    """A client that pipelines requests for large replies (statistics: 40 bytes in, 1.7 kB
    out) and never reads: the server stops reading it (its replies pile up nowhere), and
    drops it once nothing moves for ``send_timeout``. Memory is sampled while it floods."""
    t = target
    one = t.head("GET", "/v2/models/stats", b"\r\n")
    batch = one * (65536 // len(one))

    def flood() -> tuple[Outcome, float]:
        before = t.server.rss()
        box: dict[str, Outcome] = {}
        thread = threading.Thread(target=lambda: box.setdefault("got", attack(
            t.port, iter(lambda: batch, None), timeout=LIMITS["send_timeout"] + 5.0,
            rcvbuf=4096)))
        thread.start()
        peak = 0.0
        while thread.is_alive():
            peak = max(peak, t.server.rss() - before)
            thread.join(0.1)
        return box["got"], peak

    def check(outcome: tuple[Outcome, float]) -> None:
        got, peak = outcome
        assert peak < MAX_GROWTH_MIB, f"RSS grew {peak:.0f} MiB while the client flooded"
        assert got.closed, f"a client that reads nothing still connected after {got.seconds:.1f} s"

    run_twice(t, flood, check)


def test_connections_past_the_cap_are_refused(target):
    t = target
    cap = LIMITS["max_connections"]

    def flood() -> Outcome:
        held = []
        try:
            for _ in range(cap + 8):
                held.append(socket.create_connection(("127.0.0.1", t.port), timeout=5))
            # The first connections are held; the last ones (past the cap) are turned away at
            # once, in the order they came: once the last is answered, the cap is reached.
            held[-1].settimeout(10)
            assert held[-1].recv(4096).startswith(b"HTTP/1.1 503")
            return attack(t.port, [t.head("GET", "/v2/health/live", b"\r\n")])
        finally:
            for s in held:
                s.close()

    def check(got: Outcome) -> None:
        assert got.status == 503 and "connections" in got.error(), got
        assert got.closed, got

    # During the flood HTTP is full by design: the legitimate client calls gRPC meanwhile.
    run_twice(t, flood, check, http_probe=False)


def test_pipelined_requests_waiting_for_answers_are_bounded():
    """One read holds up to 256 KiB of pipelined requests, all parsed at once: past
    ``max_pipelined`` of them waiting, the next is refused (503) after the answers to those
    before it, then the connection closes. (In-process: which read holds what is the kernel's
    choice on a real socket.)"""
    from jupyter_triton.frontends.admission import Admission, Door
    from jupyter_triton.frontends.dataplane import Reply
    from jupyter_triton.frontends.fasthttp import HTTPFront, _Connection
    from jupyter_triton.frontends.limits import HTTP1Limits

    class Plane:
        max_input_size = 1 << 20
        admission, door = Admission(), Door("http")     # what a front asks a connection's slot of

        def match(self, path):
            return "route", {}

        def admit(self, route, method, headers, length):
            return None

        async def handle(self, route, call):
            return Reply(200, b"{}")

    class Transport:
        def __init__(self):
            self.out, self.closed = bytearray(), False

        def get_extra_info(self, name):
            return ("127.0.0.1", 1)

        def write(self, data):
            self.out += data

        def writelines(self, parts):
            self.out += b"".join(parts)

        def is_closing(self):
            return self.closed

        def close(self):
            self.closed = True

        def can_write_eof(self):
            return True

        def write_eof(self):
            pass

        def get_write_buffer_size(self):
            return 0

        def set_write_buffer_limits(self, high=None, low=None):
            pass

        def pause_reading(self):
            pass

        def resume_reading(self):
            pass

    async def pipeline() -> tuple[int, bytes, bool]:
        conn = _Connection(HTTPFront(Plane(), limits=HTTP1Limits(max_pipelined=100)))
        transport = Transport()
        conn.connection_made(transport)
        conn.data_received(b"GET /v2/health/live HTTP/1.1\r\n\r\n" * 5000)
        waiting = len(conn.queue)
        for _ in range(500):
            await asyncio.sleep(0)
        return waiting, bytes(transport.out), transport.closed or conn.ended

    waiting, out, closed = asyncio.run(pipeline())
    assert waiting == 101                       # 100 waiting, then the refusal
    statuses = [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", out)]
    assert statuses == [200] * 100 + [503], statuses[-3:]
    assert closed


# -- the fronts' caches (request plans, routes, header names) -----------------------------------
def test_distinct_requests_churn_the_caches_without_growth(target):
    """A client that never repeats itself: every inference carries a JSON header of its own
    (a 3.5 kB parameter, so no two decode alike), every health check a path of its own. The
    caches a repeated request is served from (decode plans, routes, header names) are bounded:
    they are refilled past their size, answers stay right, memory stays flat."""
    import http.client

    import numpy as np

    t = target
    x = np.arange(16, dtype=np.float32).reshape(1, 16)

    def churn() -> Outcome:
        started = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", t.port, timeout=10)
        try:
            for i in range(600):
                header = json.dumps({"parameters": {"pad": f"{i:06d}" + "x" * 3500},
                                     "inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                                                 "parameters": {"binary_data_size": 64}}],
                                     "outputs": [{"name": "OUTPUT0",
                                                  "parameters": {"binary_data": False}}]}).encode()
                conn.request("POST", "/v2/models/linear/infer", body=header + x.tobytes(),
                             headers={**t.server.headers,
                                      "Inference-Header-Content-Length": str(len(header))})
                reply = conn.getresponse()
                body = reply.read()
                assert reply.status == 200, body[:300]
                if i % 50 == 0:
                    out = json.loads(body)["outputs"][0]["data"]
                    np.testing.assert_allclose(out, (x @ W).ravel(), rtol=1e-5)
            for i in range(1200):
                conn.request("GET", f"/v2/models/absent{i}/ready", headers=dict(t.server.headers))
                reply = conn.getresponse()
                reply.read()
                assert 400 <= reply.status < 500, reply.status
        finally:
            conn.close()
        return Outcome(200, b"", True, 0, time.monotonic() - started)

    run_twice(t, churn, lambda got: None)
