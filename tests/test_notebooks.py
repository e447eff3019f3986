"""The example notebooks run top to bottom in a plain kernel (nbval, lax: outputs are not
compared). With no Jupyter server around, each kernel serves from its own in-kernel server."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PER_NOTEBOOK_S = 120          # each takes < 30 s on 2 cores; room for a loaded CI machine


def notebooks() -> list[Path]:
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def test_the_four_notebooks_are_there():
    assert [p.name[:2] for p in notebooks()][:4] == ["01", "02", "03", "04"]


@pytest.mark.parametrize("notebook", notebooks(), ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(notebook: Path):
    nb = nbformat.read(notebook, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{notebook.name}: outputs stored"


@pytest.mark.timeout(PER_NOTEBOOK_S + 30)
@pytest.mark.parametrize("notebook", notebooks(), ids=lambda p: p.stem)
def test_notebook_runs(notebook: Path, tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER_TRITON_", "JUPYTERHUB_"))}
    # No server extension to find: a runtime dir of our own keeps other servers' files away.
    env.update(JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), IPYTHONDIR=str(tmp_path / "ipython"))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "-p", "no:cacheprovider",
         "-q", "--timeout", str(PER_NOTEBOOK_S), "--rootdir", str(tmp_path), str(notebook)],
        cwd=NOTEBOOKS, env=env, capture_output=True, text=True, timeout=PER_NOTEBOOK_S + 20)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_binder_environment_has_every_dependency_in_its_cpu_build():
    import tomllib
    import yaml
    root = NOTEBOOKS.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    env = yaml.safe_load((root / "binder" / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    binder = {_name(r) for r in pip if not r.startswith("-")}
    wanted = {_name(r) for r in project["dependencies"]} - {"onnxruntime-gpu"}
    assert wanted <= binder, f"missing in binder/environment.yml: {sorted(wanted - binder)}"
    assert "onnxruntime-gpu" not in binder and "tensorrt" not in binder
    post_build = (root / "binder" / "postBuild").read_text()
    assert "--no-deps" in post_build and "extension enable" in post_build
    assert os.access(root / "binder" / "postBuild", os.X_OK)
