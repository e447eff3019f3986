"""Poll mode side by side with NVIDIA's tritonserver 2.51 (tests/tritonserver_peer.py): a
new version that is broken when the poller first sees it, then completed in place. Both
servers keep serving the old version, list the new one UNAVAILABLE, and serve it once its
files are whole."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from conftest import serve
from test_fidelity import FAILING_MODEL_PY, python_model
from tritonserver_peer import TritonServer, call, tritonserver_dist


def _until(predicate, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def _row(base: str, version: str) -> dict | None:
    _, rows = call(base, "POST", "/v2/repository/index", {})
    return next((r for r in rows if r["name"] == "pm" and r["version"] == version), None)


def _versions(base: str) -> list[str] | None:
    status, meta = call(base, "GET", "/v2/models/pm")
    return meta["versions"] if status == 200 else None


def test_a_version_broken_when_polled_is_served_once_complete_as_in_triton(tmp_path: Path):
    tritonserver_dist()                                  # skips with the reason where absent
    python_model(tmp_path / "theirs", "pm", FAILING_MODEL_PY)
    shutil.copytree(tmp_path / "theirs", tmp_path / "ours")
    triton = TritonServer(tmp_path / "theirs", tmp_path / "work", control="poll",
                          extra_args=["--repository-poll-secs=1"])
    server, _ = serve(tmp_path / "ours", model_control_mode="poll", repository_poll_secs=0.2)
    bases = {"theirs": triton.url, "ours": f"127.0.0.1:{server.http_port}"}
    try:
        for side in bases:
            (tmp_path / side / "pm" / "2").mkdir()
            (tmp_path / side / "pm" / "2" / "model.py").write_text("class TritonPythonModel(")
        for side, base in bases.items():
            assert _until(lambda: (_row(base, "2") or {}).get("state") == "UNAVAILABLE"), side
            assert _row(base, "1")["state"] == "READY" and _versions(base) == ["1"], side
            assert "SyntaxError" in _row(base, "2")["reason"], (side, _row(base, "2"))
        for side in bases:
            staged = tmp_path / side / "pm" / "2" / ".model.py.partial"
            staged.write_text(FAILING_MODEL_PY.replace("x + 1", "x + 2"))
            os.replace(staged, tmp_path / side / "pm" / "2" / "model.py")
        for side, base in bases.items():
            assert _until(lambda: _versions(base) == ["2"]), (side, _row(base, "2"))
            client = httpclient.InferenceServerClient(base)
            inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
            inp.set_data_from_numpy(np.ones((1, 4), np.float32))
            np.testing.assert_allclose(client.infer("pm", [inp]).as_numpy("OUTPUT0"),
                                       np.full((1, 4), 3.0), err_msg=side)
            client.close()
    finally:
        server.close()
        triton.close()
