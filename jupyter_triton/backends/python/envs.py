"""``EXECUTION_ENV_PATH``: a python model's own environment, as Triton's python backend has it::

    parameters { key: "EXECUTION_ENV_PATH"
                 value: { string_value: "$$TRITON_MODEL_DIRECTORY/my_env.tar.gz" } }

The path is a packed environment (a ``.tar.gz`` made by ``venv-pack`` or ``conda-pack``), or
an environment directory already unpacked; ``$$TRITON_MODEL_DIRECTORY`` is the model's
directory, and a relative path is taken from there. The model's workers run that
environment's ``bin/python``, with its ``bin`` first on ``PATH`` and its ``lib`` first on
``LD_LIBRARY_PATH`` (what sourcing its ``activate`` does in Triton).

An archive is unpacked once per content (its sha256) into a cache shared by every instance,
version and server of this user: ``$TMPDIR/jupyter_triton_envs_<uid>``, used only while it is
ours and private (owner, mode and no link checked; otherwise this server takes a fresh
``mkdtemp`` folder of its own, removed at exit). The python a worker runs comes from there,
so nobody else may have written a byte of it:

- each unpacking goes into a fresh ``mkdtemp`` folder, renamed into place once complete and
  marked (``MARKER``, holding the digest); an entry is reused only while it is ours, private
  and marked with its digest, and anything else under its name is thrown away;
- the members are checked before anything is written (``_checked_members``): files,
  directories and links only; no absolute or ``..`` name, no member inside a link, no name
  twice unless as a file or directory both times; hard links only to a file of the archive;
  symbolic links resolved through the archive's own links must stay in the folder, but for
  a venv's ``bin/python*`` naming its base interpreter (an executable file outside: venv-pack
  keeps that link); at most ``MAX_MEMBERS`` members and ``MAX_UNPACKED_BYTES`` bytes, from
  the headers, before a byte is written; no owner taken from the archive;
- a server holds a shared ``flock`` on the marker of each environment a loaded instance
  runs (``PackedEnv.release`` at unload); after each use the cache keeps at most
  ``MAX_UNUSED_ENVS`` environments that no server holds, the most recently used.

What a model imports comes from the environment first. The worker's own modules (this
package's) come from the server, and when the environment's python is the server's version,
the server's packages follow the environment's on ``sys.path``, so an environment needs to
hold only what the model needs beyond them (Triton asks for numpy in it; here it may come
from the server). Only process mode can run another python.
"""
from __future__ import annotations

import atexit
import fcntl
import hashlib
import logging
import os
import re
import shutil
import stat
import tarfile
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from ...protocol.errors import InvalidArgument

log = logging.getLogger(__name__)

EXECUTION_ENV_PATH = "EXECUTION_ENV_PATH"
MODEL_DIRECTORY = "$$TRITON_MODEL_DIRECTORY"

#: bounds on one archive, read from its headers before anything is written (a conda
#: environment with CUDA libraries unpacks to ~10 GB in ~60,000 files; a header read costs
#: ~0.5 KB of memory until the unpacking ends)
MAX_UNPACKED_BYTES = 32 << 30
MAX_MEMBERS = 200_000
#: environments no server runs that the cache keeps (the most recently used), for the next load
MAX_UNUSED_ENVS = 3
#: written into an entry once its unpacking is complete: the archive's sha256
MARKER = ".jupyter_triton_unpacked"
#: symbolic links a name is resolved through, as the kernel's ELOOP bound
MAX_LINK_HOPS = 40
#: a venv's interpreter links, which name its base python outside the environment
_INTERPRETER_LINK = re.compile(r"bin/python[0-9.]*")

_LOCK = threading.Lock()   # instances of one model load together: unpack once
_ROOT: list[Path] = []     # the cache folder this server uses, chosen once
_DIGESTS: dict[tuple[int, ...], str] = {}   # an archive's sha256 by its (dev, ino, size, mtime, ctime)


class RefusedArchive(Exception):
    """An archive this server will not unpack, and why."""


class _Lease:
    """A shared lock on an unpacked environment's marker: no server's cache clean-up removes
    an environment while a lease on it is open. Closed by ``close`` or when dropped."""

    def __init__(self, fd: int) -> None:
        self._close = weakref.finalize(self, os.close, fd)

    def close(self) -> None:
        self._close()


@dataclass(frozen=True)
class PackedEnv:
    """An unpacked environment a worker runs in."""

    root: Path
    python: str
    lease: _Lease | None = field(default=None, compare=False, repr=False)

    def environ(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` as the environment's ``activate`` leaves it."""
        env = dict(base)
        env["PATH"] = os.pathsep.join(filter(None, [str(self.root / "bin"), base.get("PATH", "")]))
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            filter(None, [str(self.root / "lib"), base.get("LD_LIBRARY_PATH", "")]))
        env["VIRTUAL_ENV"] = str(self.root)
        env.pop("PYTHONHOME", None)
        return env

    def release(self) -> None:
        """This instance no longer runs the environment: the cache may clean it up."""
        if self.lease is not None:
            self.lease.close()


def packed_env(config: mc.ModelConfig, model_dir: Path) -> PackedEnv | None:
    """The config's environment, unpacked (once); None when the config names none."""
    param = config.parameters.get(EXECUTION_ENV_PATH)
    text = param.string_value.strip() if param is not None else ""
    if not text:
        return None
    path = Path(text.replace(MODEL_DIRECTORY, str(model_dir))).expanduser()
    if not path.is_absolute():
        path = model_dir / path

    def refuse(why: str) -> InvalidArgument:
        return InvalidArgument(f"model '{config.name}': parameter {EXECUTION_ENV_PATH} "
                               f"'{param.string_value}': {why}")

    lease = None
    if path.is_dir():
        root = path.resolve()
    elif path.is_file():
        try:
            root, lease = _unpacked(path.resolve())
        except (OSError, tarfile.TarError, RefusedArchive) as err:
            raise refuse(f"cannot unpack {path}: {err}") from None
    else:
        raise refuse(f"no such file or directory ({path})")
    for name in ("python3", "python"):
        python = root / "bin" / name
        if python.exists():
            return PackedEnv(root, str(python), lease)
    if lease is not None:
        lease.close()
    raise refuse(f"no bin/python in {root} (a venv-pack or conda-pack archive, or its unpacked directory)")


def cache_dir() -> Path:
    """The folder this server unpacks environments into: the user's shared cache while it is
    private, else a fresh one of this server's."""
    with _LOCK:
        # checked at every use: a temporary-files cleaner may have removed it, and another
        # user made one of the same name
        if not _ROOT or _not_private(_ROOT[0]) is not None:
            _ROOT[:] = [_private_cache()]
        return _ROOT[0]


def entry_name(archive: Path) -> str:
    """The name of ``archive``'s unpacked environment in the cache: keyed by its content."""
    with open(archive, "rb") as f, _LOCK:
        return _entry_name(archive, _digest(f))


def _entry_name(archive: Path, digest: str) -> str:
    return f"{archive.name.split('.')[0]}-{digest[:32]}"


# -- the cache folder and its entries -----------------------------------------------------------

def _not_private(path: Path, st: os.stat_result | None = None) -> str | None:
    """Why ``path`` is not a folder only this user can write (None when it is)."""
    try:
        st = st or os.lstat(path)
    except OSError as err:
        return str(err)
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not {os.geteuid()}"
    if st.st_mode & 0o022:
        return f"mode {stat.S_IMODE(st.st_mode):o}: others may write to it"
    return None


def _private_cache() -> Path:
    shared = Path(tempfile.gettempdir()) / f"jupyter_triton_envs_{os.getuid()}"
    try:
        shared.mkdir(mode=0o700)
    except OSError:
        pass   # there already, or not to be made: the checks say which
    why = _not_private(shared)
    if why is None:
        return shared
    own = Path(tempfile.mkdtemp(prefix=f"jupyter_triton_envs_{os.getuid()}-"))
    atexit.register(shutil.rmtree, own, True)
    log.warning("python backend: packed environments are not unpacked into %s (%s): into %s, "
                "this server's own", shared, why, own)
    return own


def _reuse(entry: Path, digest: str) -> _Lease | None:
    """A lease on ``entry`` when it is a complete unpacking of ``digest`` made by this user;
    None when there is none. Anything else in its place is thrown away."""
    try:
        st = os.lstat(entry)
    except FileNotFoundError:
        return None
    fd = -1
    try:
        if _not_private(entry, st) is None:
            fd = os.open(entry / MARKER, os.O_RDONLY | os.O_NOFOLLOW)
            mark = os.fstat(fd)
            if (stat.S_ISREG(mark.st_mode) and mark.st_uid == os.geteuid()
                    and os.read(fd, 128).decode(errors="replace") == digest):
                fcntl.flock(fd, fcntl.LOCK_SH)
                # the clean-up of another server may have taken it away before the lock
                try:
                    now = os.lstat(entry / MARKER)
                except FileNotFoundError:
                    now = None
                if now is None or (now.st_dev, now.st_ino) != (mark.st_dev, mark.st_ino):
                    os.close(fd)
                    return None
                os.utime(fd)   # used now: the clean-up keeps the most recently used
                return _Lease(fd)
    except OSError:
        pass
    if fd >= 0:
        os.close(fd)
    log.warning("python backend: %s is not an unpacking of this server's; removing it", entry)
    _discard(entry)
    return None


def _discard(path: Path) -> None:
    """Take ``path`` out of the cache at once (a rename in its folder), then remove it."""
    aside = path.with_name(f".removing-{os.urandom(8).hex()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return   # another server's clean-up took it first
    _remove(aside)


def _remove(path: Path) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        os.unlink(path)


def _prune(cache: Path, keep: Path) -> None:
    """Remove the environments no server holds, but the ``MAX_UNUSED_ENVS`` most recently used."""
    entries = []
    for name in os.listdir(cache):
        entry = cache / name
        if name.startswith(".removing-"):   # a removal that did not finish
            _remove(entry)
        if name.startswith(".") or entry == keep:
            continue
        try:
            entries.append((os.lstat(entry / MARKER).st_mtime_ns, entry))
        except OSError:
            continue   # no marker: not an unpacking of ours
    kept = 0
    for _, entry in sorted(entries, reverse=True):
        try:
            fd = os.open(entry / MARKER, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue   # in use
        try:
            if kept < MAX_UNUSED_ENVS:
                kept += 1
            else:
                log.info("python backend: removing the unused environment %s", entry)
                _discard(entry)
        except OSError as err:
            log.warning("python backend: cannot remove %s: %s", entry, err)
        finally:
            os.close(fd)


def _digest(f) -> str:
    st = os.fstat(f.fileno())
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    digest = _DIGESTS.get(key)
    if digest is None:
        sha = hashlib.sha256()
        f.seek(0)
        while chunk := f.read(1 << 20):
            sha.update(chunk)
        digest = sha.hexdigest()
        if len(_DIGESTS) >= 64:
            _DIGESTS.pop(next(iter(_DIGESTS)))
        _DIGESTS[key] = digest
    return digest


def _unpacked(archive: Path) -> tuple[Path, _Lease]:
    cache = cache_dir()
    with open(archive, "rb") as f, _LOCK:
        digest = _digest(f)
        entry = cache / _entry_name(archive, digest)
        lease = _reuse(entry, digest)
        if lease is None:
            lease = _unpack(f, archive, entry, digest)
        try:
            _prune(cache, keep=entry)
        except OSError as err:
            log.warning("python backend: cleaning up %s: %s", cache, err)
        return entry, lease


def _unpack(f, archive: Path, entry: Path, digest: str) -> _Lease:
    """Unpack the archive open as ``f`` into a fresh folder, then rename it to ``entry``."""
    staging = Path(tempfile.mkdtemp(prefix=".unpacking-", dir=entry.parent))
    fd = -1
    try:
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            members = _checked_members(tar)
            tar.extractall(staging, members=members, filter="tar")
        fd = os.open(staging / MARKER, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        os.write(fd, digest.encode())
        fcntl.flock(fd, fcntl.LOCK_SH)   # held before the entry shows
        try:
            os.rename(staging, entry)
        except OSError:
            if os.path.lexists(entry):   # another server's unpacking of the same archive won
                lease = _reuse(entry, digest)
                if lease is not None:
                    os.close(fd)
                    shutil.rmtree(staging, ignore_errors=True)
                    return lease
            raise
        log.info("python backend: unpacked %s into %s", archive, entry)
        return _Lease(fd)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        shutil.rmtree(staging, ignore_errors=True)
        raise


# -- what an archive may hold ---------------------------------------------------------------------

def _member_name(raw: str) -> str:
    """A member's name, normalised; refused when absolute or climbing out with ``..``."""
    if raw.startswith("/") or "\0" in raw:
        raise RefusedArchive(f"member {raw!r}: an absolute name")
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise RefusedArchive(f"member {raw!r}: a name with '..'")
    return "/".join(parts)


def _checked_members(tar: tarfile.TarFile) -> list[tarfile.TarInfo]:
    """The archive's members as they will be extracted, after every check of the module's
    docstring; reads the headers only (bounded in count as they are read)."""
    kinds: dict[str, str] = {}      # name -> "dir" | "file" | "symlink" | "hardlink"
    links: dict[str, str] = {}      # symbolic links: name -> target
    members: list[tarfile.TarInfo] = []
    total = 0
    for count, member in enumerate(tar, 1):
        if count > MAX_MEMBERS:
            raise RefusedArchive(f"more than {MAX_MEMBERS} members")
        name = _member_name(member.name)
        kind = ("dir" if member.isdir() else "file" if member.isreg() else
                "symlink" if member.issym() else "hardlink" if member.islnk() else None)
        if kind is None:
            raise RefusedArchive(f"member {member.name!r}: not a file, directory or link "
                                 "(a device, fifo or other special file)")
        if not name:
            if kind != "dir":
                raise RefusedArchive(f"member {member.name!r}: names the folder itself")
            continue   # "./": the folder itself, which stays ours and private
        if name == MARKER:
            raise RefusedArchive(f"member {member.name!r}: a name this server keeps for itself")
        if kind == "file":
            total += member.size
            if total > MAX_UNPACKED_BYTES:
                raise RefusedArchive(f"more than {MAX_UNPACKED_BYTES} bytes unpacked "
                                     f"(member {member.name!r} declares {member.size})")
        parts = name.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if kinds.setdefault(parent, "dir") != "dir":
                raise RefusedArchive(f"member {member.name!r}: inside {parent!r}, a {kinds[parent]}")
        before = kinds.get(name)
        if before is not None and not (before == kind and kind in ("dir", "file")):
            raise RefusedArchive(f"member {member.name!r}: a {kind} where the archive "
                                 f"already has a {before}")
        kinds[name] = kind
        changes: dict = {"name": name, "uid": None, "gid": None, "uname": None, "gname": None}
        if kind == "hardlink":
            try:
                target = _member_name(member.linkname)
            except RefusedArchive:
                target = ""
            if kinds.get(target) != "file":
                raise RefusedArchive(f"member {member.name!r}: a hard link to {member.linkname!r}, "
                                     "not a file of the archive before it")
            changes["linkname"] = target
        elif kind == "symlink":
            links[name] = member.linkname
        elif member.mode is not None:   # owner may always read, write (and enter) what it unpacked
            changes["mode"] = member.mode | (0o700 if kind == "dir" else 0o600)
        members.append(member.replace(**changes))
    for name, target in links.items():
        if not _stays_inside(name, links):
            raise RefusedArchive(f"member {name!r}: a symbolic link to {target!r}, "
                                 "outside the folder")
    return members


def _interpreter(name: str, target: str) -> bool:
    """A venv's ``bin/python*`` naming its base interpreter, an executable file."""
    return (_INTERPRETER_LINK.fullmatch(name) is not None and os.path.isabs(target)
            and os.path.isfile(target) and os.access(target, os.X_OK))


def _stays_inside(link: str, links: dict[str, str]) -> bool:
    """Whether symbolic link ``link`` leads into the folder, following the archive's links as
    the kernel would (the folder is fresh: its only links are the archive's)."""
    if os.path.isabs(links[link]):
        return _interpreter(link, links[link])
    parts = link.split("/")[:-1]
    pending = links[link].split("/")
    hops = 1
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                return False
            parts.pop()
            continue
        parts.append(part)
        here = "/".join(parts)
        target = links.get(here)
        if target is None:
            continue
        hops += 1
        if hops > MAX_LINK_HOPS:
            return False
        if os.path.isabs(target):   # only a venv's interpreter, at the end of the path
            return _interpreter(here, target) and all(p in ("", ".") for p in pending)
        parts.pop()
        pending = target.split("/") + pending
    return True
