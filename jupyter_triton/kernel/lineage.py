"""What a version is served from, gathered in the kernel at ``serve``/``%%serve`` time and
uploaded with the version as ``<version>/.lineage.json`` (repository/lineage.py keeps it; Triton
and ``jupyter-triton export`` skip the hidden file). Cheap: no imports beyond the standard
library, one ``git rev-parse`` with a short timeout."""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from typing import Any

from ..repository.lineage import LINEAGE_FILENAME, MAX_LINEAGE_BYTES

#: the source kept of a cell or a function; a longer one is cut (``source_truncated``)
MAX_SOURCE_CHARS = 256 << 10
GIT_TIMEOUT_S = 2.0


def packages() -> list[str]:
    """``name==version`` of every distribution this Python sees, sorted, each name once."""
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").strip()
        if name:
            found.setdefault(name.lower().replace("_", "-"), f"{name}=={dist.version}")
    return sorted(found.values(), key=str.lower)


def sha256_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


def git_commit(cwd: str | None = None) -> str | None:
    """HEAD of the git work tree the kernel runs in; None outside one (or without git)."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd or os.getcwd(),
                              capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and len(commit) in (40, 64) else None


def _shell() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def _cell(shell: Any) -> tuple[str | None, int | None]:
    """The running cell's source and execution count (None, None outside IPython)."""
    if shell is None:
        return None, None
    count = getattr(shell, "execution_count", None)
    history = getattr(getattr(shell, "history_manager", None), "input_hist_raw", None) or []
    # run_cell stores the cell (as entry number <its count>) before running it; the shell's
    # counter is the running cell's (IPython 8) or already the next one's (IPython 9)
    number = len(history) - 1
    if not isinstance(count, int) or number < 1 or number not in (count, count - 1):
        return None, None
    return history[-1] or None, number


def _function_source(obj: Any) -> str | None:
    """A function's (or class's) source; an instance's class's when the user wrote it (not a
    library's: an ONNX proto or a TorchScript module is no source of theirs)."""
    if obj is None or isinstance(obj, (str, bytes, bytearray, memoryview, os.PathLike)):
        return None
    target = obj if inspect.isroutine(obj) or inspect.isclass(obj) else type(obj)
    try:
        if target is type(obj) and any(part in ("site-packages", "dist-packages") for part in
                                       (inspect.getsourcefile(target) or "").split(os.sep)):
            return None
        return inspect.getsource(target)
    except (TypeError, OSError):
        return None


def _cut(text: str | None, record: dict) -> str | None:
    if text is not None and len(text) > MAX_SOURCE_CHARS:
        record["source_truncated"] = True
        return text[:MAX_SOURCE_CHARS]
    return text


def gather(obj: Any = None, golden_cases: list | None = None) -> dict:
    """The lineage record of a version served from ``obj`` (see the module doc)."""
    shell = _shell()
    cell, count = _cell(shell)
    listed = packages()
    record: dict[str, Any] = {
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "execution_count": count,
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "executable": sys.executable,
        "packages_hash": sha256_json(listed),
        "git_commit": git_commit(),
        "golden_hash": sha256_json(golden_cases) if golden_cases else None,
    }
    record["cell_source"] = _cut(cell, record)
    record["function_source"] = _cut(_function_source(obj), record)
    record["packages"] = listed
    return record


def lineage_file(files: dict[str, bytes], record: dict) -> dict[str, bytes]:
    """``files`` with the record as the hidden file of their version directory (the first
    key's); ``files`` unchanged when it has no version directory or the record is too large."""
    version = next((key.removeprefix("file:").split("/", 1)[0] for key in files), None)
    data = json.dumps(record, sort_keys=True).encode()
    if version is None or len(data) > MAX_LINEAGE_BYTES:
        return files
    return {**files, f"{version}/{LINEAGE_FILENAME}": data}
