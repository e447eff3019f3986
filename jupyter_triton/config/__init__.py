"""ModelConfig (Triton's own ``model_config.proto``): parse, print, validate, normalize.

Layer note: this layer owns what a ``config.pbtxt`` may say and how it is completed (Triton's
defaults and rules, a padding spec), on Triton's own protobuf. It imports only ``protocol``
(datatypes, errors); it must not import the repository, the engine, a frontend or a backend:
those read a config, and a config does not know who reads it.
"""
from __future__ import annotations

from tritonclient.grpc import model_config_pb2 as mc

from .defaults import enable_default_batching, fill_defaults, has_scheduler
from .formats import (CONFIG_FILENAME, TEMPORARY_PARAMETER, config_from_json, config_to_json,
                      config_to_pbtxt, load_config_file, parse_config)
from .validate import validate_config

ModelConfig = mc.ModelConfig

__all__ = ["CONFIG_FILENAME", "ModelConfig", "TEMPORARY_PARAMETER", "config_from_json", "config_to_json",
           "config_to_pbtxt", "enable_default_batching", "fill_defaults", "has_scheduler",
           "load_config_file", "mc", "parse_config", "validate_config"]
