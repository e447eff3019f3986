"""What the python backend reads from a model's config: its ``parameters`` (execution mode,
bounds, BLAS threads), where its ``model.py`` is, and the config as Triton hands it to
``initialize`` and ``auto_complete_config`` (JSON).

Bounds, as config ``parameters`` (seconds, ``string_value``; "0" means no bound)::

    parameters { key: "execute_timeout_seconds" value: { string_value: "600" } }
    parameters { key: "initialize_timeout_seconds" value: { string_value: "600" } }
    parameters { key: "finalize_timeout_seconds" value: { string_value: "5" } }

- ``execute_timeout_seconds`` (default 600): a batch whose ``execute`` has not returned by
  then fails with DeadlineExceeded (504) naming the model and the bound; the worker is
  killed and a new one started, which serves the next batch. Long enough for a slow model on
  a CPU (a large batch through a big network), short enough that a model stuck in a loop
  or a lock gives its requests back.
- ``initialize_timeout_seconds`` (default 600): for ``initialize`` (and
  ``auto_complete_config``); past it the load fails with DeadlineExceeded, or a restarted
  worker counts as one that died. Loading weights from a slow disk or network takes minutes.
- ``finalize_timeout_seconds`` (default 5): unload waits this long for ``finalize``, then
  kills the worker, so that unload and server shutdown finish even with a hung model. A
  batch still executing when unload comes is not waited for (the engine has drained its
  requests before): its worker is killed and the batch fails with Unavailable.

BLAS threads of a worker process (numpy's OpenBLAS, MKL), as a config ``parameters`` entry::

    parameters { key: "blas_thread_count" value: { string_value: "1" } }

Default (ours; Triton leaves the library's own, one thread per core): 1, unless the server's
environment sets ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``, ``GOTO_NUM_THREADS`` or
``OMP_NUM_THREADS`` (then the environment decides). OpenBLAS's pool threads spin after
every call, and the small products a dynamic batcher forms gain nothing from them: with one
thread a worker spends a fraction of the CPU per inference and serves about twice the
throughput (benchmarks/results/notes-backends.md). "0" keeps the
library's default (large products on a machine of their own); more instances
(``instance_group`` count) are the other way to use more cores. Thread mode leaves the server
process's BLAS as it is.

Timeouts need a worker to kill: in thread mode they are not enforced (a thread cannot be
stopped) and unload gives up waiting for a hung ``execute`` after ``finalize_timeout_seconds``.
"""
from __future__ import annotations

import json
from pathlib import Path

from google.protobuf import descriptor as _descriptor
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc

from ...protocol.errors import InvalidArgument
from ..base import ModelFiles

EXECUTION_MODE = "EXECUTION_MODE"
MODES = ("process", "thread")

EXECUTE_TIMEOUT = "execute_timeout_seconds"
INITIALIZE_TIMEOUT = "initialize_timeout_seconds"
FINALIZE_TIMEOUT = "finalize_timeout_seconds"
DEFAULT_TIMEOUTS = {EXECUTE_TIMEOUT: 600.0, INITIALIZE_TIMEOUT: 600.0, FINALIZE_TIMEOUT: 5.0}

BLAS_THREADS = "blas_thread_count"
DEFAULT_BLAS_THREADS = 1


def triton_config_json(config: mc.ModelConfig) -> str:
    """The config as Triton hands it to ``initialize`` and ``auto_complete_config``: every
    field present (defaults too), proto field names, 64-bit integers as JSON numbers."""
    as_dict = json_format.MessageToDict(config, preserving_proto_field_name=True,
                                        always_print_fields_with_no_presence=True)
    return json.dumps(_int64_to_int(as_dict, config.DESCRIPTOR))


_INT64_TYPES = {_descriptor.FieldDescriptor.TYPE_INT64, _descriptor.FieldDescriptor.TYPE_UINT64,
                _descriptor.FieldDescriptor.TYPE_SINT64, _descriptor.FieldDescriptor.TYPE_FIXED64,
                _descriptor.FieldDescriptor.TYPE_SFIXED64}


def _int64_to_int(value: dict, desc: _descriptor.Descriptor) -> dict:
    # json_format writes int64 as strings (JSON's numbers are doubles); Triton writes numbers,
    # and models do arithmetic on config["dims"].
    for name, item in value.items():
        field = desc.fields_by_name.get(name)
        if field is None:
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            vfield = field.message_type.fields_by_name["value"]
            for key, sub in item.items():
                if vfield.message_type is not None:
                    _int64_to_int(sub, vfield.message_type)
                elif vfield.type in _INT64_TYPES:
                    item[key] = int(sub)
        elif field.message_type is not None:
            for sub in (item if isinstance(item, list) else [item]):
                _int64_to_int(sub, field.message_type)
        elif field.type in _INT64_TYPES:
            value[name] = [int(v) for v in item] if isinstance(item, list) else int(item)
    return value


def execution_mode(config: mc.ModelConfig) -> str:
    param = config.parameters.get(EXECUTION_MODE)
    mode = (param.string_value if param is not None else "process").strip().lower() or "process"
    if mode not in MODES:
        raise InvalidArgument(
            f"model '{config.name}': parameter {EXECUTION_MODE} must be one of "
            f"{', '.join(MODES)}, got '{param.string_value}'")
    return mode


def timeout_parameter(config: mc.ModelConfig, key: str) -> float | None:
    """Seconds from config ``parameters`` (the default when absent); None means no bound."""
    param = config.parameters.get(key)
    text = param.string_value.strip() if param is not None else ""
    if not text:
        seconds = DEFAULT_TIMEOUTS[key]
    else:
        try:
            seconds = float(text)
        except ValueError:
            seconds = -1.0
        if not seconds >= 0 or seconds == float("inf"):
            raise InvalidArgument(f"model '{config.name}': parameter {key} must be a number of "
                                  f"seconds (0 for no bound), got '{param.string_value}'")
    return seconds or None


def blas_threads_parameter(config: mc.ModelConfig) -> int:
    """A worker's BLAS threads: the config's, else 1 unless the environment chose; 0 leaves
    the library's own default."""
    param = config.parameters.get(BLAS_THREADS)
    text = param.string_value.strip() if param is not None else ""
    if not text:
        from .blas import user_chose
        return 0 if user_chose() else DEFAULT_BLAS_THREADS
    try:
        count = int(text)
    except ValueError:
        count = -1
    if count < 0:
        raise InvalidArgument(f"model '{config.name}': parameter {BLAS_THREADS} must be a number of "
                              f"threads (0 for the library's default), got '{param.string_value}'")
    return count


def model_py_path(config: mc.ModelConfig, files: ModelFiles) -> Path:
    return files.version_dir / (files.default_filename or config.default_model_filename or "model.py")
