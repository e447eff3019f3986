"""``EXECUTION_ENV_PATH``: a python model's own environment, as Triton's python backend has it::

    parameters { key: "EXECUTION_ENV_PATH"
                 value: { string_value: "$$TRITON_MODEL_DIRECTORY/my_env.tar.gz" } }

The path is a packed environment (a ``.tar.gz`` made by ``venv-pack`` or ``conda-pack``), or
an environment directory already unpacked; ``$$TRITON_MODEL_DIRECTORY`` is the model's
directory, and a relative path is taken from there. The model's workers run that
environment's ``bin/python``, with its ``bin`` first on ``PATH`` and its ``lib`` first on
``LD_LIBRARY_PATH`` (what sourcing its ``activate`` does in Triton). An archive is unpacked
once per content (path, size, mtime) into a cache under the system's temporary directory and
shared by every instance and version that names it.

What a model imports comes from the environment first. The worker's own modules (this
package's) come from the server, and when the environment's python is the server's version,
the server's packages follow the environment's on ``sys.path``, so an environment needs to
hold only what the model needs beyond them (Triton asks for numpy in it; here it may come
from the server). Only process mode can run another python.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tarfile
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from ...protocol.errors import InvalidArgument

log = logging.getLogger(__name__)

EXECUTION_ENV_PATH = "EXECUTION_ENV_PATH"
MODEL_DIRECTORY = "$$TRITON_MODEL_DIRECTORY"

_LOCK = threading.Lock()


@dataclass(frozen=True)
class PackedEnv:
    """An unpacked environment a worker runs in."""

    root: Path
    python: str

    def environ(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` as the environment's ``activate`` leaves it."""
        env = dict(base)
        env["PATH"] = os.pathsep.join(filter(None, [str(self.root / "bin"), base.get("PATH", "")]))
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            filter(None, [str(self.root / "lib"), base.get("LD_LIBRARY_PATH", "")]))
        env["VIRTUAL_ENV"] = str(self.root)
        env.pop("PYTHONHOME", None)
        return env


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

    if path.is_dir():
        root = path.resolve()
    elif path.is_file():
        try:
            root = _unpacked(path.resolve())
        except (OSError, tarfile.TarError) as err:
            raise refuse(f"cannot unpack {path}: {err}") from None
    else:
        raise refuse(f"no such file or directory ({path})")
    for name in ("python3", "python"):
        python = root / "bin" / name
        if python.exists():
            return PackedEnv(root, str(python))
    raise refuse(f"no bin/python in {root} (a venv-pack or conda-pack archive, or its unpacked directory)")


def cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"jupyter_triton_envs_{os.getuid()}"


def _unpacked(archive: Path) -> Path:
    stat = archive.stat()
    key = hashlib.sha256(f"{archive}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:20]
    root = cache_dir() / f"{archive.name.split('.')[0]}-{key}"
    with _LOCK:   # instances of one model load together: unpack once
        if root.is_dir():
            return root
        root.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".unpacking-", dir=root.parent))
        try:
            with tarfile.open(archive) as tar:
                # "tar": no member outside the folder; a venv's bin/python stays a link to
                # its base interpreter, which the "data" filter would refuse
                tar.extractall(staging, filter="tar")
            log.info("python backend: unpacked %s into %s", archive, root)
            try:
                os.replace(staging, root)
            except OSError:
                if not root.is_dir():   # not another server's unpacking of the same archive
                    raise
                shutil.rmtree(staging, ignore_errors=True)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return root
