"""Every fenced code block of the README runs here as written, or is listed in ``COVERAGE`` as
not runnable here, with the reason; ``test_every_readme_block_is_run_or_listed`` keeps the two
in step. Only the placeholders a reader fills in (a token, a port, ``./models``, the models and
variables an example assumes) are filled by the test:

* the Quickstart's curl lines and tritonclient snippet, against the out-of-the-box Jupyter
  server (the demo repository, nothing configured);
* the notebook blocks, each as one cell in README order, in a real kernel (jupyter_client) with
  no Jupyter server around, so the magic starts the in-kernel server; a preamble cell defines
  what they assume (models ``tokenize`` and ``embed`` served, an earlier ``scorer``, ``new_fn``,
  ``x``, ``expected``);
* ``jupyter-triton serve`` (and ``jupyter triton serve``) and ``jupyter-triton export`` as
  commands, on free loopback ports; the export served by NVIDIA's tritonserver where
  nvidia-pytriton's is installed (./dev test installs it);
* the server extension's configuration block, as traitlets config.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from traitlets.config import Config

from conftest import TOKEN, in_thread
from ports import free_port

README = Path(__file__).resolve().parent.parent / "README.md"
BIN = Path(sys.executable).parent          # jupyter-triton, jupyter: the venv's, as after pip install


@dataclass(frozen=True)
class NotRunnable:
    reason: str


# One entry per fenced block of each README section (a "## " heading and its subsections), in
# order: the test that runs it, or why none can here.
COVERAGE: dict[str, list[str | NotRunnable | tuple[str, ...]]] = {
    "## Set-up": [NotRunnable(
        "`./dev lab` starts JupyterLab in the foreground until it is stopped, after creating .venv "
        "and installing packages from the network on a fresh clone (tests/test_browser_notebooks.py "
        "runs every notebook in the lab it starts); `./dev test` is the whole suite, this test in it")],
    "## In a notebook": ["test_notebook_blocks_run_in_a_kernel"] * 7,
    "## Quickstart": ["test_quickstart_blocks_run_as_written"] * 2,
    "## Without Jupyter": ["test_serve_without_jupyter_block"],
    "## Scale-out": [("test_scale_out_block_exports",            # line 1
                      "test_scale_out_block_serves_in_tritonserver")],   # lines 1 and 2, where installed
    "## Configuration of the server extension": ["test_extension_configuration_block_is_valid_config"],
}


def readme_blocks() -> list[tuple[str, str, str]]:
    """(section, language, code) of every fenced block of the README; section: the "## "
    heading above it."""
    found, section, fence, lang, lines = [], "", None, "", []
    for line in README.read_text().splitlines():
        if fence is None:
            if line.startswith("## "):
                section = line
            elif line.lstrip().startswith(("```", "~~~")):
                fence, lang, lines = line.lstrip()[:3], line.lstrip()[3:].strip(), []
        elif line.lstrip().startswith(fence):
            found.append((section, lang, "\n".join(lines) + "\n"))
            fence = None
        else:
            lines.append(line)
    assert fence is None, "the README ends inside a fenced block"
    return found


def blocks(section: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block under the README heading starting ``section``."""
    return [(lang, code) for heading, lang, code in readme_blocks() if heading.startswith(section)]


def test_every_readme_block_is_run_or_listed():
    counted: dict[str, int] = {}
    for heading, _, _ in readme_blocks():
        (section,) = [s for s in COVERAGE if heading.startswith(s)] or [heading]
        counted[section] = counted.get(section, 0) + 1
    assert counted == {s: len(entries) for s, entries in COVERAGE.items()}, \
        "a README block is neither run by a test here nor listed in COVERAGE as not runnable"
    for entries in COVERAGE.values():
        for entry in entries:
            if isinstance(entry, NotRunnable):
                assert entry.reason
            for name in (entry,) if isinstance(entry, str) else entry if isinstance(entry, tuple) else ():
                assert callable(globals().get(name)), name


def _without_servers_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER_TRITON_", "JUPYTERHUB_"))}
    env["JUPYTER_RUNTIME_DIR"] = str(tmp_path / "runtime")   # no other server's runtime file
    env["IPYTHONDIR"] = str(tmp_path / "ipython")
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    return env


# ---- Quickstart: the out-of-the-box Jupyter server ------------------------------------------

@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"jupyter_triton": True}, "token": TOKEN},
            "IdentityProvider": {"token": TOKEN}}


@pytest.fixture
def jp_base_url() -> str:
    return "/"          # the README's URLs are a plain `./dev lab`'s


def _fill(code: str, port: int) -> str:
    assert "localhost:8888" in code and ("TOKEN" in code)
    code = code.replace("localhost:8888", f"localhost:{port}")
    return re.sub(r"^TOKEN=\.\.\..*$", f"TOKEN={TOKEN}", code, flags=re.M)


def _json_values(text: str) -> list:
    decoder, values, at = json.JSONDecoder(), [], 0
    while at < len(text.rstrip()):
        value, at = decoder.raw_decode(text, at)
        values.append(value)
        while at < len(text) and text[at].isspace():
            at += 1
    return values


async def test_quickstart_blocks_run_as_written(jp_triton, jp_http_port):
    found = blocks("## Quickstart")
    assert [lang for lang, _ in found] == ["bash", "python"]
    (_, shell), (_, python) = found

    done = await in_thread(lambda: subprocess.run(
        ["bash", "-euo", "pipefail", "-c", _fill(shell, jp_http_port)],
        capture_output=True, text=True, timeout=60))
    assert done.returncode == 0, done.stderr
    metadata, answer = _json_values(done.stdout)       # curl prints the two bodies back to back
    assert metadata["name"] == "demo" and metadata["versions"] == ["1"]
    assert answer["outputs"][0]["shape"] == [1, 4]

    printed: list[str] = []
    namespace = {"TOKEN": TOKEN, "print": lambda *a: printed.append(" ".join(map(str, a)))}
    code = compile(_fill(python, jp_http_port), str(README), "exec")

    def run():      # tritonclient.http's client lives on the thread that made it (gevent)
        exec(code, namespace)
        return namespace["client"].get_model_metadata("mine", headers=namespace["auth"]())

    mine = await in_thread(run)
    assert printed[0].count("[") == 3                         # the demo's (2, 4) answer
    assert printed[-1] == "True"                              # the model it loaded is served
    assert mine["versions"] == ["1"] and mine["platform"] == "onnxruntime_onnx"


# ---- In a notebook: the blocks as cells of one kernel ----------------------------------------

# What the notebook blocks assume and a reader has: the models the ensemble composes (TEXT ->
# IDS, IDS -> EMBEDDING), a scorer already served (what rollback returns to), the lifecycle
# example's function, inputs and expected outputs.
PREAMBLE = '''\
import numpy as np
import jupyter_triton

def tokenize(TEXT):
    return np.array([[len(t) % 7 + 1] * 8 for t in TEXT.reshape(-1)], np.int64)

def embed(IDS):
    return IDS.astype(np.float32) / 7

jupyter_triton.serve(tokenize, "tokenize", max_batch_size=8, outputs=[("IDS", "INT64", [-1, 8])],
                     example={"TEXT": np.array([[b"hello"]], dtype=object)})
jupyter_triton.serve(embed, "embed", max_batch_size=8, example=np.ones((1, 8), np.int64),
                     outputs=[("EMBEDDING", "FP32", [-1, 8])])
x = np.arange(8, dtype=np.float32).reshape(2, 4)
jupyter_triton.serve(lambda x: x + 1, "scorer", example=x)

def new_fn(x):
    return x * 2

expected = x * 2
'''

# After the README's cells: what they did, as the server sees it.
CHECK = '''\
import json, pathlib
ready = sorted({r["name"] for r in jupyter_triton.models() if r.get("state") == "READY"})
print(json.dumps({
    "ready": ready,
    "scorer": jupyter_triton.model("scorer").version,
    "history": [r["action"] for r in jupyter_triton.history("scorer")],
    "rag_embed": jupyter_triton.model("rag_embed").infer(np.array([[b"abc"]], dtype=object)).tolist(),
    "talker": list(jupyter_triton.model("talker").stream("one two")),
    "tuned": [len(t.results), t.best is not None, pathlib.Path("tune.csv").read_text().count("\\n")],
    "planned": len(plan.results),
}))
'''


def _kernel(cwd: Path, env: dict[str, str]):
    from jupyter_client.manager import start_new_kernel
    from test_kernel import Kernel            # runs a cell, collects what it showed
    manager, client = start_new_kernel(kernel_name="python3", env=env, cwd=str(cwd), startup_timeout=60)
    return manager, Kernel(client)


def _fill_cell(code: str) -> str:
    # the lifecycle example's "more golden cases" placeholder: the preamble's one case is all
    return code.replace("golden=[(x, expected), ...]", "golden=[(x, expected)]")


@pytest.mark.timeout(300)
def test_notebook_blocks_run_in_a_kernel(tmp_path: Path):
    cells = [code for lang, code in blocks("## In a notebook")]
    assert [lang for lang, _ in blocks("## In a notebook")] == ["python"] * 7
    manager, kernel = _kernel(tmp_path, _without_servers_env(tmp_path))
    try:
        started = kernel.ok(PREAMBLE)
        assert "serving from this kernel at http://127.0.0.1:" in started.stdout     # no Jupyter server
        shown = [kernel.ok(_fill_cell(code), timeout=180).text for code in cells]
        facts = json.loads(kernel.ok(CHECK).stdout.strip().splitlines()[-1])
    finally:
        kernel.client.stop_channels()
        manager.shutdown_kernel(now=True)
    _, embedder, talker, ensemble, tune, lifecycle, plan = shown
    assert "embedder version 1 READY" in embedder and "/v2/models/embedder" in embedder
    assert "talker version 1 READY" in talker and "decoupled" in talker
    assert "rag_embed version 1 READY" in ensemble and "steps: tokenize -> embed" in ensemble
    assert "tune.csv" in tune
    assert "scorer version 1 READY" in lifecycle                  # rolled back to the earlier one
    assert re.search(r"embedder version \d+ READY", plan) and "simulated:" in plan
    assert {"embedder", "talker", "rag_embed", "scorer"} <= set(facts["ready"]), facts
    assert facts["scorer"] == 1 and facts["history"][-2:] == ["promote", "rollback"], facts
    np.testing.assert_allclose(facts["rag_embed"], [[4 / 7] * 8], rtol=1e-6)    # tokenize, then embed
    assert facts["talker"] == ["one", "two"], facts                # a response a word
    assert facts["tuned"] == [4, True, 5], facts                  # 2 x 2 configs, a csv row each
    assert facts["planned"] == 3 * 2 * 3 * 2, facts               # qps x sizes x delays x instances


# ---- Without Jupyter: the standalone command -------------------------------------------------

def _python_model(root: Path, name: str = "add_one") -> Path:
    """A python-backend model as Triton writes them (the form NVIDIA's tritonserver here serves
    too): OUTPUT0 = INPUT0 + 1."""
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text('''\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
                    "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() + 1)])
                for r in requests]
''')
    (root / name / "config.pbtxt").write_text(f'''name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
''')
    return root


def _add_one_answers(url: str) -> None:
    client = httpclient.InferenceServerClient(url)
    try:
        inp = httpclient.InferInput("INPUT0", [2, 4], "FP32")
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        inp.set_data_from_numpy(x)
        np.testing.assert_allclose(client.infer("add_one", [inp]).as_numpy("OUTPUT0"), x + 1)
    finally:
        client.close()


def _wait_ready(proc: subprocess.Popen, url: str, seconds: float = 60) -> None:
    client = httpclient.InferenceServerClient(url)
    deadline = time.monotonic() + seconds
    try:
        while True:
            assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{proc.stdout.read()}"
            try:
                if client.is_server_ready():
                    return
            except Exception:                      # not listening yet
                pass
            assert time.monotonic() < deadline, f"the server was not ready within {seconds:g} s"
            time.sleep(0.1)
    finally:
        client.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spelling", ["as written", "the comment's"])
def test_serve_without_jupyter_block(tmp_path: Path, spelling: str):
    from conftest import build_repository
    ((lang, code),) = blocks("## Without Jupyter")
    command, _, comment = code.strip().partition("#")
    assert lang == "bash" and command.split()[:3] == ["jupyter-triton", "serve", "--model-repository"]
    if spelling != "as written":
        also = re.fullmatch(r"\s*also: (.+) serve \.\.\.\s*", comment)
        assert also, comment
        command = command.replace("jupyter-triton", also.group(1), 1)
    build_repository(tmp_path / "models")           # ./models: the user's repository
    _python_model(tmp_path / "models")
    http, grpc, metrics = free_port(), free_port(), free_port()
    ports = (f" --http-address 127.0.0.1 --grpc-address 127.0.0.1 --http-port {http}"
             f" --grpc-port {grpc} --metrics-port {metrics}")
    proc = subprocess.Popen(shlex.split(command + ports), cwd=tmp_path, env=_without_servers_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_ready(proc, f"127.0.0.1:{http}")
        client = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
        assert {r["name"]: r["state"] for r in client.get_model_repository_index()} == \
            dict.fromkeys(("add_one", "identity_int32", "linear", "simple"), "READY")   # mode none: all
        client.close()
        _add_one_answers(f"127.0.0.1:{http}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, proc.stdout.read()


# ---- Scale-out: export, then NVIDIA's tritonserver ------------------------------------------

def _scale_out_commands() -> list[str]:
    ((lang, code),) = blocks("## Scale-out")
    assert lang == "bash"
    commands = [line.strip() for line in code.replace("\\\n", " ").splitlines() if line.strip()]
    assert [c.split()[0] for c in commands] == ["jupyter-triton", "tritonserver"], commands
    return commands


def _export(tmp_path: Path) -> Path:
    """The block's first command in ``tmp_path``, its optional part (in brackets) included."""
    export = re.sub(r"\[(.*?)\]", r"\1", _scale_out_commands()[0])
    _python_model(tmp_path / "models")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", export], cwd=tmp_path,
                          env=_without_servers_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return tmp_path / "for-triton"


@pytest.mark.timeout(180)
def test_scale_out_block_exports(tmp_path: Path):
    out = _export(tmp_path)
    assert (out / "add_one" / "config.pbtxt").is_file() and (out / "add_one" / "1" / "model.py").is_file()
    manifest = (tmp_path / "for-triton-kserve.yaml").read_text()
    assert "kind: InferenceService" in manifest and "my-models" in manifest
    assert "s3://bucket/models" in manifest


@pytest.mark.timeout(300)
def test_scale_out_block_serves_in_tritonserver(tmp_path: Path):
    from tritonserver_peer import TritonServer, tritonserver_dist
    tritonserver_dist()                          # skips, with the reason, where it is not installed
    serve = _scale_out_commands()[1]
    assert serve == "tritonserver --model-repository=./for-triton", serve
    out = _export(tmp_path)
    # the binary's place, its backends, ports on 127.0.0.1: what the peer fills in; the mode is
    # tritonserver's default (none: every model of the repository loaded)
    server = TritonServer(out, tmp_path / "triton", control="none")
    try:
        _add_one_answers(server.url)
    finally:
        server.close()


# ---- Configuration of the server extension ---------------------------------------------------

def test_extension_configuration_block_is_valid_config():
    # Every trait the README's configuration block sets exists, with a value of its type.
    from jupyter_triton.serverext import JupyterTriton
    (lang, code), = blocks("## Configuration of the server extension")
    assert lang == "python"
    c = Config()
    exec(compile(code, str(README), "exec"), {"c": c})
    app = JupyterTriton(config=c)
    for name, value in c.JupyterTriton.items():
        assert app.trait_has_value(name) or name in app.trait_names(), name
        assert getattr(app, name) == value, name
