"""ModelConfig in its three spellings: config.pbtxt (text), Triton's JSON, and the proto.

Parsing is protobuf's own (``text_format`` / ``json_format``); what is ours is the error
message (model, file, line, field) and Triton's JSON dialect, where 64-bit integers are
JSON numbers rather than protobuf's strings.
"""
from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from typing import Any

from google.protobuf import descriptor as _descriptor
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from ..protocol.errors import InvalidArgument

CONFIG_FILENAME = "config.pbtxt"
#: a config parameter marking a temporary copy (the tuner's ``<model>__tune``, the planner's
#: ``<model>__sim``; its value says whose): the server removes it from the repository when it
#: is unloaded (repository ``remove_temporary``)
TEMPORARY_PARAMETER = "jupyter_triton.temporary"

# Last "<field>:" or "<field> {" before the error column: the field the parser was reading.
_FIELD_BEFORE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*[:{<\[]")


def parse_config(text: str, model_name: str, path: str = CONFIG_FILENAME) -> mc.ModelConfig:
    """Parse config.pbtxt text; errors name the model, file, line/column and field."""
    config = mc.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as err:
        raise InvalidArgument(_describe_parse_error(err, text, model_name, path)) from None
    return config


def _describe_parse_error(err: text_format.ParseError, text: str, model_name: str,
                          path: str) -> str:
    line, column = err.GetLine(), err.GetColumn()
    # protobuf prefixes "line:col : " to the reason; we say it in words instead.
    reason = re.sub(r"^\d+:\d+\s*:\s*", "", str(err))
    where = f"line {line}, column {column}" if line and column else "end of file"
    field = ""
    lines = text.splitlines(keepends=True)
    if line and 0 < line <= len(lines):
        # the field name may sit on an earlier line than the bad value
        before = "".join(lines[: line - 1]) + lines[line - 1][: max(column - 1, 0)]
        names = _FIELD_BEFORE.findall(before)
        if names:
            field = f" (field '{names[-1]}')"
    return f"model '{model_name}': failed to parse {path} at {where}{field}: {reason}"


def load_config_file(model_dir: Path) -> mc.ModelConfig:
    """Read ``<model_dir>/config.pbtxt`` the way Triton does.

    No file gives an empty config named after the directory (backends auto-complete it);
    a config without a name takes the directory's; a different name is refused.
    """
    model_dir = Path(model_dir)
    dir_name = model_dir.name
    path = model_dir / CONFIG_FILENAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return mc.ModelConfig(name=dir_name)
    except UnicodeDecodeError as err:
        raise InvalidArgument(
            f"model '{dir_name}': {CONFIG_FILENAME} is not UTF-8 text ({err.reason} "
            f"at byte {err.start})") from None
    except OSError as err:
        raise InvalidArgument(f"model '{dir_name}': cannot read {CONFIG_FILENAME}: "
                              f"{err.strerror}") from None
    config = parse_config(text, dir_name, CONFIG_FILENAME)
    return _check_name(config, dir_name)


def _check_name(config: mc.ModelConfig, model_name: str) -> mc.ModelConfig:
    if not config.name:
        config.name = model_name
    elif config.name != model_name:
        raise InvalidArgument(
            f"unexpected directory name '{model_name}' for model '{config.name}', "
            f"directory name must equal model name")
    return config


def config_from_json(obj: str | bytes | dict[str, Any], model_name: str) -> mc.ModelConfig:
    """Parse Triton's JSON form of a ModelConfig (what ``load_model(config=...)`` sends).

    64-bit integers may be JSON numbers (Triton's spelling) or strings (protobuf's).
    """
    if isinstance(obj, (str, bytes)):
        try:
            obj = json.loads(obj)
        except ValueError as err:
            raise InvalidArgument(
                f"model '{model_name}': config is not valid JSON: {err}") from None
        except RecursionError:
            raise InvalidArgument(f"model '{model_name}': config JSON is nested too "
                                  f"deeply") from None
    if not isinstance(obj, dict):
        raise InvalidArgument(
            f"model '{model_name}': config must be a JSON object, got {type(obj).__name__}")
    config = mc.ModelConfig()
    try:
        json_format.ParseDict(obj, config)
    except json_format.ParseError as err:
        raise InvalidArgument(f"model '{model_name}': invalid config: {err}") from None
    except (TypeError, ValueError, AttributeError) as err:
        # ParseDict lets a few wrong-type errors escape as plain Python exceptions.
        raise InvalidArgument(f"model '{model_name}': invalid config: {err}") from None
    except RecursionError:
        raise InvalidArgument(f"model '{model_name}': config JSON is nested too deeply") from None
    return _check_name(config, model_name)


# protobuf >= 5.26 renamed including_default_value_fields; support both.
_PRINT_DEFAULTS = ("always_print_fields_with_no_presence"
                   if "always_print_fields_with_no_presence"
                   in inspect.signature(json_format.MessageToDict).parameters
                   else "including_default_value_fields")


def config_to_json(config: mc.ModelConfig) -> dict[str, Any]:
    """Triton's JSON of ``GET v2/models/{m}/config``: proto field names, enum names,
    every primitive/repeated field printed, and 64-bit integers as JSON numbers."""
    if config.ByteSize() == 0:
        return {}
    out = json_format.MessageToDict(config, preserving_proto_field_name=True,
                                    **{_PRINT_DEFAULTS: True})
    _int64_as_numbers(config.DESCRIPTOR, out)
    # fields of the tritonclient proto that Triton 2.51's ModelConfig does not have yet:
    # printed only when set, so that the JSON is what tritonserver 2.51 serves
    for parent, name in _NEWER_THAN_2_51:
        section = out.get(parent)
        if isinstance(section, dict) and not section.get(name):
            section.pop(name, None)
    return out


_NEWER_THAN_2_51 = (("ensemble_scheduling", "max_inflight_requests"),)


_INT64_TYPES = {_descriptor.FieldDescriptor.CPPTYPE_INT64, _descriptor.FieldDescriptor.CPPTYPE_UINT64}


def _int64_as_numbers(desc: _descriptor.Descriptor, obj: dict[str, Any]) -> None:
    for field in desc.fields:
        if field.name not in obj:
            continue
        value = obj[field.name]
        msg = field.message_type
        if msg is not None and msg.GetOptions().map_entry:
            value_field = msg.fields_by_name["value"]
            # map keys stay strings: JSON allows nothing else (Triton leaves them too)
            for key, item in value.items():
                if value_field.message_type is not None:
                    _int64_as_numbers(value_field.message_type, item)
                elif value_field.cpp_type in _INT64_TYPES:
                    value[key] = int(item)
        elif msg is not None:
            for item in (value if isinstance(value, list) else [value]):
                _int64_as_numbers(msg, item)
        elif field.cpp_type in _INT64_TYPES:
            obj[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)


def config_to_pbtxt(config: mc.ModelConfig) -> str:
    """config.pbtxt text, as Triton writes and reads it."""
    return text_format.MessageToString(config)
