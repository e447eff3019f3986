"""The model lifecycle as a user meets it: an upload that fails, a server killed mid-load,
two loads racing, a model that hangs, readiness, and the bounds on what a model returns.
Real servers (in-thread, and `jupyter-triton serve` in a subprocess) and tritonclient."""
from __future__ import annotations

import http.client
import json
import os
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

from conftest import LINEAR_CONFIG, W, serve
from onnx_models import linear
from ports import free_port

# A python model whose behaviour the config's parameters choose (thread mode: it loads in
# a blink): VALUE to return, files to signal/hold initialize and execute, output size, a
# failing initialize.
MODEL_PY = '''
import json, os, time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.p = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        if "STARTED" in self.p:
            open(self.p["STARTED"], "w").close()
        deadline = time.time() + 60
        while "HOLD" in self.p and os.path.exists(self.p["HOLD"]) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(float(self.p.get("INIT_SLEEP", "0")))
        if self.p.get("FAIL_INIT"):
            raise RuntimeError("initialize failed on purpose")
        self.value = float(self.p.get("VALUE", "1"))

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            if "EXECUTING" in self.p:
                open(self.p["EXECUTING"], "w").close()
                deadline = time.time() + 120
                while not os.path.exists(self.p["RELEASE"]) and time.time() < deadline:
                    time.sleep(0.05)
            n = int(self.p.get("OUT_BYTES", "0")) // 4
            y = np.zeros(n, np.float32) if n else np.full_like(x, self.value)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", y)]))
        return out
'''


def py_config(name: str, **params: object) -> str:
    params = {"EXECUTION_MODE": "thread", **{k: str(v) for k, v in params.items()}}
    return json.dumps({
        "name": name, "backend": "python", "max_batch_size": 0,
        "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
        "parameters": {k: {"string_value": v} for k, v in params.items()}})


def py_files(version: int = 1) -> dict[str, bytes]:
    return {f"file:{version}/model.py": MODEL_PY.encode()}


def infer_py(client, name: str, n: int = 3) -> np.ndarray:
    inp = httpclient.InferInput("INPUT0", [n], "FP32")
    inp.set_data_from_numpy(np.zeros(n, np.float32))
    return client.infer(name, [inp]).as_numpy("OUTPUT0")


def infer_linear(client) -> np.ndarray:
    x = np.ones((1, 16), np.float32)
    inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(x)
    return client.infer("linear", [inp]).as_numpy("OUTPUT0")


def leftovers(model_dir: Path) -> list[str]:
    """What an interrupted or failed upload may leave in a model directory."""
    return sorted(p.name for p in model_dir.iterdir()
                  if p.name.startswith((".upload-", ".pending")) or p.name.endswith(".tmp"))


def wait_for(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


# ---- nothing lost -----------------------------------------------------------------------

def test_failed_upload_is_never_what_a_restart_serves(model_repo):
    server, client = serve(model_repo, model_control_mode="explicit", load_models=["linear"])
    try:
        broken = dict(json.loads(json.dumps({"name": "linear", "backend": "onnxruntime",
                                             "max_batch_size": 2})))
        with pytest.raises(InferenceServerException) as err:
            client.load_model("linear", config=json.dumps(broken),
                              files={"file:1/model.onnx": b"not an onnx model"})
        assert err.value.status() == "400"
        np.testing.assert_allclose(infer_linear(client), np.ones((1, 16)) @ W, rtol=1e-5)
        rows = {r.get("version"): r for r in client.get_model_repository_index()
                if r["name"] == "linear"}
        assert rows["2"]["state"] == "UNAVAILABLE" and "set aside" in rows["2"]["reason"]
    finally:
        server.close()
    assert not (model_repo / "linear" / "2").exists()
    assert leftovers(model_repo / "linear") == []
    server, client = serve(model_repo, model_control_mode="explicit", load_models=["linear"])
    try:
        assert client.is_model_ready("linear")
        assert client.get_model_metadata("linear")["versions"] == ["1"]
        assert client.get_model_config("linear")["max_batch_size"] == 8   # the config came back
        np.testing.assert_allclose(infer_linear(client), np.ones((1, 16)) @ W, rtol=1e-5)
        rows = [r for r in client.get_model_repository_index() if r["name"] == "linear"]
        assert any(r["version"] == "2" and "not an onnx" not in r["reason"] and
                   "set aside" in r["reason"] for r in rows), rows
    finally:
        server.close()


def test_a_multi_version_upload_commits_all_or_nothing(model_repo):
    server, client = serve(model_repo, model_control_mode="explicit")
    try:
        config = json.dumps({"name": "pair", "backend": "onnxruntime", "max_batch_size": 8,
                             "version_policy": {"all": {}}})
        with pytest.raises(InferenceServerException, match="pair"):
            client.load_model("pair", config=config,
                              files={"file:1/model.onnx": linear(W), "file:2/model.onnx": b"junk"})
        assert not client.is_model_ready("pair")
        assert not (model_repo / "pair").exists()           # nothing of it is served later
        rows = [r for r in client.get_model_repository_index() if r["name"] == "pair"]
        assert sorted(r["version"] for r in rows) == ["1", "2"]
        assert all(r["state"] == "UNAVAILABLE" and "set aside" in r["reason"] for r in rows)
        client.load_model("pair", config=config,
                          files={"file:1/model.onnx": linear(W), "file:2/model.onnx": linear(2 * W)})
        # 1 and 2 are set aside, never handed out again
        assert client.get_model_metadata("pair")["versions"] == ["3", "4"]
    finally:
        server.close()



def test_kill_9_mid_upload_then_restart_serves_the_previous_version(model_repo, tmp_path):
    port = free_port()
    exe = Path(sys.executable).with_name("jupyter-triton")
    proc = subprocess.Popen(
        [str(exe), "serve", "--model-repository", str(model_repo), "--http-address", "127.0.0.1",
         "--http-port", str(port), "--allow-grpc", "false", "--allow-metrics", "false",
         "--model-control-mode", "explicit", "--load-model", "linear"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    hold, started = tmp_path / "hold", tmp_path / "started"
    hold.touch()
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=120)
        assert wait_for(lambda: _ready(client), 60), "jupyter-triton serve did not start"
        # a python model replaces the ONNX one; its initialize waits on `hold`: the server
        # is killed while the new version is on disk and loading
        upload = threading.Thread(target=_quietly, daemon=True, args=(
            lambda: httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=120)
            .load_model("linear", config=py_config("linear", STARTED=started, HOLD=hold),
                        files=py_files()),))
        upload.start()
        assert wait_for(started.exists, 60), "the upload's load did not start"
        assert (model_repo / "linear" / "2" / "model.py").exists()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        hold.unlink()
    # a crash while an upload was being written leaves a staging folder: swept at start
    stale = model_repo / "linear" / ".upload-0123456789abcdef0123456789abcdef" / "3"
    stale.mkdir(parents=True)
    (stale / "model.onnx").write_bytes(b"half written")
    server, client = serve(model_repo, model_control_mode="explicit", load_models=["linear"])
    try:
        assert client.get_model_metadata("linear")["versions"] == ["1"]
        assert client.get_model_config("linear")["backend"] == "onnxruntime"
        np.testing.assert_allclose(infer_linear(client), np.ones((1, 16)) @ W, rtol=1e-5)
        assert leftovers(model_repo / "linear") == []
        assert not (model_repo / "linear" / "2").exists()
        rows = [r for r in client.get_model_repository_index() if r["name"] == "linear"]
        assert any(r["version"] == "2" and "stopped before" in r["reason"] for r in rows), rows
        assert client.is_server_ready()
    finally:
        server.close()


def _ready(client) -> bool:
    try:
        return client.is_server_ready()
    except Exception:
        return False


def _quietly(fn) -> None:
    try:
        fn()
    except Exception as err:      # the server is killed under it
        print("upload ended:", err)


def test_loads_of_one_model_are_serialized(model_repo, tmp_path):
    server, client = serve(model_repo, model_control_mode="explicit")
    started = tmp_path / "slow_started"
    results: dict[str, object] = {}

    def load(tag: str, config: str, files: dict) -> None:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", network_timeout=120)
        try:
            c.load_model("race", config=config, files=files)
            results[tag] = "ok"
        except InferenceServerException as err:
            results[tag] = err

    try:
        # slow holds the model's lock; good and broken are uploaded while it loads (whichever
        # of them comes first, the broken one is set aside and good serves: only slow's
        # start is waited for)
        threads = [threading.Thread(target=load, args=args) for args in (
            ("slow", py_config("race", INIT_SLEEP=2, VALUE=5, STARTED=started), py_files()),
            ("good", py_config("race", VALUE=7), py_files()),
            ("broken", py_config("race", FAIL_INIT=1), py_files()))]
        threads[0].start()
        assert wait_for(started.exists, 60), "slow's load did not start"
        for t in threads[1:]:
            t.start()
            time.sleep(0.4)
        for t in threads:
            t.join(120)
        assert results["slow"] == "ok" and results["good"] == "ok", results
        assert isinstance(results["broken"], InferenceServerException)
        assert "failed on purpose" in results["broken"].message()
        np.testing.assert_array_equal(infer_py(client, "race"), np.full(3, 7, np.float32))
    finally:
        server.close()
    assert sorted(p.name for p in (model_repo / "race").iterdir()
                  if p.name.isdigit()) == ["1", "2"]       # the broken version is set aside


def test_keep_versions_is_off_unless_asked(model_repo):
    # the second round's uploads are 5-7: 2-4, deleted by hand, are in the history (used)
    for keep, expected in ((0, ["1", "2", "3", "4"]), (2, ["6", "7"])):
        for v in list((model_repo / "linear").iterdir()):
            if v.name.isdigit() and v.name != "1":
                import shutil
                shutil.rmtree(v)
        server, client = serve(model_repo, model_control_mode="explicit", load_models=["linear"],
                               keep_versions=keep)
        try:
            for scale in (2, 3, 4):
                client.load_model("linear", config=json.dumps(
                    {"name": "linear", "backend": "onnxruntime", "max_batch_size": 8}),
                    files={"file:1/model.onnx": linear(scale * W)})
            on_disk = sorted((p.name for p in (model_repo / "linear").iterdir() if p.name.isdigit()),
                             key=int)
            assert on_disk == expected
            np.testing.assert_allclose(infer_linear(client), np.ones((1, 16)) @ (4 * W), rtol=1e-5)
        finally:
            server.close()


def test_reload_of_unchanged_python_model_keeps_it(model_repo):
    server, client = serve(model_repo, model_control_mode="explicit")
    try:
        client.load_model("py", config=py_config("py"), files=py_files())
        infer_py(client, "py")
        # bytecode the interpreter writes next to model.py is not a change of the model
        cache = model_repo / "py" / "1" / "__pycache__"
        cache.mkdir(exist_ok=True)
        (cache / "model.cpython-311.pyc").write_bytes(b"\0" * 64)
        client.load_model("py")
        stats = client.get_inference_statistics("py")["model_stats"][0]
        assert stats["inference_count"] == 1       # the same loaded version: not restarted
    finally:
        server.close()


# ---- bounded unload and shutdown ---------------------------------------------------------

def test_a_hung_model_cannot_hold_unload_or_shutdown(model_repo, tmp_path):
    executing, release = tmp_path / "executing", tmp_path / "release"
    server, client = serve(model_repo, model_control_mode="explicit", unload_timeout_secs=1.0,
                           exit_timeout_secs=2.0)
    outcome: dict[str, object] = {}

    def call(tag: str) -> None:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", network_timeout=60)
        try:
            infer_py(c, "hung")
            outcome[tag] = "answered"
        except Exception as err:
            outcome[tag] = err

    closed = False
    try:
        client.load_model("hung", config=py_config("hung", EXECUTING=executing, RELEASE=release),
                          files=py_files())
        t = threading.Thread(target=call, args=("unload",))
        t.start()
        assert wait_for(executing.exists, 30)
        start = time.monotonic()
        client.unload_model("hung")
        assert time.monotonic() - start < 10
        t.join(10)
        assert isinstance(outcome["unload"], InferenceServerException), outcome
        assert outcome["unload"].status() == "503"
        assert "unloaded before the request finished" in outcome["unload"].message()

        executing.unlink()
        client.load_model("hung")
        t = threading.Thread(target=call, args=("stop",))
        t.start()
        assert wait_for(executing.exists, 30)
        start = time.monotonic()
        server.close(timeout=20)
        closed = True
        assert time.monotonic() - start < 10
        t.join(10)
        assert not t.is_alive() and isinstance(outcome["stop"], InferenceServerException)
        assert outcome["stop"].status() == "503"    # a Triton-shaped error, not a dropped socket
    finally:
        release.touch()                 # let the stuck threads end
        if not closed:
            server.close()


# ---- readiness -----------------------------------------------------------------------------

def test_strict_readiness_is_the_default(model_repo):
    broken = model_repo / "broken"
    (broken / "1").mkdir(parents=True)
    (broken / "1" / "model.onnx").write_bytes(b"junk")
    (broken / "config.pbtxt").write_text('name: "broken"\nbackend: "onnxruntime"\n')
    server, client = serve(model_repo, model_control_mode="none")
    try:
        assert client.is_server_live() and client.is_model_ready("linear")
        assert not client.is_server_ready()
    finally:
        server.close()
    server, client = serve(model_repo, model_control_mode="none", strict_readiness=False)
    try:
        assert client.is_server_ready()
    finally:
        server.close()
    server, client = serve(model_repo, model_control_mode="explicit", load_models=["*"])
    try:
        assert not client.is_server_ready()
        client.unload_model("broken")           # no longer asked for
        assert client.is_server_ready()
        with pytest.raises(InferenceServerException):
            client.load_model("broken")
        assert client.is_server_ready()         # a failed explicit load does not flip it
    finally:
        server.close()


# ---- bounded output -------------------------------------------------------------------------

def test_outputs_over_the_bound_fail_their_request(model_repo):
    server, client = serve(model_repo, model_control_mode="explicit", max_output_size=1 << 20)
    try:
        client.load_model("big", config=py_config("big", OUT_BYTES=4 << 20), files=py_files())
        with pytest.raises(InferenceServerException) as err:
            infer_py(client, "big")
        assert err.value.status() == "503"
        assert "larger than the server's limit of 1048576 bytes" in err.value.message()
        client.load_model("small", config=py_config("small", OUT_BYTES=4 << 10), files=py_files())
        assert infer_py(client, "small").shape == (1024,)
    finally:
        server.close()


# ---- smaller items ---------------------------------------------------------------------------

def _post(port: int, path: str, body: object) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", path, body=json.dumps(body) if not isinstance(body, str) else body,
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data or b"{}")


def test_files_named_by_a_config_stay_inside_the_model(model_repo, tmp_path):
    server, client = serve(model_repo, model_control_mode="explicit")
    try:
        cfg = json.loads(py_config("escape"))
        cfg["default_model_filename"] = "../../../outside.py"
        with pytest.raises(InferenceServerException, match="inside the model directory") as err:
            client.load_model("escape", config=json.dumps(cfg), files=py_files())
        assert err.value.status() == "400"
        # classification would answer with the lines of a file outside the model
        (tmp_path / "secret.txt").write_text("secret\n")
        model = model_repo / "labels"
        linear(W, model / "1" / "model.onnx")
        (model / "config.pbtxt").write_text(LINEAR_CONFIG.replace('"linear"', '"labels"').replace(
            'dims: [ 4 ] }', 'dims: [ 4 ] label_filename: "../../secret.txt" }'))
        with pytest.raises(InferenceServerException, match="inside the model directory") as err:
            client.load_model("labels")
        assert err.value.status() == "400"
    finally:
        server.close()


def test_malformed_control_requests_are_400s(model_repo):
    server, client = serve(model_repo, model_control_mode="explicit", load_models=["simple"])
    try:
        port = server.http_port
        nested = "[" * 100_000 + "]" * 100_000
        status, body = _post(port, "/v2/repository/models/deep/load",
                             {"parameters": {"config": nested}})
        assert status == 400 and "nested too deeply" in body["error"], body
        for name in ("a%0Ab", "a%0Db", "a%2Fb", "a%00b"):
            status, body = _post(port, f"/v2/repository/models/{name}/load",
                                 {"parameters": {"config": "{}", "file:1/model.onnx": ""}})
            assert status in (400, 404) and "error" in body, (name, status, body)
        status, body = _post(port, "/v2/repository/models/a%0Ab/load", {})
        assert status == 400 and "invalid model name" in body["error"], body
        for shape in ([0, 2 ** 62], [2 ** 62, 0], [0, 2 ** 63 - 1]):
            status, body = _post(port, "/v2/models/simple/infer", {"inputs": [
                {"name": "INPUT0", "shape": shape, "datatype": "INT32", "data": []},
                {"name": "INPUT1", "shape": shape, "datatype": "INT32", "data": []}]})
            assert status == 400 and "limit" in body["error"], (shape, body)
        assert client.is_model_ready("simple")
    finally:
        server.close()
