"""A version number means one set of files for good, and a version's identity (number, files,
config) has one owner, repository/identity.py: a number once used (served, staged, set aside,
in the history) is never handed out again, the response cache keys on the version's identity
(files put under a number that served before answer as themselves) and forgets a version when
it unloads, a rollback's pin gives way to a newer version, lifecycle booleans are booleans, and
version numbers are Triton's (int64 above 0). Each attack against a real server over the
repository API, as a careless operator or a hostile client would send it: the answer and
the version a client then gets, and nothing stored lost."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from conftest import HTTP_FRONT, serve
from jupyter_triton.engine import EngineOptions
from jupyter_triton.repository import MAX_VERSION
from jupyter_triton.standalone import start_in_thread

pytestmark = pytest.mark.timeout(180)

# OUTPUT0 = INPUT0 + ADD (a constant of the file, so each version's files answer apart). An
# input starting with 7 holds execute while the file HOLD exists (after touching HELD): a
# golden check that a client can reach the staged version during.
MODEL_PY = '''
import json, os, time
import numpy as np
import triton_python_backend_utils as pb_utils

ADD = {add}


class TritonPythonModel:
    def initialize(self, args):
        self.p = {{k: v["string_value"] for k, v in
                  json.loads(args["model_config"]).get("parameters", {{}}).items()}}
        if {broken}:
            raise RuntimeError("this version is broken on purpose")

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            if x.size and x.flat[0] == 7 and "HOLD" in self.p:
                open(self.p["HELD"], "w").close()
                deadline = time.time() + 60
                while os.path.exists(self.p["HOLD"]) and time.time() < deadline:
                    time.sleep(0.02)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x + ADD)]))
        return out
'''
NAME = "adder"


def model_py(add: int, broken: bool = False) -> bytes:
    return MODEL_PY.format(add=add, broken=broken).encode()


def config(**params: object) -> str:
    return json.dumps({
        "name": NAME, "backend": "python", "max_batch_size": 0,
        "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
        "instance_group": [{"count": 2, "kind": "KIND_CPU"}],
        "response_cache": {"enable": True},
        "parameters": {k: {"string_value": str(v)} for k, v in
                       {"EXECUTION_MODE": "thread", **params}.items()}})


def lifecycle(**keys: object) -> bytes:
    return json.dumps(keys).encode()


def infer(client, x=(1, 2), version: str = "") -> tuple[list[float], str]:
    inp = httpclient.InferInput("INPUT0", [len(x)], "FP32")
    inp.set_data_from_numpy(np.asarray(x, np.float32))
    result = client.infer(NAME, [inp], model_version=version)
    return result.as_numpy("OUTPUT0").tolist(), result.get_response()["model_version"]


def set_aside(repo: Path, version: int) -> list[Path]:
    return sorted((repo / ".failed" / NAME).glob(f"*-v{version}"))


def start(repo: Path, **options):
    """A standalone server with a response cache and its metrics port."""
    server = start_in_thread(EngineOptions(model_repository=repo, model_control_mode="explicit",
                                           response_cache_size=1 << 20, **options),
                             host="127.0.0.1", http_port=0, metrics_port=0, grpc_port=None,
                             http_front=HTTP_FRONT)
    return server, httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}",
                                                    network_timeout=120)


def cache_entries(server) -> float:
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=60) as r:
        text = r.read().decode()
    return next(s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.name == "nv_cache_num_entries")


@pytest.fixture
def server(tmp_path: Path):
    repo = tmp_path / "models"
    repo.mkdir()
    server, client = start(repo)
    yield server, client, repo
    client.close()
    server.close()


# ---- a set-aside version's answers, under the next version with its number ---------------

def test_a_stopped_canary_never_answers_for_the_next_upload(server):
    server, client, repo = server
    client.load_model(NAME, config=config(), files={"file:1/model.py": model_py(1)})
    client.load_model(NAME, config=config(), files={"file:2/model.py": model_py(1000),
                                                    "file:lifecycle.json": lifecycle(canary=1.0)})
    assert infer(client) == ([1001.0, 1002.0], "2")
    assert infer(client) == ([1001.0, 1002.0], "2")        # the second from the cache
    assert cache_entries(server) >= 1
    client.load_model(NAME, files={"file:lifecycle.json": lifecycle(canary=0)})
    left_in_cache = cache_entries(server)
    assert infer(client) == ([2.0, 3.0], "1")
    # a fixed version uploaded as file:2 is a NEW version: 2 means the canary's files for good
    client.load_model(NAME, config=config(), files={"file:2/model.py": model_py(2)})
    assert infer(client) == ([3.0, 4.0], "3")
    assert left_in_cache == 0           # the set-aside version's answers went with it
    with pytest.raises(InferenceServerException):
        infer(client, version="2")
    rows = {r.get("version"): r for r in client.get_model_repository_index() if r["name"] == NAME}
    assert rows["2"]["state"] == "UNAVAILABLE" and rows["3"]["state"] == "READY"
    # nothing stored is lost: the canary's files are kept where it was set aside
    [kept] = set_aside(repo, 2)
    assert b"ADD = 1000" in (kept / "model.py").read_bytes()
    assert not (repo / NAME / "2").exists()


def test_a_refused_promotion_never_answers_for_the_next_upload(server, tmp_path: Path):
    server, client, repo = server
    hold, held = tmp_path / "hold", tmp_path / "held"
    client.load_model(NAME, config=config(), files={"file:1/model.py": model_py(1)})
    hold.touch()
    refused: list[Exception] = []

    def promote() -> None:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", network_timeout=120)
        golden = [{"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2], "data": [7, 8]}],
                   "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [2],
                                "data": [8, 9]}]}]
        try:
            c.load_model(NAME, config=config(HOLD=hold, HELD=held), files={
                "file:2/model.py": model_py(1000), "file:lifecycle.json": lifecycle(golden=golden)})
        except InferenceServerException as err:
            refused.append(err)
        finally:
            c.close()
    thread = threading.Thread(target=promote)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not held.exists() and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert held.exists(), "the golden check did not start"
        # while it is checked, the staged version answers a client that names it (cached)
        assert infer(client, version="2") == ([1001.0, 1002.0], "2")
    finally:
        hold.unlink()
        thread.join(120)
    assert refused and "refused" in refused[0].message()
    left_in_cache = cache_entries(server)
    client.load_model(NAME, config=config(), files={"file:2/model.py": model_py(2)})
    assert infer(client) == ([3.0, 4.0], "3")
    assert infer(client, version="3") == ([3.0, 4.0], "3")
    assert left_in_cache == 0
    [kept] = set_aside(repo, 2)
    assert b"ADD = 1000" in (kept / "model.py").read_bytes()
    assert [r["action"] for r in client.get_inference_statistics(NAME)["history"]] == \
        ["load", "refused", "load"]


def test_the_cache_keys_on_the_loaded_version_not_its_number(server):
    """The same number holding other files (replaced on disk, then loaded again) is a new
    load: the cache never answers it with the earlier files' answers."""
    server, client, repo = server
    client.load_model(NAME, config=config(), files={"file:1/model.py": model_py(1)})
    assert infer(client) == ([2.0, 3.0], "1")
    (repo / NAME / "1" / "model.py").write_bytes(model_py(50))
    client.load_model(NAME)
    assert infer(client) == ([51.0, 52.0], "1")
    assert cache_entries(server) == 1          # the earlier load's answer went with it


def test_numbers_set_aside_or_in_the_history_are_never_reused(tmp_path: Path):
    """Across a restart too: the next number is after every one used, whatever the disk
    holds now (Repository.used_versions / next_version)."""
    from jupyter_triton.repository import Repository
    repo = tmp_path / "models"
    server, client = serve(repo, model_control_mode="explicit")
    try:
        client.load_model(NAME, config=config(), files={"file:1/model.py": model_py(1)})
        with pytest.raises(InferenceServerException, match="broken on purpose"):
            client.load_model(NAME, config=config(), files={"file:1/model.py": model_py(9, True)})
        assert Repository(repo).used_versions(NAME) == {1, 2}
    finally:
        server.close()
    server, client = serve(repo, model_control_mode="explicit", load_models=[NAME])
    try:
        assert Repository(repo).next_version(NAME) == 3
        client.load_model(NAME, config=config(), files={"file:2/model.py": model_py(2)})
        assert infer(client) == ([3.0, 4.0], "3")
        assert set_aside(repo, 2)
    finally:
        server.close()


# ---- lifecycle.json: booleans are booleans ---------------------------------------------------

@pytest.mark.parametrize("value", ["false", "true", 1, None])
def test_rollback_takes_a_boolean_only(server, value):
    server, client, repo = server
    client.load_model(NAME, config=config(), files={"file:1/model.py": model_py(1)})
    client.load_model(NAME, config=config(), files={"file:2/model.py": model_py(2)})
    with pytest.raises(InferenceServerException) as err:
        client.load_model(NAME, files={"file:lifecycle.json": lifecycle(rollback=value)})
    assert err.value.status() == "400" and "'rollback'" in err.value.message()
    assert infer(client) == ([3.0, 4.0], "2")              # nothing rolled back
    assert [r["action"] for r in client.get_inference_statistics(NAME)["history"]] == ["load", "load"]
    client.load_model(NAME, files={"file:lifecycle.json": lifecycle(rollback=False)})
    assert infer(client) == ([3.0, 4.0], "2")
    client.load_model(NAME, files={"file:lifecycle.json": lifecycle(rollback=True)})
    assert infer(client) == ([2.0, 3.0], "1")


# ---- a rollback's pin gives way to a newer version -----------------------------------------

def test_a_version_after_a_rollback_serves_without_a_config(server):
    """A rollback pins config.pbtxt to the version it brings back; a newer version that comes
    with no config (copied in, then loaded) is served all the same, unless it fails."""
    server, client, repo = server
    pinned = repo / NAME / "config.pbtxt"

    def copy_in(version: int, add: int, broken: bool = False) -> None:
        (repo / NAME / str(version)).mkdir()
        (repo / NAME / str(version) / "model.py").write_bytes(model_py(add, broken))
    client.load_model(NAME, config=config(), files={"file:1/model.py": model_py(1)})
    client.load_model(NAME, config=config(), files={"file:2/model.py": model_py(2)})
    client.load_model(NAME, files={"file:lifecycle.json": lifecycle(rollback=True)})
    assert infer(client) == ([2.0, 3.0], "1")
    assert "versions: 1" in pinned.read_text()
    copy_in(3, 3)
    client.load_model(NAME)
    assert infer(client) == ([4.0, 5.0], "3")
    # served by the policy the config had before the pin; the pinned config is kept
    assert "specific" not in pinned.read_text()
    assert any("versions: 1" in p.read_text() for p in (repo / NAME / ".history").iterdir())
    client.load_model(NAME, files={"file:lifecycle.json": lifecycle(rollback=True)})
    assert infer(client) == ([2.0, 3.0], "1")
    # a broken newer version: refused, and the pin holds
    copy_in(4, 4, broken=True)
    with pytest.raises(InferenceServerException, match="broken on purpose"):
        client.load_model(NAME)
    assert infer(client) == ([2.0, 3.0], "1")
    assert "versions: 1" in pinned.read_text()
    # an upload with its own config serves as ever, after every number used
    client.load_model(NAME, config=config(), files={"file:1/model.py": model_py(5)})
    assert infer(client) == ([6.0, 7.0], "5")
    assert (repo / NAME / "2").is_dir() and (repo / NAME / "4").is_dir()     # nothing lost


# ---- version numbers are Triton's: int64 above 0 ---------------------------------------------

def test_version_numbers_are_bounded_as_triton_bounds_them(tmp_path: Path):
    repo = tmp_path / "models"
    server, client = serve(repo, model_control_mode="explicit")
    try:
        big = 999_999_999_999_999_999            # 18 digits: the next one has 19
        client.load_model(NAME, config=config(), files={f"file:{big}/model.py": model_py(1)})
        assert infer(client) == ([2.0, 3.0], str(big))
        client.load_model(NAME, config=config(), files={"file:1/model.py": model_py(2)})
        assert infer(client) == ([3.0, 4.0], str(big + 1))
        for bad in (MAX_VERSION + 1, 10 ** 19, 10 ** 30, 0):
            with pytest.raises(InferenceServerException) as err:
                client.load_model(NAME, config=config(), files={f"file:{bad}/model.py": model_py(3)})
            assert err.value.status() == "400" and "file parameter" in err.value.message()
        client.load_model(NAME, config=config(), files={f"file:{MAX_VERSION}/model.py": model_py(4)})
        assert infer(client) == ([5.0, 6.0], str(MAX_VERSION))
        # no number is left after the last one: refused, nothing written, still served
        with pytest.raises(InferenceServerException) as err:
            client.load_model(NAME, config=config(), files={"file:1/model.py": model_py(5)})
        assert err.value.status() == "400" and "no version number left" in err.value.message()
        assert infer(client) == ([5.0, 6.0], str(MAX_VERSION))
        on_disk = sorted(p.name for p in (repo / NAME).iterdir() if not p.name.startswith("."))
        assert on_disk == sorted([str(big), str(big + 1), str(MAX_VERSION), "config.pbtxt"])
    finally:
        server.close()
    # a restart loads what the uploads were answered with
    server, client = serve(repo, model_control_mode="explicit", load_models=[NAME])
    try:
        assert client.get_model_metadata(NAME)["versions"] == [str(MAX_VERSION)]
        assert infer(client) == ([5.0, 6.0], str(MAX_VERSION))
    finally:
        server.close()


def test_lifecycle_numbers_are_numbers_and_booleans_booleans():
    """The same rule for the other lifecycle keys: a boolean is no version number or tolerance,
    and a version is one the repository could hold."""
    from jupyter_triton.engine.lifecycle.promotion import parse_promotion, rollback_requested
    from jupyter_triton.protocol.errors import InvalidArgument
    golden = [{"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1], "data": [1]}],
               "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [1], "data": [2]}]}]
    for key, value in (("promote", True), ("promote", "02"), ("promote", MAX_VERSION + 1),
                       ("promote", 2.5), ("atol", True), ("rtol", False)):
        with pytest.raises(InvalidArgument, match=f"'{key}'"):
            parse_promotion({"golden": golden, key: value})
    assert parse_promotion({"golden": golden, "promote": "7"}).version == 7
    assert parse_promotion({"golden": golden, "promote": MAX_VERSION}).version == MAX_VERSION
    assert rollback_requested({}) is False and rollback_requested({"rollback": True}) is True


# ---- files put under a number that served before: the new model answers, never the cache ---
# An ONNX model whose files change under the same number: OUTPUT0 = INPUT0 @ (k * I). The
# files of two such models have the same size: only what they are tells them apart.

LINEAR = "linear"
LINEAR_CONFIG = (f'name: "{LINEAR}"\nbackend: "onnxruntime"\nmax_batch_size: 8\n'
                 f'response_cache {{ enable: true }}\n')


def linear_onnx(k: float) -> bytes:
    from onnx_models import linear
    return linear(np.eye(4, dtype=np.float32) * k)


def linear_infer(client) -> tuple[list[float], str]:
    inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(np.array([[1, 2, 3, 4]], np.float32))
    result = client.infer(LINEAR, [inp])
    return result.as_numpy("OUTPUT0")[0].tolist(), result.get_response()["model_version"]


def cache_hits(client) -> int:
    [stats] = client.get_inference_statistics(LINEAR)["model_stats"]
    return stats["inference_stats"]["cache_hit"]["count"]


def linear_repository(root: Path) -> Path:
    (root / LINEAR / "1").mkdir(parents=True)
    (root / LINEAR / "config.pbtxt").write_text(LINEAR_CONFIG)
    (root / LINEAR / "1" / "model.onnx").write_bytes(linear_onnx(2))
    return root


def test_a_model_replaced_under_its_number_answers_as_itself_not_from_the_cache(tmp_path: Path):
    """Explicit mode, as a user does it: version 1's file overwritten in place with another
    model of the same size, then a load. The version's identity changed (repository/
    identity.py), so the load serves the new model and the cache has none of its answers."""
    server, client = start(linear_repository(tmp_path / "models"))
    try:
        client.load_model(LINEAR)
        assert linear_infer(client) == ([2.0, 4.0, 6.0, 8.0], "1")
        assert linear_infer(client) == ([2.0, 4.0, 6.0, 8.0], "1")
        assert cache_hits(client) == 1                       # the second answer was the cache's
        model_file = tmp_path / "models" / LINEAR / "1" / "model.onnx"
        new = linear_onnx(3)
        assert len(new) == model_file.stat().st_size
        with open(model_file, "r+b") as f:                   # same inode, same size
            f.write(new)
        client.load_model(LINEAR)
        assert linear_infer(client) == ([3.0, 6.0, 9.0, 12.0], "1")
        assert cache_entries(server) == 1            # the new answer alone: the old one went
        assert linear_infer(client) == ([3.0, 6.0, 9.0, 12.0], "1")
        assert cache_hits(client) == 1               # the new version's own hit
        # loaded again with nothing changed, the version keeps serving as it is, cache and all
        client.load_model(LINEAR)
        assert linear_infer(client) == ([3.0, 6.0, 9.0, 12.0], "1")
        assert cache_hits(client) == 2
    finally:
        client.close()
        server.close()


def test_a_model_uploaded_again_under_its_number_is_a_new_version_and_keeps_the_old(tmp_path):
    """Through the repository API: an upload naming version 1 again is stored as a new
    version (README: an existing version is never overwritten or deleted), answers as the
    new model, and version 1's files stay as they were."""
    repo = tmp_path / "models"
    server, client = start(repo)
    config_json = json.dumps({"backend": "onnxruntime", "max_batch_size": 8,
                              "response_cache": {"enable": True}})
    try:
        client.load_model(LINEAR, config=config_json, files={"file:1/model.onnx": linear_onnx(2)})
        assert linear_infer(client) == ([2.0, 4.0, 6.0, 8.0], "1")
        assert linear_infer(client) == ([2.0, 4.0, 6.0, 8.0], "1")
        assert cache_hits(client) == 1
        client.load_model(LINEAR, config=config_json, files={"file:1/model.onnx": linear_onnx(3)})
        assert linear_infer(client) == ([3.0, 6.0, 9.0, 12.0], "2")
        assert cache_entries(server) == 1
        assert (repo / LINEAR / "1" / "model.onnx").read_bytes() == linear_onnx(2)
        assert (repo / LINEAR / "2" / "model.onnx").read_bytes() == linear_onnx(3)
    finally:
        client.close()
        server.close()


def test_a_model_replaced_under_its_number_in_poll_mode_answers_as_itself(tmp_path: Path):
    """Poll mode: the file replaced by a rename (as an editor or rsync writes it); the next
    poll loads the version anew, and no answer of the old files comes back."""
    repo = linear_repository(tmp_path / "models")
    server = start_in_thread(EngineOptions(model_repository=repo, model_control_mode="poll",
                                           repository_poll_secs=0.2, response_cache_size=1 << 20),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=None,
                             http_front=HTTP_FRONT)
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", network_timeout=120)
    try:
        assert linear_infer(client) == ([2.0, 4.0, 6.0, 8.0], "1")
        assert linear_infer(client) == ([2.0, 4.0, 6.0, 8.0], "1")
        assert cache_hits(client) == 1
        staged = repo / LINEAR / "1" / ".model.onnx.tmp"
        staged.write_bytes(linear_onnx(3))
        staged.replace(repo / LINEAR / "1" / "model.onnx")
        deadline = time.monotonic() + 60
        while cache_hits(client) == 1 and time.monotonic() < deadline:
            time.sleep(0.05)        # the poll's reload starts the version's statistics anew
        assert cache_hits(client) == 0, "the poll did not load the replaced model"
        for _ in range(2):
            assert linear_infer(client) == ([3.0, 6.0, 9.0, 12.0], "1")
        assert cache_hits(client) == 1
    finally:
        client.close()
        server.close()
