"""The files of a repository ``load`` request: ``{"file:<version>/<path>": bytes}``.

Everything is checked here, before anything is written: a request that breaks one rule
writes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Mapping

from ..protocol.errors import InvalidArgument
from .layout import MAX_NAME_BYTES, MAX_VERSION, fits_file_name, is_version_dir_name
from .lineage import LINEAGE_FILENAME, check as check_lineage

FILE_PREFIX = "file:"
MAX_UPLOAD_BYTES = 16 << 30
MAX_UPLOAD_FILES = 10_000
# a whole path's limit is 4096 bytes, with the repository's, model's and staging folders in front
MAX_PATH_BYTES = 1024


@dataclass(frozen=True)
class UploadedFile:
    version: int
    path: PurePosixPath      # relative to the version directory
    data: bytes | bytearray | memoryview


def parse_upload_files(model_name: str, files: Mapping[str, object],
                       max_bytes: int = MAX_UPLOAD_BYTES) -> dict[int, list[UploadedFile]]:
    """Group the uploaded files by version; InvalidArgument names the first bad key."""
    if len(files) > MAX_UPLOAD_FILES:
        raise InvalidArgument(f"model '{model_name}': load request has {len(files)} files, "
                              f"at most {MAX_UPLOAD_FILES} are accepted")
    by_version: dict[int, list[UploadedFile]] = {}
    total = 0
    for key, data in files.items():
        version, path = _parse_key(model_name, key)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"model '{model_name}': content of '{key}' must be bytes, "
                                  f"got {type(data).__name__}")
        total += len(data)
        if total > max_bytes:
            raise InvalidArgument(f"model '{model_name}': uploaded files exceed the limit of "
                                  f"{max_bytes} bytes")
        if str(path) == LINEAGE_FILENAME:
            check_lineage(model_name, version, data)
        by_version.setdefault(version, []).append(UploadedFile(version, path, data))
    for version, uploaded in by_version.items():
        _check_no_file_dir_clash(model_name, version, uploaded)
    return dict(sorted(by_version.items()))


def _parse_key(model_name: str, key: object) -> tuple[int, PurePosixPath]:
    rule = (f"model '{model_name}': invalid file parameter {key!r}: expected "
            f"'file:<version>/<relative path>' with a version from 1 to {MAX_VERSION} (no "
            f"leading zero) and a path inside the version directory")
    if not isinstance(key, str) or not key.startswith(FILE_PREFIX):
        raise InvalidArgument(rule)
    rest = key[len(FILE_PREFIX):]
    version, sep, relpath = rest.partition("/")
    if not sep or not is_version_dir_name(version):
        raise InvalidArgument(rule)
    parts = relpath.split("/")
    for part in parts:
        if part in ("", ".", "..") or "\0" in part or "\\" in part:
            raise InvalidArgument(f"{rule} (bad path component {part!r})")
        if not fits_file_name(part):
            raise InvalidArgument(f"{rule} (path component over {MAX_NAME_BYTES} bytes of "
                                  f"UTF-8, a file name's limit: {part[:32]!r}...)")
    if len(relpath.encode("utf-8")) > MAX_PATH_BYTES:
        raise InvalidArgument(f"{rule} (a path of {len(parts)} components over {MAX_PATH_BYTES} "
                              f"bytes of UTF-8)")
    return int(version), PurePosixPath(*parts)


def _check_no_file_dir_clash(model_name: str, version: int, uploaded: list[UploadedFile]) -> None:
    files = {f.path for f in uploaded}
    for f in uploaded:
        for parent in f.path.parents:
            if parent in files:
                raise InvalidArgument(
                    f"model '{model_name}': file:{version}/{parent} is uploaded both as a "
                    f"file and as the directory of file:{version}/{f.path}")
