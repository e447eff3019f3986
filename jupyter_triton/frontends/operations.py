"""Triton's v2 operations over the engine, each rule written once for both protocols.

A codec (``frontends.dataplane`` for HTTP, ``frontends.grpc`` for gRPC) decodes its wire
form into the plain values these functions take (a model name, a version string, a dict of
typed parameters), calls one of them, and encodes what it returns (the engine's dicts,
lists and protos). A client's mistake is raised as protocol/errors.py's TritonError, which
each codec renders with its own status.

Inference is not here: both codecs call ``Engine.infer`` themselves, so that one request
crosses no more files than its data path; its one shared rule, a decoupled model refused
to a one-response call, is ``decoupled_unsupported``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from tritonclient.grpc import model_config_pb2 as mc

from ..engine import Engine
from ..engine.composition.streaming import DecoupledRefused
from ..protocol.errors import InvalidArgument, NotFound, TritonError, Unsupported
from ..protocol.v2_rules import check_model_version


# -- health and metadata ----------------------------------------------------------------------

def server_live(engine: Engine) -> bool:
    return engine.live()


def server_ready(engine: Engine) -> bool:
    return engine.ready()


def exiting(engine: Engine) -> bool:
    """Whether the server is in the drain window of a graceful stop: not ready, and, on HTTP,
    answered in tritonserver's words while it exits ("Server exiting", 503)."""
    return engine.draining


def model_ready(engine: Engine, model: str, version: str) -> bool:
    check_model_version(version)
    return engine.model_ready(model, version)


def server_metadata(engine: Engine) -> dict:
    return engine.server_metadata()


def model_metadata(engine: Engine, model: str, version: str) -> dict:
    check_model_version(version)
    return engine.model_metadata(model, version)


def model_config(engine: Engine, model: str, version: str) -> mc.ModelConfig:
    check_model_version(version)
    return engine.model_config(model, version)


def statistics(engine: Engine, model: str, version: str, history: bool = False) -> dict:
    """``history``: also one model's promotions and rollbacks, for a caller who may load
    models (they carry earlier configs and golden-set differences)."""
    check_model_version(version)
    return engine.statistics(model, version, history=history)


# -- inference -----------------------------------------------------------------------------

class DecoupledUnsupported(Unsupported):
    """Triton's TRITONSERVER_ERROR_UNSUPPORTED for a one-response call to a decoupled model:
    HTTP 501, gRPC UNIMPLEMENTED."""
    status = 501


def decoupled_unsupported(err: DecoupledRefused, end_point: str) -> DecoupledUnsupported:
    """The engine's refusal in Triton's words for this end point ("HTTP end point",
    "ModelInfer RPC")."""
    return DecoupledUnsupported(str(err).replace("inference end point", end_point, 1))


# -- model repository -----------------------------------------------------------------------

@dataclass(frozen=True)
class ParameterWords:
    """How a protocol names the type a repository parameter must have, in its refusals
    (templates over ``model`` and ``key``): the rule is one, the wire types are the codec's."""
    config: str                 # ``config``: the model configuration JSON, as text
    file: str                   # ``file:<path>``: a file's content, as bytes
    flag: str                   # ``unload_dependents``: a boolean


def repository_index(engine: Engine, ready: Any) -> list[dict]:
    if not isinstance(ready, bool):
        raise InvalidArgument("'ready' must be a boolean")
    return engine.repository_index(ready_only=ready)


async def load(engine: Engine, model: str, parameters: Mapping[str, Any],
               words: ParameterWords) -> None:
    """Triton's repository load. ``parameters``: ``config`` (None: absent) and
    ``file:<path>`` replace the model's files; every other key rides along to the engine,
    which reads its lifecycle keys (golden, promote, rollback, canary...:
    engine/lifecycle/promotion.py)."""
    config: str | None = None
    files: dict[str, bytes] = {}
    rest: dict[str, Any] = {}
    for key, value in parameters.items():
        if key == "config":
            if value is not None and not isinstance(value, str):
                raise InvalidArgument(words.config.format(model=model, key=key))
            config = value
        elif key.startswith("file:"):
            if not isinstance(value, bytes):
                raise InvalidArgument(words.file.format(model=model, key=key))
            files[key] = value
        else:
            rest[key] = value
    await engine.load_model(model, config=config, files=files or None, parameters=rest)


async def unload(engine: Engine, model: str, parameters: Mapping[str, Any],
                 words: ParameterWords) -> None:
    """Triton's repository unload; ``unload_dependents`` unloads an ensemble's composing
    models too."""
    dependents = parameters.get("unload_dependents", False)
    if not isinstance(dependents, bool):
        raise InvalidArgument(words.flag.format(model=model, key="unload_dependents"))
    await engine.unload_model(model, unload_dependents=dependents)


# -- shared memory: the engine's regions (engine/shared_memory.py) -------------------------

def shm_status(engine: Engine, region: str) -> list[dict]:
    return engine.shared_memory.status(region)


def shm_register(engine: Engine, region: str, key: Any, offset: Any, byte_size: Any) -> None:
    engine.shared_memory.register(region, key, offset, byte_size)


def shm_unregister(engine: Engine, region: str) -> None:
    engine.shared_memory.unregister(region)


def cuda_shm_status(engine: Engine, region: str) -> list[dict]:
    return engine.shared_memory.cuda_status(region)


def cuda_shm_register(engine: Engine, region: str) -> None:
    engine.shared_memory.cuda_register(region)


def cuda_shm_unregister(engine: Engine, region: str) -> None:
    engine.shared_memory.cuda_unregister(region)


# -- trace and logging extensions ----------------------------------------------------------
# The trace state lives in the engine (``engine.tracing``), and so do the log settings
# (``engine.server_log``: engine/observation/server_log.py).

def _known_model(engine: Engine, model: str) -> None:
    """Triton's refusal of a trace setting for a model it does not know (2.51: 400)."""
    try:
        engine.model_metadata(model)
    except NotFound:
        raise InvalidArgument(f"Request for unknown model : {model}") from None
    except TritonError:
        pass                    # known, only not ready: its settings may still be set


def trace_setting(engine: Engine, model: str, updates: dict | None) -> dict:
    """The trace settings of ``model`` ("": the global ones), after ``updates`` (None: a
    read)."""
    if model:
        _known_model(engine, model)
    if updates is None:
        return engine.tracing.settings(model)
    return engine.tracing.update(model, updates)


def log_settings(engine: Engine, updates: dict | None) -> dict:
    """The server's log settings, after ``updates`` (None or empty: a read)."""
    server_log = engine.server_log
    return server_log.settings() if not updates else server_log.update(updates)
