"""`jupyter-triton serve` and `jupyter triton serve` as a user runs them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import W
from ports import free_port



@pytest.mark.parametrize("argv0", [["jupyter-triton"], ["jupyter", "triton"]])
def test_serve_command(model_repo: Path, argv0):
    bindir = Path(sys.executable).parent
    exe = [str(bindir / argv0[0]), *argv0[1:]]
    http, grpc, metrics = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        exe + ["serve", "--model-repository", str(model_repo), "--http-address", "127.0.0.1",
               "--grpc-address", "127.0.0.1", "--http-port", str(http), "--grpc-port", str(grpc),
               "--metrics-port", str(metrics), "--model-control-mode", "explicit", "--load-model", "linear"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"})
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if client.is_server_ready():
                    break
            except Exception:
                pass
            assert proc.poll() is None, proc.stdout.read().decode()
            time.sleep(0.2)
        assert client.is_model_ready("linear")
        assert not client.is_model_ready("simple")      # explicit mode: only --load-model
        inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        x = np.ones((1, 16), np.float32)
        inp.set_data_from_numpy(x)
        np.testing.assert_allclose(client.infer("linear", [inp]).as_numpy("OUTPUT0"), x @ W, rtol=1e-5)
        import urllib.request
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()
        assert 'nv_inference_request_success{model="linear",version="1"} 1' in body
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0


def test_serve_stops_with_the_reason_when_an_s3_repository_cannot_be_read(tmp_path: Path):
    # the served case (moto's S3 on loopback) is tests/test_s3_repository.py's
    url = f"s3://127.0.0.1:{free_port()}/bucket/models"      # nothing listens there
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "TRITON_AWS_MOUNT_DIRECTORY": str(tmp_path / "mount")}
    done = subprocess.run(
        [str(Path(sys.executable).parent / "jupyter-triton"), "serve", "--model-repository", url,
         "--http-address", "127.0.0.1", "--http-port", "0", "--allow-grpc", "false",
         "--allow-metrics", "false"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    assert f"jupyter-triton serve: model repository {url}: " in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
