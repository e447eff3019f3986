"""Triton's classification extension on outputs of every ordered type: top-k ranks on the
values themselves (an unsigned output must not wrap when ranked), integer scores written as
integers ("10:2", as C++'s std::to_string), floats as "%f"; checked against tritonserver
2.51 where nvidia-pytriton's venv is installed."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import serve
from tritonserver_peer import TritonServer, call, tritonserver_dist

pytestmark = pytest.mark.timeout(180)

# One input, the same values in four output types.
RANKS_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("U8", x.astype(np.uint8)),
                pb_utils.Tensor("I16", (x - 6).astype(np.int16)),
                pb_utils.Tensor("F32", x / 4),
                pb_utils.Tensor("B", x > 2)]))
        return responses
'''
OUTPUTS = {"U8": "TYPE_UINT8", "I16": "TYPE_INT16", "F32": "TYPE_FP32", "B": "TYPE_BOOL"}


def build(root: Path) -> Path:
    (root / "ranks" / "1").mkdir(parents=True)
    (root / "ranks" / "1" / "model.py").write_text(RANKS_PY)
    outputs = ", ".join(f'{{ name: "{n}" data_type: {t} dims: [ 4 ] }}' for n, t in OUTPUTS.items())
    (root / "ranks" / "config.pbtxt").write_text(f'''
name: "ranks"
backend: "python"
max_batch_size: 4
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {outputs} ]
parameters {{ key: "EXECUTION_MODE" value: {{ string_value: "thread" }} }}
''')
    return root


def classify(base: str, output: str, rows: list[list[float]], k: int = 2) -> tuple[int, object]:
    body = {"inputs": [{"name": "INPUT0", "shape": [len(rows), 4], "datatype": "FP32",
                        "data": rows}],
            "outputs": [{"name": output, "parameters": {"classification": k}}]}
    return call(base, "POST", "/v2/models/ranks/infer", body)


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    server, client = serve(build(tmp_path_factory.mktemp("ours") / "models"),
                           model_control_mode="explicit", load_models=["ranks"])
    client.close()
    yield f"127.0.0.1:{server.http_port}"
    server.close()


def _classes(answer: tuple[int, object]) -> list[str]:
    status, body = answer
    assert status == 200, body
    (out,) = body["outputs"]
    assert out["datatype"] == "BYTES", out
    return out["data"]


def test_unsigned_outputs_rank_without_wrapping(ours):
    # negated, uint8 [0, 5, 10, 4] is [0, 251, 246, 252]: the old ranking said [0, 2]
    assert _classes(classify(ours, "U8", [[0, 5, 10, 4]])) == ["10:2", "5:1"]
    assert _classes(classify(ours, "U8", [[0, 5, 10, 4], [255, 1, 0, 7]], k=3)) == [
        "10:2", "5:1", "4:3", "255:0", "7:3", "1:1"]


def test_signed_and_float_outputs_rank_and_read_as_triton_writes_them(ours):
    assert _classes(classify(ours, "I16", [[0, 5, 10, 4]], k=4)) == ["4:2", "-1:1", "-2:3", "-6:0"]
    assert _classes(classify(ours, "F32", [[0, 5, 10, 4]])) == ["2.500000:2", "1.250000:1"]


def test_bool_outputs_rank_true_first_in_index_order(ours):
    # Triton 2.51 refuses BOOL (400, see the parity test); ranking it is well defined
    assert _classes(classify(ours, "B", [[0, 5, 10, 4]], k=4)) == ["1:1", "1:2", "1:3", "0:0"]
    assert _classes(classify(ours, "B", [[9, 0, 0, 0]], k=1)) == ["1:0"]


def test_the_same_top_k_as_tritonserver(ours, tmp_path_factory):
    tritonserver_dist()                 # skips with the reason where the venv is absent
    base = tmp_path_factory.mktemp("theirs")
    repo = build(base / "models")
    triton = TritonServer(repo, base / "triton", load=["ranks"])
    try:
        theirs = triton.url
        for output, rows, k in (("U8", [[0, 5, 10, 4], [255, 1, 0, 7]], 3),
                                ("I16", [[0, 5, 10, 4]], 4), ("F32", [[0, 5, 10, 3]], 2)):
            assert _classes(classify(theirs, output, rows, k)) == \
                _classes(classify(ours, output, rows, k)), output
        status, body = classify(theirs, "B", [[0, 5, 10, 4]])
        assert status == 400 and "unsupported type 'BOOL'" in body["error"], body
    finally:
        triton.close()
        shutil.rmtree(base, ignore_errors=True)
