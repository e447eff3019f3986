"""Promotion with a golden set: what a load request asks for, the golden cases it carries,
and whether a staged version's answers match them.

A load's lifecycle parameters (``golden``, ``atol``, ``rtol``, ``promote``, ``rollback``,
``canary``) come
as load parameters, or, since tritonclient's ``load_model`` sends only ``config`` and
``file:`` parameters, as one JSON object under the load parameter ``file:lifecycle.json``
(no version directory is named like that, so it never reaches the repository)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ...protocol.datatypes import triton_to_numpy
from ...protocol.errors import InvalidArgument
from ...protocol.types import InferRequest, InferTensor
from ...repository.layout import MAX_VERSION, is_version_dir_name

LIFECYCLE_FILE = "file:lifecycle.json"
KEYS = ("golden", "atol", "rtol", "promote", "rollback", "canary", "shadow_max_diff")
#: golden cases one promotion may carry
MAX_CASES = 1000


@dataclass
class GoldenCase:
    inputs: list[InferTensor]
    expected: dict[str, np.ndarray]


@dataclass
class Promotion:
    cases: list[GoldenCase]
    atol: float = 1e-8
    rtol: float = 1e-5
    version: int | None = None       # an on-disk version to promote (no upload)
    shadow_max_diff: float | None = None    # its shadow report's bound (observation/shadow.py)


def lifecycle_parameters(parameters: Mapping[str, Any] | None,
                         files: dict[str, bytes] | None) -> dict[str, Any]:
    """The lifecycle keys of a load; takes ``file:lifecycle.json`` out of ``files``."""
    found = {k: v for k, v in (parameters or {}).items() if k in KEYS}
    if files and LIFECYCLE_FILE in files:
        try:
            carried = json.loads(bytes(files.pop(LIFECYCLE_FILE)))
        except (ValueError, RecursionError) as err:
            raise InvalidArgument(f"load parameter '{LIFECYCLE_FILE}' is not JSON: {err}") from None
        if not isinstance(carried, dict) or set(carried) - set(KEYS):
            raise InvalidArgument(f"load parameter '{LIFECYCLE_FILE}' must be a JSON object "
                                  f"with keys among {', '.join(KEYS)}")
        found.update(carried)
    return found


def parse_promotion(params: Mapping[str, Any]) -> Promotion:
    shadow_max_diff = (_tolerance(params, "shadow_max_diff", 0.0)
                       if "shadow_max_diff" in params else None)
    golden = params.get("golden", [] if shadow_max_diff is not None else None)
    if isinstance(golden, (str, bytes)):
        try:
            golden = json.loads(golden)
        except (ValueError, RecursionError) as err:
            raise InvalidArgument(f"load parameter 'golden' is not JSON: {err}") from None
    if not isinstance(golden, list) or len(golden) > MAX_CASES or \
            not (golden or shadow_max_diff is not None):
        raise InvalidArgument(f"load parameter 'golden' must be a list of 1 to {MAX_CASES} "
                              "cases, each {\"inputs\": [tensor...], \"outputs\": [tensor...]} "
                              "with tensors as in a v2 JSON inference request")
    cases = []
    for i, case in enumerate(golden):
        if not isinstance(case, dict) or not isinstance(case.get("inputs"), list) \
                or not isinstance(case.get("outputs"), list) or not case["outputs"]:
            raise InvalidArgument(f"golden case {i}: expected {{\"inputs\": [...], "
                                  f"\"outputs\": [...]}} with at least one output")
        arrays = [(t, _array(t, f"golden case {i} input")) for t in case["inputs"]]
        inputs = [InferTensor(str(t["name"]), t["datatype"], a.shape, a) for t, a in arrays]
        outputs = [(t, _array(t, f"golden case {i} output")) for t in case["outputs"]]
        expected = {str(t["name"]): a for t, a in outputs}
        cases.append(GoldenCase(inputs, expected))
    version = params.get("promote")
    if version is not None:
        if isinstance(version, str) and is_version_dir_name(version):
            version = int(version)
        if isinstance(version, bool) or not isinstance(version, int) \
                or not 0 < version <= MAX_VERSION:
            raise InvalidArgument(f"load parameter 'promote' must be a version number, "
                                  f"not {version!r}")
    return Promotion(cases, _tolerance(params, "atol", 1e-8), _tolerance(params, "rtol", 1e-5),
                     version, shadow_max_diff)


def rollback_requested(params: Mapping[str, Any]) -> bool:
    """``rollback``: a JSON boolean (a string such as "false" is refused, never truthy)."""
    value = params.get("rollback", False)
    if not isinstance(value, bool):
        raise InvalidArgument(f"load parameter 'rollback' must be a boolean (true or false), "
                              f"not {value!r}")
    return value


def canary_fraction(params: Mapping[str, Any]) -> float:
    value = params.get("canary")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise InvalidArgument(f"load parameter 'canary' must be a fraction of the requests, "
                              f"0 (stop) to 1, not {value!r}")
    return float(value)


def _tolerance(params: Mapping[str, Any], key: str, default: float) -> float:
    value = params.get(key, default)
    try:
        if isinstance(value, bool):
            raise TypeError(value)
        value = float(value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"load parameter '{key}' must be a number, not {value!r}") from None
    if not value >= 0:
        raise InvalidArgument(f"load parameter '{key}' must be >= 0")
    return value


def _array(tensor: Any, what: str) -> np.ndarray:
    if not isinstance(tensor, dict) or not {"name", "datatype", "shape", "data"} <= set(tensor) \
            or not isinstance(tensor["shape"], list) or not isinstance(tensor["datatype"], str):
        raise InvalidArgument(f"{what}: a tensor needs name, datatype (a string), shape (a list) "
                              f"and data")
    try:
        shape = [int(d) for d in tensor["shape"]]
        if tensor["datatype"] == "BYTES":
            data = np.array([d.encode() if isinstance(d, str) else bytes(d)
                             for d in np.ravel(np.array(tensor["data"], dtype=object))], dtype=object)
        else:
            data = np.asarray(tensor["data"], dtype=triton_to_numpy(tensor["datatype"]))
        if any(d < 0 for d in shape) or data.size != int(np.prod(shape)):
            raise ValueError(f"{data.size} values for shape {shape}")
        return data.reshape(shape)
    except (TypeError, ValueError, KeyError, RecursionError, InvalidArgument) as err:
        raise InvalidArgument(f"{what} '{tensor.get('name')}': {err}") from None


def golden_request(name: str, version: int, case: GoldenCase) -> InferRequest:
    return InferRequest(model_name=name, model_version=str(version), inputs=list(case.inputs))


def compare(case_index: int, case: GoldenCase, outputs: dict[str, np.ndarray],
            atol: float, rtol: float) -> dict | None:
    """None when every expected output matches; else what differs, for the refusal."""
    problems = []
    for out, want in case.expected.items():
        got = outputs.get(out)
        if got is None:
            problems.append({"output": out, "error": "missing from the response"})
            continue
        if got.shape != want.shape:
            problems.append({"output": out, "error": f"shape {list(got.shape)}, expected "
                                                     f"{list(want.shape)}"})
            continue
        if want.dtype == object or got.dtype == object:
            bad = int(np.sum(got != want))
            if bad:
                problems.append({"output": out, "mismatched": bad, "of": int(want.size)})
            continue
        close = np.isclose(got.astype(np.float64), want.astype(np.float64), atol=atol, rtol=rtol)
        if not close.all():
            diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
            problems.append({"output": out, "mismatched": int((~close).sum()), "of": int(want.size),
                             "max_abs_diff": float(np.nanmax(diff)),
                             "first": {"index": list(map(int, np.argwhere(~close)[0])),
                                       "got": got[tuple(np.argwhere(~close)[0])].item(),
                                       "expected": want[tuple(np.argwhere(~close)[0])].item()}})
    return {"case": case_index, "outputs": problems} if problems else None
