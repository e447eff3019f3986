"""Server CPU per request of a small token-authenticated infer: the Jupyter server's routes
against the standalone server's, and (``--profile``) where the Jupyter route spends it.

    .venv/bin/python tools/profile_jupyter_routes.py --front jupyter --requests 1000
    .venv/bin/python tools/profile_jupyter_routes.py --front standalone-tornado --requests 1000
    .venv/bin/python tools/profile_jupyter_routes.py --front standalone --requests 1000
    .venv/bin/python tools/profile_jupyter_routes.py --front jupyter-data --requests 1000
    .venv/bin/python tools/profile_jupyter_routes.py --front jupyter --profile /tmp/j.prof

The server runs in a child process (this script, ``--serve``); the client is one keep-alive
connection sending sequential JSON infers of one [1,16] FP32 row. CPU is the child's
utime+stime from /proc over the measured requests only (after a warm-up), so the client's
own cost is not counted. With ``--profile`` the child runs cProfile on its event-loop thread
for the measured window only (a real-time signal starts it, another writes it).
"""
from __future__ import annotations

import argparse
import cProfile
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOKEN = "profile-token-0123456789"
KEY = "profile-inference-key-0123456789"
CONFIG = """name: "linear"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
parameters { key: "intra_op_thread_count" value { string_value: "1" } }
"""


def write_repository(root: Path) -> None:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    w = np.arange(64, dtype=np.float32).reshape(16, 4) / 64
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["INPUT0", "W"], ["OUTPUT0"])], "linear",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    (root / "linear" / "1").mkdir(parents=True)
    (root / "linear" / "1" / "model.onnx").write_bytes(model.SerializeToString())
    (root / "linear" / "config.pbtxt").write_text(CONFIG)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(front: str, port: int, repo: str, home: str, profile: str) -> None:
    """The child: a server on the main thread, cProfile switched by signals."""
    profiler = cProfile.Profile()
    signal.signal(signal.SIGRTMIN, lambda *_: profiler.enable())
    signal.signal(signal.SIGRTMAX, lambda *_: (profiler.disable(), profiler.dump_stats(profile)))
    if front.startswith("jupyter"):
        from jupyter_server.serverapp import ServerApp
        # jupyter-data: the client talks to the extension's HTTP data port (``port``)
        web_port = free_port() if front == "jupyter-data" else port
        ServerApp.launch_instance(argv=[
            f"--port={web_port}", f"--JupyterTriton.http_data_port={port if web_port != port else -1}",
            f"--JupyterTriton.inference_keys={KEY}", "--ip=127.0.0.1", "--no-browser", "--allow-root", f"--ServerApp.root_dir={home}",
            f"--IdentityProvider.token={TOKEN}",
            '--ServerApp.jpserver_extensions={"jupyter_triton": True}',
            f"--JupyterTriton.model_repository={repo}"])
    else:
        import asyncio

        from jupyter_triton.cli import SWITCH_INTERVAL_S
        from jupyter_triton.engine import EngineOptions
        from jupyter_triton.standalone import start_standalone
        sys.setswitchinterval(SWITCH_INTERVAL_S)       # as jupyter-triton serve runs

        async def run() -> None:
            await start_standalone(
                EngineOptions(model_repository=repo, model_control_mode="explicit",
                              load_models=["linear"]),
                host="127.0.0.1", http_port=port, metrics_port=None, grpc_port=None,
                access_log=False, http_front=front.partition("-")[2] or "fast")
            await asyncio.Event().wait()
        asyncio.run(run())


def cpu_seconds(pid: int, task: int | None = None) -> float:
    """utime+stime of process ``pid`` (every thread), or of its thread ``task`` only."""
    path = f"/proc/{pid}/task/{task}/stat" if task is not None else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(front: str, requests: int, profile: str) -> dict:
    with tempfile.TemporaryDirectory() as home:
        repo = Path(home) / "models"
        write_repository(repo)
        port = free_port()
        env = {**os.environ, "JUPYTER_CONFIG_DIR": f"{home}/config", "JUPYTER_DATA_DIR": f"{home}/data",
               "JUPYTER_RUNTIME_DIR": f"{home}/runtime", "JUPYTER_PLATFORM_DIRS": "0"}
        child = subprocess.Popen(
            [sys.executable, __file__, "--serve", front, "--port", str(port), "--repo", str(repo),
             "--home", home, "--profile", profile or f"{home}/unused.prof"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            return _drive(child, port, front, requests, profile)
        finally:
            child.terminate()
            try:
                child.wait(20)
            except subprocess.TimeoutExpired:
                child.kill()


def _drive(child: subprocess.Popen, port: int, front: str, requests: int, profile: str) -> dict:
    headers = {"Content-Type": "application/json"}
    if front == "jupyter":
        headers["Authorization"] = f"token {TOKEN}"
    elif front == "jupyter-data":
        headers["Authorization"] = f"Bearer {KEY}"
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                                   "data": [1.0] * 16}]}).encode()
    deadline = time.monotonic() + 120
    while True:
        if child.poll() is not None:
            raise SystemExit(f"server exited: {child.stderr.read().decode()[-3000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", "/v2/models/linear/ready", headers=headers)
            resp = conn.getresponse()
            resp.read()
            if resp.status == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("server did not become ready in 120 s")
        time.sleep(0.3)

    def run(n: int) -> None:
        for _ in range(n):
            conn.request("POST", "/v2/models/linear/infer", body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                raise SystemExit(f"infer answered {resp.status}: {data[:300]!r}")

    run(200)                                   # warm-up: imports, first-call caches
    if profile:
        os.kill(child.pid, signal.SIGRTMIN)
        time.sleep(0.2)
    # the main thread runs the event loop (HTTP, auth, codec); instance threads run the model
    cpu0, loop0, wall0 = cpu_seconds(child.pid), cpu_seconds(child.pid, child.pid), time.monotonic()
    run(requests)
    cpu1, loop1, wall1 = cpu_seconds(child.pid), cpu_seconds(child.pid, child.pid), time.monotonic()
    if profile:
        os.kill(child.pid, signal.SIGRTMAX)
        time.sleep(1.0)
    conn.request("GET", "/v2/models/linear/ready", headers=headers)
    resp = conn.getresponse()
    cookies = resp.headers.get_all("Set-Cookie") or []
    resp.read()
    return {"front": front, "requests": requests,
            "server_cpu_us_per_request": round((cpu1 - cpu0) / requests * 1e6, 1),
            "event_loop_cpu_us_per_request": round((loop1 - loop0) / requests * 1e6, 1),
            "wall_us_per_request": round((wall1 - wall0) / requests * 1e6, 1),
            "set_cookie_on_response": bool(cookies)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--front", choices=["jupyter", "jupyter-data", "standalone", "standalone-tornado"],
                        default="jupyter", help="jupyter-data: the extension's http_data_port, with an "
                                                "inference key; standalone: its default (fast) HTTP front")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--profile", default="", help="write the child's cProfile stats here")
    parser.add_argument("--serve", default="")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--repo", default="")
    parser.add_argument("--home", default="")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.repo, args.home, args.profile)
        return
    for _ in range(args.rounds):
        print(json.dumps(measure(args.front, args.requests, args.profile)), flush=True)


if __name__ == "__main__":
    main()
