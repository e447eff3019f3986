"""``jupyter-triton export``: the scale-out path. Writes a copy of a repository that NVIDIA
Triton (and KServe's Triton runtime) loads as it is: each model's config.pbtxt and the version
directories its version policy serves, without what only this server keeps (``.history/``,
upload leftovers, per-version config copies, caches). The source is only read; the
destination is written to a temporary folder and renamed into place, never over anything.

Our own torch forms (a ``torch.export`` program, a pickled ``torch.nn.Module`` callable) are
written as TorchScript or ONNX, checked against the original first (``torch_convert``): an
exported program that cannot be converted faithfully stops the export with the reason; a
module callable that cannot stays a python-backend model, with a note. With ``pack_env`` a
python-backend model gets the environment it needs packed beside it (``pack_env``)."""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..config import CONFIG_FILENAME, config_to_pbtxt
from ..progress import progress as show_progress
from ..protocol.errors import InvalidArgument
from . import Repository
from .layout import is_hidden
from .pack_env import ARCHIVE, ENV_PARAMETER, build_archive, needed_modules
from .torch_convert import FORMATS, ConversionRefused, Converted, convert, convertible_source

_SKIPPED_FILES = {CONFIG_FILENAME}          # inside version dirs: our per-version copy
_SKIPPED_DIRS = {"__pycache__", ".ipynb_checkpoints"}


@dataclass
class ExportedModel:
    name: str
    versions: list[int]
    notes: list[str] = field(default_factory=list)


@dataclass
class ExportReport:
    destination: Path
    models: list[ExportedModel]
    kserve_manifest: Path | None = None

    def summary(self) -> str:
        lines = [f"exported {len(self.models)} model(s) to {self.destination}"]
        for m in self.models:
            lines.append(f"  {m.name}: versions {', '.join(map(str, m.versions))}")
            lines.extend(f"    note: {n}" for n in m.notes)
        lines.append(f"serve it with NVIDIA Triton:  tritonserver --model-repository={self.destination}")
        if self.kserve_manifest:
            lines.append(f"or on KServe:  kubectl apply -f {self.kserve_manifest}")
        return "\n".join(lines)


def export_repository(source: Path, destination: Path, models: list[str] | None = None,
                      all_versions: bool = False, kserve_name: str = "",
                      storage_uri: str = "", torch_format: str = "torchscript",
                      progress: bool = True, pack_env: bool = False,
                      pack_env_pins: list[str] = ()) -> ExportReport:
    """``torch_format``: what torch models become, ``torchscript`` (Triton's pytorch backend)
    or ``onnx`` (its onnxruntime backend). ``progress``: a bar (a notebook) or a line on stderr
    (elsewhere) as each model starts. ``pack_env``: each python-backend model gets the Python
    environment its files need packed beside it (``pack_env_pins``: versions to install
    instead of this environment's, e.g. ``numpy<2`` for Triton 2.51)."""
    if torch_format not in FORMATS:
        raise InvalidArgument(f"unknown torch export format '{torch_format}': one of {', '.join(FORMATS)}")
    destination = Path(destination)
    # The manifest sits beside the repository: Triton would take a file inside it for a model.
    manifest = destination.parent / f"{destination.name}-kserve.yaml" if kserve_name else None
    for path in (destination, manifest):
        if path is not None and path.exists():
            raise InvalidArgument(f"export destination {path} already exists; choose a new name")
    repo = Repository(source)
    names = models or repo.model_names()
    if not names:
        raise InvalidArgument(f"no models in {source}")
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}-", dir=destination.parent))
    try:
        exported = []
        with show_progress(len(names), f"export to {destination}", progress) as bar:
            for name in names:
                bar.update(len(exported), f"{name}:")
                exported.append(_export_model(repo, name, staging / name, all_versions, torch_format,
                                              list(pack_env_pins) if pack_env else None))
        os.rename(staging, destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if manifest is not None:
        manifest.write_text(kserve_manifest(kserve_name, storage_uri or f"file://{destination}"))
    return ExportReport(destination, exported, manifest)


def _export_model(repo: Repository, name: str, out: Path, all_versions: bool,
                  torch_format: str, pack_pins: list[str] | None) -> ExportedModel:
    config = repo.read_config(name)            # validates: Triton's own proto and rules
    versions = repo.versions_on_disk(name) if all_versions else repo.select_versions(name, config)
    model = ExportedModel(name, versions)
    out.mkdir(parents=True)
    src = repo.model_dir(name)
    converted = _convert_torch(name, config, {v: src / str(v) for v in versions}, torch_format, model)
    if converted:
        config = next(iter(converted.values())).config
    for v in versions:
        version_dir = src / str(v)
        if v in converted:
            (out / str(v)).mkdir()
            (out / str(v) / converted[v].filename).write_bytes(converted[v].data)
            continue

        def ignore(folder: str, names: list[str], root: Path = version_dir) -> set[str]:
            at_root = Path(folder) == root
            return {n for n in names if is_hidden(n) or n in _SKIPPED_DIRS
                    or (at_root and n in _SKIPPED_FILES)}

        shutil.copytree(version_dir, out / str(v), ignore=ignore)
        if (version_dir / "model.pkl").exists() and not any("not converted" in n for n in model.notes) \
                and pack_pins is None:
            model.notes.append(f"version {v} is a notebook callable (model.pkl): Triton's python "
                               f"backend needs cloudpickle and numpy in its Python environment "
                               f"(or export with --pack-env)")
    for extra in sorted(p.name for p in src.iterdir()
                        if p.is_file() and p.name != CONFIG_FILENAME and not is_hidden(p.name)):
        shutil.copy2(src / extra, out / extra)   # e.g. the labels file a label_filename names
    if pack_pins is not None and config.backend == "python":
        _pack_env(config, out, versions, pack_pins, model)
    # Written from the parsed proto: what Triton reads is exactly what validated here.
    (out / CONFIG_FILENAME).write_text(config_to_pbtxt(config))
    return model


def _pack_env(config, out: Path, versions: list[int], pins: list[str], model: ExportedModel) -> None:
    """Pack what the exported versions need and point the config at it; a model that already
    names its own environment keeps it."""
    if ENV_PARAMETER in config.parameters:
        model.notes.append(f"keeps its own {ENV_PARAMETER}: "
                           f"{config.parameters[ENV_PARAMETER].string_value}")
        return
    if (out / ARCHIVE).exists():
        raise InvalidArgument(f"model '{config.name}' has a file named {ARCHIVE}: the packed "
                              f"environment would replace it; rename that file to export with --pack-env")
    modules = set().union(*(needed_modules(out / str(v)) for v in versions))
    model.notes.extend(build_archive(modules, out / ARCHIVE, pins))
    config.parameters[ENV_PARAMETER].string_value = f"$$TRITON_MODEL_DIRECTORY/{ARCHIVE}"


def _convert_torch(name: str, config, version_dirs: dict[int, Path], torch_format: str,
                   model: ExportedModel) -> dict[int, Converted]:
    """The versions converted for Triton's torch or onnxruntime backend; {} where none is in
    one of our torch forms."""
    kinds = {v: convertible_source(config, d) for v, d in version_dirs.items()}
    if not any(kinds.values()):
        return {}
    converted: dict[int, Converted] = {}
    try:
        for v, d in version_dirs.items():
            if kinds[v] is None:
                raise ConversionRefused(f"model '{name}': version {v} is not a torch model like "
                                        f"the other versions exported (one config serves them all)")
            done = convert(config, d, torch_format)
            if done is None:                 # a callable that is not a torch module
                return {}
            converted[v] = done
    except ConversionRefused as err:
        if "pt2" in kinds.values():
            raise ConversionRefused(f"{err}; Triton cannot load model.pt2 (torch_export is this "
                                    f"server's platform), so the export stops here") from None
        model.notes.append(f"not converted ({err}); Triton's python backend needs torch, numpy "
                           f"and cloudpickle in its Python environment for it")
        return {}
    first = next(iter(converted.values())).config
    if any(c.config != first for c in converted.values()):
        raise ConversionRefused(f"model '{name}': the exported versions have different tensors "
                                f"and one config.pbtxt serves them all: export one version")
    model.notes.extend(sorted({c.note for c in converted.values()}))
    return converted


def kserve_manifest(name: str, storage_uri: str) -> str:
    """A KServe InferenceService that serves the exported repository with Triton (v2 protocol)."""
    return f"""apiVersion: serving.kserve.io/v1beta1
kind: InferenceService
metadata:
  name: {name}
spec:
  predictor:
    model:
      modelFormat:
        name: triton
      protocolVersion: v2
      storageUri: {storage_uri}
"""
