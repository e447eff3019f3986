"""Ensembles defined from a notebook: ``%%ensemble`` and ``jupyter_triton.ensemble`` in a real
kernel of the Jupyter server, called from elsewhere with the unmodified tritonclient, re-run
under load, and refused with a message naming the step when the steps do not fit."""
from __future__ import annotations

import asyncio
import re
import threading
import time

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from jupyter_triton.kernel.artifacts import ArtifactError
from jupyter_triton.kernel.ensemble import ensemble_config, parse_steps
from test_kernel import AUTH, call, in_thread, server_kernel  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(240)

MODELS_CELL = """%load_ext jupyter_triton
import numpy as np
import jupyter_triton
ex = np.ones((2, 3), np.float32)
def double(x):
    return x * 2
def checker(x):
    if (x < 0).any():
        raise ValueError("checker refuses negative values")
    return x + 1
print(jupyter_triton.serve(double, "double", example=ex).url)
print(jupyter_triton.serve(checker, "checker", example=ex).url)"""

ENSEMBLE_CELL = """%%ensemble pipe
# the composing models' own tensor names on the left, the ensemble's on the right
double:  x=X -> OUTPUT__0=mid
checker: x=mid -> OUTPUT__0=Y"""

API_CELL = """jupyter_triton.ensemble("pipe_api", [
    ("double", {"x": "IN"}, {"OUTPUT__0": "twice"}, 1),      # pinned to version 1
    ("checker", {"x": "twice"}, {"OUTPUT__0": "OUT"}),
])"""


async def test_two_step_ensemble_from_a_kernel_by_magic_and_api(server_kernel):
    _, kernel = await server_kernel()
    await in_thread(kernel.ok, MODELS_CELL)

    cell = await in_thread(kernel.ok, ENSEMBLE_CELL)
    assert "pipe version 1 READY" in cell.text and "double -> checker" in cell.text
    assert "input    X FP32 [-1, 3]" in cell.text and "output   Y FP32 [-1, 3]" in cell.text
    url = cell.url("pipe")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(await in_thread(call, url, {"X": x}, "Y", AUTH), x * 2 + 1)

    cell = await in_thread(kernel.ok, API_CELL)
    np.testing.assert_array_equal(
        await in_thread(call, cell.url("pipe_api"), {"IN": x}, "OUT", AUTH), x * 2 + 1)
    config = (await in_thread(kernel.ok, "c = jupyter_triton.model('pipe_api').config()\n"
                                         "c['platform'], [s['model_version'] for s in c['ensemble_scheduling']['step']]")).text
    assert config == "('ensemble', [1, -1])"

    # re-running the cell under load: new versions, every request answered
    failures: list[str] = []
    answered = [0]
    stop = threading.Event()

    def load() -> None:
        deadline = time.monotonic() + 90
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                np.testing.assert_array_equal(call(url, {"X": x}, "Y", AUTH), x * 2 + 1)
                answered[0] += 1
            except Exception as err:  # counted: the test asserts there are none
                failures.append(repr(err))

    sender = threading.Thread(target=load, daemon=True)
    sender.start()
    try:
        await asyncio.sleep(0.5)
        second = await in_thread(kernel.ok, ENSEMBLE_CELL)
        third = await in_thread(kernel.ok, ENSEMBLE_CELL)
        await asyncio.sleep(0.5)
    finally:
        stop.set()
        await in_thread(sender.join, 60)
    assert failures == []
    assert "pipe version 2 READY" in second.text and "pipe version 3 READY" in third.text
    assert answered[0] > 5

    # the second step raises: the client hears which step of which ensemble, and why
    with pytest.raises(InferenceServerException) as err:
        await in_thread(call, url, {"X": -x - 1}, "Y", AUTH)
    assert "ensemble 'pipe' step 2 ('checker' v1) failed: " in str(err.value)
    assert "checker refuses negative values" in str(err.value)
    # the dashboard shows the ensemble with its steps, the failure on the second one
    shown = await in_thread(kernel.ok, "from jupyter_triton.widgets.figures import text_table\n"
                                       "d = jupyter_triton.dashboard('pipe')\nd.stop()\n"
                                       "print(text_table([f for f in d.figures if f.version == '3']))")
    assert re.search(r"step 1 double v1 .* \d+ runs, 0 failed", shown.stdout), shown.stdout
    assert re.search(r"step 2 checker v1 .* 1 failed", shown.stdout), shown.stdout

    # steps that do not fit are refused before anything is uploaded, naming the step
    bad = await in_thread(kernel.run, "%%ensemble broken\ndouble: x=X -> OUTPUT__0=mid\n"
                                      "nowhere: x=mid -> OUTPUT__0=Y")
    assert "UsageError" in bad.stderr and "step 2 ('nowhere')" in bad.stderr
    bad = await in_thread(kernel.run, "%%ensemble broken\ndouble: x=X -> OUTPUT__0=mid\n"
                                      "checker: y=mid -> OUTPUT__0=Y")
    assert "step 2 ('checker') maps input 'y'" in bad.stderr
    bad = await in_thread(kernel.run, "%%ensemble broken\ndouble x=X")
    assert "line 1: expected 'model: IN=tensor" in bad.stderr
    listing = (await in_thread(kernel.ok, "%triton list")).stdout
    assert "broken" not in listing


# ---- the config the steps make (composing configs given as the server reports them) -------

def _cfg(name: str, mbs: int, inputs: list[tuple[str, str, list[int]]],
         outputs: list[tuple[str, str, list[int]]]) -> dict:
    return {"name": name, "max_batch_size": mbs,
            "input": [{"name": n, "data_type": f"TYPE_{d}", "dims": [str(x) for x in s]}
                      for n, d, s in inputs],
            "output": [{"name": n, "data_type": f"TYPE_{d}", "dims": s} for n, d, s in outputs]}


CONFIGS = {
    "tokenize": _cfg("tokenize", 8, [("TEXT", "STRING", [1])], [("IDS", "INT64", [-1])]),
    "embed": _cfg("embed", 4, [("IDS", "INT64", [-1]), ("MASK", "INT64", [-1])],
                  [("EMBEDDING", "FP32", [16]), ("NORM", "FP32", [1])]),
    "fp_embed": _cfg("fp_embed", 4, [("IDS", "FP32", [-1])], [("E", "FP32", [16])]),
    "flat": _cfg("flat", 0, [("IDS", "INT64", [-1])], [("E", "FP32", [16])]),
}


def test_a_step_may_pin_its_models_version():
    asked = []

    def lookup(model: str, version: str = "") -> dict:
        asked.append((model, version))
        return CONFIGS[model]
    steps = parse_steps("tokenize@2: TEXT -> IDS=ids\nembed: IDS=ids, MASK -> EMBEDDING")
    assert steps[0] == ("tokenize", {"TEXT": "TEXT"}, {"IDS": "ids"}, 2) and len(steps[1]) == 3
    config = ensemble_config("rag", steps, lookup)
    assert [s.model_version for s in config.ensemble_scheduling.step] == [2, -1]
    assert asked == [("tokenize", "2"), ("embed", "")]
    with pytest.raises(ArtifactError, match="model@version"):
        parse_steps("tokenize@x: TEXT -> IDS")
    with pytest.raises(ArtifactError, match=r"\[, version\]"):
        ensemble_config("rag", [("tokenize", {"TEXT": "TEXT"}, {"IDS": "ids"}, 0)], lookup)


def test_inputs_outputs_types_and_batch_size_come_from_the_composing_models():
    steps = parse_steps("tokenize: TEXT -> IDS=ids\n\nembed: IDS=ids, MASK=mask -> EMBEDDING, NORM=norm\n")
    assert steps == [("tokenize", {"TEXT": "TEXT"}, {"IDS": "ids"}),
                     ("embed", {"IDS": "ids", "MASK": "mask"}, {"EMBEDDING": "EMBEDDING", "NORM": "norm"})]
    config = ensemble_config("rag", steps, CONFIGS.__getitem__)
    assert config.platform == "ensemble" and config.max_batch_size == 4       # the smallest
    assert [(t.name, mc.DataType.Name(t.data_type), list(t.dims)) for t in config.input] == [
        ("TEXT", "TYPE_STRING", [1]), ("mask", "TYPE_INT64", [-1])]
    assert [(t.name, mc.DataType.Name(t.data_type), list(t.dims)) for t in config.output] == [
        ("EMBEDDING", "TYPE_FP32", [16]), ("norm", "TYPE_FP32", [1])]
    step = config.ensemble_scheduling.step[1]
    assert step.model_name == "embed" and step.model_version == -1 and dict(step.input_map) == {
        "IDS": "ids", "MASK": "mask"}


@pytest.mark.parametrize("steps, max_batch_size, message", [
    ("tokenize: TEXT -> IDS=ids\nfp_embed: IDS=ids -> E", None,
     "tensor 'ids' is INT64 at step 1 ('tokenize') output 'IDS' but FP32 at step 2 ('fp_embed') input 'IDS'"),
    ("tokenize: TEXT -> IDS=ids\nflat: IDS=ids -> E", None, "flat do(es) not"),
    ("tokenize: TEXT -> IDS=ids\nembed: IDS=ids -> EMBEDDING", None, "leaves input(s) MASK of 'embed' unmapped"),
    ("tokenize: TEXT -> IDS=ids\nembed: IDS=ids, MASK=m -> EMBEDDING=ids, NORM", None, "produced twice"),
    ("tokenize: TEXT -> NOPE=ids", None, "maps output 'NOPE', but 'tokenize' has outputs ['IDS']"),
    ("tokenize: TEXT -> IDS=ids", 16, "max_batch_size 16 must be between 0 and 8"),
    ("tokenize: TEXT=x, TEXT=y -> IDS", None, "'TEXT' is mapped twice"),
    ("tokenize TEXT -> IDS", None, "line 1: expected"),
])
def test_steps_that_do_not_fit_are_refused_with_the_step_named(steps, max_batch_size, message):
    with pytest.raises(ArtifactError, match=None) as err:
        ensemble_config("e", parse_steps(steps), CONFIGS.__getitem__, max_batch_size)
    assert message in str(err.value)
