"""A golden set, as a notebook holds it (``[(inputs, expected), ...]`` of numpy arrays), in
the form the server's promotion check reads (engine/lifecycle/promotion.py), and what the server
answered: promoted, or refused with a per-case diff.

Client-side only: everything here becomes a load request's parameters; the check itself
runs on the server, against the staged version."""
from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..protocol.datatypes import numpy_to_triton
from ..protocol.errors import InvalidArgument, TritonError

#: what the server's refusal message carries before its JSON diff
_REFUSED = "its outputs differ from the golden set: "


def _tensor(name: str, value: Any) -> dict:
    array = np.asarray(value)
    if array.dtype.kind in "USO":
        data = [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
                for v in array.reshape(-1).tolist()]
        return {"name": name, "datatype": "BYTES", "shape": list(array.shape), "data": data}
    return {"name": name, "datatype": numpy_to_triton(array.dtype), "shape": list(array.shape),
            "data": array.reshape(-1).tolist()}


def _named(value: Any, specs: list[dict], what: str) -> dict[str, Any]:
    names = [s["name"] for s in specs]
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise InvalidArgument(f"golden {what}: no {what} named {', '.join(unknown)} "
                                  f"(the model's: {', '.join(names)})")
        return dict(value)
    values = list(value) if isinstance(value, (tuple, list)) and len(specs) > 1 else [value]
    if len(values) != len(names):
        raise InvalidArgument(f"golden {what}: the model has {len(names)} ({', '.join(names)}), "
                              f"got {len(values)}")
    return dict(zip(names, values))


def _batched(value: Any, spec: dict, batching: bool) -> np.ndarray:
    array = np.asarray(value)
    # one row without its batch dimension, as handle.infer takes it
    if batching and array.ndim == len(spec.get("dims", [])):
        array = array[np.newaxis]
    return array


def from_traffic(frame: Any) -> list[tuple[dict, dict]]:
    """Captured traffic (``handle.traffic()``'s DataFrame) as golden cases: each request
    that was answered (status 200), its inputs and the outputs served to it."""
    rows = frame[frame["status"] == 200] if len(frame) else frame
    return [(dict(r["inputs"]), dict(r["outputs"])) for _, r in rows.iterrows()
            if r["inputs"] and r["outputs"]]


def encode(golden: Any, config: dict) -> list[dict]:
    """``golden`` against the model's config (its JSON: ``input``, ``output``,
    ``max_batch_size``): inputs and outputs by name, or by position in the config's order.
    A DataFrame of captured traffic (``handle.traffic()``) is read with ``from_traffic``."""
    if hasattr(golden, "iterrows") and {"inputs", "outputs", "status"} <= set(golden.columns):
        golden = from_traffic(golden)
    if not golden:
        raise InvalidArgument("the golden set is empty: give [(inputs, expected), ...]")
    batching = int(config.get("max_batch_size", 0) or 0) > 0
    ins, outs = list(config.get("input", [])), list(config.get("output", []))
    cases = []
    for i, case in enumerate(golden):
        try:
            inputs, expected = case
        except (TypeError, ValueError):
            raise InvalidArgument(f"golden case {i}: expected a pair (inputs, expected)") from None
        by_in = {s["name"]: s for s in ins}
        by_out = {s["name"]: s for s in outs}
        cases.append({
            "inputs": [_tensor(n, _batched(v, by_in.get(n, {}), batching))
                       for n, v in _named(inputs, ins, "input").items()],
            "outputs": [_tensor(n, _batched(v, by_out.get(n, {}), batching))
                        for n, v in _named(expected, outs, "output").items()]})
    return cases


@dataclass
class PromotionResult:
    """What a promotion came to: ``promoted`` (the version now served) or refused, with
    ``failed``: per golden case, what differed."""
    model: str
    version: int | None
    promoted: bool
    cases: int
    failed: list[dict] = field(default_factory=list)
    message: str = ""
    shadow_max_diff: float | None = None    # the shadow report's bound it was promoted within

    @classmethod
    def refused(cls, model: str, err: TritonError, cases: int) -> "PromotionResult":
        text = str(err)
        version, failed = None, []
        if _REFUSED in text:
            try:
                detail = json.loads(text.split(_REFUSED, 1)[1])
                version, failed = detail.get("version"), detail.get("failed", [])
            except ValueError:
                pass
        return cls(model, version, False, cases, failed, text)

    def summary(self) -> str:
        if self.promoted:
            held = [f"{self.cases} golden case(s) matched"] if self.cases else []
            if self.shadow_max_diff is not None:
                held.append(f"shadow within max |diff| {self.shadow_max_diff:g}")
            return f"'{self.model}' version {self.version} promoted: {', '.join(held)}"
        if not self.failed:
            return f"'{self.model}': promotion refused: {self.message}"
        lines = [f"'{self.model}' version {self.version} NOT promoted: {len(self.failed)} of "
                 f"{self.cases} golden case(s) differ; the served version keeps serving"]
        for case in self.failed:
            if "error" in case:
                lines.append(f"  case {case['case']}: {case['error']}")
            for out in case.get("outputs", []):
                detail = out.get("error") or (
                    f"{out['mismatched']} of {out['of']} values differ, max |diff| "
                    f"{out.get('max_abs_diff', float('nan')):.4g}"
                    + (f", first at {out['first']['index']}: got {out['first']['got']}, "
                       f"expected {out['first']['expected']}" if "first" in out else ""))
                lines.append(f"  case {case['case']} {out['output']}: {detail}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(self.summary())}</pre>"


class PromotionRefused(InvalidArgument):
    """``serve(..., golden=...)`` whose new version did not match: ``result`` says how."""

    def __init__(self, result: PromotionResult) -> None:
        super().__init__(result.summary())
        self.result = result
