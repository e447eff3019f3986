"""A model whose warmup fails does not load, and leaves no worker process behind."""
from __future__ import annotations

import time

import psutil
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from jupyter_triton.engine import EngineOptions
from jupyter_triton.standalone import start_in_thread

FAILS_ON_ZEROS = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            if not x.any():
                raise ValueError("zeros are not a valid input")
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return out
'''

CONFIG = '''
name: "picky"
backend: "python"
max_batch_size: 2
input [{ name: "X" data_type: TYPE_FP32 dims: [ 2 ] }]
output [{ name: "Y" data_type: TYPE_FP32 dims: [ 2 ] }]
model_warmup [{ name: "zeros" batch_size: 1 inputs { key: "X" value: { data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } } }]
'''


def python_workers() -> set[int]:
    """Worker processes of python models: the template's children (backends/python/launch.py
    forks each worker from one template process, so a worker's command line is the
    template's), not the template itself nor the resource tracker. Pids, not a count: an
    earlier test's worker may still be exiting."""
    found = set()
    for p in psutil.Process().children(recursive=True):
        try:
            parent = p.parent()
            if parent is not None and "boot.py template" in " ".join(parent.cmdline()) \
                    and p.status() != psutil.STATUS_ZOMBIE:
                found.add(p.pid)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue            # exited (or not yet reaped) while we looked: not a live worker
    return found


def test_failed_warmup_fails_the_load_and_frees_the_worker(tmp_path):
    root = tmp_path / "models"
    (root / "picky" / "1").mkdir(parents=True)
    (root / "picky" / "1" / "model.py").write_text(FAILS_ON_ZEROS)
    (root / "picky" / "config.pbtxt").write_text(CONFIG)
    # the same model without its failing warmup: its worker shows that workers are counted
    (root / "fine" / "1").mkdir(parents=True)
    (root / "fine" / "1" / "model.py").write_text(FAILS_ON_ZEROS)
    (root / "fine" / "config.pbtxt").write_text(
        CONFIG.split("model_warmup")[0].replace('name: "picky"', 'name: "fine"'))
    server = start_in_thread(EngineOptions(model_repository=root, model_control_mode="explicit"),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=None)
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        baseline = python_workers()
        with pytest.raises(InferenceServerException, match="zeros are not a valid input"):
            client.load_model("picky")
        assert not client.is_model_ready("picky")
        index = {r["name"]: r for r in client.get_model_repository_index()}
        assert index["picky"]["state"] == "UNAVAILABLE"
        deadline = time.monotonic() + 10
        while python_workers() - baseline and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not python_workers() - baseline, [" ".join(p.cmdline())[:200] for p in psutil.Process().children(recursive=True)]
        client.load_model("fine")
        assert len(python_workers() - baseline) == 1
    finally:
        server.close()
