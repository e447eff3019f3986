"""A model repository in object storage (``--model-repository s3://...``), served from a local
cache that this module keeps in sync; the engine only ever reads a local directory.

Triton's syntax: ``s3://bucket/path`` (AWS), ``s3://host:port/bucket/path`` (any S3 API,
over HTTP), ``s3://https://host:port/bucket/path``. Credentials and region come from the
environment as Triton reads them (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_DEFAULT_REGION``, ``AWS_PROFILE``...); the cache directory from
``TRITON_AWS_MOUNT_DIRECTORY`` when set, as in Triton. S3 is spoken by ``s3fs``.

The mirror owns only what it pulled. Its manifest (kept in the cache, hidden) records, for each
file it downloaded, the bucket's ETag and the copy's size, mtime and sha256; a version folder it
pulled, still holding exactly those files, is the only kind of local version it ever changes or
removes. A version written here (an upload through the repository API) is the server's own:
pushed to the bucket when the bucket has no version of that number, otherwise kept here and
reported as refused; never overwritten, never deleted, never mixed with the bucket's files.
What a version number may mean it asks the repository (``used_versions``), and it writes
only by renaming whole files into place: every change it makes to a version is a change of
that version's identity (repository/identity.py), which the engine then loads anew.

What one ``sync()`` does, in this order:

* **push**: a version directory written here is copied to the bucket under its number, never
  over an existing object: if the bucket already has that version, the upload stays local
  and a warning says why (a later sync pushes it once the bucket's is gone). A
  ``config.pbtxt`` changed locally is copied too, unless the bucket's changed meanwhile (then
  the bucket's wins).
* **pull**: what the bucket holds and the cache does not (or holds older, in a version this
  mirror pulled) is downloaded into a private staging folder and renamed into place, so a
  poll of the cache never sees half a version; a bucket version whose number the cache uses
  for its own is refused (reported, nothing written). Versions the bucket no longer has
  leave the cache when this mirror pulled them and they are unchanged since.
  What was downloaded before (same ETag) is not downloaded again, also after a restart on
  the same cache.

The bucket is input like any other: keys that are not a clean relative path (empty, hidden or
over-long components, a digits-only folder that is not a version, a file where another key
needs a folder), listings over ``max_objects`` keys and objects over ``max_object_bytes`` (by
default: the cache's free disk space) are refused, never written; a refused listing changes
nothing. A background thread runs ``sync()`` every ``interval`` seconds: with
``--model-control-mode poll`` the engine's poll of the cache then sees a version that appeared
in the bucket; in explicit mode a load reads what the last sync brought.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Iterator

from ..protocol.errors import InvalidArgument, TritonError, Unavailable
from . import JOURNAL_FILENAME, Repository
from .layout import check_model_name, fits_file_name, is_hidden, is_version_dir_name

log = logging.getLogger(__name__)

SCHEMES = ("s3://",)
_UNSUPPORTED = {"gs://": "Google Cloud Storage", "as://": "Azure Storage"}
# Triton's S3 path: optional scheme and host:port, then bucket and key prefix
_S3 = re.compile(r"^s3://(?:(?P<scheme>https?)://)?(?:(?P<host>[0-9A-Za-z.\-]+):(?P<port>[0-9]{1,5})/)?"
                 r"(?P<bucket>[0-9a-z.\-]{3,63})(?P<prefix>(?:/[^/]+)*)/?$")
MANIFEST = ".remote-manifest.json"
STAGING_PREFIX = ".remote-staging-"
DEFAULT_INTERVAL = 2.0
#: keys one listing may hold: more is refused (the listing's memory and time stay bounded)
MAX_OBJECTS = 50_000
#: folders below a model's (a key deeper than this is not a model file)
MAX_DEPTH = 32
#: kept free on the cache's disk when no ``max_object_bytes`` is given
DISK_RESERVE = 64 << 20
_CHUNK = 8 << 20
_USED_HERE = "number was used here (set aside, or named in the lifecycle history)"
PULLED, LOCAL = "pulled", "local"     # who wrote a cached file: this mirror, or the server


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
    refused: list[str] = field(default_factory=list)    # versions the cache and the bucket both hold, differently
    skipped: list[str] = field(default_factory=list)    # bucket keys or versions not taken (malformed, too big)


class _Refused(Exception):
    """One version or file of the bucket not taken this sync; the rest of the sync goes on."""


class Manifest:
    """What the cache holds and who wrote it: relative path -> {"etag": the bucket's ETag (None:
    no longer there), "local": [size, mtime_ns] of the cached copy, "sha256", "origin"},
    indexed by version folder (``model/version``) so that a sync stays linear in the keys."""

    def __init__(self, files: dict[str, dict]) -> None:
        self.files: dict[str, dict] = {}
        self._by_folder: dict[str, set[str]] = {}
        for rel, entry in files.items():
            self.set(rel, entry)

    def get(self, rel: str) -> dict | None:
        return self.files.get(rel)

    def set(self, rel: str, entry: dict) -> None:
        self.files[rel] = entry
        self._by_folder.setdefault(_folder_of(rel), set()).add(rel)

    def drop(self, rel: str) -> None:
        if self.files.pop(rel, None) is not None:
            folder = self._by_folder[_folder_of(rel)]
            folder.discard(rel)
            if not folder:
                del self._by_folder[_folder_of(rel)]

    def under(self, folder: str) -> dict[str, dict]:
        """The entries of one version folder (``model/version``), or of a model's own files
        (``model``)."""
        return {rel: self.files[rel] for rel in self._by_folder.get(folder, ())}


class RemoteRepository:
    """An S3 model repository mirrored in ``path`` (a local directory the engine serves)."""

    def __init__(self, url: str, cache_dir: str | os.PathLike | None = None,
                 interval: float = DEFAULT_INTERVAL, filesystem=None,
                 max_objects: int = MAX_OBJECTS, max_object_bytes: int | None = None) -> None:
        self.url = url
        self.location = S3Location.parse(url)
        self.interval = interval
        self.max_objects = max_objects
        self.max_object_bytes = max_object_bytes
        cache = cache_dir or os.environ.get("TRITON_AWS_MOUNT_DIRECTORY")
        self.path = Path(cache) if cache else Path(tempfile.mkdtemp(prefix="jupyter-triton-s3-"))
        self.path.mkdir(parents=True, exist_ok=True)
        for leftover in self.path.glob(STAGING_PREFIX + "*"):    # a sync the process never finished
            shutil.rmtree(leftover, ignore_errors=True)
        self.fs = filesystem or _s3_filesystem(self.location)
        self._manifest = Manifest(self._read_manifest())
        self._said: set[str] = set()          # refusals already logged (once each, not every sync)
        self._used: dict[str, set[int]] = {}   # each model's used version numbers, this sync
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
                self._write_manifest()
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
            try:
                self._push(report)
                self._pull(report)
            finally:
                self._write_manifest()
        if report.pulled or report.pushed or report.removed:
            log.info("model repository %s: %d file(s) pulled, %d pushed, %d version(s) removed",
                     self.url, len(report.pulled), len(report.pushed), len(report.removed))
        return report

    def _remote_files(self, report: SyncReport) -> dict[str, dict]:
        """Every object under the repository that can be a model's file, by path relative to
        it; the whole listing or an error (a listing cut short would read as deletions)."""
        self.fs.invalidate_cache()
        root = self.location.root
        try:
            found = self.fs.find(root, detail=True, max_items=self.max_objects + 1)
        except FileNotFoundError:
            raise Unavailable(f"model repository {self.url}: bucket '{self.location.bucket}' "
                              f"not found") from None
        except PermissionError as err:
            raise Unavailable(f"model repository {self.url}: access denied ({err})") from None
        if len(found) > self.max_objects:
            raise Unavailable(f"model repository {self.url}: the bucket lists more than "
                              f"{self.max_objects} objects under the repository; nothing synced")
        files, bad = {}, []
        for key, info in found.items():
            if info.get("type") == "directory":
                continue
            rel = key[len(root) + 1:] if key.startswith(root + "/") else None
            why = _bad_key(rel)
            if why == "hidden":
                continue            # staging, history, a manifest: never anyone's model
            if why:
                bad.append(f"{(rel or key)[:120]!r} ({why})")
            else:
                files[rel] = info
        # a file where other keys need a folder: neither it nor they are taken
        folders = {str(parent) for rel in files for parent in PurePosixPath(rel).parents}
        clashes = {rel for rel in files if rel in folders}
        for rel in [rel for rel in files if rel in clashes
                    or any(str(parent) in clashes for parent in PurePosixPath(rel).parents)]:
            del files[rel]
            bad.append(f"{rel[:120]!r} (a file where other keys need a folder)")
        report.skipped.extend(bad)
        new = [what for what in bad if what not in self._said]
        if new and len(self._said) < self.max_objects:
            self._said.update(new)
            log.warning("model repository %s: %d key(s) in the bucket not taken: %s%s", self.url,
                        len(new), ", ".join(new[:5]), ", ..." if len(new) > 5 else "")
        return files

    def _pull(self, report: SyncReport) -> None:
        remote = self._remote_files(report)
        self._used = {}
        by_model: dict[str, dict[str, dict[str, dict]]] = {}
        for rel, info in remote.items():
            by_model.setdefault(PurePosixPath(rel).parts[0], {}) \
                .setdefault(_folder_of(rel), {})[rel] = info
        for model, groups in sorted(by_model.items()):
            try:
                if not os.path.lexists(self.path / model):
                    self._pull_model(model, groups, report)
                    continue
                # versions first, the model's own files (config.pbtxt) after them
                for folder in sorted((f for f in groups if f != model),
                                     key=lambda f: int(f.rpartition("/")[2])):
                    self._pull_version(folder, groups[folder], report)
                self._pull_model_files(groups.get(model, {}), report)
            except (_Refused, OSError) as err:
                self._skip(f"model '{model}' ({err})", report)
        self._drop_removed(remote, report)

    def _pull_model(self, model: str, groups: dict[str, dict[str, dict]], report: SyncReport) -> None:
        """A model the cache does not have, whole (a poll never sees its config without its
        versions), but for versions whose numbers this server used (set aside, in history)."""
        used = self._used_versions(model)
        refused = [f for f in groups if f != model and int(f.rpartition("/")[2]) in used]
        for folder in refused:
            del groups[folder]
            self._refuse(folder, _USED_HERE, report)
        if not refused or any(folder != model for folder in groups):
            self._pull_new(model, {rel: info for files in groups.values()
                                   for rel, info in files.items()}, report)

    def _pull_version(self, folder: str, files: dict[str, dict], report: SyncReport) -> None:
        known = self._manifest.under(folder)
        changed = {rel: info for rel, info in files.items()
                   if (known.get(rel) or {}).get("etag") != _etag(info)}
        if not changed:
            return       # as pulled or pushed before (or pulled and deleted here: stays so)
        model, _, version = folder.partition("/")
        try:
            if not os.path.lexists(self.path / folder) and not known \
                    and int(version) in self._used_versions(model):
                self._refuse(folder, _USED_HERE, report)
            elif not os.path.lexists(self.path / folder):
                self._pull_new(folder, files, report)
            elif self._pulled_unchanged(folder, by_content=True):
                self._pull_into(changed, report)
            else:
                self._refuse(folder, "was changed here since it was pulled" if known
                             else "was written here", report)
        except (_Refused, OSError) as err:
            self._skip(f"version {folder} ({err})", report)

    def _pull_new(self, rel_dir: str, files: dict[str, dict], report: SyncReport) -> None:
        """A model or a version folder the cache does not have: downloaded whole into the
        staging folder, renamed into place only if its name is still free."""
        self._check_fits(files)
        target = self.path / rel_dir
        with self._staging() as staging:
            sums = {rel: self._download(rel, info, staging / rel) for rel, info in files.items()}
            if os.path.lexists(target):
                raise _Refused("written here meanwhile")
            target.parent.mkdir(parents=True, exist_ok=True)
            os.rename(staging / rel_dir, target)
        for rel in list(self._manifest.under(rel_dir)):
            self._manifest.drop(rel)       # what an earlier copy of this folder was
        for rel, info in files.items():
            self._remember(rel, info, sums[rel], PULLED)
            report.pulled.append(rel)

    def _pull_into(self, files: dict[str, dict], report: SyncReport) -> None:
        """Files changed in the bucket, into a folder this mirror owns: all downloaded first,
        then each renamed over its cached copy."""
        self._check_fits(files)
        with self._staging() as staging:
            sums = {rel: self._download(rel, info, staging / rel) for rel, info in files.items()}
            for rel in sorted(files):
                local = self.path / rel
                local.parent.mkdir(parents=True, exist_ok=True)
                os.replace(staging / rel, local)
                self._remember(rel, files[rel], sums[rel], PULLED)
                report.pulled.append(rel)

    def _pull_model_files(self, files: dict[str, dict], report: SyncReport) -> None:
        changed = {}
        for rel, info in files.items():
            known = self._manifest.get(rel)
            if known is not None and known.get("etag") == _etag(info):
                continue
            if known is None and os.path.lexists(self.path / rel):
                continue             # made here, not pushed yet: push decides
            changed[rel] = info
        if changed:
            self._pull_into(changed, report)

    def _drop_removed(self, remote: dict[str, dict], report: SyncReport) -> None:
        """What the bucket no longer has leaves the cache when this mirror pulled it and it
        is unchanged here; the server's own stays, and is not pushed again."""
        gone: dict[str, list[str]] = {}
        for rel, entry in self._manifest.files.items():
            if rel not in remote and entry.get("etag") is not None:
                gone.setdefault(_folder_of(rel), []).append(rel)
        remote_folders = {_folder_of(rel) for rel in remote}
        for folder, rels in sorted(gone.items()):
            whole = "/" in folder and folder not in remote_folders     # a version gone
            if whole and not os.path.lexists(self.path / folder):
                self._forget(list(self._manifest.under(folder)))     # deleted here and there
            elif "/" in folder and not self._pulled_unchanged(folder, by_content=True):
                self._keep(list(self._manifest.under(folder)))
                if folder not in self._said:
                    self._said.add(folder)
                    log.warning("model repository %s: version %s left the bucket, but the "
                                "cache's was written or changed here: kept", self.url, folder)
            elif whole:
                self._discard(self.path / folder)
                self._forget(list(self._manifest.under(folder)))
                report.removed.append(folder)
            else:    # some files of a version this mirror pulled, or a model's own files
                for rel in rels:
                    entry = self._manifest.get(rel)
                    if entry["origin"] == PULLED and _stat(self.path / rel) == entry.get("local"):
                        (self.path / rel).unlink(missing_ok=True)
                        self._forget([rel])
                    else:
                        self._keep([rel])
        # a model the bucket no longer has at all leaves with its last files, unless it
        # holds something made here
        models = {folder.split("/")[0] for folder in gone}
        for model in sorted(models - {rel.split("/")[0] for rel in remote}):
            folder = self.path / model
            if folder.is_dir() and not _visible_files(folder):
                self._discard(folder)
                report.removed.append(model)

    def _forget(self, rels: list[str]) -> None:
        for rel in rels:
            self._manifest.drop(rel)

    def _keep(self, rels: list[str]) -> None:
        """Cached files the bucket no longer has, kept as the server's own: not removed, and
        not pushed again unless changed here."""
        for rel in rels:
            self._manifest.set(rel, {**self._manifest.get(rel), "etag": None, "origin": LOCAL})

    def _push(self, report: SyncReport) -> None:
        remote: dict[str, dict] | None = None
        remote_folders: set[str] = set()
        for model_dir in sorted(p for p in self.path.iterdir() if p.is_dir() and not is_hidden(p.name)):
            if (model_dir / JOURNAL_FILENAME).exists():
                continue        # an upload whose load has not succeeded yet: it may be taken back
            for vdir in sorted(p for p in model_dir.iterdir()
                               if p.is_dir() and is_version_dir_name(p.name)):
                folder = f"{model_dir.name}/{vdir.name}"
                if self._manifest.under(folder):
                    continue                    # came from the bucket, or pushed before
                if remote is None:
                    remote = self._remote_files(SyncReport())
                    remote_folders = {_folder_of(rel) for rel in remote}
                if folder in remote_folders:
                    if not self._adopt(folder, remote):
                        self._refuse(folder, "was written here", report)
                    continue
                for local in sorted(_visible_files(vdir)):
                    self._upload(local, local.relative_to(self.path).as_posix(), report)
                self._said.discard(folder)
            for local in sorted(f for f in model_dir.iterdir() if f.is_file() and not is_hidden(f.name)):
                rel = local.relative_to(self.path).as_posix()
                known = self._manifest.get(rel)
                if known is not None and known.get("local") == _stat(local):
                    continue
                if remote is None:
                    remote = self._remote_files(SyncReport())
                    remote_folders = {_folder_of(rel) for rel in remote}
                if rel in remote and (known is None or known.get("etag") != _etag(remote[rel])):
                    continue                    # changed in the bucket too: the pull brings it
                self._upload(local, rel, report)

    def _adopt(self, folder: str, remote: dict[str, dict]) -> bool:
        """A version written here that the bucket holds byte for byte (pushed by a sync
        whose manifest was never written): recorded as pushed. Compared by the single-part
        ETag, an MD5; anything else is a different version."""
        files = {p.relative_to(self.path).as_posix(): p for p in _visible_files(self.path / folder)}
        theirs = {rel: info for rel, info in remote.items() if _folder_of(rel) == folder}
        if set(files) != set(theirs) or any(
                (_stat(p) or [None])[0] != int(theirs[rel].get("size") or 0) for rel, p in files.items()):
            return False
        if any(_etag(theirs[rel]).strip('"') != _digest(path, "md5") for rel, path in files.items()):
            return False
        for rel, info in theirs.items():
            self._remember(rel, info, _digest(files[rel], "sha256"), LOCAL)
        return True

    # ---- what the mirror owns -----------------------------------------------------------------

    def _used_versions(self, model: str) -> set[int]:
        """The numbers the repository (the owner of what a number means) says ``model`` used:
        a bucket version never takes one of them unless this mirror brought it before. Read
        once a sync (a pull adds only the bucket's own numbers)."""
        if model not in self._used:
            self._used[model] = Repository(self.path).used_versions(model)
        return self._used[model]

    def _pulled_unchanged(self, folder: str, by_content: bool = False) -> bool:
        """Whether a version folder holds exactly the files this mirror pulled into it, as it
        wrote them (by size and mtime; ``by_content``: also by sha256, before it changes or
        removes anything)."""
        entries = self._manifest.under(folder)
        if not entries or any(e.get("origin") != PULLED for e in entries.values()):
            return False
        local = self.path / folder
        if {p.relative_to(self.path).as_posix() for p in _visible_files(local)} != set(entries):
            return False
        for rel, entry in entries.items():
            if _stat(self.path / rel) != entry.get("local"):
                return False
            if by_content and _digest(self.path / rel, "sha256") != entry.get("sha256"):
                return False
        return True

    def _refuse(self, folder: str, why: str, report: SyncReport) -> None:
        if folder not in report.refused:
            report.refused.append(folder)
        if folder not in self._said:
            self._said.add(folder)
            log.warning("model repository %s: version %s differs in the bucket, and the cache's "
                        "%s: neither is overwritten, the cache keeps serving its own", self.url,
                        folder, why)

    def _skip(self, what: str, report: SyncReport) -> None:
        report.skipped.append(what)
        if what not in self._said and len(self._said) < self.max_objects:
            self._said.add(what)
            log.warning("model repository %s: not taken from the bucket: %s", self.url, what)

    # ---- one file ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _staging(self) -> Iterator[Path]:
        """A private folder in the cache (the same filesystem: a rename into place is atomic;
        hidden: the engine never sees it), removed with whatever is left in it."""
        folder = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.path))
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _discard(self, target: Path) -> None:
        # moved into a staging folder first: a poll never sees it half deleted
        with self._staging() as trash:
            os.rename(target, trash / target.name)

    def _check_fits(self, files: dict[str, dict]) -> None:
        sizes = [int(info.get("size") or 0) for info in files.values()]
        if self.max_object_bytes is not None and max(sizes, default=0) > self.max_object_bytes:
            raise _Refused(f"an object is over {self.max_object_bytes} bytes")
        free = shutil.disk_usage(self.path).free - DISK_RESERVE
        if sum(sizes) > free:
            raise _Refused(f"{sum(sizes)} bytes do not fit in the cache's {max(free, 0)} free")

    def _download(self, rel: str, info: dict, local: Path) -> str:
        """One object, as listed (If-Match its ETag, never past its listed size); its sha256."""
        local.parent.mkdir(parents=True, exist_ok=True)
        size = int(info.get("size") or 0)
        digest = hashlib.sha256()
        with self.fs.open(f"{self.location.root}/{rel}", "rb", block_size=_CHUNK,
                          cache_type="none") as src, open(local, "xb") as out:
            if _etag(src.details) != _etag(info) or src.size != size:
                raise _Refused(f"{rel} changed while it was read")
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
        return digest.hexdigest()

    def _upload(self, local: Path, rel: str, report: SyncReport) -> None:
        key = f"{self.location.root}/{rel}"
        self.fs.put_file(str(local), key)
        self._remember(rel, self.fs.info(key), _digest(local, "sha256"), LOCAL)
        report.pushed.append(rel)

    def _remember(self, rel: str, info: dict, sha256: str, origin: str) -> None:
        self._manifest.set(rel, {"etag": _etag(info), "local": _stat(self.path / rel),
                                 "sha256": sha256, "origin": origin})

    # ---- manifest ---------------------------------------------------------------------------

    def _read_manifest(self) -> dict[str, dict]:
        try:
            data = json.loads((self.path / MANIFEST).read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("url") != self.url:
            return {}                  # a cache of another repository: start over
        files = data.get("files")
        # only entries whose cached copy is still there as it was written; one written
        # before origins were recorded counts as the server's own (never removed)
        return {rel: {**e, "origin": e.get("origin", LOCAL)}
                for rel, e in (files if isinstance(files, dict) else {}).items()
                if isinstance(e, dict) and _bad_key(rel) is None
                and _stat(self.path / rel) == e.get("local")}

    def _write_manifest(self) -> None:
        tmp = self.path / f"{MANIFEST}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"url": self.url, "files": self._manifest.files}))
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


def _bad_key(rel: str | None) -> str | None:
    """Why a key (relative to the repository) cannot be a model's file, or None: the rules of
    an upload's paths (repository/upload.py) and of model names, and the cache's file names."""
    if rel is None:
        return "outside the repository"
    parts = rel.split("/")
    if any(is_hidden(p) for p in parts):
        return "hidden"
    if len(parts) < 2:
        return "not in a model folder"
    if len(parts) > MAX_DEPTH + 1:
        return f"more than {MAX_DEPTH} folders deep"
    try:
        check_model_name(parts[0])
    except InvalidArgument:
        return "not a model name"
    if any(not p or "\0" in p or "\\" in p or not fits_file_name(p) for p in parts):
        return "an empty, NUL, backslash or over-long path component"
    if parts[1].isdigit() and not (len(parts) > 2 and is_version_dir_name(parts[1])):
        return "a number that is not a version folder"
    return None


def _folder_of(rel: str) -> str:
    """``model/version`` for a file in a version folder, else ``model`` (its own files)."""
    parts = rel.split("/")
    return f"{parts[0]}/{parts[1]}" if len(parts) > 2 and is_version_dir_name(parts[1]) else parts[0]


def _visible_files(folder: Path) -> list[Path]:
    """Every file (or link) below ``folder`` that is not hidden, as the engine sees them."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not is_hidden(d)]
        found.extend(Path(dirpath) / f for f in filenames if not is_hidden(f))
    return found


def _etag(info: dict) -> str:
    return str(info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("size"))


def _stat(path: Path) -> list[int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def _digest(path: Path, algorithm: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, algorithm).hexdigest()
    except OSError:
        return None


def open_repository(location: str | os.PathLike, poll_secs: float = 15.0,
                    cache_dir: str | os.PathLike | None = None) -> RemoteRepository | None:
    """The started mirror of an ``s3://`` repository (serve its ``.path``; ``close()`` it
    after the server), or None for a local directory. Synced every ``poll_secs`` at most
    ``DEFAULT_INTERVAL``, so that in poll mode a change in the bucket is seen by the next
    poll or the one after."""
    if not is_remote(location):
        return None
    return RemoteRepository(str(location), cache_dir, interval=min(poll_secs, DEFAULT_INTERVAL)).start()
