"""``jupyter-triton export --pack-env``: the Python environment a python-backend model needs,
packed beside it, so Triton's python backend runs it with nothing installed by hand.

What a model needs is read from its files, not guessed from the whole environment: the
modules a ``model.pkl`` (a notebook callable) references and those a ``model.py`` imports,
mapped to their installed distributions and closed over those distributions' requirements.
Each distribution is copied from the environment the export runs in (the one the notebook
served with, so the versions are the served ones), into a fresh venv that venv-pack packs;
``pins`` install a different version instead (from the package index or pip's cache), for
a Triton whose python backend needs one (Triton 2.51's needs ``numpy<2``). The archive goes
into the model's folder and the config's ``EXECUTION_ENV_PATH`` points at it through
``$$TRITON_MODEL_DIRECTORY``, as Triton's python backend documents.
"""
from __future__ import annotations

import ast
import importlib.metadata as md
import pickletools
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import venv
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from ..protocol.errors import InvalidArgument

ARCHIVE = "python_env.tar.gz"
ENV_PARAMETER = "EXECUTION_ENV_PATH"
#: what every python-backend callable imports (CALLABLE_MODEL_PY)
BASE_MODULES = {"numpy"}
#: provided by Triton's python backend itself, never packed
PROVIDED = {"triton_python_backend_utils", "c_python_backend_utils"}
_SUBIMPORT = {("cloudpickle.cloudpickle", "subimport"), ("cloudpickle.cloudpickle", "_import_module")}


def pickled_modules(data: bytes) -> set[str]:
    """Top-level modules a pickle references: the globals it loads and the modules
    cloudpickle re-imports by name (``subimport``). Strings are followed through the memo,
    as pickle writes a repeated name once."""
    found: set[str] = set()
    memo: dict[int, object] = {}
    last: list[object] = [None, None]          # the two values pushed last
    want_module = False

    def pushed(value: object) -> None:
        nonlocal want_module
        if want_module and isinstance(value, str):
            found.add(value)
            want_module = False
        last[:] = [last[1], value]

    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name in ("GLOBAL", "INST"):
                module, _, attr = arg.partition(" ")
                found.add(module)
                pushed(None)
                want_module = (module, attr) in _SUBIMPORT
            elif name == "STACK_GLOBAL":
                module, attr = last
                if isinstance(module, str):
                    found.add(module)
                pushed(None)
                want_module = (module, attr) in _SUBIMPORT
            elif name == "MEMOIZE":
                memo[len(memo)] = last[1]
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = last[1]
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                pushed(memo.get(arg))
            elif op.stack_after:
                pushed(arg if isinstance(arg, str) else None)
    except Exception as err:  # a broken pickle is the user's file: say which
        raise InvalidArgument(f"cannot read the pickle's imports: {err}") from None
    return {m.split(".")[0] for m in found if m}


def imported_modules(source: str) -> set[str]:
    """Top-level modules a model.py imports (absolute imports, at any depth)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def needed_modules(version_dir: Path) -> set[str]:
    modules = set(BASE_MODULES)
    for path in version_dir.rglob("*.py"):
        modules |= imported_modules(path.read_text(errors="replace"))
    pickle_file = version_dir / "model.pkl"
    if pickle_file.exists():
        modules |= pickled_modules(pickle_file.read_bytes())
    return {m for m in modules
            if m not in sys.stdlib_module_names and m not in PROVIDED and m != "__main__"}


def distributions(modules: set[str]) -> tuple[dict[str, md.Distribution], list[str]]:
    """The installed distributions providing ``modules``, closed over their requirements
    (extras left out), and the modules no distribution provides (code beside the model)."""
    providers = md.packages_distributions()
    wanted, unknown = [], []
    for module in sorted(modules):
        names = providers.get(module)
        (wanted.extend(names) if names else unknown.append(module))
    found: dict[str, md.Distribution] = {}
    while wanted:
        name = canonicalize_name(wanted.pop())
        if name in found:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue                     # an optional requirement not installed here
        found[name] = dist
        for text in dist.requires or ():
            try:
                req = Requirement(text)
            except InvalidRequirement:
                continue
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                wanted.append(req.name)
    return found, unknown


def _site_packages(prefix: Path) -> Path:
    return Path(sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)}))


def _copy_distribution(dist: md.Distribution, site: Path) -> None:
    root = Path(dist.locate_file("")).resolve()
    for rel in dist.files or ():
        if rel.parts and rel.parts[0] == "..":
            continue                     # console scripts: the model imports, never runs them
        src = (root / rel).resolve()
        if not src.is_file() or root not in src.parents:
            continue
        dst = site / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)


def build_archive(modules: set[str], output: Path, pins: list[str] = ()) -> list[str]:
    """Write the packed environment for ``modules`` to ``output``; the notes to tell the
    user (what was packed, what could not be)."""
    import venv_pack

    pinned: dict[str, str] = {}
    for pin in pins:
        try:
            req = Requirement(pin)
        except InvalidRequirement as err:
            raise InvalidArgument(f"--pack-env-pin {pin!r}: {err}") from None
        pinned[canonicalize_name(req.name)] = pin
    found, unknown = distributions(modules)
    with tempfile.TemporaryDirectory(prefix="jupyter-triton-env-") as tmp:
        prefix = Path(tmp) / "env"
        venv.EnvBuilder(with_pip=False, symlinks=True).create(prefix)
        site = _site_packages(prefix)
        for name, dist in sorted(found.items()):
            if name not in pinned:
                _copy_distribution(dist, site)
        if pinned:
            done = subprocess.run(
                [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                 "--no-deps", "--only-binary=:all:", "--target", str(site), *pinned.values()],
                capture_output=True, text=True)
            if done.returncode:
                raise InvalidArgument(f"--pack-env-pin: pip could not install "
                                      f"{' '.join(pinned.values())}: {done.stderr.strip()[-500:]}")
        venv_pack.pack(prefix=str(prefix), output=str(output), force=True, verbose=False)
    versions = [f"{d.metadata['Name']}=={d.version}" for n, d in sorted(found.items())
                if n not in pinned] + sorted(pinned.values())
    notes = [f"packed its Python {sys.version_info[0]}.{sys.version_info[1]} environment "
             f"({', '.join(versions)}) as {ARCHIVE}; Triton's python backend stub must be built "
             f"for the same Python version"]
    if unknown:
        notes.append(f"no installed distribution provides {', '.join(unknown)}: "
                     f"not in the packed environment")
    return notes
