"""Model logs: pb_utils.Logger lines and a worker's stdout/stderr kept per model version
(jupyter_triton.model_logs.ModelLogs: the engine's, here an instance's own outside an engine),
and still written to the server's own output."""
from __future__ import annotations

import time

import numpy as np
import pytest

from jupyter_triton.model_logs import ModelLogs

from test_backend_python import THREAD_MODE, loaded, write_model

pytestmark = pytest.mark.timeout(120)

CHATTY_MODEL_PY = '''
import sys
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        print("chatty: loading weights")
        pb_utils.Logger.log_info("chatty: initialized")

    def execute(self, requests):
        print("chatty: executing", len(requests), "request(s)")
        print("chatty: a warning on stderr", file=sys.stderr)
        pb_utils.Logger.log_warn("chatty: careful")
        pb_utils.Logger.log_error("chatty: something failed")
        pb_utils.Logger.log_verbose("chatty: details")
        pb_utils.Logger.log("chatty: explicit level", pb_utils.LogLevel.ERROR)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([1], np.int32))])
                for _ in requests]

    def finalize(self):
        print("chatty: bye")
'''

CHATTY_CONFIG = '''
name: "{name}"
backend: "python"
input [{{ name: "X" data_type: TYPE_INT32 dims: [ 1 ] }}]
output [{{ name: "Y" data_type: TYPE_INT32 dims: [ 1 ] }}]
'''


def wait_for(predicate, seconds: float = 10.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_workers_prints_and_logger_lines_are_kept_per_model(tmp_path, capfd):
    config, files = write_model(tmp_path, "chatty_p", CHATTY_MODEL_PY, CHATTY_CONFIG.format(name="chatty_p"))
    with loaded(config, files) as backend:
        model_logs = backend.calls.logs.lines
        assert isinstance(backend.execute([{"X": np.array([1], np.int32)}])[0], dict)
        wait_for(lambda: any("a warning on stderr" in e["message"] for e in model_logs("chatty_p")))
    lines = model_logs("chatty_p", "1")
    got = [(e["source"], e["level"], e["message"]) for e in lines]
    assert ("stdout", "INFO", "chatty: loading weights") in got
    assert ("stdout", "INFO", "chatty: executing 1 request(s)") in got
    assert ("stderr", "WARNING", "chatty: a warning on stderr") in got
    for level, message in (("INFO", "chatty: initialized"), ("WARNING", "chatty: careful"),
                           ("ERROR", "chatty: something failed"), ("VERBOSE", "chatty: details"),
                           ("ERROR", "chatty: explicit level")):
        assert ("logger", level, message) in got
    assert ("stdout", "INFO", "chatty: bye") in got          # finalize's, in before unload returned
    assert all(e["instance"] == "chatty_p_0_0" and e["version"] == "1" for e in lines)
    assert [e["timestamp"] for e in lines] == sorted(e["timestamp"] for e in lines)
    out, err = capfd.readouterr()
    assert "chatty: executing 1 request(s)" in out and "chatty: bye" in out   # still the server's
    assert "chatty: a warning on stderr" in err
    assert model_logs("chatty_p", "2") == [] and model_logs("nobody") == []


def test_thread_mode_keeps_the_logger_lines(tmp_path):
    config, files = write_model(tmp_path, "chatty_t", CHATTY_MODEL_PY,
                                CHATTY_CONFIG.format(name="chatty_t") + THREAD_MODE)
    with loaded(config, files) as backend:
        backend.execute([{"X": np.array([1], np.int32)}])
    got = [(e["source"], e["level"], e["message"]) for e in backend.calls.logs.lines("chatty_t")]
    assert ("logger", "INFO", "chatty: initialized") in got
    assert ("logger", "ERROR", "chatty: something failed") in got


def test_the_ring_buffer_is_bounded_and_cuts_long_lines():
    logs = ModelLogs(max_lines=3)
    for i in range(5):
        logs.record("m", "1", "INFO", f"line {i}", "stdout", to_server_log=False)
    logs.record("m", "1", "INFO", "x" * 100_000, "stdout", to_server_log=False)
    lines = logs.lines("m")
    assert [e["message"][:6] for e in lines] == ["line 3", "line 4", "xxxxxx"]
    assert len(lines[-1]["message"]) < 9000 and "characters cut" in lines[-1]["message"]


BACKGROUND_MODEL_PY = '''
import threading, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        def later():
            time.sleep(0.3)
            pb_utils.Logger.log_warn("background: still here\\\\nsecond line")
        threading.Thread(target=later, daemon=True).start()

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([1], np.int32))])
                for _ in requests]
'''


def test_a_logger_line_from_an_idle_models_thread_arrives_at_once(tmp_path):
    config, files = write_model(tmp_path, "background", BACKGROUND_MODEL_PY,
                                CHATTY_CONFIG.format(name="background"))
    with loaded(config, files) as backend:
        model_logs = backend.calls.logs.lines
        # no batch runs: the line is not waiting for one
        wait_for(lambda: any(e["source"] == "logger" for e in model_logs("background")), 5)
        line = next(e for e in model_logs("background") if e["source"] == "logger")
        assert (line["level"], line["message"]) == ("WARNING", "background: still here\\nsecond line")
