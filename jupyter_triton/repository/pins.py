"""A version the lifecycle pinned: a rollback (or the promotion of a version on disk) serves
it by writing ``version_policy { specific { versions: [N] } }`` into config.pbtxt, so that a
restart, and Triton itself, serve it too. The pin stands for "serve N instead of what is
there now", not "never serve anything newer": the first load that finds a version newer
than every version used when the pin was written serves it under the policy the config had
before the pin.

The pin is remembered in ``<model>/.lifecycle-pin.json`` (hidden: Triton and poll mode ignore
it) with a digest of the config.pbtxt it wrote: a config.pbtxt that is not that one (an
upload's own config, an operator's edit) is not a pin, whatever its policy."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

PIN_FILENAME = ".lifecycle-pin.json"


def pinned(config: mc.ModelConfig, version: int) -> mc.ModelConfig:
    """``config`` serving only ``version``."""
    out = mc.ModelConfig()
    out.CopyFrom(config)
    out.version_policy.Clear()
    out.version_policy.specific.versions[:] = [version]
    return out


def record(model_dir: Path, original: mc.ModelConfig, version: int, newest: int,
           pinned_text: bytes) -> bytes:
    """The pin file's content: what to go back to, and when. ``original`` is the config the
    pin is applied to; when it is itself an earlier pin (a rollback brings back the config a
    version served with, pinned), the policy to go back to is that pin's."""
    policy = (text_format.MessageToString(original.version_policy)
              if original.HasField("version_policy") else None)
    earlier = _read(model_dir)
    if earlier is not None and list(original.version_policy.specific.versions) == \
            [earlier.get("version")]:
        policy = earlier.get("policy")
    return json.dumps({"version": version, "newest": newest, "policy": policy,
                       "config_sha256": hashlib.sha256(pinned_text).hexdigest()}).encode()


def released(model_dir: Path, config_text: bytes, config: mc.ModelConfig,
             newest_on_disk: int) -> mc.ModelConfig | None:
    """``config`` (read from ``config_text``) with the pin's policy undone when it is the pin
    this model's pin file describes and a version newer than the pin's is on disk; else None."""
    pin = _read(model_dir)
    if pin is None or pin.get("config_sha256") != hashlib.sha256(config_text).hexdigest():
        return None
    newest = pin.get("newest")
    if not isinstance(newest, int) or newest_on_disk <= newest:
        return None
    out = mc.ModelConfig()
    out.CopyFrom(config)
    out.ClearField("version_policy")
    policy = pin.get("policy")
    if isinstance(policy, str):
        try:
            text_format.Parse(policy, out.version_policy)
        except text_format.ParseError:
            out.ClearField("version_policy")
    return out


def _read(model_dir: Path) -> dict | None:
    try:
        pin = json.loads((model_dir / PIN_FILENAME).read_bytes())
    except (OSError, ValueError):
        return None
    return pin if isinstance(pin, dict) else None
