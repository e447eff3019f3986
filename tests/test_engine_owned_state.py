"""What a server's models log and count, and its log settings, are that server's own: two
servers in one process (a Jupyter server and the standalone one a kernel starts, or the
tests) each show their own model's lines on ``v2/models/<name>/logs``, their own custom
metrics on ``/metrics`` and their own ``v2/logging`` settings, even for models of the same
name."""
from __future__ import annotations

import json
import logging
import re
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from jupyter_triton.engine import EngineOptions
from jupyter_triton.standalone import start_in_thread
from server_waits import wait_until
from test_backend_python import THREAD_MODE

pytestmark = pytest.mark.timeout(180)

TALKER_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.seen = pb_utils.MetricFamily(name="talker_seen", description="Values seen",
                                          kind=pb_utils.MetricFamily.COUNTER).Metric(
                                              labels={"model": "talker"})

    def execute(self, requests):
        out = []
        for request in requests:
            x = int(pb_utils.get_input_tensor_by_name(request, "X").as_numpy().reshape(-1)[0])
            self.seen.increment(x)
            pb_utils.Logger.log_info(f"talker got {x}")
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([x], np.int32))]))
        return out
'''

TALKER_CONFIG = '''
name: "talker"
backend: "python"
input [{ name: "X" data_type: TYPE_INT32 dims: [ 1 ] }]
output [{ name: "Y" data_type: TYPE_INT32 dims: [ 1 ] }]
'''

INITIAL = {"log_file": "", "log_info": True, "log_warning": True, "log_error": True,
           "log_verbose_level": 0, "log_format": "default"}


def start(root: Path, mode: str):
    version = root / "talker" / "1"
    version.mkdir(parents=True)
    (version / "model.py").write_text(TALKER_PY)
    (root / "talker" / "config.pbtxt").write_text(TALKER_CONFIG + (THREAD_MODE if mode == "thread" else ""))
    return start_in_thread(EngineOptions(model_repository=root, model_control_mode="explicit",
                                         load_models=["talker"]),
                           host="127.0.0.1", http_port=0, metrics_port=0, grpc_port=None)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def said(server) -> list[str]:
    lines = json.loads(get(f"http://127.0.0.1:{server.http_port}/v2/models/talker/logs"))["lines"]
    return [e["message"] for e in lines if e["source"] == "logger"]


def seen(server) -> list[str]:
    text = get(f"http://127.0.0.1:{server.metrics_port}/metrics")
    return re.findall(r"^talker_seen\{.*$", text, re.M)


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_two_servers_in_one_process_keep_their_models_logs_metrics_and_log_settings(tmp_path, mode):
    servers = [start(tmp_path / "a", mode), start(tmp_path / "b", mode)]
    try:
        clients = [httpclient.InferenceServerClient(f"127.0.0.1:{s.http_port}") for s in servers]
        for client, x in zip(clients, (1, 2)):
            inp = httpclient.InferInput("X", [1], "INT32")
            inp.set_data_from_numpy(np.array([x], np.int32))
            assert client.infer("talker", [inp]).as_numpy("Y").tolist() == [x]

        # a worker's logger lines arrive on their own reader thread: wait for them
        for server, x in zip(servers, (1, 2)):
            wait_until(lambda: said(server), f"server {x}'s model log line")
        assert said(servers[0]) == ["talker got 1"]
        assert said(servers[1]) == ["talker got 2"]

        assert seen(servers[0]) == ['talker_seen{model="talker"} 1']
        assert seen(servers[1]) == ['talker_seen{model="talker"} 2']

        updated = clients[0].update_log_settings({"log_info": False, "log_format": "ISO8601"})
        assert updated == {**INITIAL, "log_info": False, "log_format": "ISO8601"}
        assert clients[1].get_log_settings() == INITIAL
        assert clients[0].get_log_settings() == updated
        # Python logging is the process's: the other server's info lines still get through
        assert logging.getLogger("jupyter_triton").isEnabledFor(logging.INFO)

        # one server's unload takes its model's metrics away, not the other's
        clients[0].unload_model("talker")
        wait_until(lambda: not seen(servers[0]), "server 1's custom metrics gone after its unload")
        assert seen(servers[1]) == ['talker_seen{model="talker"} 2']
    finally:
        for server in servers:
            server.close()
