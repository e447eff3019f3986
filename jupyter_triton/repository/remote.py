"""A model repository in object storage (``--model-repository s3://...``), served from a local
cache that this module keeps in sync; the engine only ever reads a local directory.

Triton's syntax: ``s3://bucket/path`` (AWS), ``s3://host:port/bucket/path`` (any S3 API,
over HTTP), ``s3://https://host:port/bucket/path``. Credentials and region come from the
environment as Triton reads them (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_DEFAULT_REGION``, ``AWS_PROFILE``...); the cache directory from
``TRITON_AWS_MOUNT_DIRECTORY`` when set, as in Triton. S3 is spoken by ``s3fs``.

What one ``sync()`` does, in this order:

* **push**: a version directory that appeared in the cache and did not come from the bucket
  (an upload through the repository API writes one) is copied to the bucket under its
  number, never over an existing object: if the bucket already has that version, the
  upload stays local and a warning says why. A ``config.pbtxt`` changed locally is copied
  too, unless the bucket's changed meanwhile (then the bucket's wins).
* **pull**: what the bucket holds and the cache does not (or holds older) is downloaded into
  a hidden staging name and renamed into place, so a poll of the cache never sees half a
  version or half a model; versions the bucket no longer has are removed from the cache.
  What was downloaded before (same ETag) is not downloaded again, also after a restart on
  the same cache (the manifest is kept in the cache, hidden).

A background thread runs ``sync()`` every ``interval`` seconds: with ``--model-control-mode
poll`` the engine's poll of the cache then sees a version that appeared in the bucket; in
explicit mode a load reads what the last sync brought.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..protocol.errors import InvalidArgument, TritonError, Unavailable
from . import JOURNAL_FILENAME
from .layout import is_hidden, is_version_dir_name

log = logging.getLogger(__name__)

SCHEMES = ("s3://",)
_UNSUPPORTED = {"gs://": "Google Cloud Storage", "as://": "Azure Storage"}
# Triton's S3 path: optional scheme and host:port, then bucket and key prefix
_S3 = re.compile(r"^s3://(?:(?P<scheme>https?)://)?(?:(?P<host>[0-9A-Za-z.\-]+):(?P<port>[0-9]{1,5})/)?"
                 r"(?P<bucket>[0-9a-z.\-]{3,63})(?P<prefix>(?:/[^/]+)*)/?$")
MANIFEST = ".remote-manifest.json"
DEFAULT_INTERVAL = 2.0


def is_remote(location: str | os.PathLike) -> bool:
    text = str(location)
    return text.startswith(SCHEMES) or text.startswith(tuple(_UNSUPPORTED))


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str                        # key prefix without slashes at either end ("" = bucket root)
    endpoint_url: str | None = None    # None: AWS

    @classmethod
    def parse(cls, url: str) -> "S3Location":
        for scheme, what in _UNSUPPORTED.items():
            if url.startswith(scheme):
                raise InvalidArgument(f"model repository {url}: {what} repositories are not "
                                      f"supported here (only s3://, any S3 API)")
        m = _S3.match(url)
        if m is None:
            raise InvalidArgument(
                f"model repository {url!r} is not an S3 path: expected s3://bucket/path, "
                f"s3://host:port/bucket/path or s3://https://host:port/bucket/path")
        endpoint = None
        if m["host"]:
            endpoint = f"{m['scheme'] or 'http'}://{m['host']}:{m['port']}"
        elif m["scheme"]:
            raise InvalidArgument(f"model repository {url!r}: an http(s):// endpoint needs host:port")
        return cls(m["bucket"], m["prefix"].strip("/"), endpoint)

    @property
    def root(self) -> str:
        return f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket


@dataclass
class SyncReport:
    pulled: list[str] = field(default_factory=list)     # relative paths downloaded
    pushed: list[str] = field(default_factory=list)     # relative paths uploaded
    removed: list[str] = field(default_factory=list)    # versions removed from the cache
    refused: list[str] = field(default_factory=list)    # local versions the bucket already has


class RemoteRepository:
    """An S3 model repository mirrored in ``path`` (a local directory the engine serves)."""

    def __init__(self, url: str, cache_dir: str | os.PathLike | None = None,
                 interval: float = DEFAULT_INTERVAL, filesystem=None) -> None:
        self.url = url
        self.location = S3Location.parse(url)
        self.interval = interval
        cache = cache_dir or os.environ.get("TRITON_AWS_MOUNT_DIRECTORY")
        self.path = Path(cache) if cache else Path(tempfile.mkdtemp(prefix="jupyter-triton-s3-"))
        self.path.mkdir(parents=True, exist_ok=True)
        self.fs = filesystem or _s3_filesystem(self.location)
        # relative path -> {"etag": bucket's ETag, "local": [size, mtime_ns] of the cached copy}
        self._manifest: dict[str, dict] = self._read_manifest()
        self._refused: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> "RemoteRepository":
        """First sync (errors raised: a server must not start on a repository it cannot read),
        then the background thread."""
        try:
            self.sync()
        except TritonError:
            raise
        except Exception as err:      # endpoint unreachable, credentials refused, ...
            raise Unavailable(f"model repository {self.url}: {type(err).__name__}: {err}") from None
        self._thread = threading.Thread(target=self._run, name="jupyter-triton-s3-sync", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread after one last push (an upload just made is not lost)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        try:
            with self._lock:
                self._push(SyncReport())
        except Exception as err:  # the bucket went away: the uploads stay in the cache
            log.warning("model repository %s: last push failed: %s", self.url, err)

    def __enter__(self) -> "RemoteRepository":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sync()
                self.last_error = None
            except Exception as err:   # a network blip: the cache keeps serving
                if str(err) != self.last_error:
                    log.warning("model repository %s: sync failed: %s", self.url, err)
                self.last_error = str(err)

    # ---- sync ------------------------------------------------------------------------------

    def sync(self) -> SyncReport:
        report = SyncReport()
        with self._lock:
            self._push(report)
            self._pull(report)
            self._write_manifest()
        if report.pulled or report.pushed or report.removed:
            log.info("model repository %s: %d file(s) pulled, %d pushed, %d version(s) removed",
                     self.url, len(report.pulled), len(report.pushed), len(report.removed))
        return report

    def _remote_files(self) -> dict[str, dict]:
        """Every object under the repository, by path relative to it."""
        self.fs.invalidate_cache()
        root = self.location.root
        try:
            found = self.fs.find(root, detail=True)
        except FileNotFoundError:
            raise Unavailable(f"model repository {self.url}: bucket '{self.location.bucket}' "
                              f"not found") from None
        except PermissionError as err:
            raise Unavailable(f"model repository {self.url}: access denied ({err})") from None
        files = {}
        for key, info in found.items():
            if info.get("type") == "directory":
                continue
            rel = key[len(root):].lstrip("/")
            parts = PurePosixPath(rel).parts
            if len(parts) < 2 or any(is_hidden(p) for p in parts):
                continue            # a model is a folder; nothing at the root is one
            files[rel] = info
        return files

    def _pull(self, report: SyncReport) -> None:
        remote = self._remote_files()
        by_model: dict[str, dict[str, dict]] = {}
        for rel, info in remote.items():
            by_model.setdefault(PurePosixPath(rel).parts[0], {})[rel] = info
        for model, files in sorted(by_model.items()):
            if not (self.path / model).exists():
                self._pull_whole(model, files, report)
                continue
            groups: dict[str, dict[str, dict]] = {}
            for rel, info in files.items():
                parts = PurePosixPath(rel).parts
                key = parts[1] if len(parts) > 2 and is_version_dir_name(parts[1]) else ""
                groups.setdefault(key, {})[rel] = info
            # versions first, the model's own files (config.pbtxt) after them
            for version in sorted((g for g in groups if g), key=int):
                vdir = self.path / model / version
                if not vdir.exists():
                    if all(self._manifest.get(rel, {}).get("etag") == _etag(info)
                           for rel, info in groups[version].items()):
                        continue   # pulled before and deleted here (--keep-versions): stays so
                    self._pull_whole(f"{model}/{version}", groups[version], report)
                else:
                    self._pull_changed(groups[version], report)
            self._pull_changed(groups.get("", {}), report)
        self._drop_removed(remote, report)

    def _pull_whole(self, rel_dir: str, files: dict[str, dict], report: SyncReport) -> None:
        target = self.path / rel_dir
        staging = target.parent / f".{target.name}.pulling-{uuid.uuid4().hex[:8]}"
        try:
            for rel, info in files.items():
                inside = PurePosixPath(rel).relative_to(rel_dir)
                self._download(rel, info, staging / inside)
            os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        for rel, info in files.items():
            self._remember(rel, info)
            report.pulled.append(rel)

    def _pull_changed(self, files: dict[str, dict], report: SyncReport) -> None:
        for rel, info in sorted(files.items()):
            known = self._manifest.get(rel)
            if known is not None and known.get("etag") == _etag(info):
                continue
            local = self.path / rel
            if known is None and local.exists():
                continue             # made here, not pushed yet: push decides
            staged = local.parent / f".{local.name}.pulling-{uuid.uuid4().hex[:8]}"
            try:
                self._download(rel, info, staged)
                os.replace(staged, local)      # one file at a time, each whole
            finally:
                staged.unlink(missing_ok=True)
            self._remember(rel, info)
            report.pulled.append(rel)

    def _drop_removed(self, remote: dict[str, dict], report: SyncReport) -> None:
        """Versions (and models) the bucket no longer has, that came from it, leave the cache."""
        gone = [rel for rel in self._manifest if rel not in remote]
        dirs = set()
        for rel in gone:
            parts = PurePosixPath(rel).parts
            if len(parts) > 2 and is_version_dir_name(parts[1]):
                prefix = f"{parts[0]}/{parts[1]}/"
                if not any(r.startswith(prefix) for r in remote):
                    dirs.add(f"{parts[0]}/{parts[1]}")
                    continue
            (self.path / rel).unlink(missing_ok=True)
            del self._manifest[rel]
        for rel_dir in sorted(dirs):
            self._discard(self.path / rel_dir)
            for rel in [r for r in self._manifest if r.startswith(rel_dir + "/")]:
                del self._manifest[rel]
            report.removed.append(rel_dir)
        # a model the bucket no longer has at all leaves with its last files, unless it
        # holds something made here
        models = {PurePosixPath(rel).parts[0] for rel in gone}
        for model in sorted(models - {PurePosixPath(rel).parts[0] for rel in remote}):
            folder = self.path / model
            left = [p for p in folder.rglob("*") if p.is_file()
                    and not any(is_hidden(part) for part in p.relative_to(self.path).parts)]
            if folder.exists() and not left:
                self._discard(folder)
                report.removed.append(model)

    @staticmethod
    def _discard(target: Path) -> None:
        # renamed to a hidden name first: a poll never sees it half deleted
        if target.exists():
            trash = target.parent / f".{target.name}.removed-{uuid.uuid4().hex[:8]}"
            os.rename(target, trash)
            shutil.rmtree(trash, ignore_errors=True)

    def _push(self, report: SyncReport) -> None:
        remote = None
        for model_dir in sorted(p for p in self.path.iterdir() if p.is_dir() and not is_hidden(p.name)):
            if (model_dir / JOURNAL_FILENAME).exists():
                continue        # an upload whose load has not succeeded yet: it may be taken back
            for vdir in sorted(p for p in model_dir.iterdir()
                               if p.is_dir() and is_version_dir_name(p.name)):
                prefix = f"{model_dir.name}/{vdir.name}/"
                if any(rel.startswith(prefix) for rel in self._manifest):
                    continue                    # came from the bucket, or pushed before
                if remote is None:
                    remote = self._remote_files()
                if any(rel.startswith(prefix) for rel in remote):
                    report.refused.append(prefix.rstrip("/"))
                    if prefix not in self._refused:
                        self._refused.add(prefix)      # said once, not at every sync
                        log.warning("model repository %s: version %s of model '%s' was written "
                                    "here but the bucket already has that version: not "
                                    "overwritten, kept only in the cache", self.url, vdir.name,
                                    model_dir.name)
                    continue
                for local in sorted(f for f in vdir.rglob("*") if f.is_file()):
                    rel = local.relative_to(self.path).as_posix()
                    if any(is_hidden(p) for p in PurePosixPath(rel).parts):
                        continue
                    self._upload(local, rel, report)
            for local in sorted(f for f in model_dir.iterdir() if f.is_file() and not is_hidden(f.name)):
                rel = local.relative_to(self.path).as_posix()
                known = self._manifest.get(rel)
                if known is not None and known.get("local") == _stat(local):
                    continue
                if remote is None:
                    remote = self._remote_files()
                if rel in remote and (known is None or known.get("etag") != _etag(remote[rel])):
                    continue                    # changed in the bucket too: the pull brings it
                self._upload(local, rel, report)

    # ---- one file ---------------------------------------------------------------------------

    def _download(self, rel: str, info: dict, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        self.fs.get_file(f"{self.location.root}/{rel}", str(local))

    def _upload(self, local: Path, rel: str, report: SyncReport) -> None:
        key = f"{self.location.root}/{rel}"
        self.fs.put_file(str(local), key)
        self._manifest[rel] = {"etag": _etag(self.fs.info(key)), "local": _stat(local)}
        report.pushed.append(rel)

    def _remember(self, rel: str, info: dict) -> None:
        self._manifest[rel] = {"etag": _etag(info), "local": _stat(self.path / rel)}

    # ---- manifest ---------------------------------------------------------------------------

    def _read_manifest(self) -> dict[str, dict]:
        try:
            data = json.loads((self.path / MANIFEST).read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("url") != self.url:
            return {}                  # a cache of another repository: start over
        files = data.get("files")
        # only entries whose cached copy is still there as it was written
        return {rel: e for rel, e in (files or {}).items()
                if isinstance(e, dict) and _stat(self.path / rel) == e.get("local")}

    def _write_manifest(self) -> None:
        tmp = self.path / f"{MANIFEST}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"url": self.url, "files": self._manifest}))
        os.replace(tmp, self.path / MANIFEST)


def _s3_filesystem(location: S3Location):
    try:
        import s3fs
    except ImportError:
        raise Unavailable("s3:// model repositories need s3fs: pip install s3fs") from None
    client_kwargs = {"endpoint_url": location.endpoint_url} if location.endpoint_url else {}
    # bounded: a wrong endpoint fails the start in seconds, not after botocore's long retries
    config = {"connect_timeout": 5, "read_timeout": 30, "retries": {"max_attempts": 3}}
    return s3fs.S3FileSystem(client_kwargs=client_kwargs, config_kwargs=config,
                             use_listings_cache=False, skip_instance_cache=True)


def _etag(info: dict) -> str:
    return str(info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("size"))


def _stat(path: Path) -> list[int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def open_repository(location: str | os.PathLike, poll_secs: float = 15.0,
                    cache_dir: str | os.PathLike | None = None) -> RemoteRepository | None:
    """The started mirror of an ``s3://`` repository (serve its ``.path``; ``close()`` it
    after the server), or None for a local directory. Synced every ``poll_secs`` at most
    ``DEFAULT_INTERVAL``, so that in poll mode a change in the bucket is seen by the next
    poll or the one after."""
    if not is_remote(location):
        return None
    return RemoteRepository(str(location), cache_dir, interval=min(poll_secs, DEFAULT_INTERVAL)).start()
