"""A request that reaches the Jupyter server while the extension still loads the models named
at start waits for them: Jupyter answers as soon as it listens (v2/health/live), before the
engine has loaded its models, and such a request used to get Triton's 404 "unknown model" for a
model about to be served (seen as a flaky 404 right after a lab started)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from pathlib import Path

from conftest import TOKEN
from ports import free_port

SLOW_MODEL = '''
import os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        release = os.environ["RELEASE_FILE"]
        deadline = time.monotonic() + 120          # bounded: the test releases it
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.02)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() + 1)]) for r in requests]
'''
CONFIG = '''backend: "python"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_FP32, dims: [ 2 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 2 ] } ]
'''
AUTH = {"Authorization": f"token {TOKEN}"}


def _call(url: str, body: bytes | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={**AUTH, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=150) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def test_a_request_during_the_start_waits_for_the_models_named_at_start(tmp_path: Path):
    repo = tmp_path / "models"
    (repo / "slow" / "1").mkdir(parents=True)
    (repo / "slow" / "1" / "model.py").write_text(SLOW_MODEL)
    (repo / "slow" / "config.pbtxt").write_text(CONFIG)
    release = tmp_path / "release"
    for sub in ("config", "data", "runtime"):
        (tmp_path / sub).mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER_TRITON_", "JUPYTERHUB_"))}
    env.update(RELEASE_FILE=str(release), JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
               JUPYTER_DATA_DIR=str(tmp_path / "data"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "server", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={TOKEN}",
         "--ServerApp.allow_root=True", "--ServerApp.open_browser=False",
         f"--ServerApp.root_dir={tmp_path}", f"--JupyterTriton.model_repository={repo}"],
        env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/v2"
    try:
        deadline = time.monotonic() + 90
        while True:         # Jupyter listens: the engine is still in the model's initialize
            try:
                if _call(f"{base}/health/live")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "jupyter server did not start"
            time.sleep(0.2)
        assert _call(f"{base}/health/ready")[0] == 400       # strict readiness: not yet
        body = json.dumps({"inputs": [{"name": "X", "shape": [1, 2], "datatype": "FP32",
                                       "data": [1, 2]}]}).encode()
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(_call, f"{base}/models/slow/infer", body)
            try:       # an early answer can only be a refusal: the model cannot answer yet
                early = answer.result(timeout=2)
            except FutureTimeout:
                early = None
            assert early is None, f"answered before its model was loaded: {early}"
            release.touch()
            status, reply = answer.result(timeout=150)
        assert status == 200, reply
        assert reply["outputs"][0]["data"] == [2.0, 3.0]
    finally:
        release.touch()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
