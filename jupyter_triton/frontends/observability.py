"""Triton's trace and logging extensions as the skins serve them: the JSON of
``v2[/models/{m}]/trace/setting`` and ``v2/logging``, and the gRPC ``TraceSetting`` and
``LogSettings`` messages. The state lives in the engine (``engine.tracing``) and in the
process's logging (``engine/server_log.py``: logging is per process)."""
from __future__ import annotations

from typing import Any

from tritonclient.grpc import service_pb2 as pb

from ..engine import Engine
from ..engine.observation.server_log import SERVER_LOG
from ..protocol.errors import InvalidArgument, NotFound, TritonError


def _known_model(engine: Engine, model: str) -> None:
    """Triton's refusal of a trace setting for a model it does not know (2.51: 400)."""
    try:
        engine.model_metadata(model)
    except NotFound:
        raise InvalidArgument(f"Request for unknown model : {model}") from None
    except TritonError:
        pass                    # known, only not ready: its settings may still be set


def trace_setting(engine: Engine, model: str, updates: dict | None) -> dict:
    """GET (``updates`` None) or POST of the trace settings of ``model`` ("" = global)."""
    if model:
        _known_model(engine, model)
    if updates is None:
        return engine.tracing.settings(model)
    return engine.tracing.update(model, updates)


def grpc_trace_setting(engine: Engine, request: pb.TraceSettingRequest) -> pb.TraceSettingResponse:
    updates: dict[str, Any] = {}
    for name, value in request.settings.items():
        values = list(value.value)
        # an empty value clears the setting (tritonclient sends that for None)
        updates[name] = None if not values else values if name == "trace_level" else values[0]
    settings = trace_setting(engine, request.model_name, updates if request.settings else None)
    response = pb.TraceSettingResponse()
    for name, value in settings.items():
        response.settings[name].value.extend(value if isinstance(value, list) else [value])
    return response


def log_settings(engine: Engine, updates: dict | None) -> dict:
    """GET (``updates`` None) or POST of ``v2/logging``."""
    return SERVER_LOG.settings() if not updates else SERVER_LOG.update(updates)


def grpc_log_settings(engine: Engine, request: pb.LogSettingsRequest) -> pb.LogSettingsResponse:
    updates: dict[str, Any] = {}
    for name, value in request.settings.items():
        choice = value.WhichOneof("parameter_choice")
        if choice is None:
            raise InvalidArgument(f"log setting '{name}' has no value")
        updates[name] = getattr(value, choice)
    settings = log_settings(engine, updates or None)
    response = pb.LogSettingsResponse()
    for name, value in settings.items():
        slot = response.settings[name]
        if isinstance(value, bool):
            slot.bool_param = value
        elif isinstance(value, int):
            slot.uint32_param = value
        else:
            slot.string_param = value
    return response
