"""Model files and names attacked through the repository load API (issue 32), against a real
``jupyter-triton serve`` process (explicit mode, no credentials: whoever may load models):

- a ``model.pt2`` crafted so that ``torch.export.load`` would run its payload in the server
  process (a pickled object whose ``__reduce__`` writes a marker file, under torch's
  ``weights_only=False`` loads and their fallback, or plain ``pickle``; a shape expression
  sympy would eval; AOTInductor compiled code): the load is a 400 that names the file, the
  marker is never written, and the server serves the next model, a legitimate program;
- names longer than a file name may be (255 bytes of UTF-8, not 255 characters): a 400 that
  names the rule on HTTP and gRPC, before anything touches the filesystem; 85 CJK characters
  (255 bytes) load and infer; a name too long for a file is no 500 on any model route.
"""
from __future__ import annotations

import base64
import http.client
import io
import json
import pickle
import zipfile
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import build_repository
from hostile import legit_infer, start_standalone
from onnx_models import add_sub

torch = pytest.importorskip("torch")

CJK = "模"           # 3 bytes of UTF-8
PT2_CONFIG = json.dumps({"backend": "pytorch", "platform": "torch_export", "max_batch_size": 8})
SIMPLE_CONFIG = json.dumps({"backend": "onnxruntime"})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = build_repository(tmp_path_factory.mktemp("model-files") / "models")
    srv = start_standalone(repo, extra_args=("--model-control-mode", "explicit", "--load-model", "*"))
    yield srv
    srv.close()


def request(server, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, (json.loads(data) if data else {})
    finally:
        conn.close()


def load(server, name: str, config: str, files: dict[str, bytes]) -> tuple[int, dict]:
    params = {"config": config, **{k: base64.b64encode(v).decode() for k, v in files.items()}}
    return request(server, "POST", f"/v2/repository/models/{quote(name, safe='')}/load",
                   {"parameters": params})


def assert_alive(server) -> None:
    assert server.alive(), server.log_tail()
    legit_infer(server, timeout=30.0)


# -- model.pt2 files that would run code in the server process ---------------------------------

class Payload:
    """Unpickled, it opens (creates) the marker file: proof that the pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


class AddOne(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((3,), 2.0))

    def forward(self, x):
        return x * self.scale + 1


def exported() -> torch.export.ExportedProgram:
    batch = torch.export.Dim("batch", min=1, max=8)
    return torch.export.export(AddOne(), (torch.ones(2, 3),), dynamic_shapes=({0: batch},))


def saved_program() -> bytes:
    buf = io.BytesIO()
    torch.export.save(exported(), buf)
    return buf.getvalue()


def pickled(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save({"scale": Payload(marker)}, buf)
    return buf.getvalue()


def rewritten(archive: bytes, change) -> bytes:
    """``archive`` with each member passed through ``change(name, data)`` (None drops it)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as src, zipfile.ZipFile(out, "w") as dst:
        for name in src.namelist():
            data = change(name, src.read(name))
            if data is not None:
                dst.writestr(name, data)
    return out.getvalue()


def older_format(marker: Path) -> bytes:
    """The pre-2.8 archive torch.export.load falls back to; its state dict a pickled payload:
    a weights-only load fails, torch retries with weights_only=False."""
    from torch._export.serde.schema import SCHEMA_VERSION
    from torch._export.serde.serialize import serialize
    artifact = serialize(exported())
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("version", ".".join(map(str, SCHEMA_VERSION)))
        z.writestr("serialized_exported_program.json", artifact.exported_program)
        z.writestr("serialized_state_dict.pt", pickled(marker))
        z.writestr("serialized_constants.pt", artifact.constants)
        z.writestr("serialized_example_inputs.pt", artifact.example_inputs)
    return out.getvalue()


def sample_inputs_payload(marker: Path) -> bytes:
    """The sample inputs a payload: torch's weights-only load fails, its fallback unpickles."""
    return rewritten(saved_program(), lambda name, data: pickled(marker)
                     if name.endswith("sample_inputs/model.pt") else data)


def pickled_weight(marker: Path) -> bytes:
    """A weight marked ``use_pickle``: torch loads it with weights_only=False outright."""
    archive = saved_program()
    weight = _weight_file(archive)

    def change(name: str, data: bytes) -> bytes:
        if name.endswith("weights/model_weights_config.json"):
            config = json.loads(data)
            (entry,) = config["config"].values()
            entry["use_pickle"] = True
            return json.dumps(config).encode()
        return pickled(marker) if name.endswith(f"weights/{weight}") else data
    return rewritten(archive, change)


def _weight_file(archive: bytes) -> str:
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        (name,) = [n for n in z.namelist() if n.endswith("weights/model_weights_config.json")]
        (entry,) = json.loads(z.read(name))["config"].values()
    return entry["path_name"]


def opaque_constant(marker: Path) -> bytes:
    """An "opaque" constant: torch unpickles it with plain pickle.loads."""
    from torch.export.pt2_archive.constants import OPAQUE_OBJ_FILENAME_PREFIX
    path_name = f"{OPAQUE_OBJ_FILENAME_PREFIX}0"

    def change(name: str, data: bytes) -> bytes:
        if name.endswith("constants/model_constants_config.json"):
            return json.dumps({"config": {"payload": {
                "path_name": path_name, "is_param": False, "use_pickle": True,
                "tensor_meta": None}}}).encode()
        return data
    archive = rewritten(saved_program(), change)
    folder = zipfile.ZipFile(io.BytesIO(archive)).namelist()[0].split("/")[0]
    out = io.BytesIO(archive)
    with zipfile.ZipFile(out, "a") as z:
        z.writestr(f"{folder}/data/constants/{path_name}", pickle.dumps(Payload(marker)))
    return out.getvalue()


def shape_expression(marker: Path) -> bytes:
    """A symbolic shape that is code: torch parses it with sympy.sympify, an eval."""
    code = f"__import__('builtins').open({str(marker)!r}, 'w') and "

    def change(name: str, data: bytes) -> bytes:
        if name.endswith("models/model.json"):
            text = data.decode()
            assert '"expr_str": "Symbol(' in text
            return text.replace('"expr_str": "Symbol(', '"expr_str": "' + code.replace(
                '"', '\\"') + 'Symbol(', 1).encode()
        return data
    return rewritten(saved_program(), change)


ATTACKS = {
    "older_format_fallback": (older_format, "unpickle"),
    "sample_inputs_fallback": (sample_inputs_payload, "unpickle"),
    "pickled_weight": (pickled_weight, "unpickle"),
    "opaque_constant": (opaque_constant, "unpickle"),
    "shape_expression": (shape_expression, "shape expression"),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_pt2_never_runs_its_payload_in_the_server(server, tmp_path, attack):
    """Before: each payload ran in the server process (the marker was written), and some of
    these files loaded and served (200)."""
    build, reason = ATTACKS[attack]
    marker = tmp_path / f"{attack}.ran"
    status, body = load(server, f"evil_{attack}", PT2_CONFIG, {"file:1/model.pt2": build(marker)})
    assert not marker.exists(), f"the payload ran in the server process ({status} {body})"
    assert status == 400, (status, body, server.log_tail())
    assert set(body) == {"error"}
    assert "'model.pt2'" in body["error"] and "refused" in body["error"], body
    assert reason in body["error"], body
    assert "weights_only=False succeeded" not in server.log_tail(1 << 20)
    assert_alive(server)


@pytest.mark.parametrize("expr, safe", [
    ("Symbol('s77', positive=True, integer=True)", True),
    ("Mod(Add(Integer(4), Mul(Integer(-1), Symbol('s0', integer=True))), Integer(4))", True),
    ("LessThan(Symbol('u0', integer=True), Integer(192))", True),
    ("FloorDiv(s0, 2) + 1", True),                  # the str() form older torch wrote
    ("Float('1.5', precision=53)", True),
    ("open('x', 'w')", False),                      # a builtin
    ("chr(111) + chr(115)", False),
    ("Add('__import__(\"os\")')", False),          # a string sympy would sympify again
    ("lambdify(1, 2)", False),                      # a sympy function that is not a class
    ("S.Half", False),
    ("+".join(["1"] * 100_000), False),             # too deep to check
])
def test_shape_expressions_are_sympy_constructors_and_literals_only(expr, safe):
    from jupyter_triton.backends.exported_program import _is_sympy_literal
    assert _is_sympy_literal(expr) is safe


def test_a_pt2_with_compiled_code_is_refused(server):
    """AOTInductor's compiled libraries would be loaded into the server process."""
    archive = saved_program()
    folder = zipfile.ZipFile(io.BytesIO(archive)).namelist()[0].split("/")[0]
    out = io.BytesIO(archive)
    with zipfile.ZipFile(out, "a") as z:
        z.writestr(f"{folder}/data/aotinductor/model/model.so", b"\x7fELF")
    status, body = load(server, "evil_aoti", PT2_CONFIG, {"file:1/model.pt2": out.getvalue()})
    assert status == 400, body
    assert "'model.pt2'" in body["error"] and "AOTInductor" in body["error"], body
    assert_alive(server)


def test_a_legitimate_program_loads_and_serves_after_the_attacks(server):
    status, body = load(server, "add_one", PT2_CONFIG, {"file:1/model.pt2": saved_program()})
    assert status == 200, body
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    try:
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        inp = httpclient.InferInput("x", [2, 3], "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer("add_one", [inp])
        np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), x * 2 + 1)
    finally:
        client.close()
    assert_alive(server)


# -- names longer than a file name -------------------------------------------------------------

def simple_files() -> dict[str, bytes]:
    return {"file:1/model.onnx": add_sub()}


def test_a_name_over_255_bytes_is_a_400_that_names_the_rule(server):
    """Before: 200 CJK characters (600 bytes) passed the 255-character check and the server
    answered 500 (File name too long) on HTTP and INTERNAL on gRPC."""
    for name in (CJK * 200, CJK * 86):
        status, body = load(server, name, SIMPLE_CONFIG, simple_files())
        assert status == 400, (len(name), status, body)
        assert "255 bytes of UTF-8" in body["error"], body
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        with pytest.raises(InferenceServerException) as err:
            client.load_model(CJK * 200, config=SIMPLE_CONFIG, files=simple_files())
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT", err.value
        assert "255 bytes of UTF-8" in err.value.message()
    finally:
        client.close()
    assert_alive(server)


def test_a_name_of_255_bytes_loads_and_serves(server, tmp_path):
    name = CJK * 85
    try:
        (tmp_path / name).mkdir()
    except OSError as err:
        pytest.skip(f"this filesystem holds no 255-byte file name: {err}")
    status, body = load(server, name, SIMPLE_CONFIG, simple_files())
    assert status == 200, body
    x, y = np.arange(4, dtype=np.float32)[None], np.ones((1, 4), np.float32)
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    try:
        inputs = [httpclient.InferInput("INPUT0", [1, 4], "FP32"),
                  httpclient.InferInput("INPUT1", [1, 4], "FP32")]
        inputs[0].set_data_from_numpy(x)
        inputs[1].set_data_from_numpy(y)
        result = client.infer(name, inputs)
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), x + y)
        np.testing.assert_allclose(result.as_numpy("OUTPUT1"), x - y)
    finally:
        client.close()
    assert_alive(server)


def test_an_upload_path_over_a_file_names_limit_is_a_400(server):
    """Before: a path component of 200 CJK characters, or a path deeper than a path may be,
    was a 500 (the write failed with File name too long)."""
    for key, rule in ((f"file:1/{CJK * 200}", "255 bytes of UTF-8"),
                      (f"file:1/{CJK * 85}/x", None),
                      ("file:1/" + "a/" * 600 + "x", "1024 bytes of UTF-8")):
        status, body = load(server, "paths", SIMPLE_CONFIG, {**simple_files(), key: b"x"})
        if rule is None:
            assert status == 200, body
            continue
        assert status == 400, (key[:40], status, body)
        assert rule in body["error"], body
    assert_alive(server)


def test_a_name_too_long_for_a_file_is_no_500_on_any_model_route(server):
    name = quote(CJK * 200, safe="")
    for method, path, body in (("GET", f"/v2/models/{name}", None),
                               ("GET", f"/v2/models/{name}/ready", None),
                               ("GET", f"/v2/models/{name}/config", None),
                               ("GET", f"/v2/models/{name}/stats", None),
                               ("POST", f"/v2/models/{name}/infer", {"inputs": []}),
                               ("POST", f"/v2/repository/models/{name}/unload", {})):
        status, answer = request(server, method, path, body)
        assert status in (400, 404), (method, path[:40], status, answer)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        for call in (lambda: client.get_model_metadata(CJK * 200),
                     lambda: client.get_model_config(CJK * 200),
                     lambda: client.unload_model(CJK * 200)):
            try:
                call()
            except InferenceServerException as err:
                assert err.status() in ("StatusCode.INVALID_ARGUMENT", "StatusCode.NOT_FOUND"), err
    finally:
        client.close()
    assert_alive(server)


def test_shared_memory_names_over_a_file_names_limit_are_a_400(server):
    for region, key in (("r", "/" + CJK * 100), (CJK * 100, "/jt-test-region")):
        status, body = request(server, "POST",
                               f"/v2/systemsharedmemory/region/{quote(region, safe='')}/register",
                               {"key": key, "offset": 0, "byte_size": 8})
        assert status == 400, (status, body)
        assert "bytes of UTF-8" in body["error"], body
    assert_alive(server)
