"""A model's captured traffic (``GET v2/models/{m}/traffic``) as a pandas DataFrame: one row a
request, tensors as numpy arrays. pandas is an optional extra (``jupyter_triton[notebook]``)."""
from __future__ import annotations

from typing import Any

from ..protocol.errors import InvalidArgument
from ..protocol.json_tensors import tensor_from_json

COLUMNS = ["time", "model_version", "id", "trace_id", "latency_ms", "status", "error",
           "inputs", "outputs"]


def capture_body(fraction: Any, max_rows: Any, max_bytes: Any, capture: Any, clear: Any) -> dict:
    """The control body ``handle.capture`` and ``jupyter_triton.capture`` send; the server
    checks every value (a 400 naming it)."""
    if capture is not True:
        return {"capture": capture, "clear": clear}
    body = {"capture": True, "fraction": fraction, "max_rows": max_rows}
    if max_bytes is not None:
        body["max_bytes"] = max_bytes
    return body


def traffic_frame(doc: dict, n: int | None = None):
    """The rows of ``doc`` (the route's answer), the newest ``n`` (None: all), oldest first:
    ``time`` (UTC), ``model_version``, ``id``, ``trace_id``, ``latency_ms``, ``status`` (200 or
    the error's HTTP status), ``error``, and ``inputs`` / ``outputs`` (name -> numpy array)."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise InvalidArgument(f"traffic(n=...) takes a number of rows, 0 or more, or None; got {n!r}")
    try:
        import pandas as pd
    except ImportError:
        raise ImportError("traffic() returns a pandas DataFrame: pip install "
                          "'jupyter_triton[notebook]' (or pandas)") from None
    rows = doc.get("requests", [])
    if n is not None:
        rows = rows[len(rows) - n:] if n else []
    frame = pd.DataFrame(
        [{"time": r["time"], "model_version": r["model_version"], "id": r["id"],
          "trace_id": r["trace_id"], "latency_ms": r["latency_us"] / 1000, "status": r["status"],
          "error": r["error"], "inputs": {t["name"]: tensor_from_json(t) for t in r["inputs"]},
          "outputs": {t["name"]: tensor_from_json(t) for t in r["outputs"]}} for r in rows],
        columns=COLUMNS)
    frame["time"] = pd.to_datetime(frame["time"].astype(float), unit="s", utc=True)
    return frame
