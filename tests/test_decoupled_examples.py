"""NVIDIA's decoupled examples (python_backend ``examples/decoupled``: repeat_int32 and
square_int32, their configs and gRPC stream clients, as published, in tests/triton_examples/
decoupled/) against the standalone server. The clients take no flags: only their address
(``localhost:8001``) is replaced by the test server's."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jupyter_triton.engine import EngineOptions
from jupyter_triton.standalone import start_in_thread

EXAMPLES = Path(__file__).parent / "triton_examples" / "decoupled"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("models")
    for model, stem in (("repeat_int32", "repeat"), ("square_int32", "square")):
        (repo / model / "1").mkdir(parents=True)
        shutil.copy(EXAMPLES / f"{stem}_model.py", repo / model / "1" / "model.py")
        shutil.copy(EXAMPLES / f"{stem}_config.pbtxt", repo / model / "config.pbtxt")
    served = start_in_thread(EngineOptions(model_repository=repo, model_control_mode="explicit",
                                           load_models=["*"]),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0)
    yield served
    served.close()


@pytest.mark.parametrize("client", ["repeat_client.py", "square_client.py"])
def test_nvidia_decoupled_example_client_passes(server, client, tmp_path):
    text = (EXAMPLES / client).read_text()
    assert text.count('url="localhost:8001"') == 1
    script = tmp_path / client
    script.write_text(text.replace('url="localhost:8001"', f'url="127.0.0.1:{server.grpc_port}"'))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    model = client.replace("_client.py", "_int32")
    assert f"PASS: {model}" in done.stdout


def test_tritonclient_custom_repeat_example_passes(server):
    """tritonclient's simple_grpc_custom_repeat.py (10 responses a second apart from one
    request on the stream), run with its --url flag."""
    done = subprocess.run([sys.executable, str(EXAMPLES.parent / "simple_grpc_custom_repeat.py"),
                           "-u", f"127.0.0.1:{server.grpc_port}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "PASS: Decoupled API" in done.stdout
