"""What "version N of model M" is, decided in one place.

A ``VersionIdentity`` is minted once, when the lifecycle reads a version to load it
(``Repository.version_identity``), and carried by the loaded ``ModelVersion`` (``.identity``).
Everything that must tell one version's answers from another's asks it, instead of deriving
its own notion from the number:

* the lifecycle's reload keeps a loaded version whose identity is unchanged, and loads one
  whose files or config changed under the same number anew (engine/lifecycle/control.py);
* the response cache keys every entry on ``identity.key`` (engine/cache.py), so files put
  under a number that served before never meet the earlier files' answers;
* the number itself is the repository's to hand out, and one once used is never handed out
  again (``Repository.used_versions``): the S3 mirror asks the same owner before it takes a
  bucket version (repository/remote.py).

The files are stamped by their names, sizes, mtimes and inodes, not hashed: a model's files
can be gigabytes, and a version that is loaded again must not cost a read of all of them.
A file replaced by a rename or rewritten changes its inode or mtime.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from ..config import CONFIG_FILENAME
from .layout import is_hidden, is_version_dir_name


@dataclass(frozen=True)
class VersionIdentity:
    """One version as it was read to be loaded: its model, its number, a stamp of its files
    (its version folder and the model's own files beside config.pbtxt, e.g. a label file)
    and a digest of the config it loads with. Equal identities load the same model."""
    model: str
    number: int
    files: str
    config: str
    # the digest of all four, what a cache key starts with (computed once, at minting)
    key: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", hashlib.blake2b(
            f"{self.model}\0{self.number}\0{self.files}\0{self.config}".encode(),
            digest_size=32).digest())


def mint(model: str, model_dir: Path, number: int, config: mc.ModelConfig) -> VersionIdentity:
    """The identity of version ``number`` of ``model`` (in ``model_dir``) loaded with ``config`` (as
    completed and validated: what the version will run with). Blocking (reads the disk)."""
    files = hashlib.sha256()
    files.update(tree_stamp(model_dir / str(int(number))).encode())
    files.update(_own_files_stamp(model_dir).encode())
    return VersionIdentity(model, int(number), files.hexdigest(),
                           hashlib.sha256(config.SerializeToString(deterministic=True)).hexdigest())


def _own_files_stamp(model_dir: Path) -> str:
    """The model's files that are neither a version nor config.pbtxt (the config counts by
    its content): what every version reads besides its own folder."""
    digest = hashlib.sha256()
    for entry in sorted(os.scandir(model_dir), key=lambda e: e.name):
        if is_hidden(entry.name) or entry.name == CONFIG_FILENAME or (
                is_version_dir_name(entry.name) and entry.is_dir()):
            continue
        try:
            stamp = tree_stamp(Path(entry.path))
        except FileNotFoundError:       # removed while we looked, or a dangling symlink
            stamp = "gone"
        digest.update(f"{entry.name}\0{stamp}\0".encode())
    return digest.hexdigest()


def tree_stamp(path: Path) -> str:
    """A cheap stamp of a file or folder tree (names, sizes, mtimes, inodes); hidden entries
    and __pycache__ are not the model, as for Triton. FileNotFoundError when it went away."""
    st = os.stat(path)
    digest = hashlib.sha256()
    if not os.path.isdir(path):
        digest.update(f"f\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0".encode())
        return digest.hexdigest()
    for dirpath, dirnames, filenames in os.walk(path):
        # hidden entries (.history, upload staging, .ipynb_checkpoints) and
        # __pycache__ are not the model, as for Triton
        dirnames[:] = sorted(d for d in dirnames if not is_hidden(d))
        rel = os.path.relpath(dirpath, path)
        for name in sorted(dirnames):
            digest.update(f"d\0{rel}/{name}\0".encode())
        for name in sorted(f for f in filenames if not is_hidden(f)):
            file = os.path.join(dirpath, name)
            try:
                st = os.stat(file)
            except FileNotFoundError:
                try:
                    st = os.lstat(file)   # a dangling symlink is still a change
                except FileNotFoundError:
                    continue
            # the inode too: a file replaced by rename (an atomic write, rsync, cp -p) may
            # keep its size and mtime
            digest.update(f"f\0{rel}/{name}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0"
                          .encode())
    return digest.hexdigest()
