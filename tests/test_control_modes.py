"""Model control modes none / explicit / poll, as tritonserver's --model-control-mode."""
from __future__ import annotations

import logging
import os
import shutil
import time

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import LINEAR_CONFIG, W, serve
from onnx_models import linear




def counted_polls(engine) -> list[int]:
    """From now on, one entry per repository poll ``engine`` finishes (its poller looks up
    ``poll_once`` for each poll)."""
    done: list[int] = []
    poll_once = engine.poll_once

    async def counted() -> None:
        try:
            await poll_once()
        finally:
            done.append(1)
    engine.poll_once = counted
    return done


def wait_for(predicate, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_none_mode_loads_everything_and_refuses_load(model_repo):
    server, client = serve(model_repo, model_control_mode="none")
    try:
        assert client.is_model_ready("linear") and client.is_model_ready("simple")
        with pytest.raises(InferenceServerException, match="not allowed"):
            client.unload_model("linear")
        assert client.is_model_ready("linear")
    finally:
        server.close()


def test_explicit_mode_loads_only_named_models(model_repo):
    server, client = serve(model_repo, model_control_mode="explicit", load_models=["simple"])
    try:
        assert client.is_model_ready("simple") and not client.is_model_ready("linear")
        names = {r["name"] for r in client.get_model_repository_index()}
        assert "linear" in names                      # listed, not loaded
        client.load_model("linear")
        assert client.is_model_ready("linear")
    finally:
        server.close()


def test_poll_mode_follows_the_repository(model_repo):
    server, client = serve(model_repo, model_control_mode="poll", repository_poll_secs=0.2)
    try:
        assert client.is_model_ready("linear")
        new = model_repo / "added"
        linear(W, new / "1" / "model.onnx")
        (new / "config.pbtxt").write_text(LINEAR_CONFIG.replace('"linear"', '"added"'))
        assert wait_for(lambda: client.is_model_ready("added"))
        # a new version appears (written aside and renamed in, as a polled repository must be
        # changed: the poller may otherwise see a half-written model.onnx): latest serves it
        staged = model_repo.parent / "staged-version"
        linear(2 * W, staged / "model.onnx")
        staged.rename(new / "2")
        assert wait_for(lambda: client.get_model_metadata("added")["versions"] == ["2"])
        x = np.ones((1, 16), np.float32)
        inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_allclose(client.infer("added", [inp]).as_numpy("OUTPUT0"), x @ (2 * W), rtol=1e-5)
        shutil.rmtree(new)
        assert wait_for(lambda: not client.is_model_ready("added"))
        with pytest.raises(InferenceServerException, match="not allowed"):
            client.load_model("linear")
    finally:
        server.close()


def test_poll_mode_retries_a_version_once_its_files_change(model_repo, caplog):
    """A version caught half-written fails to load and is listed UNAVAILABLE with its
    reason; while its files stay as they are it is tried again only after a back-off and
    its error is logged once (tritonserver 2.51 tries and logs at every poll); it is served
    at the first poll after they change. Nothing in the repository is moved or deleted."""
    caplog.set_level(logging.WARNING, logger="jupyter_triton.engine.lifecycle.control")

    def failures() -> int:
        return sum("failed to load model 'linear'" in r.getMessage() for r in caplog.records)

    server, client = serve(model_repo, model_control_mode="poll", repository_poll_secs=0.1)
    try:
        version = model_repo / "linear" / "2"
        version.mkdir()
        (version / "model.onnx").write_bytes(linear(2 * W)[:40])    # a copy caught midway
        assert wait_for(lambda: failures() >= 1)
        polls = counted_polls(server.engine)
        assert wait_for(lambda: len(polls) >= 10)                   # ten more polls
        assert failures() == 1
        assert client.get_model_metadata("linear")["versions"] == ["1"]    # v1 keeps serving
        [row] = [r for r in client.get_model_repository_index()
                 if r["name"] == "linear" and r["version"] == "2"]
        assert row["state"] == "UNAVAILABLE" and "could not be loaded" in row["reason"], row
        staged = version / ".model.onnx.partial"                  # hidden: not the model's
        linear(2 * W, staged)
        os.replace(staged, version / "model.onnx")
        assert wait_for(lambda: client.get_model_metadata("linear")["versions"] == ["2"])
        x = np.ones((1, 16), np.float32)
        inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_allclose(client.infer("linear", [inp]).as_numpy("OUTPUT0"), x @ (2 * W),
                                   rtol=1e-5)
        assert sorted(p.name for p in version.iterdir()) == ["model.onnx"]
        assert (model_repo / "linear" / "1" / "model.onnx").is_file()
        assert sorted(p.name for p in model_repo.iterdir()) == ["identity_int32", "linear", "simple"]
    finally:
        server.close()


NEEDS_SERVICE_PY = """
import os
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        if not os.path.exists(%r):
            raise RuntimeError("the service this model needs is down")

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() * 2)])
            for r in requests]
"""


NEEDS_CONFIG = """
name: "needs"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
parameters { key: "EXECUTION_MODE" value: { string_value: "thread" } }
"""


def test_poll_mode_tries_unchanged_files_again_after_a_back_off(model_repo, tmp_path, caplog):
    """A failure outside the model's files (here: a service it needs) heals without
    touching the repository, as with Triton's poller, which tries at every poll; here the
    tries back off (1, 2, 4, ... polls) and the error is logged once."""
    caplog.set_level(logging.WARNING, logger="jupyter_triton.engine.lifecycle.control")
    service = tmp_path / "service-is-up"
    (model_repo / "needs" / "1").mkdir(parents=True)
    (model_repo / "needs" / "1" / "model.py").write_text(NEEDS_SERVICE_PY % str(service))
    (model_repo / "needs" / "config.pbtxt").write_text(NEEDS_CONFIG)
    server, client = serve(model_repo, model_control_mode="poll", repository_poll_secs=0.05)
    try:
        polls = counted_polls(server.engine)
        assert wait_for(lambda: len(polls) >= 20, seconds=60)
        assert not client.is_model_ready("needs")
        logged = [r.getMessage() for r in caplog.records
                  if r.name == "jupyter_triton.engine.lifecycle.control" and "needs" in r.getMessage()]
        assert len(logged) == 2, logged             # its version, then the model: once each
        tries = [r for r in caplog.records if r.name == "jupyter_triton.backends.python.backend"
                 and "initialize failed" in r.getMessage()]
        # at start, then at polls 1, 2, 4, 8, 16 (at every poll: 21)
        assert 3 <= len(tries) <= 7, len(tries)
        service.touch()
        assert wait_for(lambda: client.is_model_ready("needs"))
        inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(np.ones((1, 4), np.float32))
        np.testing.assert_allclose(client.infer("needs", [inp]).as_numpy("OUTPUT0"), 2 * np.ones((1, 4)))
    finally:
        server.close()


SLOW_LOAD_PY = """
import pathlib
import time
import triton_python_backend_utils as pb_utils

ADD = %d


class TritonPythonModel:
    def initialize(self, args):
        pathlib.Path(%r).write_text("loading")
        time.sleep(1.0)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() + ADD)])
            for r in requests]
"""


def test_poll_mode_reloads_files_changed_while_they_were_loading(model_repo, tmp_path):
    """A load that read the files before they changed (a copy still going on, an edit)
    does not count the change as seen: the next poll loads the model again."""
    started = tmp_path / "initialize-started"
    staged = tmp_path / "slow"
    (staged / "1").mkdir(parents=True)
    (staged / "1" / "model.py").write_text(SLOW_LOAD_PY % (1, str(started)))
    (staged / "config.pbtxt").write_text(NEEDS_CONFIG.replace('"needs"', '"slow"'))
    server, client = serve(model_repo, model_control_mode="poll", repository_poll_secs=0.1)
    try:
        staged.rename(model_repo / "slow")
        assert wait_for(started.exists)                # model.py imported: ADD = 1 is loading
        edit = model_repo / "slow" / "1" / ".model.py.partial"
        edit.write_text(SLOW_LOAD_PY % (2, str(started)))
        os.replace(edit, model_repo / "slow" / "1" / "model.py")
        inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(np.zeros((1, 4), np.float32))

        def adds() -> float | None:
            if not client.is_model_ready("slow"):
                return None
            return float(client.infer("slow", [inp]).as_numpy("OUTPUT0")[0, 0])

        assert wait_for(lambda: adds() == 2.0), adds()
    finally:
        server.close()


CHAIN = """
name: "chain"
platform: "ensemble"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 4 ] } ]
ensemble_scheduling { step [ { model_name: "later" model_version: -1
  input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "Y" } } ] }
"""


def test_poll_mode_retries_an_ensemble_when_its_composing_model_arrives(model_repo, tmp_path):
    """An ensemble polled in before its composing model fails; it is loaded again once that
    model loads, though its own files never changed (Triton follows the dependency too)."""
    (model_repo / "chain" / "1").mkdir(parents=True)
    (model_repo / "chain" / "config.pbtxt").write_text(CHAIN)
    server, client = serve(model_repo, model_control_mode="poll", repository_poll_secs=0.1)
    try:
        assert not client.is_model_ready("chain")
        staged = tmp_path / "later"
        linear(W, staged / "1" / "model.onnx")
        (staged / "config.pbtxt").write_text(LINEAR_CONFIG.replace('"linear"', '"later"'))
        staged.rename(model_repo / "later")
        assert wait_for(lambda: client.is_model_ready("chain"))
        x = np.ones((1, 16), np.float32)
        inp = httpclient.InferInput("X", [1, 16], "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_allclose(client.infer("chain", [inp]).as_numpy("Y"), x @ W, rtol=1e-5)
    finally:
        server.close()


def test_version_policy_all(model_repo):
    linear(2 * W, model_repo / "linear" / "2" / "model.onnx")
    cfg = model_repo / "linear" / "config.pbtxt"
    cfg.write_text(cfg.read_text() + "version_policy: { all: {} }\n")
    server, client = serve(model_repo, model_control_mode="none")
    try:
        assert client.get_model_metadata("linear")["versions"] == ["1", "2"]
        x = np.ones((1, 16), np.float32)
        for version, weights in (("1", W), ("2", 2 * W)):
            inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
            inp.set_data_from_numpy(x)
            out = client.infer("linear", [inp], model_version=version).as_numpy("OUTPUT0")
            np.testing.assert_allclose(out, x @ weights, rtol=1e-5)
    finally:
        server.close()


def test_body_over_the_cap_is_refused_and_server_keeps_serving(model_repo):
    server, client = serve(model_repo, model_control_mode="none", max_input_size=64 * 1024)
    try:
        import http.client
        import json
        big = json.dumps({"inputs": [{"name": "INPUT0", "shape": [8, 16], "datatype": "FP32",
                                      "data": [0.5] * (8 * 16)}], "pad": "x" * 100_000}).encode()
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
        conn.request("POST", "/v2/models/linear/infer", body=big)
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
        assert 400 <= resp.status < 500
        assert "maximum input size" in json.loads(body)["error"]
        inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_data_from_numpy(np.ones((1, 16), np.float32))
        assert client.infer("linear", [inp]).as_numpy("OUTPUT0").shape == (1, 4)
    finally:
        server.close()
