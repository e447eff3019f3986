"""What ``%%serve`` returns: a handle on a model served by the server, shown as its URL,
version, state and the calls another service would make (curl, tritonclient)."""
from __future__ import annotations

import html
import json
import os
from typing import Any, Iterator, Sequence
from urllib.parse import urlsplit

import numpy as np

from ..hub import HUB_TOKEN, in_hub
from ..protocol.datatypes import as_numpy, triton_to_numpy
from ..protocol.errors import InvalidArgument, TritonError, Unavailable
from .artifacts import TEXT_INPUT, TEXT_OUTPUT
from .client import TritonHTTP
from .discovery import IN_KERNEL, Connection
from .golden import PromotionResult, encode
from .traffic import capture_body, traffic_frame

#: shown instead of the real secret, a variable this kernel has: a hub's kernels carry a token
#: of the user's (``JUPYTERHUB_API_TOKEN``), a server started with ``JUPYTER_TOKEN`` passes it
#: on, and every server of ours sets its own (``JUPYTER_TRITON_TOKEN``; the in-kernel one too)
TOKEN_VARIABLE, IN_KERNEL_TOKEN_VARIABLE = "JUPYTER_TOKEN", "JUPYTER_TRITON_TOKEN"
_INLINE_ELEMENTS = 16


class ServedModel:
    """A model on the server. ``infer`` goes to the model's URL (its newest ready version),
    like any other client's call; ``version`` is the version this handle was made for."""

    def __init__(self, name: str, version: int, connection: Connection, *,
                 notes: list[str] | None = None, load_seconds: float | None = None) -> None:
        self.name = name
        self.version = int(version)
        self.connection = connection
        self.notes = list(notes or [])
        self.load_seconds = load_seconds
        self._client = TritonHTTP(connection)

    @classmethod
    def from_server(cls, name: str, connection: Connection) -> "ServedModel":
        """A handle on the newest ready version of an already served model."""
        meta = TritonHTTP(connection).metadata(name)
        return cls(name, max(int(v) for v in meta["versions"]), connection)

    # ---- what it is --------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The model's URL as other hosts reach it (a hub's public address when known)."""
        return self.connection.public_model_url(self.name)

    @property
    def version_url(self) -> str:
        return f"{self.url}/versions/{self.version}"

    @property
    def state(self) -> str:
        """This version's state in the repository index (READY, LOADING, UNAVAILABLE)."""
        try:
            rows = self._client.index()
        except TritonError as err:
            return f"UNKNOWN ({err})"
        for row in rows:
            if row.get("name") == self.name and str(row.get("version")) == str(self.version):
                return row.get("state", "UNKNOWN")
        return "UNKNOWN"

    def metadata(self) -> dict:
        return self._client.metadata(self.name)

    def config(self) -> dict:
        return self._client.config(self.name)

    def stats(self) -> dict:
        """Triton's statistics JSON of this model (every served version)."""
        return self._client.stats(self.name)

    def logs(self, tail: int = 50) -> str:
        """The model's last ``tail`` log lines (its ``pb_utils.Logger`` calls and the stdout
        and stderr of its worker processes), as the server keeps them for every version."""
        lines = self._client.logs(self.name)[-tail:] if tail else []
        return "\n".join(f"{e['time']} v{e['version']} {e['level']:<7} [{e['source']}] {e['message']}"
                         for e in lines)

    # ---- its lifecycle -----------------------------------------------------------------
    def promote(self, version: int, golden: Any = None, *, atol: float = 1e-8,
                rtol: float = 1e-5, shadow_max_diff: float | None = None) -> PromotionResult:
        """Serve ``version`` (on the server's disk, or staged, not served now) only if it
        answers every golden case ``(inputs, expected)`` within ``atol``/``rtol`` and, with
        ``shadow_max_diff``, only if its shadow report (``shadow_report()``) shows no output
        further than that from the served answers. ``golden`` may be captured traffic
        (``traffic(n=200)``: each request's inputs and the outputs served to it). The server
        checks both and switches its version policy only if all hold. A refusal comes back
        as the result (its diff, or the output and its difference), not as an exception."""
        if golden is None and shadow_max_diff is None:
            raise InvalidArgument("promote() needs a golden set, a shadow_max_diff, or both")
        lifecycle: dict[str, Any] = {"promote": int(version)}
        cases: list = []
        if golden is not None:
            cases = encode(golden, self._client.config(self.name))
            lifecycle.update({"golden": cases, "atol": atol, "rtol": rtol})
        if shadow_max_diff is not None:
            lifecycle["shadow_max_diff"] = shadow_max_diff
        try:
            self._client.load(self.name, lifecycle=lifecycle)
        except InvalidArgument as err:
            return PromotionResult.refused(self.name, err, len(cases))
        self.version = int(version)
        return PromotionResult(self.name, int(version), True, len(cases),
                               shadow_max_diff=shadow_max_diff)

    # ---- shadow traffic (the server's engine/observation/shadow.py) --------------------
    def shadow(self, version: int | None, fraction: float = 1.0) -> dict | None:
        """Send a copy of ``fraction`` of this model's served requests to its staged
        ``version`` (``serve(..., stage=True)``); its answers never reach a client, and a
        slow or failing one never delays or fails the served answer. ``None`` (or False)
        stops, keeping the report. Returns the report (``shadow_report``)."""
        if version is False:
            version = None
        body = json.dumps({"version": version, "fraction": fraction}).encode()
        doc = json.loads(self._client.request("POST", self._shadow_path(), body,
                                              what=f"shadow of '{self.name}'")[2])
        return doc["shadow"]

    def shadow_report(self) -> dict | None:
        """How the shadowed version's answers compare with the served ones, per output:
        ``compared``, ``max_abs_diff``, ``agreement`` (argmax, [batch, classes] outputs),
        ``cosine_distance`` (mean, max; vectors); and ``latency_ms`` of both versions
        (p50, p99). None when no shadow ran."""
        return self._client.get_json(self._shadow_path(), what=f"shadow of '{self.name}'")["shadow"]

    def _shadow_path(self) -> str:
        return self._client._model_path(self.name) + "/shadow"

    def stop_canary(self) -> None:
        """End this model's canary: its version is set aside, all requests go to the
        served version again."""
        self._client.load(self.name, lifecycle={"canary": 0})

    def rollback(self) -> "ServedModel":
        """Serve again the version (and its config) that served before the current one, in
        one swap; returns a handle on it."""
        self._client.load(self.name, lifecycle={"rollback": True})
        return ServedModel.from_server(self.name, self.connection)

    def history(self) -> list[dict]:
        """Loads, promotions, refusals and rollbacks of this model, oldest first."""
        return self._client.history(self.name)

    def lineage(self, version: int | None = None) -> dict | None:
        """What ``version`` (None: this handle's) was served from (kernel/lineage.py): cell and
        function source, execution count, Python, packages and their hash, git commit, golden
        set's hash; None for a version served without one."""
        path = f"{self._client._model_path(self.name, str(version or self.version))}/lineage"
        return self._client.get_json(path, what=f"lineage of '{self.name}'")["lineage"]

    # ---- its traffic (the server's engine/observation/capture.py) -----------------------------------
    def capture(self, fraction: float = 1.0, max_rows: int = 10_000, *,
                max_bytes: int | None = None, capture: bool = True, clear: bool = False) -> dict:
        """Keep a bounded, in-memory sample of this model's requests on the server, over HTTP
        and gRPC alike: ``fraction`` of them, the newest ``max_rows`` within ``max_bytes``
        (None: the server's default, 16 MiB). Starting again starts a new sample;
        ``capture=False`` stops it and keeps it readable (``clear=True`` drops it). Returns
        the capture's state (None once cleared)."""
        body = capture_body(fraction, max_rows, max_bytes, capture, clear)
        return self._client.capture(self.name, body)["capture"]

    def traffic(self, n: int | None = None):
        """The captured requests, the newest ``n`` (None: all), as a pandas DataFrame: one row
        a request (time, model_version, id, trace_id, latency_ms, status, error, and inputs /
        outputs as name -> numpy array)."""
        return traffic_frame(self._client.traffic(self.name), n)

    # ---- what it does ------------------------------------------------------------------
    def infer(self, *arrays: Any, **named: Any) -> np.ndarray | dict[str, np.ndarray]:
        """Run the model: inputs by position (the model's input order) or by name. Returns
        the output array, or a dict of them when the model has several. A model that
        batches also takes one row without its batch dimension, and answers in kind. A text
        model (``text_input`` -> ``text_output``) takes and returns a string."""
        return self._infer(arrays, named, None)

    def sequence(self, sequence_id: int | str) -> "Sequence":
        """Requests of one sequence (correlation id) of a stateful model: ``s.infer(x,
        start=True)``, ..., ``s.infer(x, end=True)``."""
        return Sequence(self, sequence_id)

    def _infer(self, arrays: tuple, named: dict, sequence: dict | None) -> Any:
        meta = self.metadata()
        if self._text_model(meta) and len(arrays) == 1 and isinstance(arrays[0], str) and not named:
            out = self._client.infer(self.name, {TEXT_INPUT: np.array([arrays[0].encode("utf-8")],
                                                                      dtype=np.object_)}, sequence=sequence)
            value = np.asarray(out[TEXT_OUTPUT]).reshape(-1)[0]
            return value.decode("utf-8") if isinstance(value, bytes) else str(value)
        specs = meta.get("inputs", [])
        if len(arrays) > len(specs):
            raise InvalidArgument(f"model '{self.name}' takes {len(specs)} input(s) "
                                  f"({', '.join(s['name'] for s in specs)}), got {len(arrays)}")
        values = {s["name"]: a for s, a in zip(specs, arrays)}
        unknown = [k for k in named if k not in {s["name"] for s in specs}]
        if unknown:
            raise InvalidArgument(f"model '{self.name}' has no input(s) {', '.join(unknown)} "
                                  f"(inputs: {', '.join(s['name'] for s in specs)})")
        values.update(named)
        missing = [s["name"] for s in specs if s["name"] not in values]
        if missing:
            raise InvalidArgument(f"model '{self.name}': missing input(s) {', '.join(missing)}")
        max_batch = int(self._client.config(self.name).get("max_batch_size", 0))
        added_batch = False
        inputs = {}
        for spec in specs:
            value = as_numpy(values[spec["name"]], spec["datatype"])
            if max_batch and value.ndim == len(spec["shape"]) - 1:
                value, added_batch = value[np.newaxis], True
            inputs[spec["name"]] = value
        rows = {v.shape[0] for v in inputs.values() if v.ndim}
        if max_batch and len(rows) == 1 and rows.pop() > max_batch:
            # more rows than one request may carry: send them in max_batch_size slices
            total = next(iter(inputs.values())).shape[0]
            if sequence:
                raise InvalidArgument(f"model '{self.name}': a sequence request carries at most "
                                      f"max_batch_size ({max_batch}) rows")
            parts = [self._client.infer(self.name, {k: v[i:i + max_batch] for k, v in inputs.items()})
                     for i in range(0, total, max_batch)]
            outputs = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        else:
            outputs = self._client.infer(self.name, inputs, sequence=sequence)
        if added_batch:
            outputs = {k: v[0] for k, v in outputs.items()}
        order = [o["name"] for o in meta.get("outputs", [])]
        outputs = {k: outputs[k] for k in order if k in outputs} or outputs
        return next(iter(outputs.values())) if len(outputs) == 1 else outputs

    __call__ = infer

    def map(self, items: Any, *, chunk_size: int | None = None, concurrency: int = 4,
            priority: int | str = "bulk", progress: bool = True, resume: Any = None) -> Any:
        """Run the model over a large input: ``chunk_size`` rows a request (default
        max_batch_size), ``concurrency`` requests at a time, at the model's lowest priority
        level (``priority="bulk"``, or a level), with a progress bar; returns the outputs in
        input order (a list of strings for a text model). An interruption or a failed chunk
        raises ``BulkInterrupted``/``BulkFailed`` whose ``bulk`` keeps what finished:
        ``handle.map(items, resume=err.bulk)`` (or its key) sends only the rest."""
        from .bulk import run_map
        return run_map(self, items, chunk_size=chunk_size, concurrency=concurrency,
                       priority=priority, progress=progress, resume=resume)

    def _text_model(self, meta: dict) -> bool:
        ins = [(t["name"], t["datatype"]) for t in meta.get("inputs", [])]
        outs = [t["name"] for t in meta.get("outputs", [])]
        return ins == [(TEXT_INPUT, "BYTES")] and TEXT_OUTPUT in outs

    def _generate_body(self, args: tuple, named: dict) -> tuple[dict, bool]:
        meta = self.metadata()
        text = self._text_model(meta)
        names = [t["name"] for t in meta.get("inputs", [])]
        if len(args) > len(names):
            raise InvalidArgument(f"model '{self.name}' takes {len(names)} input(s) "
                                  f"({', '.join(names)}), got {len(args)}")
        body = {n: a for n, a in zip(names, args)}
        body.update(named)         # other names become request parameters (max_tokens, ...)
        for key, value in body.items():
            if hasattr(value, "tolist"):
                body[key] = value.tolist()
        return body, text

    def stream(self, *args: Any, via: str = "http", **named: Any) -> Iterator[Any]:
        """Every response of one request, as the model sends them: a text model
        (``text_input`` -> ``text_output``) yields strings, others a dict of outputs.
        Keywords that are no input of the model go as request parameters (``max_tokens``).
        ``via="http"``: generate_stream; ``via="grpc"``: tritonclient's gRPC stream (the
        connection's gRPC port)."""
        if via == "grpc":
            yield from self._grpc_stream(args, named)
            return
        if via != "http":
            raise InvalidArgument(f"via must be 'http' or 'grpc', not {via!r}")
        body, text = self._generate_body(args, named)
        for event in self._client.generate_stream(self.name, body):
            yield event.get(TEXT_OUTPUT, "") if text else _event_outputs(event)

    def _grpc_stream(self, args: tuple, named: dict) -> Iterator[Any]:
        import queue

        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException
        if not self.connection.grpc_url:
            raise Unavailable(f"model '{self.name}': the server at {self.connection.url} has no "
                              f"gRPC port this kernel knows of; use via='http'")
        meta = self.metadata()
        text = self._text_model(meta)
        specs = meta.get("inputs", [])
        values = {s["name"]: a for s, a in zip(specs, args)}
        parameters = {k: v for k, v in named.items() if k not in {s["name"] for s in specs}}
        values.update({k: v for k, v in named.items() if k not in parameters})
        tensors = []
        for spec in specs:
            if spec["name"] not in values:
                raise InvalidArgument(f"model '{self.name}': missing input {spec['name']}")
            value = values[spec["name"]]
            if text and isinstance(value, str):
                value = np.array([value.encode("utf-8")], dtype=np.object_)
            value = as_numpy(value, spec["datatype"])
            tensor = grpcclient.InferInput(spec["name"], list(value.shape), spec["datatype"])
            tensor.set_data_from_numpy(value)
            tensors.append(tensor)
        client = grpcclient.InferenceServerClient(self.connection.grpc_url)
        results: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)),
                            headers=self.connection.grpc_headers)
        try:
            client.async_stream_infer(self.name, tensors, parameters=parameters or None,
                                      enable_empty_final_response=True)
            while True:
                try:
                    result, error = results.get(timeout=self._client.timeout)
                except queue.Empty:
                    raise Unavailable(f"model '{self.name}': no response within "
                                      f"{self._client.timeout:.0f} s") from None
                if error is not None:
                    message = error.message() if isinstance(error, InferenceServerException) else str(error)
                    raise TritonError(f"stream of '{self.name}': {message}")
                response = result.get_response()
                final = response.parameters["triton_final_response"].bool_param \
                    if "triton_final_response" in response.parameters else False
                if response.outputs:
                    outputs = {o.name: result.as_numpy(o.name) for o in response.outputs}
                    if text:
                        value = outputs[TEXT_OUTPUT].reshape(-1)[0]
                        yield value.decode("utf-8") if isinstance(value, bytes) else str(value)
                    else:
                        yield outputs
                if final:
                    return
        finally:
            client.stop_stream(cancel_requests=True)
            client.close()

    def generate(self, *args: Any, **named: Any) -> Any:
        """One response through the generate extension (a string for a text model)."""
        body, text = self._generate_body(args, named)
        event = self._client.generate(self.name, body)
        return event.get(TEXT_OUTPUT, "") if text else _event_outputs(event)

    def dashboard(self, interval: float = 1.0):
        from ..widgets import Dashboard
        return Dashboard(self.connection, model=self.name, interval=interval)

    def unload(self) -> None:
        self._client.unload(self.name)

    # ---- how it shows ------------------------------------------------------------------
    def _summary(self) -> dict:
        try:
            meta = self.metadata()
        except TritonError:
            meta = {}
        try:
            config = self.config()
        except TritonError:
            config = {}
        return {"state": self.state, "inputs": meta.get("inputs", []),
                "outputs": meta.get("outputs", []),
                "decoupled": bool(config.get("model_transaction_policy", {}).get("decoupled")),
                "sequence": "sequence_batching" in config, "text": self._text_model(meta)}

    def snippets(self, summary: dict | None = None) -> tuple[str, str]:
        """(curl command, client code) that call this model from elsewhere: v2 infer and
        tritonclient; generate_stream and the openai client for a text model; generate_stream
        for another decoupled one (HTTP infer refuses it)."""
        summary = summary if summary is not None else self._summary()
        if summary.get("text"):
            return _curl_generate(self, {TEXT_INPUT: "hello world"}, summary["decoupled"]), _openai(self)
        if summary.get("decoupled"):
            body = {t["name"]: _zeros_json(t) for t in summary["inputs"]}
            return _curl_generate(self, body, True), _sse_python(self, body)
        sequence = bool(summary.get("sequence"))
        return (_curl(self, summary["inputs"], sequence),
                _tritonclient(self, summary["inputs"], summary["outputs"], sequence))

    @staticmethod
    def _client_label(summary: dict) -> str:
        if summary.get("text"):
            return "openai:"
        return "python:" if summary.get("decoupled") else "tritonclient:"

    def _notes(self) -> list[str]:
        return self.notes + [n for n in self.connection.notes if n not in self.notes]

    def __repr__(self) -> str:
        s = self._summary()
        curl, client = self.snippets(s)
        lines = [f"{self.name} version {self.version} {s['state']}"
                 + (f" (served in {self.load_seconds:.1f} s)" if self.load_seconds is not None else ""),
                 f"  URL      {self.url}"]
        lines += [f"  input    {_tensor_text(t)}" for t in s["inputs"]]
        lines += [f"  output   {_tensor_text(t)}" for t in s["outputs"]]
        lines += [f"  note     {n}" for n in self._notes()]
        lines += ["curl:", _indent(curl), self._client_label(s), _indent(client)]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        s = self._summary()
        curl, client = self.snippets(s)
        e = html.escape
        color = {"READY": "#2e7d32", "LOADING": "#f9a825"}.get(s["state"], "#c62828")
        rows = [("URL", f"<code>{e(self.url)}</code>"),
                ("version", f"{self.version}"),
                ("state", f"<b style='color:{color}'>{e(s['state'])}</b>"
                          + (f" &middot; served in {self.load_seconds:.1f} s" if self.load_seconds else ""))]
        rows += [("input", f"<code>{e(_tensor_text(t))}</code>") for t in s["inputs"]]
        rows += [("output", f"<code>{e(_tensor_text(t))}</code>") for t in s["outputs"]]
        rows += [("note", e(n)) for n in self._notes()]
        table = "".join(f"<tr><th style='text-align:left;padding-right:1em'>{k}</th>"
                        f"<td style='text-align:left'>{v}</td></tr>" for k, v in rows)
        pre = "style='white-space:pre-wrap;font-size:90%;margin:0.3em 0'"
        return (f"<div><b>{e(self.name)}</b><table>{table}</table>"
                f"<details><summary>curl</summary><pre {pre}>{e(curl)}</pre></details>"
                f"<details><summary>{self._client_label(s)[:-1]}</summary><pre {pre}>{e(client)}</pre>"
                f"</details></div>")


class Sequence:
    """One correlation id of a stateful model (``ServedModel.sequence``)."""

    def __init__(self, model: ServedModel, sequence_id: int | str) -> None:
        self.model, self.sequence_id = model, sequence_id

    def infer(self, *arrays: Any, start: bool = False, end: bool = False, **named: Any) -> Any:
        return self.model._infer(arrays, named, {"sequence_id": self.sequence_id,
                                                 "sequence_start": start, "sequence_end": end})

    __call__ = infer


def _event_outputs(event: dict) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in event.items() if k not in ("model_name", "model_version")}


def _tensor_text(t: dict) -> str:
    return f"{t['name']} {t['datatype']} {list(t['shape'])}"


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def _example_shape(shape: list[int]) -> list[int]:
    return [1 if int(d) < 0 else int(d) for d in shape] or [1]


def _token_variable(connection: Connection) -> str:
    """The environment variable the snippets read the credential from ('' when none)."""
    if not connection.token:
        return ""
    if connection.mode == IN_KERNEL:
        return IN_KERNEL_TOKEN_VARIABLE
    if in_hub(os.environ):
        return HUB_TOKEN
    return TOKEN_VARIABLE if os.environ.get(TOKEN_VARIABLE) else IN_KERNEL_TOKEN_VARIABLE


#: a sequence model's one-request sequence, as the snippets send it
_SEQUENCE = {"sequence_id": 1, "sequence_start": True, "sequence_end": True}


def _curl(model: ServedModel, inputs: list[dict], sequence: bool = False) -> str:
    variable = _token_variable(model.connection)
    # curl -d alone says application/x-www-form-urlencoded, which the server refuses
    auth = '-H "Content-Type: application/json" ' + (
        f'-H "Authorization: token ${variable}" ' if variable else "")
    tensors, generated = [], False
    for t in inputs:
        shape = _example_shape(t["shape"])
        count = int(np.prod(shape))
        zero = '""' if t["datatype"] == "BYTES" else ("false" if t["datatype"] == "BOOL" else "0")
        if count <= _INLINE_ELEMENTS:
            data = "[" + ",".join([zero] * count) + "]"
        else:
            data, generated = f"[{zero}]*{count}", True
        tensors.append(f'{{"name":"{t["name"]}","shape":{json.dumps(shape)},'
                       f'"datatype":"{t["datatype"]}","data":{data}}}')
    parameters = ',"parameters":' + json.dumps(_SEQUENCE, separators=(",", ":")) if sequence else ""
    body = '{"inputs":[' + ",".join(tensors) + ']' + parameters + '}'
    if generated:
        body = body.replace("false", "False").replace("true", "True")
        payload = f"\"$(python3 -c 'import json; print(json.dumps({body}))')\""
    else:
        payload = f"'{body}'"
    return f"curl -s {auth}{model.url}/infer \\\n     -d {payload}"


def _auth_header(model: ServedModel) -> str:
    variable = _token_variable(model.connection)
    return f'-H "Authorization: token ${variable}" ' if variable else ""


def _zeros_json(t: dict) -> Any:
    shape = _example_shape(t["shape"])
    zero = "" if t["datatype"] == "BYTES" else (False if t["datatype"] == "BOOL" else 0)
    return np.full(shape, zero, dtype=object).tolist() if int(np.prod(shape)) > 1 else zero


def _curl_generate(model: ServedModel, body: dict, stream: bool) -> str:
    route, no_buffer = ("generate_stream", "-N ") if stream else ("generate", "")
    return (f"curl -s {no_buffer}-H \"Content-Type: application/json\" {_auth_header(model)}"
            f"{model.url}/{route} \\\n     -d '{json.dumps(body)}'")


def _openai(model: ServedModel) -> str:
    base = model.url.split("/v2/models/")[0] + "/v1"
    variable = _token_variable(model.connection)
    key = f'os.environ["{variable}"]' if variable else '"none"'
    return "\n".join([
        "import os",
        "from openai import OpenAI",
        f'client = OpenAI(base_url="{base}", api_key={key})',
        f'stream = client.chat.completions.create(model="{model.name}", stream=True,',
        '    messages=[{"role": "user", "content": "hello world"}])',
        'print("".join(c.choices[0].delta.content or "" for c in stream if c.choices))'])


def _sse_python(model: ServedModel, body: dict) -> str:
    variable = _token_variable(model.connection)
    auth = f', "Authorization": "token " + os.environ["{variable}"]' if variable else ""
    return "\n".join([
        "import json, os, urllib.request",
        f'req = urllib.request.Request("{model.url}/generate_stream",',
        f"    data=json.dumps({body!r}).encode(),",
        f'    headers={{"Content-Type": "application/json"{auth}}})',
        "for line in urllib.request.urlopen(req):      # one server-sent event per response",
        '    if line.startswith(b"data:"):',
        "        print(json.loads(line[5:]))"])


def _tritonclient(model: ServedModel, inputs: list[dict], outputs: list[dict],
                  sequence: bool = False) -> str:
    parts = urlsplit(model.url)
    base = parts.path.split("/v2/models/")[0].rstrip("/")
    target = f"{parts.netloc}{base}"
    ssl = ", ssl=True" if parts.scheme == "https" else ""
    lines = ["import numpy as np, os, tritonclient.http as httpclient",
             f'client = httpclient.InferenceServerClient("{target}"{ssl})']
    variable = _token_variable(model.connection)
    uses_token = bool(variable)
    if uses_token:
        lines.append(f'headers = {{"Authorization": "token " + os.environ["{variable}"]}}')
    names = []
    for i, t in enumerate(inputs):
        shape = _example_shape(t["shape"])
        var = f"in{i}"
        names.append(var)
        if t["datatype"] == "BYTES":
            data = f"np.full({tuple(shape)}, b'', dtype=object)"
        elif t["datatype"] == "BF16":     # numpy has no bfloat16; the client sends float32 as BF16
            data = f"np.zeros({tuple(shape)}, np.float32)"
        else:
            data = f"np.zeros({tuple(shape)}, np.{triton_to_numpy(t['datatype']).name})"
        lines.append(f'{var} = httpclient.InferInput("{t["name"]}", {shape}, "{t["datatype"]}")')
        lines.append(f"{var}.set_data_from_numpy({data})")
    call = f'result = client.infer("{model.name}", [{", ".join(names)}]' + (
        ", sequence_id=1, sequence_start=True, sequence_end=True" if sequence else "") + (
        ", headers=headers)" if uses_token else ")")
    lines.append(call)
    lines += [f'print(result.as_numpy("{o["name"]}"))' for o in outputs]
    return "\n".join(lines)
