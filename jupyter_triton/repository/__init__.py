"""A Triton model repository on disk: ``<root>/<model>/config.pbtxt`` and
``<root>/<model>/<version>/<files>``.

It answers questions about the disk (which models, which versions, has anything changed)
and writes uploads as new version directories. It never deletes or overwrites what a
user stored: a replaced config.pbtxt is kept under ``<model>/.history/`` (hidden, so
Triton ignores it). Control modes (none / explicit / poll) belong to the engine.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import threading
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Mapping

from tritonclient.grpc import model_config_pb2 as mc

from ..config import (CONFIG_FILENAME, config_from_json, config_to_pbtxt, load_config_file,
                      parse_config, validate_config)
from ..protocol.errors import Internal, InvalidArgument, NotFound
from .layout import check_model_name, is_hidden, is_version_dir_name
from .upload import MAX_UPLOAD_BYTES, UploadedFile, parse_upload_files

HISTORY_DIR = ".history"
_UPLOAD_PREFIX = ".upload-"
_RENAME_ATTEMPTS = 100


class Repository:
    """One model repository root."""

    def __init__(self, root: Path | str, max_upload_bytes: int = MAX_UPLOAD_BYTES) -> None:
        self.root = Path(root)
        self.max_upload_bytes = max_upload_bytes
        # serializes this process's writers; other processes are handled by the
        # rename-retry (a version directory name is claimed by an atomic rename)
        self._write_lock = threading.Lock()

    # ---- reading -------------------------------------------------------------

    def model_names(self) -> list[str]:
        """Every non-hidden subdirectory of the root, sorted (Triton treats each as a model)."""
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        return sorted(e.name for e in entries if not is_hidden(e.name) and e.is_dir())

    def model_dir(self, name: str) -> Path:
        check_model_name(name)
        path = self.root / name
        if not path.is_dir():
            raise NotFound(f"model '{name}' is not found in the model repository")
        return path

    def versions_on_disk(self, name: str) -> list[int]:
        """Numeric version directories, ascending (Triton ignores other names and a leading 0)."""
        model_dir = self.model_dir(name)
        return sorted(int(e.name) for e in os.scandir(model_dir)
                      if is_version_dir_name(e.name) and e.is_dir())

    def version_dir(self, name: str, version: int) -> Path:
        path = self.model_dir(name) / str(int(version))
        if not path.is_dir():
            raise NotFound(f"model '{name}' has no version {version} in the model repository")
        return path

    def select_versions(self, name: str, config: mc.ModelConfig) -> list[int]:
        """The versions ``config.version_policy`` serves, ascending (default: latest 1)."""
        on_disk = self.versions_on_disk(name)
        policy = config.version_policy
        kind = policy.WhichOneof("policy_choice") if config.HasField("version_policy") else None
        if kind == "all":
            selected = on_disk
        elif kind == "specific":
            wanted = sorted(set(policy.specific.versions))
            missing = [v for v in wanted if v not in on_disk]
            if missing:
                raise InvalidArgument(
                    f"model '{name}': version_policy specific lists version(s) {missing} that "
                    f"are not in the model repository (found: {on_disk})")
            selected = wanted
        else:
            count = max(policy.latest.num_versions, 1) if kind == "latest" else 1
            selected = on_disk[-count:]
        if not selected:
            raise InvalidArgument(f"at least one version must be available under the version "
                                  f"policy of model '{name}'")
        return selected

    def read_config(self, name: str) -> mc.ModelConfig:
        """config.pbtxt as written (empty if absent), checked by the rules that hold
        before a backend auto-completes it."""
        config = load_config_file(self.model_dir(name))
        validate_config(config, complete=False)
        return config

    def read_version_config(self, name: str, version: int) -> mc.ModelConfig | None:
        """The config an upload stored with a version (for rollback); None if it has none."""
        path = self.version_dir(name, version) / CONFIG_FILENAME
        if not path.is_file():
            return None
        config = parse_config(path.read_text(encoding="utf-8"), name,
                              f"{version}/{CONFIG_FILENAME}")
        config.name = config.name or name
        return config

    def history(self, name: str) -> list[Path]:
        """Preserved earlier config.pbtxt files, oldest first."""
        history = self.model_dir(name) / HISTORY_DIR
        return sorted(history.glob("config.*.pbtxt")) if history.is_dir() else []

    def fingerprint(self, name: str) -> str:
        """A cheap stamp of the model tree (names, sizes, mtimes) for poll mode."""
        return _fingerprint(self.model_dir(name))

    def fingerprints(self) -> dict[str, str]:
        stamps = {}
        for name in self.model_names():
            try:
                stamps[name] = _fingerprint(self.root / name)
            except FileNotFoundError:
                continue   # removed while we looked
        return stamps

    # ---- writing -------------------------------------------------------------

    def write_upload(self, name: str, config_json: str | bytes | dict | None,
                     files: Mapping[str, object] | None) -> list[int]:
        """Persist what ``load_model(name, config=..., files=...)`` sends.

        Each uploaded version becomes a NEW version directory: if any uploaded version
        number is already taken, the uploaded versions are renumbered, in order, to the
        numbers after the highest one on disk (so a "latest" policy serves the upload).
        A config naming the uploaded versions in a ``specific`` policy is rewritten to the
        new numbers. Returns the version numbers written, ascending.
        """
        check_model_name(name)
        config = None
        if config_json is not None:
            config = config_from_json(config_json, name)
            validate_config(config, complete=False)
        uploads = parse_upload_files(name, files or {}, self.max_upload_bytes)
        if not uploads:
            if config is not None:
                self.write_config(name, config)
            return []

        with self._write_lock:
            model_dir = self.root / name
            taken = _taken_versions(model_dir)
            mapping = _assign_versions(list(uploads), taken)
            if config is not None:
                _renumber_specific(config, mapping)
            try:
                model_dir.mkdir(parents=True, exist_ok=True)
                written = self._write_versions(model_dir, uploads, mapping, config)
            except OSError as err:
                raise Internal(f"model '{name}': failed to write the uploaded files: "
                               f"{err.strerror or err}") from None
            if written != mapping and config is not None:
                # a concurrent writer took a number between our scan and our rename
                _renumber_specific(config, {mapping[v]: written[v] for v in mapping})
                for version in written.values():
                    _write_atomic(model_dir / str(version) / CONFIG_FILENAME,
                                  config_to_pbtxt(config).encode())
            if config is not None:
                self._write_config_locked(name, model_dir, config)
        return sorted(written.values())

    def write_config(self, name: str, config: mc.ModelConfig) -> None:
        """Replace <model>/config.pbtxt atomically, keeping the previous one in .history/."""
        check_model_name(name)
        if not config.name:
            config.name = name
        elif config.name != name:
            raise InvalidArgument(f"unexpected directory name '{name}' for model "
                                  f"'{config.name}', directory name must equal model name")
        with self._write_lock:
            model_dir = self.root / name
            model_dir.mkdir(parents=True, exist_ok=True)
            self._write_config_locked(name, model_dir, config)

    def _write_config_locked(self, name: str, model_dir: Path, config: mc.ModelConfig) -> None:
        text = config_to_pbtxt(config).encode()
        path = model_dir / CONFIG_FILENAME
        try:
            previous = path.read_bytes() if path.is_file() else None
            if previous == text:
                return
            if previous is not None:
                _write_atomic(_history_path(model_dir), previous)
            _write_atomic(path, text)
        except OSError as err:
            raise Internal(f"model '{name}': failed to write {CONFIG_FILENAME}: "
                           f"{err.strerror or err}") from None

    def _write_versions(self, model_dir: Path, uploads: dict[int, list[UploadedFile]],
                        mapping: dict[int, int], config: mc.ModelConfig | None) -> dict[int, int]:
        """Write every version into one hidden temp dir, then rename each into place:
        a failure before the renames leaves nothing visible."""
        staging = model_dir / f"{_UPLOAD_PREFIX}{uuid.uuid4().hex}"
        staging.mkdir()
        try:
            config_text = (config_to_pbtxt(config).encode() if config is not None
                           else _read_if_file(model_dir / CONFIG_FILENAME))
            for version, uploaded in uploads.items():
                version_dir = staging / str(mapping[version])
                version_dir.mkdir()
                for item in uploaded:
                    _write_file(version_dir / item.path, item.data)
                if config_text is not None and not (version_dir / CONFIG_FILENAME).exists():
                    # the version keeps the config it was uploaded with, for rollback
                    _write_file(version_dir / CONFIG_FILENAME, config_text)
                _fsync_tree_dirs(version_dir)
            written: dict[int, int] = {}
            for version in uploads:
                written[version] = _claim(staging / str(mapping[version]), model_dir,
                                          mapping[version])
            _fsync_dir(model_dir)
            return written
        finally:
            shutil.rmtree(staging, ignore_errors=True)


# ---- helpers -----------------------------------------------------------------

def _taken_versions(model_dir: Path) -> set[int]:
    try:
        return {int(e.name) for e in os.scandir(model_dir) if is_version_dir_name(e.name)}
    except FileNotFoundError:
        return set()


def _assign_versions(uploaded: list[int], taken: set[int]) -> dict[int, int]:
    if not any(v in taken for v in uploaded):
        return {v: v for v in uploaded}
    start = max(taken) + 1
    return {v: start + i for i, v in enumerate(sorted(uploaded))}


def _renumber_specific(config: mc.ModelConfig, mapping: dict[int, int]) -> None:
    if config.HasField("version_policy") and \
            config.version_policy.WhichOneof("policy_choice") == "specific":
        versions = config.version_policy.specific.versions
        renumbered = [mapping.get(v, v) for v in versions]
        del versions[:]
        versions.extend(renumbered)


def _claim(staged: Path, model_dir: Path, version: int) -> int:
    """Rename a staged version dir to the first free number from ``version`` on."""
    for _ in range(_RENAME_ATTEMPTS):
        target = model_dir / str(version)
        # rename(2) replaces an EMPTY directory; an empty dir holds no user data, but
        # check anyway so that even that is never silently taken over
        if not os.path.lexists(target):
            try:
                os.rename(staged, target)
                return version
            except OSError as err:
                if err.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                    raise
        version = max(version, max(_taken_versions(model_dir), default=0)) + 1
    raise OSError(errno.EEXIST, f"no free version number after {_RENAME_ATTEMPTS} attempts")


def _write_file(path: Path, data: bytes | bytearray | memoryview) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        _write_file(tmp, data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)


def _history_path(model_dir: Path) -> Path:
    history = model_dir / HISTORY_DIR
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    path = history / f"config.{stamp}.pbtxt"
    n = 1
    while path.exists():
        path = history / f"config.{stamp}-{n}.pbtxt"
        n += 1
    return path


def _read_if_file(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return   # platforms without directory fds
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree_dirs(root: Path) -> None:
    for dirpath, _, _ in os.walk(root, topdown=False):
        _fsync_dir(Path(dirpath))


def _fingerprint(model_dir: Path) -> str:
    os.stat(model_dir)   # FileNotFoundError when the model went away
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(model_dir):
        # hidden entries (.history, upload staging, .ipynb_checkpoints) and
        # __pycache__ are not the model, as for Triton
        dirnames[:] = sorted(d for d in dirnames if not is_hidden(d))
        rel = os.path.relpath(dirpath, model_dir)
        for name in sorted(dirnames):
            digest.update(f"d\0{rel}/{name}\0".encode())
        for name in sorted(f for f in filenames if not is_hidden(f)):
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                try:
                    st = os.lstat(path)   # a dangling symlink is still a change
                except FileNotFoundError:
                    continue
            digest.update(f"f\0{rel}/{name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return digest.hexdigest()


__all__ = ["HISTORY_DIR", "Repository", "check_model_name"]
