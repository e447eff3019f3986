"""Names in a Triton repository: which model names are safe, which subdirectories are versions."""
from __future__ import annotations

import re

from ..protocol.errors import InvalidArgument

# Triton ignores version directories that are not numbers or that start with a zero; a
# version is an int64 above 0 (its loader parses the name with std::stoll).
MAX_VERSION = 2**63 - 1
_VERSION_DIR = re.compile(r"[1-9][0-9]{0,18}")
# Python's bytecode cache (the python backend imports model.py from the version dir):
# not part of the model, and it must not make poll mode see a change.
IGNORED_NAMES = frozenset({"__pycache__"})
# a file name's limit (Linux, macOS), counted in bytes: 85 CJK characters are 255 UTF-8 bytes
MAX_NAME_BYTES = 255
# newlines and other control characters would forge lines in logs, metrics and headers
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def is_hidden(name: str) -> bool:
    return name.startswith(".") or name in IGNORED_NAMES


def is_version_dir_name(name: str) -> bool:
    return _VERSION_DIR.fullmatch(name) is not None and int(name) <= MAX_VERSION


def fits_file_name(name: str) -> bool:
    """Whether ``name`` is text a file name can hold: valid UTF-8 of at most MAX_NAME_BYTES."""
    try:
        return len(name.encode("utf-8")) <= MAX_NAME_BYTES
    except UnicodeEncodeError:      # a lone surrogate
        return False


def check_model_name(name: str) -> str:
    """A model name that is one directory below the repository root, or InvalidArgument."""
    if not isinstance(name, str) or not name:
        raise InvalidArgument("model name must be a non-empty string")
    bad = ("/" in name or "\\" in name or ".." in name or name.startswith(".")
           or name in IGNORED_NAMES or not fits_file_name(name) or _CONTROL.search(name))
    if bad:
        raise InvalidArgument(
            f"invalid model name {name!r}: a model name is one directory name, must not "
            f"contain '/', '\\', '..' or control characters (newline, NUL...), must not "
            f"start with '.', and is at most {MAX_NAME_BYTES} bytes of UTF-8 (a file name's "
            f"limit)")
    return name
