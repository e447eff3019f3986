"""A real JupyterHub (pip ``jupyterhub``, npm ``configurable-http-proxy``; DummyAuthenticator,
SimpleLocalProcessSpawner, all on 127.0.0.1), alice's single-user server running the extension,
used as alice would: through the hub's proxy with her tokens, from a kernel of her server, and
on her server's gRPC port. ``./dev test`` installs the proxy; without it the tests are skipped."""
from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

from ports import free_port

pytest.importorskip("jupyterhub")
BIN = Path(sys.executable).parent
CHP_DEFAULT = Path.home() / ".cache/jupyter-triton-bench/chp/node_modules/.bin/configurable-http-proxy"
CHP = os.environ.get("JUPYTER_TRITON_CHP") or shutil.which("configurable-http-proxy") or str(CHP_DEFAULT)
if not Path(CHP).is_file():
    pytest.skip("configurable-http-proxy is not installed (./dev test installs it: npm install "
                "--prefix ~/.cache/jupyter-triton-bench/chp configurable-http-proxy@5)",
                allow_module_level=True)

SERVICE_TOKEN = uuid.uuid4().hex
ROW = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                              "data": [1.0] * 16}]}).encode()
SPAWN_TIMEOUT = 60


def _call(url: str, token: str | None = None, data: bytes | None = None, method: str | None = None,
          timeout: float = 30) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"} if data is not None else {}
    if token:
        headers["Authorization"] = f"token {token}"
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _until(what: str, check, timeout: float):
    """check() until it returns something true (polled; a bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.2)


class Hub:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.port, self.hub_port, self.api_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log = root / "hub.log"
        self.proc: subprocess.Popen | None = None
        self.servers: set[int] = set()      # single-user servers' pids (a session of their own)

    def config(self) -> str:
        args = ["--JupyterTriton.activity_interval=0.5"]
        if os.geteuid() == 0:
            args.append("--ServerApp.allow_root=True")     # CI runs as root
        return textwrap.dedent(f"""
            c.JupyterHub.ip = "127.0.0.1"
            c.JupyterHub.port = {self.port}
            c.JupyterHub.hub_ip = "127.0.0.1"
            c.JupyterHub.hub_port = {self.hub_port}
            c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{self.api_port}"
            c.ConfigurableHTTPProxy.command = [{CHP!r}]
            c.ConfigurableHTTPProxy.pid_file = {str(self.root / "proxy.pid")!r}
            c.JupyterHub.db_url = "sqlite:///{self.root / "hub.sqlite"}"
            c.JupyterHub.cookie_secret_file = {str(self.root / "cookie_secret")!r}
            c.JupyterHub.authenticator_class = "dummy"
            c.Authenticator.allowed_users = {{"alice", "bob"}}
            c.JupyterHub.spawner_class = "simple"
            c.SimpleLocalProcessSpawner.home_dir_template = {str(self.root / "home" / "{username}")!r}
            c.Spawner.cmd = [{str(BIN / "jupyterhub-singleuser")!r}]
            c.Spawner.args = {args!r}
            c.Spawner.ip = "127.0.0.1"
            c.Spawner.start_timeout = {SPAWN_TIMEOUT}
            c.Spawner.http_timeout = {SPAWN_TIMEOUT}
            c.Spawner.default_url = "/lab"
            c.Spawner.environment = {{"JUPYTERHUB_ACTIVITY_INTERVAL": "1",
                                      "JUPYTER_PLATFORM_DIRS": "1"}}
            c.JupyterHub.services = [{{"name": "tester", "api_token": {SERVICE_TOKEN!r}}}]
            c.JupyterHub.load_roles = [{{"name": "tester", "services": ["tester"],
                "scopes": ["admin:users", "admin:servers", "admin:server_state", "tokens",
                           "access:servers"]}}]
            """)

    def start(self) -> None:
        (self.root / "jupyterhub_config.py").write_text(self.config())
        env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [str(BIN / "jupyterhub"), "-f", str(self.root / "jupyterhub_config.py")],
                cwd=self.root, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True)
        _until("the hub's API through its proxy", self._up, 30)
        assert self.proc.poll() is None, self.log.read_text()[-3000:]

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            return True
        try:
            return _call(self.url + "hub/api/", timeout=2)[0] == 200
        except OSError:
            return False

    def api(self, path: str, method: str = "GET", body: dict | None = None) -> dict:
        status, data = _call(self.url + "hub/api/" + path, SERVICE_TOKEN,
                             json.dumps(body).encode() if body is not None else None, method)
        assert status < 300, f"{method} hub/api/{path}: {status} {data[:500]!r}"
        return json.loads(data) if data else {}

    def spawn(self, user: str) -> dict:
        self.api(f"users/{user}/server", "POST", {})
        return _until(f"{user}'s server", lambda: self._ready(user), SPAWN_TIMEOUT)

    def _ready(self, user: str) -> dict | None:
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        server = self.api(f"users/{user}").get("servers", {}).get("")
        if server and server.get("state", {}).get("pid"):
            self.servers.add(int(server["state"]["pid"]))
        return server if server and server.get("ready") else None

    def token(self, user: str) -> str:
        return self.api(f"users/{user}/tokens", "POST", {"expires_in": 3600, "note": "tests"})["token"]

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)   # the hub stops its servers and its proxy
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        # whatever is left: the hub's session (its proxy), and servers it did not stop (each in
        # a session of its own), if those pids are still the servers it started
        groups = [self.proc.pid] + [pid for pid in self.servers if _is_single_user_server(pid)]
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait(timeout=10)


def _is_single_user_server(pid: int) -> bool:
    import psutil
    try:
        return any("jupyterhub-singleuser" in part for part in psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = Hub(tmp_path_factory.mktemp("hub"))
    try:
        h.start()
        h.server = h.spawn("alice")
        assert h.servers, "the hub API shows no pid of alice's server (clean-up needs it)"
        h.alice, h.bob = h.token("alice"), h.token("bob")
        h.user_url = h.url + "user/alice/"
        yield h
    finally:
        h.stop()


def _alive(path: Path) -> bool:
    try:
        os.kill(int(path.stem.rsplit("-", 1)[1]), 0)
    except (ProcessLookupError, ValueError):
        return False
    return True


def _runtime_info(hub: Hub) -> dict:
    # the hub may call the server ready before the extension has written it (bounded wait); a
    # stopped server's file may stay behind (kernels skip it: its process is gone)
    files = _until("alice's server's runtime file", lambda: [
        f for f in (hub.root / "home" / "alice").rglob("jupyter_triton-*.json") if _alive(f)], 30)
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def _status_activity(hub: Hub) -> datetime:
    status, body = _call(hub.user_url + "api/status", hub.alice)
    assert status == 200, body
    return datetime.fromisoformat(json.loads(body)["last_activity"].replace("Z", "+00:00"))


def _hub_activity(hub: Hub) -> datetime | None:
    stamp = hub.api("users/alice")["servers"][""].get("last_activity")
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")) if stamp else None


def test_inference_on_the_grpc_port_is_the_servers_activity_and_the_hubs(hub):
    import tritonclient.grpc as grpcclient
    info = _runtime_info(hub)
    assert isinstance(info["grpc_port"], int) and info["grpc_port"] > 0 and not info["grpc_error"]
    before_server, before_hub = _status_activity(hub), _hub_activity(hub)
    started = datetime.now(before_server.tzinfo)
    # the proxy never sees this traffic: only the extension can say the server is busy
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{info['grpc_port']}")
    tensor = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 16), np.float32))
    for _ in range(5):
        client.infer("demo", [tensor], headers={"authorization": f"token {hub.alice}"})
    client.close()
    after_server = _until("the server's last_activity after inference",
                          lambda: (t := _status_activity(hub)) >= started and t, 30)
    after_hub = _until("the hub's last_activity of alice's server",
                       lambda: (t := _hub_activity(hub)) and t >= started and t, 30)
    print(f"\nlast_activity (server /api/status): {before_server.isoformat()} -> "
          f"{after_server.isoformat()}; (hub API): {before_hub and before_hub.isoformat()} -> "
          f"{after_hub.isoformat()}")


def _infer_loop(url: str, token: str | None, count: int, statuses: Counter, lock: threading.Lock,
                barrier: threading.Barrier) -> None:
    import http.client
    from urllib.parse import urlsplit
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"token {token}"
    barrier.wait(timeout=30)
    try:
        for _ in range(count):
            conn.request("POST", parts.path, body=ROW, headers=headers)
            resp = conn.getresponse()
            resp.read()
            with lock:
                statuses[resp.status] += 1
    finally:
        conn.close()


def test_bursts_of_refused_infers_beside_valid_ones_through_the_proxy_are_never_503(hub):
    url = hub.user_url + "v2/models/demo/infer"
    for burst in range(5):
        refused, valid = Counter(), Counter()
        lock = threading.Lock()
        # 40 refused (no credential, bob's token, a made-up one) beside 40 of alice's, at once
        senders = [(None, 14, refused), (hub.bob, 13, refused), ("not-a-token", 13, refused),
                   (hub.alice, 20, valid), (hub.alice, 20, valid)]
        barrier = threading.Barrier(len(senders))
        threads = [threading.Thread(target=_infer_loop, args=(url, token, n, seen, lock, barrier))
                   for token, n, seen in senders]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        assert sum(refused.values()) == 40 and set(refused) <= {401, 403}, (burst, refused)
        assert valid == Counter({200: 40}), (burst, valid)


def _throughput(url: str, token: str, seconds: float = 2.0, threads: int = 4) -> float:
    import http.client
    from urllib.parse import urlsplit
    parts = urlsplit(url)
    done, stop = [0] * threads, time.monotonic() + seconds

    def run(i: int) -> None:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        while time.monotonic() < stop:
            conn.request("POST", parts.path, body=ROW, headers={
                "Content-Type": "application/json", "Authorization": f"token {token}"})
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200
            done[i] += 1
        conn.close()
    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=seconds + 30)
    return sum(done) / seconds


def test_throughput_through_the_proxy_and_direct(hub):
    """Figures for the note, not a bound: the proxy's cost on this machine."""
    info = _runtime_info(hub)
    proxied = _throughput(hub.user_url + "v2/models/demo/infer", hub.alice)
    direct = _throughput(info["url"] + "v2/models/demo/infer", hub.alice)
    print(f"\ninfer/s, 4 connections, alice's token: through the proxy {proxied:.0f}, "
          f"on the server's own port {direct:.0f}")
    assert proxied > 0 and direct > 0


class Kernel:
    """A kernel of alice's server, reached as JupyterLab reaches it: through the proxy."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        status, body = _call(hub.user_url + "api/kernels", hub.alice, b'{"name": "python3"}', "POST")
        assert status == 201, body
        self.id = json.loads(body)["id"]
        self.session = uuid.uuid4().hex

    async def _run(self, code: str, timeout: float) -> dict:
        from tornado.httpclient import HTTPRequest
        from tornado.websocket import websocket_connect
        url = self.hub.user_url.replace("http://", "ws://") + f"api/kernels/{self.id}/channels"
        ws = await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {self.hub.alice}"}))
        msg_id = uuid.uuid4().hex
        ws.write_message(json.dumps({
            "header": {"msg_id": msg_id, "username": "alice", "session": self.session,
                       "msg_type": "execute_request", "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": True,
                        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}}))
        out = {"stdout": "", "text": "", "error": None}
        deadline = time.monotonic() + timeout
        try:
            while True:
                raw = await asyncio.wait_for(ws.read_message(), max(0.1, deadline - time.monotonic()))
                assert raw is not None, "the kernel's websocket closed"
                msg = json.loads(raw)
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if kind == "stream":
                    out["stdout"] += content["text"]
                elif kind in ("execute_result", "display_data"):
                    out["text"] += content["data"].get("text/plain", "")
                elif kind == "error":
                    out["error"] = f"{content['ename']}: {content['evalue']}"
                elif kind == "status" and content["execution_state"] == "idle":
                    return out
        finally:
            ws.close()

    def ok(self, code: str, timeout: float = 60) -> dict:
        out = asyncio.run(self._run(code, timeout))
        assert out["error"] is None, f"{out['error']}\n{out['stdout']}"
        return out

    def close(self) -> None:
        _call(self.hub.user_url + f"api/kernels/{self.id}", self.hub.alice, method="DELETE")


SERVE_CELL = """%%serve plusone --example x
import numpy as np
x = np.zeros((1, 4), np.float32)
def plusone(x):
    return x + 1
plusone"""


def _section(text: str, start: str, end: str | None) -> str:
    block = text.split("\n" + start + "\n", 1)[1]
    if end:
        block = block.split("\n" + end + "\n", 1)[0]
    return textwrap.dedent(block)


def test_a_serve_cell_shows_the_hubs_public_url_and_its_snippets_run_in_the_kernel_and_elsewhere(hub):
    kernel = Kernel(hub)
    try:
        kernel.ok("%load_ext jupyter_triton")
        shown = kernel.ok(SERVE_CELL, timeout=120)["text"]
        print("\n%%serve in a kernel of alice's server:\n" + shown)
        url = re.search(r"URL +(\S+)", shown).group(1)
        # the hub's public address and alice's prefix, not the spawner's port, which changes: a
        # hub that does not say its address (its default) is reached where alice's requests came
        assert url == hub.user_url + "v2/models/plusone", shown
        assert _runtime_info(hub)["url"] not in shown
        assert "$JUPYTERHUB_API_TOKEN" in shown and "$JUPYTER_TOKEN" not in shown
        assert f"{hub.url}hub/token" in shown        # where a token for another host comes from
        curl = _section(shown, "curl:", "tritonclient:")
        client = _section(shown, "tritonclient:", None)

        # as printed, in the kernel: tritonclient with the kernel's own JUPYTERHUB_API_TOKEN
        ran = kernel.ok(client)["stdout"]
        print("tritonclient snippet, run in the kernel:\n" + ran)
        assert ran.strip() == str(np.ones((1, 4), np.float32)), ran
        # as printed, on another host: the curl line with a token of alice's from the hub
        done = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60,
                              env={"PATH": os.environ["PATH"], "JUPYTERHUB_API_TOKEN": hub.alice})
        print("curl snippet, run elsewhere:\n" + done.stdout)
        assert json.loads(done.stdout)["outputs"][0]["data"] == [1.0] * 4, done
        hub.shown = (url, curl)
    finally:
        kernel.close()


def test_the_url_and_the_snippet_stay_the_same_after_the_server_restarts(hub):
    url, curl = getattr(hub, "shown", (None, None))
    if url is None:
        pytest.skip("the %%serve test did not run")
    before = _runtime_info(hub)["url"]
    hub.api("users/alice/server", "DELETE")
    _until("alice's server to stop", lambda: not hub.api("users/alice").get("servers"), SPAWN_TIMEOUT)
    hub.spawn("alice")
    after = _until("the new server's runtime file",
                   lambda: (info := _runtime_info(hub)) and info["url"] != before and info, 30)
    assert _call(hub.user_url + "api/status", hub.alice)[0] == 200      # alice's page load
    kernel = Kernel(hub)
    try:
        shown = kernel.ok("import jupyter_triton\nfrom jupyter_triton.kernel.handle import ServedModel\n"
                          "ServedModel.from_server('plusone', jupyter_triton.connection())")["text"]
    finally:
        kernel.close()
    assert re.search(r"URL +(\S+)", shown).group(1) == url and after["url"] not in shown, shown
    done = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ["PATH"], "JUPYTERHUB_API_TOKEN": hub.alice})
    assert json.loads(done.stdout)["outputs"][0]["data"] == [1.0] * 4, done


def test_no_per_inference_lines_in_the_single_user_log(hub):
    # the earlier tests sent hundreds of inferences through the proxy: none is an INFO line
    lines = hub.log.read_text(errors="replace").splitlines()
    infers = [line for line in lines if "/v2/models/" in line and "/infer" in line]
    assert not [line for line in infers if line.startswith("[I ")], infers[:5]
    # refusals are still logged, as errors are
    assert any(line.startswith("[W ") and " 403 " in line for line in infers), infers[:5]
