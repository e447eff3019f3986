"""A harness for attacking our own servers as a hostile client would (issue 17).

- ``start_standalone`` / ``start_jupyter``: a real server in a *subprocess* (its RSS is
  measurable and a crash is visible), on 127.0.0.1 and free ports, serving the repository
  ``conftest.build_repository`` writes; ``ServerProcess.close()`` stops it.
  ``h2_limits={...}`` overrides HTTP2Limits defaults in that process (short idle / keepalive
  deadlines for tests), ``http1_limits={...}`` the HTTP1Limits ones. The standalone server
  runs on its default loop (uvloop where installed), or ``loop="asyncio"``: the attack tests
  run it on both, since their memory bounds depend on how a loop reads and writes.
- ``rss_mib(pid)``: resident memory of a process, from /proc.
- ``Probe``: a legitimate tritonclient calling the server in a thread during an attack;
  ``probe.check()`` asserts every call was answered correctly within ``LEGIT_DEADLINE_S``.
- Raw HTTP/2: ``frame``, ``H2`` (a socket speaking frames; ``request_block`` builds a gRPC
  request header block with hpack), ``H2.read_until_closed`` / ``H2.goaway``.
- ``assert_survived(server, before_mib)``: alive, a fresh legitimate call answered, RSS grew
  less than ``MAX_GROWTH_MIB``.

Everything is bounded in count and time, and talks to 127.0.0.1 only.
"""
from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from conftest import INFER_KEY, TOKEN, W, build_repository
from ports import free_port

PYTHON = sys.executable
LEGIT_DEADLINE_S = 2.0
MAX_GROWTH_MIB = 100.0
STARTUP_TIMEOUT_S = 90.0

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = \
    range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# RFC 9113 §7 error codes
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, SETTINGS_TIMEOUT = 0, 1, 2, 3, 4
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 5, 6, 7, 8, 9
CONNECT_ERROR, ENHANCE_YOUR_CALM = 0xA, 0xB

# Run in the server's process before anything of ours is imported: the limits a test asks for
# become the dataclasses' defaults there (the servers build theirs from the defaults).
_BOOT = """
import dataclasses, json, os, sys
from jupyter_triton.frontends import limits as _limits
for _cls, _var in ((_limits.HTTP2Limits, "JT_TEST_H2_LIMITS"), (getattr(_limits, "HTTP1Limits", None), "JT_TEST_H1_LIMITS")):
    _spec = json.loads(os.environ.get(_var) or "{}")
    if _cls is None or not _spec:
        continue
    _names = [f.name for f in dataclasses.fields(_cls)]
    _init = _cls.__init__
    _defaults = list(_init.__defaults__ or ())
    _first = len(_names) - len(_defaults)
    for _i, _name in enumerate(_names[_first:]):
        if _name in _spec:
            _defaults[_i] = _spec[_name]
    _init.__defaults__ = tuple(_defaults)
"""


def hostile_repository(root: Path) -> Path:
    """``conftest.build_repository`` plus ``identity_big``: INT32 [batch, n] -> the same, for
    responses as large as a test wants."""
    from onnx import TensorProto
    from onnx_models import identity
    build_repository(root)
    identity(TensorProto.INT32, root / "identity_big" / "1" / "model.onnx", dims="n")
    return root



def rss_mib(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB (VmRSS of /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no VmRSS for {pid}")


@dataclass
class ServerProcess:
    """A server running in a subprocess. ``headers``: what a legitimate gRPC/HTTP client sends
    (credentials); a hostile client sends none."""
    name: str
    proc: subprocess.Popen
    grpc_port: int
    http_port: int | None
    headers: dict[str, str] = field(default_factory=dict)
    http_prefix: str = ""               # base URL path of the v2 routes on http_port
    log_path: Path | None = None
    workdir: tempfile.TemporaryDirectory | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss(self) -> float:
        return rss_mib(self.pid)

    def log_tail(self, n: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-n:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.workdir is not None:
            self.workdir.cleanup()


def _env(h2_limits: dict | None, http1_limits: dict | None, home: Path) -> dict:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    # the package under test: PYTHONPATH when the caller set one (a worktree), else this tree
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), root) if p)
    env["JT_TEST_H2_LIMITS"] = json.dumps(h2_limits or {})
    env["JT_TEST_H1_LIMITS"] = json.dumps(http1_limits or {})
    env["JUPYTER_CONFIG_DIR"] = str(home / "config")
    env["JUPYTER_DATA_DIR"] = str(home / "data")
    env["JUPYTER_RUNTIME_DIR"] = str(home / "runtime")
    env["JUPYTER_PLATFORM_DIRS"] = "1"
    env.pop("JUPYTER_TRITON_URL", None)
    env.pop("JUPYTER_TRITON_TOKEN", None)
    env.pop("JUPYTER_TRITON_LOOP", None)
    return env


def _spawn(name: str, code: str, argv: list[str], env: dict, home: Path) -> tuple[subprocess.Popen, Path]:
    log_path = home / f"{name}.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen([PYTHON, "-c", _BOOT + code, *argv], env=env, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(home))
    log.close()
    return proc, log_path


def _wait_ready(server: ServerProcess) -> ServerProcess:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    last: Exception | None = None
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeError(f"{server.name} exited ({server.proc.returncode}):\n{server.log_tail()}")
        try:
            legit_infer(server, timeout=5.0)
            return server
        except Exception as err:  # noqa: BLE001 - not up yet
            last = err
            time.sleep(0.3)
    server.close()
    raise RuntimeError(f"{server.name} not ready in {STARTUP_TIMEOUT_S} s: {last}\n{server.log_tail()}")


def start_standalone(repo: Path | None = None, *, h2_limits: dict | None = None,
                     http1_limits: dict | None = None, extra_args: tuple[str, ...] = (),
                     loop: str | None = None) -> ServerProcess:
    """``jupyter-triton serve`` in a subprocess, every model of ``repo`` (default: a fresh
    ``build_repository``) loaded, HTTP and gRPC on free loopback ports; on the event loop
    ``loop`` names ("asyncio", "uvloop"; None: the server's default), named
    ``standalone-<loop>`` then."""
    work = tempfile.TemporaryDirectory(prefix="hostile-standalone-")
    home = Path(work.name)
    repo = repo or build_repository(home / "models")
    grpc_port, http_port = free_port(), free_port()
    argv = ["serve", "--model-repository", str(repo), "--http-address", "127.0.0.1",
            "--http-port", str(http_port), "--grpc-address", "127.0.0.1",
            "--grpc-port", str(grpc_port), "--allow-metrics", "false", *extra_args]
    code = "from jupyter_triton.cli import main; sys.exit(main(sys.argv[1:]))"
    env = _env(h2_limits, http1_limits, home)
    name = "standalone"
    if loop is not None:
        env["JUPYTER_TRITON_LOOP"] = loop
        name = f"standalone-{loop}"
    proc, log_path = _spawn(name, code, argv, env, home)
    server = _wait_ready(ServerProcess(name, proc, grpc_port, http_port, {}, "", log_path, work))
    if loop is not None and f"event loop: {loop}" not in log_path.read_text(errors="replace"):
        server.close()
        raise RuntimeError(f"{name} is not on {loop}:\n{server.log_tail()}")
    return server


def start_jupyter(repo: Path | None = None, *, h2_limits: dict | None = None,
                  http1_limits: dict | None = None, extra_args: tuple[str, ...] = ()
                  ) -> ServerProcess:
    """``jupyter server`` with the extension and its gRPC port, in a subprocess; legitimate
    clients present the inference key ``conftest.INFER_KEY``."""
    work = tempfile.TemporaryDirectory(prefix="hostile-jupyter-")
    home = Path(work.name)
    for sub in ("config", "data", "runtime"):
        (home / sub).mkdir()
    repo = repo or build_repository(home / "models")
    grpc_port, http_port = free_port(), free_port()
    argv = ["--ServerApp.ip=127.0.0.1", f"--ServerApp.port={http_port}",
            "--ServerApp.port_retries=0", f"--ServerApp.token={TOKEN}",
            f"--IdentityProvider.token={TOKEN}", "--ServerApp.allow_root=True",
            "--ServerApp.open_browser=False", f"--ServerApp.root_dir={home}",
            "--ServerApp.jpserver_extensions={'jupyter_triton': True}",
            f"--JupyterTriton.model_repository={repo}",
            f"--JupyterTriton.grpc_port={grpc_port}",
            f"--JupyterTriton.inference_keys={INFER_KEY}", *extra_args]
    code = "from jupyter_server.serverapp import main; sys.argv[0] = 'jupyter-server'; sys.exit(main())"
    proc, log_path = _spawn("jupyter", code, argv, _env(h2_limits, http1_limits, home), home)
    return _wait_ready(ServerProcess("jupyter", proc, grpc_port, http_port,
                                     {"authorization": f"Bearer {INFER_KEY}"}, "", log_path, work))


# -- a legitimate client --------------------------------------------------------------------
def legit_infer(server: ServerProcess, timeout: float = LEGIT_DEADLINE_S) -> float:
    """One tritonclient.grpc inference on ``linear``, checked; returns its seconds."""
    import tritonclient.grpc as grpcclient
    started = time.monotonic()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        x = np.ones((2, 16), np.float32)
        inp = grpcclient.InferInput("INPUT0", [2, 16], "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer("linear", [inp], headers=server.headers, client_timeout=timeout)
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), x @ W, rtol=1e-5)
    finally:
        client.close()
    return time.monotonic() - started


def legit_http_infer(server: ServerProcess, timeout: float = LEGIT_DEADLINE_S) -> float:
    """One tritonclient.http inference on the server's HTTP port (standalone only)."""
    import tritonclient.http as httpclient
    assert server.http_port is not None
    started = time.monotonic()
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}",
                                              connection_timeout=timeout, network_timeout=timeout)
    try:
        x = np.ones((2, 16), np.float32)
        inp = httpclient.InferInput("INPUT0", [2, 16], "FP32")
        inp.set_data_from_numpy(x)
        # a copy: tritonclient.http adds its Inference-Header-Content-Length to the dict
        result = client.infer("linear", [inp], headers=dict(server.headers))
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), x @ W, rtol=1e-5)
    finally:
        client.close()
    return time.monotonic() - started


class Probe:
    """Legitimate calls in a thread, one every ``interval`` seconds, while an attack runs."""

    def __init__(self, server: ServerProcess, interval: float = 0.2, http: bool = False) -> None:
        self.server = server
        self.interval = interval
        self.call = legit_http_infer if http else legit_infer
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.latencies.append(self.call(self.server))
            except Exception as err:  # noqa: BLE001 - recorded, asserted in check()
                self.errors.append(f"{type(err).__name__}: {err}")
            self._stop.wait(self.interval)

    def __enter__(self) -> "Probe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(LEGIT_DEADLINE_S * 3)

    def check(self) -> None:
        assert not self.errors, f"legitimate calls failed during the attack: {self.errors[:3]}"
        assert self.latencies, "no legitimate call completed during the attack"
        assert max(self.latencies) < LEGIT_DEADLINE_S, f"slowest legitimate call {max(self.latencies):.2f} s"


@contextmanager
def probing(server: ServerProcess, http: bool = False) -> Iterator[Probe]:
    """``with probing(server): attack()`` then asserts the legitimate calls made meanwhile."""
    probe = Probe(server, http=http)
    with probe:
        yield probe
    probe.check()


def assert_survived(server: ServerProcess, before_mib: float, max_growth: float = MAX_GROWTH_MIB,
                    settle_s: float = 3.0) -> float:
    """The server is alive, answers a legitimate call in time, and its RSS (after up to
    ``settle_s`` for memory to be given back) grew less than ``max_growth`` MiB. Returns the
    growth."""
    assert server.alive(), f"{server.name} died:\n{server.log_tail()}"
    assert legit_infer(server) < LEGIT_DEADLINE_S
    deadline = time.monotonic() + settle_s
    while True:
        growth = server.rss() - before_mib
        if growth < max_growth or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert growth < max_growth, f"{server.name} RSS grew {growth:.0f} MiB"
    return growth


def repeats_add_nothing(attack_and_measure: Callable[[], float], name: str,
                        repeat_mib: float) -> list[float]:
    """Run ``attack_and_measure`` (one attack; it returns the RSS growth since before the
    first) twice: the repeat must add under ``repeat_mib``. Where it did add, a third attack
    must not: malloc may keep what one attack freed (glibc raises its mmap threshold to the
    largest block freed, so the next large buffers come from heaps it gives back only from
    the top) and hand it to the next attack, while a leak of ``repeat_mib`` an attack grows
    each time. Returns the growths."""
    growths = [attack_and_measure(), attack_and_measure()]
    if growths[1] >= max(growths[0], 0) + repeat_mib:
        growths.append(attack_and_measure())
    assert growths[-1] < max(growths[-2], 0) + repeat_mib, \
        f"{name}: the repeat grew RSS again: {[round(g, 1) for g in growths]} MiB"
    return growths


# -- raw HTTP/2 ----------------------------------------------------------------------------
def frame(ftype: int, flags: int, sid: int, payload: bytes = b"", length: int | None = None) -> bytes:
    n = len(payload) if length is None else length
    return struct.pack(">BHBBL", n >> 16, n & 0xFFFF, ftype, flags, sid) + payload


def settings(**values: int) -> bytes:
    """A SETTINGS payload: ``settings(initial_window_size=0)``."""
    ids = {"header_table_size": 1, "enable_push": 2, "max_concurrent_streams": 3,
           "initial_window_size": 4, "max_frame_size": 5, "max_header_list_size": 6}
    return b"".join(struct.pack(">HL", ids[k], v) for k, v in values.items())


def grpc_message(body: bytes, compressed: bool = False) -> bytes:
    return bytes([1 if compressed else 0]) + struct.pack(">L", len(body)) + body


SERVICE = "/inference.GRPCInferenceService/"


@dataclass
class Frame:
    type: int
    flags: int
    sid: int
    payload: bytes

    @property
    def error_code(self) -> int | None:
        """GOAWAY's or RST_STREAM's error code."""
        if self.type == GOAWAY and len(self.payload) >= 8:
            return struct.unpack(">L", self.payload[4:8])[0]
        if self.type == RST_STREAM and len(self.payload) == 4:
            return struct.unpack(">L", self.payload)[0]
        return None

    @property
    def last_stream(self) -> int | None:
        return struct.unpack(">L", self.payload[:4])[0] & 0x7FFFFFFF if self.type == GOAWAY else None


class H2:
    """A raw HTTP/2 client connection: send what you like, read what comes back."""

    def __init__(self, port: int, *, handshake: bool = True, local_settings: bytes = b"",
                 timeout: float = 5.0, rcvbuf: int | None = None) -> None:
        from hpack import Decoder, Encoder
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:      # a peer that never reads: keep its kernel buffer small
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.timeout = timeout          # of sends; reads set their own
        self.sock.settimeout(timeout)
        self.sock.connect(("127.0.0.1", port))
        self.encoder, self.decoder = Encoder(), Decoder()
        self.buf = b""
        self.frames: list[Frame] = []
        self.closed = False
        # flow control as the server grants it (send_data honours it)
        self.server_settings: dict[int, int] = {}
        self.conn_window = 65535
        self.stream_windows: dict[int, int] = {}
        if handshake:
            self.send(PREFACE + frame(SETTINGS, 0, 0, local_settings))

    def send(self, data: bytes) -> bool:
        """Send; False once the server has closed or reset the connection (or stopped
        reading it for the send timeout)."""
        try:
            self.sock.settimeout(self.timeout)
            self.sock.sendall(data)
            return True
        except (BrokenPipeError, ConnectionResetError, socket.timeout, OSError):
            self.closed = True
            return False

    def request_block(self, method: str, *, extra: list[tuple[str, str]] = (),
                      authority: str = "127.0.0.1") -> bytes:
        headers = [(":method", "POST"), (":scheme", "http"), (":path", SERVICE + method),
                   (":authority", authority), ("content-type", "application/grpc"),
                   ("te", "trailers"), *extra]
        return self.encoder.encode(headers)

    def headers(self, sid: int, method: str, *, end: bool = False,
                extra: list[tuple[str, str]] = ()) -> bool:
        return self.send(frame(HEADERS, END_HEADERS | (END_STREAM if end else 0), sid,
                               self.request_block(method, extra=extra)))

    def request(self, sid: int, method: str, body: bytes | None = b"", *, end: bool = True,
                extra: list[tuple[str, str]] = ()) -> bool:
        """HEADERS (+ one DATA with ``body`` framed as a gRPC message unless None)."""
        out = frame(HEADERS, END_HEADERS | (END_STREAM if body is None and end else 0), sid,
                    self.request_block(method, extra=extra))
        if body is not None:
            out += frame(DATA, END_STREAM if end else 0, sid, grpc_message(body))
        return self.send(out)

    def _recv(self, timeout: float) -> bool:
        self.sock.settimeout(max(timeout, 0.01))
        try:
            chunk = self.sock.recv(1 << 20)
        except socket.timeout:
            return True
        except (ConnectionResetError, OSError):
            chunk = b""
        if not chunk:
            self.closed = True
            return False
        self.buf += chunk
        while len(self.buf) >= 9:
            n = int.from_bytes(self.buf[:3], "big")
            if len(self.buf) < 9 + n:
                break
            b = self.buf
            f = Frame(b[3], b[4], int.from_bytes(b[5:9], "big") & 0x7FFFFFFF, b[9:9 + n])
            self.frames.append(f)
            self.buf = b[9 + n:]
            if f.type == SETTINGS and not f.flags & ACK:
                for i in range(0, len(f.payload) - 5, 6):
                    key, value = struct.unpack(">HL", f.payload[i:i + 6])
                    if key == 4:
                        delta = value - self.server_settings.get(4, 65535)
                        for sid in self.stream_windows:
                            self.stream_windows[sid] += delta
                    self.server_settings[key] = value
            elif f.type == WINDOW_UPDATE and len(f.payload) == 4:
                inc = struct.unpack(">L", f.payload)[0] & 0x7FFFFFFF
                if f.sid == 0:
                    self.conn_window += inc
                else:
                    self.stream_windows[f.sid] = self._window(f.sid) + inc
        return True

    def _window(self, sid: int) -> int:
        return self.stream_windows.get(sid, self.server_settings.get(4, 65535))

    def send_data(self, sid: int, data: bytes, *, end: bool = False, deadline: float | None = None,
                  stall: float = 1.0) -> int:
        """DATA frames within the windows the server grants; waits for WINDOW_UPDATEs up to
        ``stall`` seconds at a time (and until ``deadline``, a time.monotonic()). Returns the
        bytes sent: fewer than ``len(data)`` when the server stopped granting."""
        sent, view = 0, memoryview(data)
        frame_max = self.server_settings.get(5, 16384)
        while sent < len(data) or (end and not sent and not data):
            room = min(self.conn_window, self._window(sid), frame_max, len(data) - sent)
            if room <= 0 and data:
                waited = time.monotonic() + stall
                while room <= 0 and not self.closed and time.monotonic() < waited and \
                        (deadline is None or time.monotonic() < deadline):
                    self._recv(0.05)
                    room = min(self.conn_window, self._window(sid), frame_max, len(data) - sent)
                if room <= 0:
                    return sent
            if deadline is not None and time.monotonic() > deadline:
                return sent
            last = sent + room >= len(data)
            if not self.send(frame(DATA, END_STREAM if end and last else 0, sid,
                                   bytes(view[sent:sent + room]))):
                return sent
            self.conn_window -= room
            self.stream_windows[sid] = self._window(sid) - room
            sent += room
            if not data:
                break
            if self.conn_window < 65536:        # pick up WINDOW_UPDATEs as they come
                self._recv(0.0)
        return sent

    def statuses(self) -> dict[int, str]:
        """Stream id -> grpc-status of every response that ended (trailers or trailers-only)."""
        from hpack import Decoder
        decoder = Decoder()
        out = {}
        for f in self.frames:
            if f.type == HEADERS:
                headers = dict(decoder.decode(f.payload))
                if f.flags & END_STREAM:
                    out[f.sid] = headers.get("grpc-status", "?")
        return out

    def read_for(self, seconds: float) -> list[Frame]:
        """Read whatever arrives for ``seconds`` (or until closed); all frames so far."""
        deadline = time.monotonic() + seconds
        while not self.closed and (left := deadline - time.monotonic()) > 0:
            self._recv(left)
        return self.frames

    def read_until(self, predicate, timeout: float = 5.0) -> Frame | None:
        """The first frame (already read or arriving within ``timeout``) that ``predicate``
        accepts, else None."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for f in self.frames[seen:]:
                if predicate(f):
                    return f
            seen = len(self.frames)
            left = deadline - time.monotonic()
            if self.closed or left <= 0:
                return None
            self._recv(min(left, 0.5))

    def goaway(self, timeout: float = 5.0) -> Frame | None:
        return self.read_until(lambda f: f.type == GOAWAY, timeout)

    def read_until_closed(self, timeout: float = 5.0) -> bool:
        """True when the server closed the connection within ``timeout``."""
        self.read_for(timeout)
        return self.closed

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> "H2":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def assert_refused(conn: H2, codes: tuple[int, ...], timeout: float = 5.0,
                   reset_ok: bool = False) -> Frame | None:
    """The server ended ``conn``: a GOAWAY with one of ``codes`` (then, usually, a close), or
    a plain close when ``codes`` is empty. ``reset_ok``: a peer that never read may find the
    connection reset before it reads the GOAWAY; then being closed is enough. Returns the
    GOAWAY."""
    got = conn.goaway(timeout)
    if got is None and reset_ok:
        assert conn.read_until_closed(timeout), "connection neither GOAWAY'd nor closed"
        return None
    if codes:
        assert got is not None, f"no GOAWAY (closed={conn.closed}); frames: " \
            f"{[(f.type, f.flags, f.sid) for f in conn.frames[-10:]]}"
        assert got.error_code in codes, f"GOAWAY code {got.error_code}, expected {codes}"
    else:
        assert got is not None or conn.read_until_closed(timeout), "connection neither GOAWAY'd nor closed"
    return got
