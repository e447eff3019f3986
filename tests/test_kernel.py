"""The notebook story in real kernels: %%serve a model, call its URL from another process
with the unmodified tritonclient, re-run the cell under load, restart the kernel.

The Jupyter server (pytest-jupyter) runs on this test's event loop, so the kernel's cells
and every blocking client run in threads while the test awaits them.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
from jupyter_client import BlockingKernelClient
from jupyter_client.manager import start_new_kernel
from tritonclient.utils import InferenceServerException

from conftest import TOKEN
from jupyter_triton.kernel import discovery

pytestmark = pytest.mark.timeout(180)

AUTH = {"Authorization": f"token {TOKEN}"}
CELL_TIMEOUT = 120.0


@dataclass
class Cell:
    stdout: str
    stderr: str
    text: str            # the execute_result's text/plain
    error: str

    def url(self, model: str) -> str:
        found = re.search(rf"URL\s+(http://\S+/v2/models/{model})\b", self.text)
        assert found, f"no URL for {model} in the cell output:\n{self}"
        return found.group(1)


class Kernel:
    """A blocking client that runs one cell at a time and collects what it showed."""

    def __init__(self, client: BlockingKernelClient) -> None:
        self.client = client

    def run(self, code: str, timeout: float = CELL_TIMEOUT) -> Cell:
        msg_id = self.client.execute(code)
        out = {"stdout": "", "stderr": "", "text": "", "error": ""}
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"cell did not finish within {timeout} s:\n{code}"
            msg = self.client.get_iopub_msg(timeout=remaining)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out[content["name"]] += content["text"]
            elif kind == "execute_result":
                out["text"] += content["data"].get("text/plain", "")
            elif kind == "error":
                out["error"] = f"{content['ename']}: {content['evalue']}"
            elif kind == "status" and content["execution_state"] == "idle":
                return Cell(**out)

    def ok(self, code: str, timeout: float = CELL_TIMEOUT) -> Cell:
        cell = self.run(code, timeout)
        assert not cell.error and "Error" not in cell.stderr, f"{code}\n->\n{cell}"
        return cell


def call(url: str, inputs: dict[str, np.ndarray], output: str, headers: dict | None = None) -> np.ndarray:
    """One inference with the official client at a model URL printed by %%serve."""
    parts = urlsplit(url)
    base, _, model = parts.path.partition("/v2/models/")
    client = httpclient.InferenceServerClient(parts.netloc + base.rstrip("/"), network_timeout=60)
    try:
        tensors = []
        for name, value in inputs.items():
            t = httpclient.InferInput(name, list(value.shape), "FP32")
            t.set_data_from_numpy(value)
            tensors.append(t)
        return client.infer(model, tensors, headers=dict(headers or {})).as_numpy(output)
    finally:
        client.close()


async def in_thread(fn, *args):
    # Not asyncio.to_thread: it copies the context, and jupyter_client's blocking calls would
    # find this (running) loop in jupyter_core's context variable.
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


@pytest.fixture
def server_kernel(jp_triton, jp_asyncio_loop):
    """Start kernels through the Jupyter server's own kernel manager (they inherit the
    server's environment, JUPYTER_TRITON_URL/TOKEN included)."""
    manager = jp_triton.kernel_manager
    started: list[str] = []

    async def start() -> tuple[str, Kernel]:
        kid = await manager.start_kernel()
        started.append(kid)
        return kid, await connect(kid)

    async def connect(kid: str) -> Kernel:
        client = BlockingKernelClient()
        client.load_connection_info(manager.get_kernel(kid).get_connection_info(session=False))
        # A missed heartbeat reads as a dead kernel: on a busy machine 1 s (the default) is
        # too short for a kernel that is merely slow to answer.
        client.hb_channel.time_to_dead = 30.0
        client.start_channels()
        await in_thread(client.wait_for_ready, 60)
        return Kernel(client)

    start.connect = connect
    yield start
    for kid in started:
        if kid in manager:
            jp_asyncio_loop.run_until_complete(manager.shutdown_kernel(kid, now=True))


TORCH_CELL = """%%serve embedder --max-batch-size 64 --max-queue-delay-us 500 --instances 2
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.ReLU())
model"""

ONNX_CELL = """%%serve {name}
import numpy as np
from onnx import TensorProto, helper, numpy_helper
scale = {scale}
W = np.arange(12, dtype=np.float32).reshape(4, 3) / 10 * scale
graph = helper.make_graph(
    [helper.make_node("MatMul", ["x", "W"], ["y"])], "matmul",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
    [numpy_helper.from_array(W, "W")])
onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
onnx_model.ir_version = 8
onnx_model"""

SOFTMAX_CELL = """%%serve softmax --example logits
import numpy as np
logits = np.random.default_rng(0).standard_normal((2, 5)).astype(np.float32)
def softmax(logits):
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)
softmax"""


def onnx_w(scale: float) -> np.ndarray:
    return np.arange(12, dtype=np.float32).reshape(4, 3) / 10 * scale


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


async def test_serve_torch_onnx_and_a_function_from_a_kernel_of_the_jupyter_server(
        server_kernel, jp_base_url):
    _, kernel = await server_kernel()
    await in_thread(kernel.ok, "%load_ext jupyter_triton")

    # the README example: the time from running the cell to another process's first answer
    started = time.monotonic()
    cell = await in_thread(kernel.ok, TORCH_CELL)
    url = cell.url("embedder")
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    got = await in_thread(call, url, {"input": x}, "OUTPUT__0", AUTH)
    first_call = time.monotonic() - started
    print(f"\n%%serve (torch module, 2 python-backend instances) -> first remote call: {first_call:.2f} s")
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.ReLU())
    np.testing.assert_allclose(got, reference(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6)

    assert urlsplit(url).path == f"{jp_base_url}v2/models/embedder"
    assert "version 1 READY" in cell.text
    # the snippets read a variable the kernel has: the server's JUPYTER_TOKEN only where it is set
    variable = "JUPYTER_TOKEN" if os.environ.get("JUPYTER_TOKEN") else "JUPYTER_TRITON_TOKEN"
    assert f'-H "Authorization: token ${variable}" {url}/infer' in cell.text
    assert 'httpclient.InferenceServerClient("' in cell.text and 'as_numpy("OUTPUT__0")' in cell.text
    assert os.environ["JUPYTER_TRITON_TOKEN"] not in cell.text + cell.stdout   # never the secret
    assert "serving from this kernel" not in cell.stdout

    started = time.monotonic()
    cell = await in_thread(kernel.ok, ONNX_CELL.format(name="matmul", scale=1.0))
    x = np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)
    got = await in_thread(call, cell.url("matmul"), {"x": x}, "y", AUTH)
    print(f"%%serve (ONNX) -> first remote call: {time.monotonic() - started:.2f} s")
    np.testing.assert_allclose(got, x @ onnx_w(1.0), rtol=1e-5)

    started = time.monotonic()
    cell = await in_thread(kernel.ok, SOFTMAX_CELL)
    x = np.random.default_rng(3).standard_normal((4, 5)).astype(np.float32)
    got = await in_thread(call, cell.url("softmax"), {"logits": x}, "OUTPUT__0", AUTH)
    print(f"%%serve (numpy function) -> first remote call: {time.monotonic() - started:.2f} s")
    np.testing.assert_allclose(got, softmax(x), rtol=1e-5)

    # the handle works from the notebook too, and %triton lists what is served
    cell = await in_thread(kernel.ok, "h = _\nh.infer(np.ones((2, 5), np.float32)).round(3).tolist()")
    assert json.loads(cell.text) == softmax(np.ones((2, 5), np.float32)).round(3).tolist()
    listing = (await in_thread(kernel.ok, "%triton list")).stdout
    assert re.search(r"embedder\s+1\s+READY", listing) and re.search(r"softmax\s+1\s+READY", listing)


async def test_rerunning_a_serve_cell_under_load_fails_no_request(server_kernel, model_repo):
    _, kernel = await server_kernel()
    await in_thread(kernel.ok, "%load_ext jupyter_triton")
    cell = await in_thread(kernel.ok, ONNX_CELL.format(name="rolling", scale=1.0))
    url = cell.url("rolling")
    assert "version 1 READY" in cell.text

    x = np.ones((2, 4), np.float32)
    answers = {"v1": x @ onnx_w(1.0), "v2": x @ onnx_w(2.0), "v3": x @ onnx_w(3.0)}
    seen: list[str] = []
    failures: list[str] = []
    stop = threading.Event()

    def load() -> None:
        deadline = time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                got = call(url, {"x": x}, "y", AUTH)
                seen.append(next(k for k, v in answers.items() if np.allclose(got, v)))
            except Exception as err:  # counted: the test asserts there are none
                failures.append(repr(err))

    sender = threading.Thread(target=load, daemon=True)
    sender.start()

    async def answers_past(count: int) -> None:
        # waited for, not slept: the sender shares this process (and its GIL) with the server
        deadline = time.monotonic() + 30
        while len(seen) < count + 2 and not failures and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    try:
        await answers_past(0)
        second = await in_thread(kernel.ok, ONNX_CELL.format(name="rolling", scale=2.0))
        third = await in_thread(kernel.ok, ONNX_CELL.format(name="rolling", scale=3.0))
        await answers_past(len(seen))       # at least one call sent after v3 was ready
    finally:
        stop.set()
        await in_thread(sender.join, 30)
    assert failures == []
    assert "version 2 READY" in second.text and "version 3 READY" in third.text
    assert seen[0] == "v1" and seen[-1] == "v3" and len(seen) > 10
    # answers never go back to an older version
    assert seen == sorted(seen)
    assert (model_repo / "rolling" / "1" / "model.onnx").exists()      # old versions stay on disk
    assert (model_repo / "rolling" / "2" / "model.onnx").exists()


async def test_models_survive_a_kernel_restart(server_kernel, jp_triton):
    kid, kernel = await server_kernel()
    await in_thread(kernel.ok, "%load_ext jupyter_triton")
    url = (await in_thread(kernel.ok, ONNX_CELL.format(name="durable", scale=1.0))).url("durable")
    kernel.client.stop_channels()

    await jp_triton.kernel_manager.restart_kernel(kid)
    kernel = await server_kernel.connect(kid)
    x = np.ones((1, 4), np.float32)
    np.testing.assert_allclose(await in_thread(call, url, {"x": x}, "y", AUTH), x @ onnx_w(1.0), rtol=1e-5)
    cell = await in_thread(kernel.ok, "%load_ext jupyter_triton\n%triton status durable")
    assert cell.url("durable") == url and "version 1 READY" in cell.text


def test_without_the_extension_the_kernel_serves_itself(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JUPYTER_TRITON_", "JUPYTERHUB_"))}
    env["JUPYTER_RUNTIME_DIR"] = str(tmp_path)          # no other server's runtime file either
    manager, client = start_new_kernel(kernel_name="python3", env=env, startup_timeout=60)
    try:
        kernel = Kernel(client)
        kernel.ok("%load_ext jupyter_triton")
        started = time.monotonic()
        cell = kernel.ok(SOFTMAX_CELL)
        url = cell.url("softmax")
        token = json.loads(kernel.ok("import os; os.environ['JUPYTER_TRITON_TOKEN']").text.replace("'", '"'))
        auth = {"Authorization": f"token {token}"}
        x = np.random.default_rng(4).standard_normal((3, 5)).astype(np.float32)
        got = call(url, {"logits": x}, "OUTPUT__0", auth)
        print(f"\nin-kernel server: %%serve (numpy function) -> first remote call: "
              f"{time.monotonic() - started:.2f} s")
        np.testing.assert_allclose(got, softmax(x), rtol=1e-5)
        assert re.search(r"no Jupyter server extension found: serving from this kernel at "
                         r"http://127\.0\.0\.1:\d+/", cell.stdout)
        assert url.startswith("http://127.0.0.1:") and token not in cell.text + cell.stdout
        assert f'-H "Authorization: token $JUPYTER_TRITON_TOKEN" {url}/infer' in cell.text
        assert 'os.environ["JUPYTER_TRITON_TOKEN"]' in cell.text
        # the curl line the handle shows works as shown, from the kernel's own shell
        curl = cell.text[cell.text.index("curl -s"):].split("tritonclient:")[0]
        shown = kernel.ok("import subprocess\nprint(subprocess.run(" + repr(curl.replace("\\\n", " ")) +
                          ", shell=True, capture_output=True, text=True, timeout=30).stdout)")
        assert json.loads(shown.stdout)["outputs"][0]["name"] == "OUTPUT__0"

        with pytest.raises(InferenceServerException) as err:
            call(url, {"logits": x}, "OUTPUT__0")                       # no credential
        assert err.value.status() == "401"
        load = url.replace("/v2/models/softmax", "/v2/repository/models/softmax/load")
        for headers, status in [({**auth, "Content-Type": "text/plain"}, 415),       # no preflight
                                ({**auth, "Host": "rebound.example"}, 403),            # DNS rebinding
                                ({"Content-Type": "application/json"}, 401)]:
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(urllib.request.Request(load, data=b"{}", headers=headers), timeout=10)
            assert refused.value.code == status, headers
        again = kernel.ok(SOFTMAX_CELL)
        assert "version 2 READY" in again.text and "serving from this kernel" not in again.stdout
        problem = kernel.run("%%serve nothing\nimport numpy as np\nnp.ones(3)")
        assert "UsageError" in problem.stderr and "model 'nothing'" in problem.stderr
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


# ---- discovery without kernels -------------------------------------------------------------

async def test_discovery_skips_stale_settings_and_finds_the_runtime_file(jp_triton, jp_runtime_dir, tmp_path):
    stale = {"JUPYTER_TRITON_URL": "http://127.0.0.1:9/", "JUPYTER_TRITON_TOKEN": "x"}
    assert await in_thread(discovery.from_environment, stale) is None
    dead = tmp_path / "jupyter_triton-999999999.json"
    dead.write_text(json.dumps({"url": "http://127.0.0.1:9/", "token": "t", "pid": 999999999}))
    assert discovery.runtime_files(tmp_path) == []
    found = await in_thread(discovery.from_runtime_files, jp_runtime_dir)
    assert found is not None and found.mode == discovery.RUNTIME_FILE
    assert found.url == os.environ["JUPYTER_TRITON_URL"] and found.token == os.environ["JUPYTER_TRITON_TOKEN"]
    assert found.headers == {"Authorization": f"token {found.token}"}
    assert found.model_url("m") == found.url + "v2/models/m"


# ---- the magic's arguments (in-process IPython, the server call replaced) -------------------

def test_serve_magic_maps_knobs_and_takes_the_cells_value(monkeypatch):
    from IPython.core.error import UsageError
    from IPython.testing.globalipapp import get_ipython

    from jupyter_triton.kernel import api
    calls = []
    monkeypatch.setattr(api, "serve", lambda obj, name, **kw: calls.append((obj, name, kw)) or "handle")
    ip = get_ipython()
    ip.run_line_magic("load_ext", "jupyter_triton")
    result = ip.run_cell_magic(
        "serve", "m --max-batch-size 64 --preferred-batch-size 8,16 --preferred-batch-size 32 "
                 "--max-queue-delay-us 500 --priority-levels 2 --instances 2 --kind cpu --warmup 3 "
                 "--example ex --config 'parameters { key: \"k\" value { string_value: \"a b\" } }'",
        "import numpy as np\nex = np.ones((2, 3))\ndef f(x):\n    return x\nf")
    assert result == "handle"
    obj, name, kw = calls[-1]
    assert name == "m" and obj is ip.user_ns["f"]
    assert kw["example"] is ip.user_ns["ex"]
    assert (kw["max_batch_size"], kw["preferred_batch_sizes"], kw["max_queue_delay_us"]) == (64, [8, 16, 32], 500)
    assert (kw["priority_levels"], kw["instances"], kw["kind"], kw["warmup"]) == (2, 2, "cpu", 3)
    assert kw["config"] == 'parameters { key: "k" value { string_value: "a b" } }'

    assert kw["decoupled"] is None and kw["sequence"] is False      # inferred from the function
    ip.run_cell_magic("serve", "m2", "g = lambda x: x")          # a last assignment is the value
    assert calls[-1][0] is ip.user_ns["g"]
    ip.run_cell_magic("serve", "m6 --decoupled --sequence", "g")
    assert (calls[-1][2]["decoupled"], calls[-1][2]["sequence"]) == (True, True)
    ip.run_cell_magic("serve", "m3 --var g", "unused = 1")
    assert calls[-1][0] is ip.user_ns["g"]
    with pytest.raises(UsageError, match="no value to serve"):
        ip.run_cell_magic("serve", "m4", "print('hi')")
    with pytest.raises(UsageError, match="no variable 'missing'"):
        ip.run_cell_magic("serve", "m5 --example missing", "g")


def test_the_magic_in_a_plain_ipython_shell_serves_from_a_guarded_server(monkeypatch, tmp_path, capsys):
    from IPython.testing.globalipapp import get_ipython
    for name in [k for k in os.environ if k.startswith(("JUPYTER_TRITON_", "JUPYTERHUB_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    discovery.reset()
    ip = get_ipython()
    try:
        ip.run_line_magic("load_ext", "jupyter_triton")
        name_line, _, body = ONNX_CELL.format(name="plain", scale=2.0).partition("\n")
        handle = ip.run_cell_magic("serve", name_line.split(maxsplit=1)[1], body)
        conn = handle.connection
        assert conn.mode == discovery.IN_KERNEL and "serving from this kernel" in capsys.readouterr().out
        x = np.ones((2, 4), np.float32)
        np.testing.assert_allclose(handle.infer(x), x @ onnx_w(2.0), rtol=1e-5)     # the handle
        auth = {"Authorization": f"token {os.environ['JUPYTER_TRITON_TOKEN']}"}
        np.testing.assert_allclose(call(handle.url, {"x": x}, "y", auth), x @ onnx_w(2.0), rtol=1e-5)
        with pytest.raises(InferenceServerException) as err:
            call(handle.url, {"x": x}, "y")
        assert err.value.status() == "401"
        # its gRPC port (the streams') takes the same credential, as metadata
        import tritonclient.grpc as grpcclient
        grpc = grpcclient.InferenceServerClient(conn.grpc_url)
        tensor = grpcclient.InferInput("x", [2, 4], "FP32")
        tensor.set_data_from_numpy(x)
        with pytest.raises(InferenceServerException, match="UNAUTHENTICATED"):
            grpc.infer("plain", [tensor])
        np.testing.assert_allclose(grpc.infer("plain", [tensor], headers=conn.grpc_headers).as_numpy("y"),
                                   x @ onnx_w(2.0), rtol=1e-5)
        grpc.close()
        shown = repr(handle)
        assert '"Authorization: token $JUPYTER_TRITON_TOKEN"' in shown and conn.token not in shown
        assert conn.token not in repr(conn)
        import jupyter_triton
        assert [(m["name"], m["state"]) for m in jupyter_triton.models()] == [("plain", "READY")]
    finally:
        discovery.stop_in_kernel()
        discovery.reset()
    assert "JUPYTER_TRITON_URL" not in os.environ
