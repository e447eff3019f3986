"""A small blocking v2 client for the kernel side: urllib for transport (no gevent in the
kernel's event loop), tritonclient's own helpers for the binary tensor encoding.

Every call is the same request an official client sends: ``load`` is exactly what
``tritonclient.http.InferenceServerClient.load_model(name, config=..., files=...)`` posts.
"""
from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from typing import Any, Iterator, Mapping
from urllib.parse import quote

import numpy as np

from ..protocol.datatypes import numpy_to_triton
from ..protocol.errors import (Cancelled, Internal, InvalidArgument, NotFound, PermissionDenied,
                               TritonError, Unavailable)
from .discovery import Connection

_BY_STATUS: dict[int, type[TritonError]] = {400: InvalidArgument, 403: PermissionDenied,
                                            404: NotFound, 499: Cancelled, 503: Unavailable}

#: seconds for a model load: a python-backend model spawns worker processes that import torch
LOAD_TIMEOUT = 600.0
CALL_TIMEOUT = 60.0


def _error(status: int, body: bytes, what: str) -> TritonError:
    try:
        message = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace").strip() or f"HTTP {status}"
    return _BY_STATUS.get(status, Internal)(f"{what}: {message}")


class TritonHTTP:
    """The v2 routes the notebook side needs, against one ``Connection``."""

    def __init__(self, connection: Connection, timeout: float = CALL_TIMEOUT) -> None:
        self.connection = connection
        self.timeout = timeout

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: Mapping[str, str] | None = None, timeout: float | None = None,
                what: str = "") -> tuple[int, dict[str, str], bytes]:
        all_headers = {**self.connection.headers, **(headers or {})}
        if body is not None and "Content-Type" not in all_headers:
            all_headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.connection.url + path, data=body, method=method,
                                     headers=all_headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as err:
            raise _error(err.code, err.read(), what or f"{method} {path}") from None
        except (urllib.error.URLError, OSError) as err:
            raise Unavailable(f"{what or method + ' ' + path}: cannot reach the inference server "
                              f"at {self.connection.url} ({getattr(err, 'reason', err)})") from None

    def get_json(self, path: str, what: str = "") -> Any:
        return json.loads(self.request("GET", path, what=what)[2] or b"null")

    # ---- health and queries ------------------------------------------------------------
    def ready(self, timeout: float = 3.0) -> bool:
        try:
            return self.request("GET", "v2/health/ready", timeout=timeout)[0] == 200
        except TritonError:
            return False

    def index(self) -> list[dict]:
        return json.loads(self.request("POST", "v2/repository/index", b"{}",
                                       what="repository index")[2])

    def metadata(self, model: str, version: str = "") -> dict:
        return self.get_json(self._model_path(model, version), what=f"model '{model}'")

    def config(self, model: str, version: str = "") -> dict:
        return self.get_json(self._model_path(model, version) + "/config", what=f"model '{model}'")

    def stats(self, model: str = "", version: str = "") -> dict:
        path = self._model_path(model, version) + "/stats" if model else "v2/models/stats"
        return self.get_json(path, what=f"statistics of '{model or 'all models'}'")

    def logs(self, model: str, version: str = "") -> list[dict]:
        """What the model said (pb_utils.Logger lines, its worker's stdout/stderr), oldest first."""
        return self.get_json(self._model_path(model, version) + "/logs",
                             what=f"logs of '{model}'")["lines"]

    # ---- control -----------------------------------------------------------------------
    def load(self, model: str, config: str | None = None,
             files: Mapping[str, bytes] | None = None, lifecycle: Mapping[str, Any] | None = None
             ) -> None:
        """POST v2/repository/models/{model}/load, files as ``{"<version>/<path>": bytes}``.
        ``lifecycle``: promotion (``golden``, ``atol``, ``rtol``, ``promote``) or ``rollback``,
        sent as the load parameter ``file:lifecycle.json`` (engine/lifecycle/promotion.py), which
        tritonclient's ``load_model(files=...)`` can send as well."""
        params: dict[str, str] = {}
        if lifecycle:
            params["file:lifecycle.json"] = base64.b64encode(json.dumps(lifecycle).encode()).decode()
        if config is not None:
            params["config"] = config
        for path, content in (files or {}).items():
            key = path if path.startswith("file:") else f"file:{path}"
            params[key] = base64.b64encode(bytes(content)).decode("ascii")
        body = json.dumps({"parameters": params} if params else {}).encode()
        self.request("POST", f"v2/repository/models/{quote(model, safe='')}/load", body,
                     timeout=LOAD_TIMEOUT, what=f"failed to load '{model}'")

    def history(self, model: str) -> list[dict]:
        """The model's promotions, refusals and rollbacks, oldest first (its statistics'
        ``history``; empty when it has none)."""
        return self.get_json(self._model_path(model) + "/stats",
                             what=f"history of '{model}'").get("history", [])

    def unload(self, model: str) -> None:
        self.request("POST", f"v2/repository/models/{quote(model, safe='')}/unload", b"{}",
                     what=f"failed to unload '{model}'")

    # ---- traffic (the server's engine/observation/capture.py) ---------------------------------------
    def capture(self, model: str, settings: Mapping[str, Any]) -> dict:
        """POST v2/models/{model}/traffic: start (``{"capture": true, "fraction": ...,
        "max_rows": ..., "max_bytes": ...}``) or stop (``{"capture": false}``) a capture."""
        return json.loads(self.request("POST", self._model_path(model) + "/traffic",
                                       json.dumps(settings).encode(),
                                       what=f"traffic capture of '{model}'")[2])

    def traffic(self, model: str) -> dict:
        """GET v2/models/{model}/traffic: the capture's state and its rows, oldest first."""
        return self.get_json(self._model_path(model) + "/traffic", what=f"traffic of '{model}'")

    # ---- data --------------------------------------------------------------------------
    def infer(self, model: str, inputs: Mapping[str, np.ndarray], version: str = "",
              outputs: list[str] | None = None, sequence: Mapping[str, Any] | None = None,
              priority: int = 0) -> dict[str, np.ndarray]:
        """One inference with binary tensors; returns every output as numpy. ``sequence``:
        ``sequence_id``, ``sequence_start``, ``sequence_end`` as tritonclient takes them;
        ``priority``: Triton's request parameter (0: the model's default level)."""
        import tritonclient.http as httpclient   # its codec helpers; the transport stays urllib
        infer_inputs = []
        for name, value in inputs.items():
            value = np.asarray(value)
            if value.dtype.kind == "U":
                value = np.char.encode(value, "utf-8").astype(np.object_)
            datatype = _triton_dtype(value)
            tensor = httpclient.InferInput(name, list(value.shape), datatype)
            tensor.set_data_from_numpy(value, binary_data=True)
            infer_inputs.append(tensor)
        requested = [httpclient.InferRequestedOutput(n, binary_data=True) for n in outputs or []]
        body, json_size = httpclient.InferenceServerClient.generate_request_body(
            infer_inputs, outputs=requested or None, priority=int(priority), **dict(sequence or {}))
        headers = {"Content-Type": "application/octet-stream"}
        if json_size is not None:
            headers["Inference-Header-Content-Length"] = str(json_size)
        _, resp_headers, data = self.request(
            "POST", self._model_path(model, version) + "/infer", body, headers=headers,
            what=f"inference on '{model}'")
        lower = {k.lower(): v for k, v in resp_headers.items()}
        header_length = lower.get("inference-header-content-length")
        result = httpclient.InferResult.from_response_body(
            data, header_length=int(header_length) if header_length is not None else None)
        return {out["name"]: result.as_numpy(out["name"])
                for out in result.get_response()["outputs"]}

    def generate(self, model: str, body: Mapping[str, Any], version: str = "") -> dict:
        """POST .../generate: one JSON object in, the model's one response out."""
        data = json.dumps(body).encode()
        return json.loads(self.request("POST", self._model_path(model, version) + "/generate", data,
                                       what=f"generate on '{model}'")[2])

    def generate_stream(self, model: str, body: Mapping[str, Any], version: str = "",
                        timeout: float | None = None) -> Iterator[dict]:
        """POST .../generate_stream: each server-sent event's JSON object as it arrives. An
        error event raises; closing the iterator early closes the connection, which the
        server takes as the request's cancellation."""
        what = f"generate_stream on '{model}'"
        headers = {**self.connection.headers, "Content-Type": "application/json",
                   "Accept": "text/event-stream"}
        req = urllib.request.Request(
            self.connection.url + self._model_path(model, version) + "/generate_stream",
            data=json.dumps(body).encode(), method="POST", headers=headers)
        try:
            resp = urllib.request.urlopen(req, timeout=timeout or self.timeout)
        except urllib.error.HTTPError as err:
            raise _error(err.code, err.read(), what) from None
        except (urllib.error.URLError, OSError) as err:
            raise Unavailable(f"{what}: cannot reach the inference server at "
                              f"{self.connection.url} ({getattr(err, 'reason', err)})") from None
        with resp:
            for raw in resp:
                line = raw.decode("utf-8").rstrip("\r\n")
                if not line.startswith("data:"):
                    continue           # blank separators, comments, event names
                event = json.loads(line[5:].strip())
                if isinstance(event, dict) and set(event) == {"error"}:
                    raise _error(400, json.dumps(event).encode(), what)
                yield event

    @staticmethod
    def _model_path(model: str, version: str = "") -> str:
        path = f"v2/models/{quote(model, safe='')}"
        return f"{path}/versions/{version}" if version else path


def _triton_dtype(value: np.ndarray) -> str:
    try:
        return numpy_to_triton(value.dtype)
    except InvalidArgument:
        raise InvalidArgument(f"arrays of dtype {value.dtype} cannot be sent to Triton") from None
