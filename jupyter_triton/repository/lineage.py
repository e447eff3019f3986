"""A version's lineage: what a notebook served it from (kernel/lineage.py gathers it), kept
beside the version as ``<model>/<version>/.lineage.json``. Hidden, so Triton, poll mode, the S3
mirror and ``jupyter-triton export`` all skip it; it is user data (cell source, packages),
read back only on the model-repository group's route ``GET v2/models/{m}[/versions/{v}]/lineage``.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..protocol.errors import InvalidArgument

LINEAGE_FILENAME = ".lineage.json"
MAX_LINEAGE_BYTES = 1 << 20


def check(model_name: str, version: int, data: bytes | bytearray | memoryview) -> None:
    """An uploaded lineage is one JSON object of at most MAX_LINEAGE_BYTES, or InvalidArgument."""
    where = f"model '{model_name}': file:{version}/{LINEAGE_FILENAME}"
    if len(data) > MAX_LINEAGE_BYTES:
        raise InvalidArgument(f"{where} has {len(data)} bytes, a lineage is at most "
                              f"{MAX_LINEAGE_BYTES}")
    try:
        record = json.loads(bytes(data))
    except ValueError:
        raise InvalidArgument(f"{where} is not JSON") from None
    if not isinstance(record, dict):
        raise InvalidArgument(f"{where} must be a JSON object")


def read(version_dir: Path) -> dict | None:
    """The version's lineage; None when it was served without one (or it is unreadable)."""
    try:
        with open(version_dir / LINEAGE_FILENAME, "rb") as f:
            data = f.read(MAX_LINEAGE_BYTES + 1)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    if len(data) > MAX_LINEAGE_BYTES:
        return None
    try:
        record = json.loads(data)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None
