"""KServe's own clients (pip kserve 0.21: InferenceRESTClient with protocol v2, and
InferenceGRPCClient) are answered by the standalone server as by a KServe runtime: the health
bodies of the Open Inference Protocol ({"live": true}, {"ready": true}), which the REST
client parses, beside Triton's status codes, which tritonclient reads. KServe needs a
protobuf and psutil of its own, so it runs from a venv of its own (./dev test makes it)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import W
from jupyter_triton.engine import EngineOptions
from jupyter_triton.frontends.admission import INFERENCE_SCOPE, AccessPolicy

VENV = Path(os.environ.get("JUPYTER_TRITON_KSERVE_VENV")
            or Path.home() / ".cache" / "jupyter-triton-bench" / "kserve-venv")
PYTHON = VENV / "bin" / "python"
SCRIPT = Path(__file__).resolve().parent / "kserve" / "clients.py"
KEY = "kserve-key"

pytestmark = pytest.mark.skipif(
    not PYTHON.exists() or subprocess.run([str(PYTHON), "-c", "import kserve"],
                                          capture_output=True).returncode != 0,
    reason=f"no kserve client in {VENV} (./dev test installs it; JUPYTER_TRITON_KSERVE_VENV points elsewhere)")


def test_kserve_rest_and_grpc_clients(model_repo: Path):
    from jupyter_triton.standalone import start_in_thread
    server = start_in_thread(EngineOptions(model_repository=model_repo, model_control_mode="explicit",
                                           load_models=["linear"]),
                             http_port=0, metrics_port=None, grpc_port=0,
                             access=AccessPolicy(tokens={KEY: INFERENCE_SCOPE}),
                             grpc_access=AccessPolicy(tokens={KEY: INFERENCE_SCOPE}))
    try:
        done = subprocess.run([str(PYTHON), str(SCRIPT), f"http://127.0.0.1:{server.http_port}",
                               f"127.0.0.1:{server.grpc_port}", KEY],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        out = json.loads(done.stdout.strip().splitlines()[-1])
        expected = np.ones((2, 16), np.float32) @ W
        np.testing.assert_allclose(out.pop("rest_infer"), expected, rtol=1e-6)
        np.testing.assert_allclose(out.pop("grpc_infer"), expected, rtol=1e-6)
        assert out == {"rest_live": True, "rest_ready": True, "rest_model_ready": True,
                       "rest_unknown_ready": False, "grpc_live": True, "grpc_ready": True,
                       "grpc_model_ready": True}
        # Triton's own client reads the same routes by their status
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        auth = {"Authorization": f"Bearer {KEY}"}
        assert client.is_server_live(headers=dict(auth)) and client.is_server_ready(headers=dict(auth))
        assert client.is_model_ready("linear", headers=dict(auth))
        assert not client.is_model_ready("nothing_here", headers=dict(auth))
    finally:
        server.close()
