"""Shared fixtures: a model repository built by the tests, a standalone server on
127.0.0.1, and (through pytest-jupyter) a real Jupyter server with the extension."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from jupyter_triton.engine import EngineOptions
from onnx_models import add_sub, identity, linear

pytest_plugins = ["pytest_jupyter.jupyter_server"]

# The standalone HTTP skin every test server gets: JUPYTER_TRITON_HTTP_FRONT=tornado runs the
# whole suite on the tornado skin (the default is the product's, the httptools front). Test
# modules that start servers themselves get it too, through start_standalone's default.
HTTP_FRONT = os.environ.get("JUPYTER_TRITON_HTTP_FRONT", "fast")
if HTTP_FRONT not in ("fast", "tornado"):
    raise RuntimeError(f"JUPYTER_TRITON_HTTP_FRONT must be fast or tornado, not {HTTP_FRONT!r}")
import jupyter_triton.standalone as _standalone  # noqa: E402

for _fn in (_standalone.start_standalone, _standalone.start_in_thread):
    _fn.__kwdefaults__["http_front"] = HTTP_FRONT

W = np.arange(16 * 4, dtype=np.float32).reshape(16, 4) / 64.0
TOKEN = "test-token"
INFER_KEY = "infer-key-123"

LINEAR_CONFIG = """\
name: "linear"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""


def build_repository(root: Path) -> Path:
    """linear (config.pbtxt given), simple (auto-completed ONNX), identity_int32."""
    linear(W, root / "linear" / "1" / "model.onnx")
    (root / "linear" / "config.pbtxt").write_text(LINEAR_CONFIG)
    add_sub(root / "simple" / "1" / "model.onnx")
    from onnx import TensorProto
    identity(TensorProto.INT32, root / "identity_int32" / "1" / "model.onnx")
    return root


@pytest.fixture
def model_repo(tmp_path: Path) -> Path:
    return build_repository(tmp_path / "models")


@pytest.fixture
def http_front() -> str:
    """The HTTP skin of the ``standalone`` fixture; a module that must pass on both
    overrides it with ``pytest.fixture(params=BOTH_FRONTS)``."""
    return HTTP_FRONT


BOTH_FRONTS = ["fast", "tornado"]


@pytest.fixture
def standalone(model_repo: Path, http_front: str):
    """A standalone server on 127.0.0.1 (free ports), explicit mode, every model loaded."""
    from jupyter_triton.standalone import start_in_thread
    server = start_in_thread(EngineOptions(model_repository=model_repo, model_control_mode="explicit",
                                           load_models=["*"]),
                             host="127.0.0.1", http_port=0, metrics_port=0, grpc_port=0,
                             http_front=http_front)
    yield server
    server.close()


def serve(repo: Path, http_front: str | None = None, **options):
    """A standalone server on 127.0.0.1 (HTTP only, a free port) and a tritonclient for it;
    stop it with ``server.close()``."""
    import tritonclient.http as httpclient
    from jupyter_triton.standalone import start_in_thread
    server = start_in_thread(EngineOptions(model_repository=repo, **options), host="127.0.0.1",
                             http_port=0, metrics_port=None, grpc_port=None,
                             http_front=http_front or HTTP_FRONT)
    return server, httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")


@pytest.fixture
def jp_server_config(model_repo: Path):
    return {
        "ServerApp": {
            "jpserver_extensions": {"jupyter_triton": True},
            "allow_unauthenticated_access": False,
            "token": TOKEN,
        },
        "IdentityProvider": {"token": TOKEN},
        "JupyterTriton": {"model_repository": str(model_repo), "inference_keys": [INFER_KEY]},
    }


@pytest.fixture
def jp_base_url() -> str:
    return "/user/alice/"


async def in_thread(fn, *args):
    """tritonclient.http is blocking (gevent): call it off the in-process server's loop."""
    return await asyncio.to_thread(fn, *args)


@pytest.fixture
def jp_triton(jp_serverapp, jp_fetch, jp_asyncio_loop, http_server):
    """The Jupyter server with its HTTP port open and the extensions' start hooks run
    (pytest-jupyter initialises the app but does not run ``_post_start``). The port's
    tornado HTTPServer is the app's own, as in a real server: the fast routes take it."""
    jp_serverapp._http_server = http_server
    jp_asyncio_loop.run_until_complete(jp_serverapp.extension_manager.start_all_extensions())
    return jp_serverapp
