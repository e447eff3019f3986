"""One admission on Jupyter's port: the fast routes (``JupyterTriton.fast_routes``) take only
what Jupyter itself would answer the same way. A corpus of raw requests (every credential
kind and scope, ``?token=``, login cookies with and without XSRF, Origin, Host variants,
pipelining, Content-Length / Transfer-Encoding variants) is sent over sockets to two real
Jupyter servers with the extension, one with the fast routes on and one with them off; each
request must get the same status (and the same number of answers) from both."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from pathlib import Path

import pytest

from conftest import INFER_KEY, TOKEN
from ports import free_port

BASE = "/user/alice/"
ROW = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                              "data": [1.0] * 16}]}).encode()


@dataclass
class Server:
    """A Jupyter server in a process of its own, and what a client learns of it."""
    port: int
    process: subprocess.Popen
    runtime: Path
    server_token: str = ""
    cookie: str = ""            # "name=value" of a login cookie Jupyter minted
    xsrf: str = ""              # the _xsrf cookie's value
    log: Path = field(default_factory=Path)



def start_server(root: Path, repo: Path, fast_routes: bool) -> Server:
    name = "on" if fast_routes else "off"
    config_dir, runtime = root / f"config-{name}", root / f"runtime-{name}"
    config_dir.mkdir()
    port = free_port()
    (config_dir / "jupyter_server_config.json").write_text(json.dumps({
        # Only ours: the others' start-up is not what is compared.
        "ServerApp": {"jpserver_extensions": {"jupyter_triton": True, "jupyterlab": False,
                                              "jupyter_lsp": False, "notebook_shim": False,
                                              "jupyter_server_terminals": False},
                      "port": port, "port_retries": 0, "ip": "127.0.0.1", "open_browser": False,
                      "base_url": BASE, "root_dir": str(root), "allow_root": True},
        "IdentityProvider": {"token": TOKEN},
        "JupyterTriton": {"model_repository": str(repo), "inference_keys": [INFER_KEY],
                          "fast_routes": fast_routes, "gil_switch_interval": None},
    }))
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(config_dir), "JUPYTER_RUNTIME_DIR": str(runtime),
           "JUPYTER_DATA_DIR": str(root / f"data-{name}"), "JUPYTER_PLATFORM_DIRS": "1"}
    log = root / f"server-{name}.log"
    process = subprocess.Popen([sys.executable, "-m", "jupyter_server"], env=env, cwd=root,
                               stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    return Server(port, process, runtime, log=log)


def wait_ready(server: Server, timeout: float = 90.0) -> None:
    """Until the extension advertised itself (runtime file) and the routes answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited: {server.log.read_text()[-3000:]}")
        files = list(server.runtime.glob("jupyter_triton-*.json"))
        if files:
            try:
                server.server_token = json.loads(files[0].read_text())["token"]
                if exchange(server, get(server, "v2/health/ready",
                                        authorization=f"token {TOKEN}")) == [200]:
                    return
            except (OSError, ValueError, KeyError):
                pass
        time.sleep(0.2)
    raise RuntimeError(f"server not ready: {server.log.read_text()[-3000:]}")


def login(server: Server) -> None:
    """A browser's state: the login cookie Jupyter sets for ``?token=``, and its _xsrf cookie."""
    raw = get(server, "api/status?token=" + TOKEN)
    cookies = SimpleCookie()
    for line in exchange_raw(server, raw).split(b"\r\n"):
        if line.lower().startswith(b"set-cookie:"):
            cookies.load(line.split(b":", 1)[1].decode().strip())
    login = [c for c in cookies.values() if c.key.startswith("username-")]
    assert login, "Jupyter minted no login cookie"
    server.cookie = f"{login[0].key}={login[0].value}"
    raw = get(server, "login")
    for line in exchange_raw(server, raw).split(b"\r\n"):
        if line.lower().startswith(b"set-cookie:"):
            cookies.load(line.split(b":", 1)[1].decode().strip())
    assert "_xsrf" in cookies, "Jupyter set no _xsrf cookie"
    server.xsrf = cookies["_xsrf"].value


def message(method: str, server: Server, path: str, host: str | None = "", body: bytes | None = None,
         **headers: str) -> bytes:
    lines = [f"{method} {BASE}{path} HTTP/1.1"]
    if host is not None:
        lines.append(f"Host: {host or f'127.0.0.1:{server.port}'}")
    for name, value in headers.items():
        lines.append(f"{name.replace('_', '-').title()}: {value}")
    if body is not None and "content_length" not in headers and "transfer_encoding" not in headers:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


def get(server: Server, path: str, **headers: str) -> bytes:
    return message("GET", server, path, **headers)


def post(server: Server, path: str, body: bytes = ROW, **headers: str) -> bytes:
    return message("POST", server, path, body=body, **headers)


def exchange_raw(server: Server, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(data)
        return b"".join(raw for _, raw in _read_responses(s.makefile("rb"), data, 1))


def exchange(server: Server, data: bytes, answers: int = 1) -> list[int]:
    """Send ``data`` on one connection; the statuses of up to ``answers`` responses (fewer
    when the server closes; -1 for one that did not come within 10 s)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(data)
        return [status for status, _ in _read_responses(s.makefile("rb"), data, answers)]


def _read_responses(reader, data: bytes, answers: int):
    methods = re.findall(rb"(?m)^([A-Z]+) \S+ HTTP/1\.[01]\r$", data)
    try:
        for _ in range(answers):
            status_line = reader.readline(65536)
            if not status_line:
                return
            status = int(status_line.split()[1])
            raw = [status_line]
            headers: dict[str, str] = {}
            while True:
                line = reader.readline(65536)
                raw.append(line)
                if line in (b"\r\n", b"\n", b""):
                    break
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            method = methods.pop(0) if methods and status >= 200 else b""
            if method == b"HEAD" or status < 200 or status in (204, 304):
                body = b""
            elif headers.get("transfer-encoding", "").lower() == "chunked":
                body = b""
                while True:
                    size = int(reader.readline().split(b";")[0], 16)
                    body += reader.read(size + 2)[:size]
                    if size == 0:
                        break
            else:
                body = reader.read(int(headers.get("content-length", "0")))
            yield status, b"".join(raw) + body
    except (ConnectionError, TimeoutError):
        yield -1, b""


# -- the corpus: (name, request bytes, answers expected at most) per server -----------------
ROUTES = [("GET", "v2/health/live"), ("GET", "v2/models/linear"), ("GET", "v2/models/linear/config"),
          ("GET", "v2/models/linear/stats"), ("POST", "v2/models/linear/infer"),
          ("POST", "v2/repository/index"), ("POST", "v2/repository/models/nothing/unload"),
          ("GET", "v2/systemsharedmemory/status"), ("GET", "v2/models/missing/ready"),
          ("HEAD", "v2/models/linear"), ("PUT", "v2/models/linear/infer"), ("GET", "v2/nothing/here")]


def credentials(s: Server) -> dict[str, dict[str, str]]:
    return {"jupyter token": {"authorization": f"token {TOKEN}"},
            "jupyter token as Bearer": {"authorization": f"Bearer {TOKEN}"},
            "inference key": {"authorization": f"Bearer {INFER_KEY}"},
            "server token": {"authorization": f"Bearer {s.server_token}"},
            "no credential": {},
            "bad credential": {"authorization": "token nope"},
            "basic scheme": {"authorization": f"Basic {TOKEN}"}}


def corpus(s: Server) -> list[tuple[str, bytes, int]]:
    items: list[tuple[str, bytes, int]] = []
    p = f"127.0.0.1:{s.port}"
    token = {"authorization": f"token {TOKEN}"}
    key = {"authorization": f"Bearer {INFER_KEY}"}
    for kind, creds in credentials(s).items():
        for method, path in ROUTES:
            body = (b"{}" if "repository" in path else ROW) if method in ("POST", "PUT") else None
            items.append((f"{kind}: {method} {path}", message(method, s, path, body=body, **creds), 1))
    for kind, creds in (("?token=", {}), ("?token= and key", key)):
        items.append((f"{kind} GET", get(s, f"v2/models/linear?token={TOKEN}", **creds), 1))
        items.append((f"{kind} POST infer", post(s, f"v2/models/linear/infer?token={TOKEN}", **creds), 1))
    items.append(("bad ?token=", get(s, "v2/models/linear?token=nope"), 1))
    # A browser: the login cookie; XSRF on unsafe methods, as header and cookie (or not).
    xsrf = {"x_xsrftoken": s.xsrf}
    both = f"{s.cookie}; _xsrf={s.xsrf}"
    for kind, headers in (
            ("cookie", {"cookie": s.cookie}),
            ("cookie + _xsrf header and cookie", {"cookie": both, **xsrf}),
            ("cookie + _xsrf cookie only", {"cookie": both}),
            ("cookie + _xsrf header only", {"cookie": s.cookie, **xsrf}),
            ("cookie + wrong _xsrf", {"cookie": f"{s.cookie}; _xsrf=wrong", "x_xsrftoken": "wrong"}),
            ("cookie + token header", {"cookie": s.cookie, **token}),
            ("cookie + key", {"cookie": s.cookie, **key}),
            ("stray cookie + token", {"cookie": "x=1", **token}),
            ("stray cookie + key", {"cookie": "x=1", **key}),
            ("bad login cookie", {"cookie": s.cookie.split("=", 1)[0] + "=forged"})):
        items.append((f"{kind}: GET metadata", get(s, "v2/models/linear", **headers), 1))
        items.append((f"{kind}: POST infer", post(s, "v2/models/linear/infer", **headers), 1))
        items.append((f"{kind}: POST unload", post(s, "v2/repository/models/nothing/unload",
                                                  b"{}", **headers), 1))
    for kind, origin in (("same Origin", f"http://{p}"), ("foreign Origin", "http://evil.example"),
                         ("null Origin", "null")):
        for creds_kind, creds in (("token", token), ("key", key), ("cookie", {"cookie": both, **xsrf})):
            items.append((f"{kind} + {creds_kind}: POST infer",
                          post(s, "v2/models/linear/infer", origin=origin, **creds), 1))
            items.append((f"{kind} + {creds_kind}: GET metadata",
                          get(s, "v2/models/linear", origin=origin, **creds), 1))
    items.append(("Referer foreign + cookie", post(s, "v2/models/linear/infer", referer="http://evil.example/",
                                                   cookie=both, **xsrf), 1))
    for pattern in ("localhost", "localhost:{port}", "127.0.0.1", "[::1]:{port}", "evil.example",
                    "evil.example:{port}", "LOCALHOST", "127.0.0.2", None):
        host = pattern.format(port=s.port) if pattern is not None else None
        for creds_kind, creds in (("token", token), ("key", key), ("server token",
                                                                    {"authorization": f"Bearer {s.server_token}"})):
            items.append((f"Host {pattern!r} + {creds_kind}: GET metadata",
                          get(s, "v2/models/linear", host=host, **creds), 1))
            items.append((f"Host {pattern!r} + {creds_kind}: POST infer",
                          post(s, "v2/models/linear/infer", host=host, **creds), 1))
    # Pipelined: two (or three) requests in one write on one connection.
    infer_t, infer_k = post(s, "v2/models/linear/infer", **token), post(s, "v2/models/linear/infer", **key)
    for kind, data, n in (
            ("token, token", infer_t + infer_t, 2),
            ("token, key, token", infer_t + infer_k + infer_t, 3),
            ("token, cookie without xsrf", infer_t + post(s, "v2/models/linear/infer", cookie=s.cookie), 2),
            ("cookie without xsrf, token", post(s, "v2/models/linear/infer", cookie=s.cookie) + infer_t, 2),
            ("token, bad credential", infer_t + post(s, "v2/models/linear/infer", authorization="token x"), 2),
            ("key unload, token", post(s, "v2/repository/models/nothing/unload", b"{}", **key) + infer_t, 2),
            ("token, foreign Host", infer_t + get(s, "v2/models/linear", host="evil.example", **token), 2),
            ("token, Jupyter's api/status", infer_t + get(s, "api/status", **token), 2),
            ("token, ?token=", infer_t + get(s, f"v2/models/linear?token={TOKEN}"), 2),
            ("token, chunked", infer_t + post(s, "v2/models/linear/infer", b"2\r\n{}\r\n0\r\n\r\n",
                                               transfer_encoding="chunked", **token), 2),
            ("token, close", infer_t + post(s, "v2/models/linear/infer", connection="close", **token) + infer_t, 3)):
        items.append((f"pipelined {kind}", data, n))
    # Content-Length / Transfer-Encoding variants.
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(ROW), ROW)
    for kind, headers, body in (
            ("chunked", {"transfer_encoding": "chunked"}, chunked),
            ("CL and TE", {"transfer_encoding": "chunked", "content_length": str(len(chunked))}, chunked),
            ("TE gzip, chunked", {"transfer_encoding": "gzip, chunked"}, chunked),
            ("TE identity", {"transfer_encoding": "identity", "content_length": str(len(ROW))}, ROW),
            ("CL with sign", {"content_length": f"+{len(ROW)}"}, ROW),
            ("CL not a number", {"content_length": "abc"}, ROW),
            ("CL too small", {"content_length": "10"}, ROW[:10]),
            ("CL zero", {"content_length": "0"}, b"")):
        for creds_kind, creds in (("token", token), ("key", key)):
            items.append((f"{kind} + {creds_kind}", post(s, "v2/models/linear/infer", body, **headers, **creds), 1))
    dup_same = post(s, "v2/models/linear/infer", **token).replace(
        b"Content-Length:", b"Content-Length: %d\r\nContent-Length:" % len(ROW), 1)
    dup_other = post(s, "v2/models/linear/infer", **token).replace(
        b"Content-Length:", b"Content-Length: 5\r\nContent-Length:", 1)
    items.append(("duplicate Content-Length, same", dup_same, 1))
    items.append(("duplicate Content-Length, different", dup_other, 1))
    items.append(("HTTP/1.0", post(s, "v2/models/linear/infer", **token).replace(b"HTTP/1.1", b"HTTP/1.0", 1), 1))
    items.append(("Expect: 100-continue", post(s, "v2/models/linear/infer", expect="100-continue", **token), 2))
    items.append(("Connection: upgrade", get(s, "v2/models/linear", connection="Upgrade", upgrade="websocket",
                                             **token), 1))
    items.append(("duplicate Authorization", get(s, "v2/models/linear", **token).replace(
        b"Authorization:", b"Authorization: token nope\r\nAuthorization:", 1), 1))
    items.append(("duplicate Host", get(s, "v2/models/linear", **token).replace(
        b"Host:", b"Host: evil.example\r\nHost:", 1), 1))
    items.append(("absolute URI", get(s, "v2/models/linear", **token).replace(
        f"GET {BASE}".encode(), f"GET http://evil.example{BASE}".encode(), 1), 1))
    items.append(("path with dot segments", get(s, "v2/../v2/models/linear", **token), 1))
    items.append(("path with %2F", get(s, "v2/models%2Flinear", **token), 1))
    items.append(("base_url missing", get(s, "v2/models/linear", **token).replace(BASE.encode(), b"/", 1), 1))
    return items


def statuses(server: Server) -> dict[str, list[int]]:
    return {name: exchange(server, data, n) for name, data, n in corpus(server)}


@pytest.fixture
def servers(tmp_path: Path, model_repo: Path):
    started = [start_server(tmp_path, model_repo, fast) for fast in (True, False)]
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(wait_ready, started))
        for s in started:
            login(s)
        yield started
    finally:
        for s in started:
            s.process.terminate()
        for s in started:
            try:
                s.process.wait(15)
            except subprocess.TimeoutExpired:
                s.process.kill()


def test_fast_routes_answer_every_request_as_jupyter_does(servers):
    on, off = servers
    fast, jupyter = statuses(on), statuses(off)
    assert fast.keys() == jupyter.keys()
    differ = {name: (fast[name], jupyter[name]) for name in fast if fast[name] != jupyter[name]}
    assert not differ, "fast routes on vs off: " + "; ".join(
        f"{name}: {a} vs {b}" for name, (a, b) in differ.items())
    # The corpus reaches both sides of the fast routes' decision, and Jupyter's refusals.
    seen = {s for answers in jupyter.values() for s in answers}
    assert {200, 400, 403, 404, 405} <= seen, seen
    assert len(fast) >= 150
