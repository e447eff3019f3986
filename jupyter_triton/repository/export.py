"""``jupyter-triton export``: the scale-out path. Writes a copy of a repository that NVIDIA
Triton (and KServe's Triton runtime) loads as it is: each model's config.pbtxt and the version
directories its version policy serves, without what only this server keeps (``.history/``,
upload leftovers, per-version config copies, caches). The source is only read; the
destination is written to a temporary folder and renamed into place, never over anything."""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..config import CONFIG_FILENAME, config_to_pbtxt
from ..protocol.errors import InvalidArgument
from . import Repository
from .layout import is_hidden

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
                      storage_uri: str = "") -> ExportReport:
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
        exported = [_export_model(repo, name, staging / name, all_versions) for name in names]
        os.rename(staging, destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if manifest is not None:
        manifest.write_text(kserve_manifest(kserve_name, storage_uri or f"file://{destination}"))
    return ExportReport(destination, exported, manifest)


def _export_model(repo: Repository, name: str, out: Path, all_versions: bool) -> ExportedModel:
    config = repo.read_config(name)            # validates: Triton's own proto and rules
    versions = repo.versions_on_disk(name) if all_versions else repo.select_versions(name, config)
    model = ExportedModel(name, versions)
    out.mkdir(parents=True)
    # Written from the parsed proto: what Triton reads is exactly what validated here.
    (out / CONFIG_FILENAME).write_text(config_to_pbtxt(config))
    src = repo.model_dir(name)
    for v in versions:
        version_dir = src / str(v)

        def ignore(folder: str, names: list[str], root: Path = version_dir) -> set[str]:
            at_root = Path(folder) == root
            return {n for n in names if is_hidden(n) or n in _SKIPPED_DIRS
                    or (at_root and n in _SKIPPED_FILES)}

        shutil.copytree(version_dir, out / str(v), ignore=ignore)
        if (version_dir / "model.pkl").exists():
            model.notes.append(f"version {v} is a notebook callable (model.pkl): Triton's python "
                               f"backend needs cloudpickle and numpy in its Python environment")
    for extra in sorted(p.name for p in src.iterdir()
                        if p.is_file() and p.name != CONFIG_FILENAME and not is_hidden(p.name)):
        shutil.copy2(src / extra, out / extra)   # e.g. the labels file a label_filename names
    return model


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
