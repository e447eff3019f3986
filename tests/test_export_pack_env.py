"""``jupyter-triton export --pack-env``: a notebook callable exported with the Python
environment it needs packed beside it answers in NVIDIA's tritonserver 2.51 with nothing
installed by hand, and in this server from the same copy. The environment holds what the
callable's files reference (cloudpickle, numpy, the packages its globals come from), not
the whole notebook environment."""
from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from packaging.version import Version

from conftest import serve
from jupyter_triton.config import parse_config
from jupyter_triton.repository import Repository
from jupyter_triton.repository.callable_format import pack_callable
from tritonserver_peer import TritonServer, tritonserver_dist

pytestmark = pytest.mark.timeout(600)
CLI = str(Path(sys.executable).parent / "jupyter-triton")


def scale_by_major(x):
    # a global from a third-party package: the packed environment must bring it
    return x * float(Version("3.0").major) - 1


def build(root: Path) -> Path:
    config, files = pack_callable(scale_by_major, name="scaled",
                                  inputs=[("x", "FP32", [4])], outputs=[("y", "FP32", [4])],
                                  max_batch_size=8)
    Repository(root).write_upload("scaled", config, {f"file:{k}": v for k, v in files.items()})
    return root


def export(source: Path, out: Path, *flags: str) -> str:
    done = subprocess.run([CLI, "export", "--model-repository", str(source), "--output", str(out),
                           "--pack-env", *flags], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def packed_top_levels(archive: Path) -> dict[str, str]:
    """{top-level package in the archive's site-packages: its dist-info version}."""
    found = {}
    with tarfile.open(archive) as tar:
        for name in tar.getnames():
            parts = name.split("/")
            if "site-packages" in parts and len(parts) > parts.index("site-packages") + 1:
                top = parts[parts.index("site-packages") + 1]
                if top.endswith(".dist-info"):
                    dist, _, version = top[:-len(".dist-info")].partition("-")
                    found[dist.lower()] = version
    return found


def infer(url: str, x: np.ndarray) -> np.ndarray:
    client = httpclient.InferenceServerClient(url, network_timeout=120)
    try:
        tensor = httpclient.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        return client.infer("scaled", [tensor]).as_numpy("y")
    finally:
        client.close()


def test_the_packed_environment_holds_what_the_callable_needs(tmp_path: Path):
    source = build(tmp_path / "models")
    out = tmp_path / "exported"
    summary = export(source, out)
    config = parse_config((out / "scaled" / "config.pbtxt").read_text(), "scaled")
    assert config.parameters["EXECUTION_ENV_PATH"].string_value == \
        "$$TRITON_MODEL_DIRECTORY/python_env.tar.gz"
    packed = packed_top_levels(out / "scaled" / "python_env.tar.gz")
    assert {"cloudpickle", "numpy", "packaging"} <= set(packed), packed
    assert "torch" not in packed and "jupyter_server" not in packed, packed
    import numpy
    assert packed["numpy"] == numpy.__version__          # the served version, copied
    assert "packed its Python" in summary
    # the source is untouched: the environment lives only in the copy
    assert "EXECUTION_ENV_PATH" not in (source / "scaled" / "config.pbtxt").read_text()

    # this server runs the copy in its packed environment too
    server, client = serve(out, model_control_mode="none")
    client.close()
    try:
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        np.testing.assert_array_equal(infer(f"127.0.0.1:{server.http_port}", x), x * 3 - 1)
    finally:
        server.close()


def test_a_bad_pin_is_refused_and_writes_nothing(tmp_path: Path):
    source = build(tmp_path / "models")
    out = tmp_path / "exported"
    done = subprocess.run([CLI, "export", "--model-repository", str(source), "--output", str(out),
                           "--pack-env", "--pack-env-pin", "numpy>>>1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "--pack-env-pin" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists() and not list(tmp_path.glob(".exported-*"))


def test_an_exported_callable_answers_in_tritonserver_with_nothing_installed(tmp_path: Path):
    tritonserver_dist()                 # skips with the reason where the venv is absent
    source = build(tmp_path / "models")
    out = tmp_path / "exported"
    # Triton 2.51's python backend returns empty outputs with numpy 2 (tritonserver_peer)
    export(source, out, "--pack-env-pin", "numpy<2")
    assert packed_top_levels(out / "scaled" / "python_env.tar.gz")["numpy"].startswith("1.")
    triton = TritonServer(out, tmp_path / "triton", control="none",
                          extra_args=["--exit-on-error=false"])      # no packages linked in
    try:
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        np.testing.assert_array_equal(infer(triton.url, x), x * 3 - 1)
    except Exception:
        print(triton.log.read_text(errors="replace")[-3000:])
        raise
    finally:
        triton.close()
