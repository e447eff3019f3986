"""The lifecycle history of one model: which version (and config) was served after each
promotion, refused promotion and rollback, as JSON lines in ``<model>/.lifecycle-history.jsonl``
(hidden: Triton and poll mode ignore it). Appended, never rewritten; a rollback reads it to
find what served before."""
from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

HISTORY_FILENAME = ".lifecycle-history.jsonl"
#: records a query returns (newest last); the file itself keeps everything
MAX_RECORDS = 200
#: a longer line (a pasted-in config of megabytes) is still kept, but not returned
_MAX_LINE = 1 << 20


def append(model_dir: Path, record: dict) -> dict:
    """Add ``record`` (with its UTC time) as one line; returns what was written."""
    record = {"time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"), **record}
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    # O_APPEND: one write of one line, so concurrent writers never interleave within it
    fd = os.open(model_dir / HISTORY_FILENAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)
    return record


def versions_named(model_dir: Path) -> set[int]:
    """The version numbers the (last ``MAX_RECORDS``) records name: numbers the model has
    used, which the repository never hands out again."""
    return {r[key] for r in read(model_dir) for key in _VERSION_KEYS
            if isinstance(r.get(key), int) and not isinstance(r.get(key), bool) and r[key] > 0}


_VERSION_KEYS = ("version", "previous", "served")


def read(model_dir: Path, limit: int = MAX_RECORDS) -> list[dict]:
    """The last ``limit`` records, oldest first; lines that are not JSON objects are skipped
    (a torn last line after a crash)."""
    try:
        with open(model_dir / HISTORY_FILENAME, "rb") as f:
            lines = f.read().splitlines()[-limit:]
    except (FileNotFoundError, NotADirectoryError):
        return []
    records = []
    for line in lines:
        if len(line) > _MAX_LINE:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
