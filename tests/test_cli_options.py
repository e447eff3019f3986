"""The engine options of the lifecycle work, reached as an operator reaches them: flags of
`jupyter-triton serve` (tritonserver's spelling where tritonserver has the flag)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import W
from onnx_models import linear
from python_models import request, sleepy_model
from ports import free_port

COPY_CONFIG = json.dumps({"name": "copy", "backend": "onnxruntime", "max_batch_size": 8})


def serve(repo: Path, *flags: str, ready: bool = True) -> tuple[subprocess.Popen, str]:
    """`jupyter-triton serve` on 127.0.0.1 (HTTP only), explicit mode, once it answers
    live (and ready, when ``ready``); returns the process and its host:port."""
    http = free_port()
    exe = str(Path(sys.executable).parent / "jupyter-triton")
    proc = subprocess.Popen(
        [exe, "serve", "--model-repository", str(repo), "--http-address", "127.0.0.1",
         "--http-port", str(http), "--allow-grpc", "false", "--allow-metrics", "false",
         "--model-control-mode", "explicit", *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"127.0.0.1:{http}"
    client = httpclient.InferenceServerClient(url, network_timeout=30)
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            try:
                if client.is_server_live() and (not ready or client.is_server_ready()):
                    return proc, url
            except Exception:  # not listening yet
                pass
            if proc.poll() is not None:
                raise AssertionError(proc.stdout.read().decode())
            time.sleep(0.2)
    finally:
        client.close()
    stop(proc)
    raise AssertionError("jupyter-triton serve did not answer in 60 s")


def stop(proc: subprocess.Popen, timeout: float = 30) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out.decode()


def one_row() -> list[httpclient.InferInput]:
    inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(np.ones((1, 16), np.float32))
    return [inp]


def test_keep_versions_and_max_output_size(tmp_path: Path):
    repo = tmp_path / "models"
    repo.mkdir()
    proc, url = serve(repo, "--keep-versions", "1", "--max-output-size", "8")
    c = httpclient.InferenceServerClient(url, network_timeout=30)
    try:
        for scale in (1.0, 2.0):
            c.load_model("copy", config=COPY_CONFIG, files={"file:1/model.onnx": linear(W * scale)})
        # two uploads: versions 1 and 2; only the newest stays on disk
        assert sorted(p.name for p in (repo / "copy").iterdir() if p.name.isdigit()) == ["2"]
        assert c.is_model_ready("copy", "2")
        # a 1x4 FP32 output is 16 bytes, past the 8 asked for
        with pytest.raises(InferenceServerException) as err:
            c.infer("copy", one_row())
        assert err.value.status() == "503"
        assert "max_output_size" in err.value.message()
    finally:
        c.close()
        out = stop(proc)
    assert proc.returncode == 0, out


def broken_repository(root: Path) -> Path:
    linear(W, root / "linear" / "1" / "model.onnx")
    (root / "broken" / "1").mkdir(parents=True)
    (root / "broken" / "1" / "model.onnx").write_bytes(b"not an onnx file")
    return root


@pytest.mark.parametrize("strict", ["true", "false"])
def test_strict_readiness_flag(tmp_path: Path, strict: str):
    repo = broken_repository(tmp_path / "models")
    proc, url = serve(repo, "--load-model", "linear", "--load-model", "broken",
                      "--strict-readiness", strict, ready=False)
    c = httpclient.InferenceServerClient(url, network_timeout=30)
    try:
        assert c.is_model_ready("linear") and not c.is_model_ready("broken")
        # tritonserver: with strict readiness, not ready while a model asked for failed
        assert c.is_server_ready() is (strict == "false")
    finally:
        c.close()
        stop(proc)


HUNG_MODEL_PY = '''
import os
import time


class TritonPythonModel:
    def initialize(self, args):
        self.started = os.path.join(args["model_repository"], "started")

    def execute(self, requests):
        open(self.started, "w").close()
        time.sleep(30)
        return []
'''


def test_exit_timeout_secs_bounds_the_stop_of_a_hung_model(tmp_path: Path):
    repo = tmp_path / "models"
    model_dir = sleepy_model(repo, "hung", max_batch_size=1)
    (model_dir / "1" / "model.py").write_text(HUNG_MODEL_PY)
    proc, url = serve(repo, "--load-model", "hung", "--exit-timeout-secs", "1")
    answered: list[str] = []
    answered_at: list[float] = []

    def infer() -> None:
        mine = httpclient.InferenceServerClient(url, network_timeout=60)
        try:
            mine.infer("hung", request(1))
            answered.append("ok")
        except InferenceServerException as err:
            answered.append(err.message())
        finally:
            answered_at.append(time.monotonic())
            mine.close()

    t = threading.Thread(target=infer)
    t.start()
    deadline = time.monotonic() + 30
    while not (model_dir / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (model_dir / "started").exists()
    start = time.monotonic()
    out = stop(proc)
    t.join(timeout=30)
    assert proc.returncode == 0, out              # stopped, not killed after stop()'s 30 s
    assert len(answered) == 1 and "was unloaded before the request finished" in answered[0]
    # the server's own figure: requests in flight get 0.6 of the bound, here of the 1 s asked,
    # not of the 5 s default (a client's clock would also count a busy machine's stalls)
    assert "ran past 0.6 s" in answered[0], answered[0]
    assert answered_at[0] - start >= 0.6                # and not before
