"""``TritonPythonModel.auto_complete_config``: a model's ``model.py`` fills in its own config
before it loads. The server reads ``model.py`` to see whether it defines the hook (never runs
it for that), then runs the hook in a short-lived worker process (thread mode: in the server
process, as the model itself will run), so that model.py's imports and side effects stay out
of the server.
"""
from __future__ import annotations

import ast
import logging
import select
import threading
from pathlib import Path

from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc

from ...model_logs import ModelLogs
from ...protocol.errors import DeadlineExceeded, Internal, InvalidArgument
from ..base import ModelFiles
from . import launch
from .envs import PackedEnv, packed_env
from .messages import AutoCompleted, Channel, ProtocolError
from .model_config import INITIALIZE_TIMEOUT, execution_mode, model_py_path, timeout_parameter, triton_config_json
from .stub import StubError, module_name, run_auto_complete_config
from .worker import WorkerDied, WorkerTimeout, how_it_ended, unexpected
from .worker_logs import read_output

log = logging.getLogger(__name__)


def auto_complete(config: mc.ModelConfig, files: ModelFiles) -> mc.ModelConfig:
    """The config as the model's ``auto_complete_config`` completes it; ``config`` itself
    when model.py defines none."""
    model_py = model_py_path(config, files)
    if not model_py.is_file() or not defines_auto_complete(model_py):
        return config
    module = module_name(files.model_name, str(files.version), "auto_complete_config")
    try:
        if execution_mode(config) == "thread":
            completed = run_auto_complete_config(str(model_py), module, triton_config_json(config))
        else:
            completed = auto_complete_in_worker(str(model_py), module, triton_config_json(config),
                                                timeout_parameter(config, INITIALIZE_TIMEOUT),
                                                packed_env(config, files.model_dir))
    except StubError as err:
        log.error("model '%s': auto_complete_config failed:\n%s", files.model_name, err.traceback)
        raise InvalidArgument(
            f"model '{files.model_name}': TritonPythonModel.auto_complete_config failed: "
            f"{err.message}") from None
    except WorkerDied as err:
        raise Internal(f"python worker for model '{files.model_name}' {how_it_ended(err)} "
                       "while running auto_complete_config") from None
    except WorkerTimeout as err:
        raise DeadlineExceeded(
            f"model '{files.model_name}': TritonPythonModel.auto_complete_config did not finish "
            f"within {err.seconds:g} s (parameter {INITIALIZE_TIMEOUT}); the worker was killed") from None
    try:
        return json_format.ParseDict(completed, mc.ModelConfig())
    except json_format.ParseError as err:
        raise InvalidArgument(f"model '{files.model_name}': auto_complete_config returned an "
                              f"invalid model configuration: {err}") from None


def defines_auto_complete(model_py: Path) -> bool:
    """Read, not import: the server process never runs a model's code just to find out."""
    try:
        tree = ast.parse(model_py.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return False
    return any(isinstance(node, ast.ClassDef) and node.name == "TritonPythonModel"
               and any(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                       and f.name == "auto_complete_config" for f in node.body)
               for node in tree.body)



def auto_complete_in_worker(model_py: str, module: str, config_json: str, timeout: float | None = None,
                            env: PackedEnv | None = None) -> dict:
    """Run ``auto_complete_config`` in a short-lived worker, so model.py's imports and
    side effects stay out of the server process."""
    sock, out_r, err_r, process = launch.start("auto_complete", model_py, (module, config_json),
                                               env=env)
    # no model version to keep its lines for yet: they go to the server's streams only
    output = threading.Thread(target=read_output,
                              args=(ModelLogs(max_lines=0), "auto_complete", "", "", out_r, err_r),
                              daemon=True, name="triton-python-output-auto-complete")
    output.start()
    chan = Channel(sock.fileno())
    try:
        ready = select.poll()
        ready.register(sock.fileno(), select.POLLIN)
        if not ready.poll(None if timeout is None else int(timeout * 1000) + 1):
            process.kill()
            raise WorkerTimeout("auto_complete_config", timeout or 0)
        try:
            msg = chan.recv()
        except (EOFError, OSError):
            process.join(5)
            raise WorkerDied(process.exitcode) from None
        except ProtocolError as err:
            process.kill()
            process.join(5)
            raise WorkerDied(process.exitcode, str(err)) from None
        if type(msg) is not AutoCompleted:
            raise unexpected(msg)
        return msg.config
    finally:
        sock.close()
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join(2)
        output.join(2)
