"""Triton's logging extension: tritonclient's log-settings calls over HTTP and gRPC, and the
settings acting on what the server writes to its log (tritonserver's line formats)."""
from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import build_repository
from jupyter_triton.engine import EngineOptions
from jupyter_triton.engine.observation.server_log import ServerLog
from jupyter_triton.standalone import start_in_thread

pytestmark = pytest.mark.timeout(120)

INITIAL = {"log_file": "", "log_info": True, "log_warning": True, "log_error": True,
           "log_verbose_level": 0, "log_format": "default"}
DEFAULT_LINE = re.compile(r"^[VIWE]\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ [\w.]+:\d+\] ")
ISO_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ [VIWE] \d+ [\w.]+:\d+\] ")


@pytest.fixture
def server(tmp_path: Path):
    log_file = tmp_path / "server.log"
    server_log = ServerLog()
    server_log.install(log_file=str(log_file))
    server = start_in_thread(EngineOptions(model_repository=build_repository(tmp_path / "models"),
                                           model_control_mode="explicit", load_models=["*"]),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0,
                             server_log=server_log)
    server.log_file = log_file
    yield server
    server.close()
    server_log.uninstall()


def refused_request(server) -> None:
    """A request the server refuses: the data plane logs it at verbose level only."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    conn.request("POST", "/v2/models/simple/infer", b"{not json", {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    assert resp.status == 400


def log_lines(server) -> list[str]:
    server.engine.server_log.handler.flush()
    return server.log_file.read_text().splitlines()


def test_http_log_settings(server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    assert "logging" in client.get_server_metadata()["extensions"]
    expected = {**INITIAL, "log_file": str(server.log_file)}
    assert client.get_log_settings() == expected

    refused_request(server)
    assert not any("POST /v2/models/simple/infer" in line for line in log_lines(server))
    assert client.update_log_settings({"log_verbose_level": 1}) == {**expected, "log_verbose_level": 1}
    refused_request(server)
    verbose = [line for line in log_lines(server) if "POST /v2/models/simple/infer -> 400" in line]
    assert len(verbose) == 1 and DEFAULT_LINE.match(verbose[0]), verbose

    assert client.update_log_settings({"log_format": "ISO8601"})["log_format"] == "ISO8601"
    refused_request(server)
    iso = [line for line in log_lines(server) if "POST /v2/models/simple/infer -> 400" in line]
    assert len(iso) == 2 and ISO_LINE.match(iso[1]), iso

    with pytest.raises(InferenceServerException, match="log file location can not be updated"):
        client.update_log_settings({"log_file": "/tmp/elsewhere.log"})
    with pytest.raises(InferenceServerException, match="expect boolean for 'log_info'"):
        client.update_log_settings({"log_info": "yes"})
    with pytest.raises(InferenceServerException, match="log_verbose_level"):
        client.update_log_settings({"log_verbose_level": -1})
    with pytest.raises(InferenceServerException, match="log_format"):
        client.update_log_settings({"log_format": "fancy"})
    # a refused update changes nothing
    assert client.get_log_settings() == {**expected, "log_verbose_level": 1, "log_format": "ISO8601"}


def test_kinds_switched_off_are_not_written(server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    log = __import__("logging").getLogger("jupyter_triton.frontends.dataplane")
    client.update_log_settings({"log_warning": False})
    log.warning("warning while off")
    log.error("an error still on")
    client.update_log_settings({"log_warning": True, "log_error": False, "log_info": False})
    log.warning("warning back on")
    log.error("error while off")
    log.info("info while off")
    lines = log_lines(server)
    text = "\n".join(lines)
    assert "warning while off" not in text and "error while off" not in text
    assert "info while off" not in text
    assert any(line.startswith("E") and "an error still on" in line for line in lines)
    assert any(line.startswith("W") and "warning back on" in line for line in lines)


def test_grpc_log_settings(server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    expected = {**INITIAL, "log_file": str(server.log_file)}
    assert client.get_log_settings(as_json=True) == {"settings": {
        "log_file": {"string_param": expected["log_file"]}, "log_info": {"bool_param": True},
        "log_warning": {"bool_param": True}, "log_error": {"bool_param": True},
        "log_verbose_level": {"uint32_param": 0}, "log_format": {"string_param": "default"}}}
    updated = client.update_log_settings({"log_info": False, "log_verbose_level": 2}, as_json=True)
    assert updated["settings"]["log_info"] == {"bool_param": False}
    assert updated["settings"]["log_verbose_level"] == {"uint32_param": 2}
    with pytest.raises(InferenceServerException, match="log file location can not be updated"):
        client.update_log_settings({"log_file": "x.log"})
    # tritonclient picks the value's type from the setting's name: a raw request sends a
    # wrong one, which Triton refuses in these words
    wrong = grpcclient.service_pb2.LogSettingsRequest()
    wrong.settings["log_error"].uint32_param = 3
    with pytest.raises(Exception, match="expect boolean for 'log_error'"):
        client._client_stub.LogSettings(wrong)
    assert server.engine.server_log.settings() == {**expected, "log_info": False, "log_verbose_level": 2}
    client.close()


def test_cli_flags_as_tritonserver(tmp_path: Path):
    """``jupyter-triton serve --log-file ... --log-format ISO8601``: the server's own lines go to
    the file in Triton's ISO8601 format, and v2/logging reports the flags."""
    repo = build_repository(tmp_path / "models")
    log_file = tmp_path / "cli.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter_triton.cli", "serve", "--model-repository", str(repo),
         "--http-port", "0", "--grpc-port", "0", "--allow-metrics", "false",
         "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1",
         "--log-file", str(log_file), "--log-format", "ISO8601", "--log-info", "true"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        match = re.search(r"HTTP http://127\.0\.0\.1:(\d+)", line)
        assert match, line
        client = httpclient.InferenceServerClient(f"127.0.0.1:{match.group(1)}")
        assert client.get_log_settings() == {**INITIAL, "log_file": str(log_file),
                                             "log_format": "ISO8601"}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not log_file.read_text():
            time.sleep(0.1)
        lines = log_file.read_text().splitlines()
        assert lines and all(ISO_LINE.match(l) for l in lines if l and not l.startswith(" ")), lines
    finally:
        proc.terminate()
        proc.wait(timeout=30)
