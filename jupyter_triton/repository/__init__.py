"""A Triton model repository on disk: ``<root>/<model>/config.pbtxt`` and
``<root>/<model>/<version>/<files>``.

It answers questions about the disk (which models, which versions, has anything changed)
and writes uploads as new version directories. It never deletes or overwrites what a
user stored: a replaced config.pbtxt is kept under ``<model>/.history/`` (hidden, so
Triton ignores it). Only a temporary copy (its config carries ``TEMPORARY_PARAMETER``: the
tuner's, the planner's) is deleted, when it is unloaded (``remove_temporary``). Control
modes (none / explicit / poll) belong to the engine.

An upload the engine loads is a transaction (``stage_upload`` -> ``PendingUpload``): its
versions are renamed into place so the model sees its final paths while it loads, but a
hidden journal (``<model>/.pending-load.json``) says they are not committed yet. The engine
commits after a successful load; a failed load, or a server that died mid-load (found by
``recover`` at start), sets the versions aside under ``<root>/.failed/<model>/`` with their
reason and puts the previous config.pbtxt back, so a restart serves what served before.

A version number means one set of files for good: a number once used (on disk, set aside
under ``.failed/``, named in the lifecycle history) is never handed out again
(``used_versions``, ``next_version``), so nothing keyed by a number (the response cache,
statistics, the S3 mirror, the history) can attribute one version's answers to another.
A version as loaded (its number, files and config) is its ``VersionIdentity``, minted here
(``version_identity``, repository/identity.py) and nowhere else. Numbers are Triton's: an
int64 above 0 (layout.MAX_VERSION); past the last one an upload is refused.

Layer note: this layer owns the files (the tree, versions, history, lineage, the S3 mirror of
it in ``remote``). It may import ``protocol`` and ``config``, and ``backends`` only inside
``torch_convert`` (a model.pt2 is read as the pytorch backend reads it); it must not
import the engine or a frontend: which version is served is the engine's to say.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import uuid
from datetime import datetime, timezone
from pathlib import Path
from dataclasses import dataclass, field
from typing import Mapping

from tritonclient.grpc import model_config_pb2 as mc

from ..config import (CONFIG_FILENAME, TEMPORARY_PARAMETER, config_from_json, config_to_pbtxt,
                      load_config_file, parse_config, validate_config)
from ..protocol.errors import Internal, InvalidArgument, NotFound
from . import history, identity, pins
from .identity import VersionIdentity, tree_stamp
from .layout import MAX_VERSION, check_model_name, is_hidden, is_version_dir_name
from .upload import MAX_UPLOAD_BYTES, UploadedFile, parse_upload_files

log = logging.getLogger(__name__)

HISTORY_DIR = ".history"
FAILED_DIR = ".failed"             # <root>/.failed/<model>/<stamp>-v<version>/ + REASON.txt
REMOVED_DIR = ".removed"           # <root>/.removed/<sha256 of the name>.json: a removed copy's numbers
REASON_FILENAME = "REASON.txt"
JOURNAL_FILENAME = ".pending-load.json"
MARKER_FILENAME = ".jupyter-triton-upload"    # in a version dir: the upload that wrote it
_UPLOAD_PREFIX = ".upload-"
# what recover() may sweep: only the names this server writes (staging, _write_atomic)
_STAGING_NAME = re.compile(re.escape(_UPLOAD_PREFIX) + r"[0-9a-f]{32}")
_TMP_NAME = re.compile(r"\..+\.[0-9a-f]{32}\.tmp")
_RENAME_ATTEMPTS = 100
_MAX_SET_ASIDE_LISTED = 50
INTERRUPTED = "the server stopped before this upload finished loading"


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

    def used_versions(self, name: str) -> set[int]:
        """Every version number ``name`` has used: its version directories, the versions set
        aside under ``.failed/<name>/`` and those its lifecycle history names. None of them
        is handed out again (the model directory need not exist)."""
        check_model_name(name)
        return _used_versions(self.root, name)

    def is_temporary(self, name: str) -> bool:
        """Whether ``name`` is a temporary copy: its config.pbtxt carries TEMPORARY_PARAMETER
        naming it (the tuner's and the planner's copies of a model; a user's model never does,
        even with a config read from a copy: that mark names the copy)."""
        try:
            mark = self.read_config(name).parameters.get(TEMPORARY_PARAMETER)
        except (NotFound, InvalidArgument, OSError):
            return False
        return mark is not None and mark.string_value == name

    def remove_temporary(self, name: str) -> bool:
        """Delete a temporary copy (``is_temporary``; False, and nothing touched, for any other
        model), keeping the version numbers it used under ``.removed/`` so that none is handed
        out again if the name comes back."""
        with self._write_lock:
            if not self.is_temporary(name):
                return False
            model_dir = self.model_dir(name)
            kept = self.root / REMOVED_DIR / _removed_file(name)
            _write_atomic(kept, json.dumps({"name": name,
                                            "versions": sorted(_used_versions(self.root, name))}).encode())
            trash = self.root / REMOVED_DIR / f".trash-{uuid.uuid4().hex}"
            os.rename(model_dir, trash)         # gone from the index at once, then deleted
            shutil.rmtree(trash, ignore_errors=True)
            return True

    def next_version(self, name: str) -> int:
        """The number the next upload of ``name`` gets (after every used one);
        InvalidArgument when none is left below Triton's bound."""
        return _next_versions(name, self.used_versions(name), 1)[0]

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

    def lifecycle_history(self, name: str) -> list[dict]:
        """Promotions, refusals and rollbacks of ``name``, oldest first (repository/history.py)."""
        try:
            return history.read(self.model_dir(name))
        except (NotFound, InvalidArgument):      # the caller's own lookup says why
            return []

    def record_lifecycle(self, name: str, record: dict) -> dict:
        return history.append(self.model_dir(name), record)

    def history(self, name: str) -> list[Path]:
        """Preserved earlier config.pbtxt files, oldest first."""
        history = self.model_dir(name) / HISTORY_DIR
        return sorted(history.glob("config.*.pbtxt")) if history.is_dir() else []

    def fingerprint(self, name: str) -> str:
        """A cheap stamp of the model tree (names, sizes, mtimes) for poll mode: whether to
        load the model again at all (which versions changed is their identities' to say)."""
        return tree_stamp(self.model_dir(name))

    def version_identity(self, name: str, version: int, config: mc.ModelConfig) -> VersionIdentity:
        """What version ``version`` of ``name`` is, read now, to be loaded with ``config``: the
        one place a version's identity is minted (repository/identity.py)."""
        return identity.mint(name, self.model_dir(name), version, config)

    def fingerprints(self) -> dict[str, str]:
        stamps = {}
        for name in self.model_names():
            try:
                stamps[name] = tree_stamp(self.root / name)
            except FileNotFoundError:
                continue   # removed while we looked
        return stamps

    # ---- writing -------------------------------------------------------------

    def write_upload(self, name: str, config_json: str | bytes | dict | None,
                     files: Mapping[str, object] | None) -> list[int]:
        """Persist what ``load_model(name, config=..., files=...)`` sends, committed at once.

        Each uploaded version becomes a NEW version directory: unless every uploaded version
        number is above the highest used (``used_versions``), the uploaded versions are
        renumbered, in order, to the numbers after it (so a "latest" policy serves the upload,
        and no number ever means two sets of files).
        A config naming the uploaded versions in a ``specific`` policy is rewritten to the
        new numbers. Returns the version numbers written, ascending.
        """
        pending = self.stage_upload(name, config_json, files)
        pending.commit()
        return pending.versions

    def stage_upload(self, name: str, config_json: str | bytes | dict | None,
                     files: Mapping[str, object] | None) -> "PendingUpload":
        """Write an upload as ``write_upload`` does, but uncommitted: until ``commit()``, an
        ``abort(reason)`` or a ``recover()`` after a crash takes it back out."""
        check_model_name(name)
        config = None
        if config_json is not None:
            config = config_from_json(config_json, name)
            validate_config(config, complete=False)
        uploads = parse_upload_files(name, files or {}, self.max_upload_bytes)
        if config is not None:
            if not config.name:
                config.name = name
            elif config.name != name:
                raise InvalidArgument(f"unexpected directory name '{name}' for model "
                                      f"'{config.name}', directory name must equal model name")
        with self._write_lock:
            model_dir = self.root / name
            created = not model_dir.is_dir()
            pending = PendingUpload(self, name, uuid.uuid4().hex, created=created)
            try:
                model_dir.mkdir(parents=True, exist_ok=True)
                previous = _read_if_file(model_dir / CONFIG_FILENAME)
                config_text = config_to_pbtxt(config).encode() if config is not None else None
                replaces = config_text is not None and previous != config_text
                _write_atomic(model_dir / JOURNAL_FILENAME, json.dumps({
                    "id": pending.id, "pid": os.getpid(), "created": created,
                    "replaces_config": replaces,
                    "previous_config": previous.decode("utf-8", "replace") if replaces and previous
                    is not None else None}).encode())
            except OSError as err:
                raise Internal(f"model '{name}': failed to write the upload journal: "
                               f"{err.strerror or err}") from None
            try:
                if uploads:
                    mapping = _assign_versions(name, list(uploads),
                                               _used_versions(self.root, name))
                    if config is not None:
                        _renumber_specific(config, mapping)
                    written = self._write_versions(model_dir, uploads, mapping, config, pending.id)
                    if written != mapping and config is not None:
                        # a concurrent writer took a number between our scan and our rename
                        _renumber_specific(config, {mapping[v]: written[v] for v in mapping})
                        for version in written.values():
                            _write_atomic(model_dir / str(version) / CONFIG_FILENAME,
                                          config_to_pbtxt(config).encode())
                    pending.versions = sorted(written.values())
                if config is not None:
                    self._write_config_locked(name, model_dir, config)
            except OSError as err:
                pending._abort_locked(f"writing the upload failed: {err.strerror or err}")
                raise Internal(f"model '{name}': failed to write the uploaded files: "
                               f"{err.strerror or err}") from None
            except BaseException:
                pending._abort_locked("writing the upload failed")
                raise
        return pending

    # ---- recovery and versions set aside -------------------------------------

    def recover(self) -> list[str]:
        """At start: sweep staging left by a crash and take back uploads whose load never
        finished (their journal is still there). Returns the models it changed."""
        changed = []
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        for entry in entries:
            if is_hidden(entry.name) or not entry.is_dir():
                continue
            model_dir = Path(entry.path)
            for child in os.scandir(model_dir):
                # a user's own hidden files stay
                if _STAGING_NAME.fullmatch(child.name) or _TMP_NAME.fullmatch(child.name):
                    _remove(Path(child.path))
                    changed.append(entry.name)
            journal = _read_journal(model_dir)
            if journal is None:
                continue
            pid = journal.get("pid")
            if isinstance(pid, int) and pid != os.getpid() and _alive(pid):
                continue       # another live server on this repository is loading it now
            pending = PendingUpload(self, entry.name, str(journal.get("id", "")),
                                    created=bool(journal.get("created")))
            with self._write_lock:
                pending._abort_locked(INTERRUPTED)
            log.warning("model '%s': took back an upload whose load never finished", entry.name)
            changed.append(entry.name)
        return sorted(set(changed))

    def set_aside_models(self) -> list[str]:
        """Names with versions set aside (a model whose only upload failed has no directory)."""
        try:
            return sorted(e.name for e in os.scandir(self.root / FAILED_DIR) if e.is_dir())
        except (FileNotFoundError, NotADirectoryError):
            return []

    def set_aside(self, name: str) -> list[tuple[int, str, str]]:
        """Versions whose load failed, newest first: (version, reason, where)."""
        folder = self.root / FAILED_DIR / name
        try:
            dirs = sorted((e for e in os.scandir(folder) if e.is_dir()), key=lambda e: e.name,
                          reverse=True)[:_MAX_SET_ASIDE_LISTED]
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for d in dirs:
            _, _, version = d.name.rpartition("-v")
            if not version.isdigit():
                continue
            reason = _read_if_file(Path(d.path) / REASON_FILENAME) or b""
            out.append((int(version), reason.decode("utf-8", "replace").strip(),
                        f"{FAILED_DIR}/{name}/{d.name}"))
        return out

    def prune_versions(self, name: str, keep: int, protect: set[int]) -> list[int]:
        """Retention the operator asked for: delete the oldest versions beyond the newest
        ``keep`` (never one in ``protect``, the versions being served)."""
        if keep < 1:
            return []
        versions = self.versions_on_disk(name)
        removed = []
        for version in versions[:-keep]:
            if version in protect:
                continue
            shutil.rmtree(self.root / name / str(version), ignore_errors=True)
            removed.append(version)
        return removed

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

    def pin_version(self, name: str, version: int, config: mc.ModelConfig) -> None:
        """Serve only ``version`` (a rollback, the promotion of a version on disk): ``config``
        pinned to it becomes config.pbtxt (the replaced one kept in .history/), until a load
        finds a newer version (``release_pin``; repository/pins.py)."""
        check_model_name(name)
        target = pins.pinned(config, version)
        target.name = target.name or name
        text = config_to_pbtxt(target).encode()
        with self._write_lock:
            model_dir = self.root / name
            newest = max(_used_versions(self.root, name) | {version})
            self._write_config_locked(name, model_dir, target)
            try:
                _write_atomic(model_dir / pins.PIN_FILENAME,
                              pins.record(model_dir, config, version, newest, text))
            except OSError as err:
                raise Internal(f"model '{name}': failed to write {pins.PIN_FILENAME}: "
                               f"{err.strerror or err}") from None

    def release_pin(self, name: str) -> bytes | None:
        """Before a load: when config.pbtxt is the lifecycle's pin and a version newer than
        every one used when it was pinned is on disk, config.pbtxt goes back to the policy it
        had before the pin (the pinned one kept in .history/). Returns the pinned config's
        bytes, for ``restore_config`` if the load fails; None when nothing changed."""
        with self._write_lock:
            model_dir = self.model_dir(name)
            if not (model_dir / pins.PIN_FILENAME).is_file():
                return None
            text = _read_if_file(model_dir / CONFIG_FILENAME)
            if text is None:
                return None
            try:
                config = parse_config(text.decode("utf-8", "replace"), name, CONFIG_FILENAME)
            except InvalidArgument:
                return None         # not ours: the load says what is wrong with it
            config.name = config.name or name
            unpinned = pins.released(model_dir, text, config,
                                     max(self.versions_on_disk(name), default=0))
            if unpinned is None:
                return None
            self._write_config_locked(name, model_dir, unpinned)
            log.info("model '%s': a version newer than its pin is on disk: config.pbtxt "
                     "serves by its earlier version policy again", name)
            return text

    def restore_config(self, name: str, text: bytes) -> None:
        """Put back config.pbtxt as ``text`` (what ``release_pin`` replaced), byte for byte."""
        with self._write_lock:
            self._put_config_locked(name, self.model_dir(name), text)

    def _write_config_locked(self, name: str, model_dir: Path, config: mc.ModelConfig) -> None:
        self._put_config_locked(name, model_dir, config_to_pbtxt(config).encode())

    def _put_config_locked(self, name: str, model_dir: Path, text: bytes) -> None:
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
                        mapping: dict[int, int], config: mc.ModelConfig | None,
                        upload_id: str) -> dict[int, int]:
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
                if (version_dir / MARKER_FILENAME).exists():
                    raise InvalidArgument(f"model '{model_dir.name}': file:{version}/"
                                          f"{MARKER_FILENAME} is a name the server uses itself")
                _write_file(version_dir / MARKER_FILENAME, upload_id.encode())
                _fsync_tree_dirs(version_dir)
            written: dict[int, int] = {}
            for version in uploads:
                written[version] = _claim(staging / str(mapping[version]), model_dir,
                                          mapping[version])
            _fsync_dir(model_dir)
            return written
        finally:
            shutil.rmtree(staging, ignore_errors=True)


@dataclass
class PendingUpload:
    """An upload written but not committed (see the module doc)."""
    repository: Repository
    name: str
    id: str
    versions: list[int] = field(default_factory=list)
    created: bool = False
    done: bool = False

    @property
    def model_dir(self) -> Path:
        return self.repository.root / self.name

    def commit(self) -> None:
        """The load succeeded: removing the journal is the commit point."""
        if self.done:
            return
        with self.repository._write_lock:
            _unlink(self.model_dir / JOURNAL_FILENAME)
            _fsync_dir(self.model_dir)
            for version in self.versions:
                _unlink(self.model_dir / str(version) / MARKER_FILENAME)
            self.done = True

    def abort(self, reason: str) -> list[str]:
        """The load failed: set the versions aside with ``reason`` and restore the config."""
        if self.done:
            return []
        with self.repository._write_lock:
            return self._abort_locked(reason)

    def _abort_locked(self, reason: str) -> list[str]:
        model_dir = self.model_dir
        journal = _read_journal(model_dir) or {}
        moved = []
        failed_root = self.repository.root / FAILED_DIR / self.name
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        try:
            versions = sorted(int(e.name) for e in os.scandir(model_dir)
                              if is_version_dir_name(e.name) and e.is_dir())
        except FileNotFoundError:
            versions = []
        for version in versions:
            vdir = model_dir / str(version)
            marker = _read_if_file(vdir / MARKER_FILENAME)
            if marker is None or marker.decode("utf-8", "replace") != self.id:
                continue             # not this upload's: never touched
            target = failed_root / f"{stamp}-v{version}"
            try:
                failed_root.mkdir(parents=True, exist_ok=True)
                os.rename(vdir, target)
                _unlink(target / MARKER_FILENAME)
                _write_atomic(target / REASON_FILENAME, reason.encode())
                moved.append(str(target.relative_to(self.repository.root)))
            except OSError as err:
                log.error("model '%s': could not set version %d aside: %s", self.name, version, err)
        if journal.get("replaces_config"):
            path = model_dir / CONFIG_FILENAME
            try:
                failed_config = _read_if_file(path)
                if failed_config is not None:
                    _write_atomic(_history_path(model_dir), failed_config)
                previous = journal.get("previous_config")
                if previous is None:
                    _unlink(path)
                else:
                    _write_atomic(path, previous.encode())
            except OSError as err:
                log.error("model '%s': could not restore %s: %s", self.name, CONFIG_FILENAME, err)
        _unlink(model_dir / JOURNAL_FILENAME)
        if journal.get("created", self.created):
            # a model this upload created leaves nothing behind but its history
            for leftover in (model_dir / HISTORY_DIR, model_dir):
                try:
                    if leftover.name == HISTORY_DIR:
                        for f in leftover.glob("config.*.pbtxt"):
                            failed_root.mkdir(parents=True, exist_ok=True)
                            os.replace(f, failed_root / f"{stamp}-{f.name}")
                    os.rmdir(leftover)
                except OSError:
                    pass
        _fsync_dir(model_dir) if model_dir.exists() else None
        self.done = True
        return moved


# ---- helpers -----------------------------------------------------------------

def _read_journal(model_dir: Path) -> dict | None:
    data = _read_if_file(model_dir / JOURNAL_FILENAME)
    if data is None:
        return None
    try:
        journal = json.loads(data)
    except ValueError:
        return {}         # torn by a crash: still an uncommitted upload
    return journal if isinstance(journal, dict) else {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        _unlink(path)


def _taken_versions(model_dir: Path) -> set[int]:
    try:
        return {int(e.name) for e in os.scandir(model_dir) if is_version_dir_name(e.name)}
    except (FileNotFoundError, NotADirectoryError):
        return set()


def _used_versions(root: Path, name: str) -> set[int]:
    """Numbers on disk (any entry so named), set aside (``<stamp>-v<version>``), in history."""
    used = _taken_versions(root / name)
    try:
        for entry in os.scandir(root / FAILED_DIR / name):
            _, sep, version = entry.name.rpartition("-v")
            if sep and is_version_dir_name(version):
                used.add(int(version))
    except (FileNotFoundError, NotADirectoryError):
        pass
    return used | history.versions_named(root / name) | _removed_versions(root, name)


def _removed_file(name: str) -> str:
    # a name is up to 255 bytes: a file named after it could not take a suffix
    return hashlib.sha256(name.encode()).hexdigest() + ".json"


def _removed_versions(root: Path, name: str) -> set[int]:
    """The numbers a removed temporary copy of ``name`` used (``remove_temporary``)."""
    try:
        kept = json.loads((root / REMOVED_DIR / _removed_file(name)).read_bytes())
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return set()
    return {v for v in kept.get("versions", []) if isinstance(v, int) and not isinstance(v, bool) and v > 0}


def _next_versions(name: str, used: set[int], count: int) -> list[int]:
    start = max(used, default=0) + 1
    if start + count - 1 > MAX_VERSION:
        raise InvalidArgument(f"model '{name}' has no version number left: versions are "
                              f"numbered 1 to {MAX_VERSION} and {max(used)} is used")
    return list(range(start, start + count))


def _assign_versions(name: str, uploaded: list[int], used: set[int]) -> dict[int, int]:
    # an upload is always the newest, and never takes a number used before: one at or below
    # the highest used (on disk, freed by keep_versions, set aside) is renumbered after it
    if not used or min(uploaded) > max(used):
        return {v: v for v in uploaded}
    return dict(zip(sorted(uploaded), _next_versions(name, used, len(uploaded))))


def _renumber_specific(config: mc.ModelConfig, mapping: dict[int, int]) -> None:
    if config.HasField("version_policy") and \
            config.version_policy.WhichOneof("policy_choice") == "specific":
        versions = config.version_policy.specific.versions
        renumbered = [mapping.get(v, v) for v in versions]
        del versions[:]
        versions.extend(renumbered)


def _claim(staged: Path, model_dir: Path, version: int) -> int:
    """Rename a staged version dir to the first unused number from ``version`` on."""
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
        used = _used_versions(model_dir.parent, model_dir.name) | {version}
        version = _next_versions(model_dir.name, used, 1)[0]
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


__all__ = ["FAILED_DIR", "HISTORY_DIR", "MAX_VERSION", "PendingUpload", "Repository",
           "VersionIdentity", "check_model_name"]
