"""EXECUTION_ENV_PATH: a python model runs its workers in its own packed environment (a
venv packed by venv-pack), with a package the server's python does not have; built here,
offline, in the test."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import serve
from jupyter_triton.backends.python import envs

PACKAGE = "tiny_env_only_pkg"

MODEL_PY = f'''
import json, os, sys
import numpy as np
import triton_python_backend_utils as pb_utils
import {PACKAGE}

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            if float(x.ravel()[0]) < 0:
                os._exit(3)   # a crash costs this worker's requests only
            info = {{"magic": {PACKAGE}.magic(float(x.ravel()[0])), "executable": sys.executable,
                    "prefix": sys.prefix, "pid": os.getpid(), "package": {PACKAGE}.__file__,
                    "virtual_env": os.environ.get("VIRTUAL_ENV", "")}}
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor(
                "INFO", np.array([json.dumps(info).encode()], dtype=np.object_))]))
        return out
'''


def config(name: str, env_path: str | None) -> str:
    text = f'''
name: "{name}"
backend: "python"
input [{{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }}]
output [{{ name: "INFO" data_type: TYPE_STRING dims: [ 1 ] }}]
'''
    if env_path is not None:
        text += f'parameters {{ key: "EXECUTION_ENV_PATH" value: {{ string_value: "{env_path}" }} }}\n'
    return text


@pytest.fixture(scope="module")
def packed_env(tmp_path_factory) -> Path:
    """A venv with a package of its own (written into its site-packages, as pip would put
    it), packed by venv-pack."""
    import venv_pack
    root = tmp_path_factory.mktemp("env")
    prefix = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(prefix)], check=True, timeout=120)
    site = next(prefix.glob("lib/python3*/site-packages"))
    (site / PACKAGE).mkdir()
    (site / PACKAGE / "__init__.py").write_text(textwrap.dedent('''
        def magic(x):
            return f"packed env says {x:g}"
    '''))
    archive = root / "tiny_env.tar.gz"
    venv_pack.pack(prefix=str(prefix), output=str(archive))
    return archive


def write(repo: Path, name: str, env_path: str | None, archive: Path | None = None) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(MODEL_PY)
    (repo / name / "config.pbtxt").write_text(config(name, env_path))
    if archive is not None:
        (repo / name / archive.name).write_bytes(archive.read_bytes())


def ask(client: httpclient.InferenceServerClient, name: str, x: float) -> dict:
    inp = httpclient.InferInput("X", [1], "FP32")
    inp.set_data_from_numpy(np.array([x], np.float32))
    result = client.infer(name, [inp])
    return json.loads(result.as_numpy("INFO")[0])


def test_a_model_runs_in_its_packed_environment(tmp_path, packed_env):
    with pytest.raises(ImportError):   # the server's python has not got it
        __import__(PACKAGE)
    repo = tmp_path / "models"
    write(repo, "in_env", "$$TRITON_MODEL_DIRECTORY/tiny_env.tar.gz", packed_env)
    # another model naming the same archive by its absolute path: unpacked once for both
    write(repo, "same_elsewhere", str(repo / "in_env" / packed_env.name))
    write(repo, "no_env", None)
    server, client = serve(repo, model_control_mode="explicit")
    try:
        client.load_model("in_env")
        client.load_model("same_elsewhere")
        info = ask(client, "in_env", 2.0)
        assert info["magic"] == "packed env says 2"
        unpacked = Path(info["prefix"])
        assert unpacked.parent == envs.cache_dir() and unpacked.name.startswith("tiny_env-")
        assert Path(info["executable"]).parent == unpacked / "bin"
        assert Path(info["package"]).is_relative_to(unpacked)
        assert info["virtual_env"] == str(unpacked)     # as its activate would leave it
        assert ask(client, "same_elsewhere", 5.0)["prefix"] == info["prefix"]

        # the same model.py without the environment cannot import its package: a 400
        with pytest.raises(InferenceServerException) as err:
            client.load_model("no_env")
        assert err.value.status() == "400" and PACKAGE in str(err.value)

        # a crash in the environment's worker costs its own request; a new worker serves on
        with pytest.raises(InferenceServerException) as crash:
            ask(client, "in_env", -1.0)
        assert "died" in str(crash.value)
        again = ask(client, "in_env", 3.0)
        assert again["magic"] == "packed env says 3" and again["pid"] != info["pid"]
        assert ask(client, "same_elsewhere", 4.0)["magic"] == "packed env says 4"
    finally:
        server.close()


@pytest.mark.parametrize("value, why", [
    ("$$TRITON_MODEL_DIRECTORY/missing.tar.gz", "no such file or directory"),
    ("not_an_env", "no bin/python"),
    ("broken.tar.gz", "cannot unpack"),
])
def test_a_bad_environment_fails_the_load_with_400(tmp_path, value, why):
    repo = tmp_path / "models"
    write(repo, "bad_env", value)
    (repo / "bad_env" / "not_an_env").mkdir()
    (repo / "bad_env" / "broken.tar.gz").write_bytes(b"not a tar archive")
    server, client = serve(repo, model_control_mode="explicit")
    try:
        with pytest.raises(InferenceServerException) as err:
            client.load_model("bad_env")
        assert err.value.status() == "400", err.value
        assert "EXECUTION_ENV_PATH" in str(err.value) and why in str(err.value), err.value
        assert client.is_server_live()
    finally:
        server.close()
