"""The notebook's Python API; the magics are thin wrappers over it.

Every model reaches the server through one call, the repository API's load request
(``POST v2/repository/models/{name}/load`` with the config and ``file:1/<file>`` contents),
which the server stores as a new version directory and loads before it retires the old one.
"""
from __future__ import annotations

import json
import time
from typing import Any, Sequence

from ..protocol.errors import InvalidArgument
from .artifacts import ArtifactError, TensorSpec, build_artifact
from .client import TritonHTTP
from .discovery import IN_KERNEL, Connection
from .discovery import connection as _discover
from .ensemble import StepSpec, ensemble_artifact, ensemble_config
from .golden import PromotionRefused, PromotionResult, encode
from .handle import ServedModel
from .huggingface import is_text_embedder, text_embedder
from .knobs import Knobs, apply_knobs
from .lineage import gather as gather_lineage, lineage_file
from .traffic import capture_body, traffic_frame

_announced: set[int] = set()
#: the artifact this kernel last served under each name: what ``tune`` loads under other names
uploaded: dict[str, Any] = {}


def connection(refresh: bool = False) -> Connection:
    """The server this kernel talks to (found once; see ``discovery``). The first time an
    in-kernel server is started, says so."""
    conn = _discover(refresh)
    if conn.mode == IN_KERNEL and id(conn) not in _announced:
        _announced.add(id(conn))
        print(conn.describe())
    return conn


def _client() -> TritonHTTP:
    return TritonHTTP(connection())


def serve(obj: Any, name: str, *, max_batch_size: int | None = None,
          preferred_batch_sizes: list[int] | None = None, max_queue_delay_us: int | None = None,
          instances: int = 1, kind: str = "auto", gpus: list[int] | None = None,
          priority_levels: int | None = None, warmup: int | None = None, example: Any = None,
          inputs: Sequence[TensorSpec] | None = None, outputs: Sequence[TensorSpec] | None = None,
          config: str = "", decoupled: bool | None = None, sequence: bool = False,
          golden: Sequence[tuple[Any, Any]] | None = None, atol: float = 1e-8,
          rtol: float = 1e-5, canary: float | None = None, stage: bool = False) -> ServedModel:
    """Serve ``obj`` as model ``name``: a new version, loaded before the old one retires.

    ``obj``: an ONNX model, a torch module, a TorchScript module, a TensorRT engine, a
    callable or model.py source (see ``jupyter_triton.kernel.artifacts``); a Hugging Face
    ``(transformers_model, tokenizer)`` or a ``SentenceTransformer`` is served as a tokenize ->
    encode ensemble, ``name`` behind ``v1/embeddings`` (``kernel/huggingface.py``). ``example``: a
    batch of inputs (an array, a tuple of them or a dict by name); ``inputs``/``outputs``:
    ``[("x", "FP32", [-1, 4])]``. The knobs are config.pbtxt fields; ``config`` is more
    config.pbtxt text merged on top.

    ``decoupled``: each value the callable yields is one response (the default for generator
    and async-generator functions); the handle's ``stream(...)`` yields them. A function of
    one ``str`` parameter follows the generate extension's text convention (``text_input`` ->
    ``text_output``). ``sequence``: a stateful callable; its ``state`` parameter is one dict
    per correlation id, new at the sequence's start.

    ``golden``: ``[(inputs, expected), ...]``: the new version is served only if it answers
    every case within ``atol``/``rtol`` (the server checks it staged); otherwise
    ``PromotionRefused`` (its ``result`` has the per-case diff) and the served version stays.
    ``canary``: instead, the new version takes this fraction of the requests that name no
    version (with its own statistics) until ``handle.promote(version, golden=...)`` serves
    it or ``handle.stop_canary()`` sets it aside; returns a handle on the canary version.
    ``stage``: the new version is loaded staged: callable by its version only, the served
    version keeps serving; the served model's ``handle.shadow(version)`` sends it a copy of
    live requests, ``handle.promote(version, shadow_max_diff=...)`` serves it. Returns a
    handle on the staged version (a canary at fraction 0: ``stop_canary()`` sets it aside).
    """
    knobs = Knobs(
        max_batch_size=max_batch_size, preferred_batch_sizes=list(preferred_batch_sizes or []),
        max_queue_delay_us=max_queue_delay_us, priority_levels=priority_levels,
        instances=instances, kind=kind, gpus=gpus, warmup=warmup, config=config)
    if is_text_embedder(obj):
        return _serve_text_embedder(obj, name, knobs, {
            "example": example, "inputs": inputs, "outputs": outputs, "decoupled": decoupled,
            "sequence": sequence, "golden": golden, "canary": canary, "stage": stage})
    artifact = build_artifact(obj, name, example=example, inputs=inputs, outputs=outputs,
                              max_batch_size=max_batch_size, decoupled=decoupled, sequence=sequence)
    artifact.config = apply_knobs(artifact, knobs)
    lifecycle = None
    if stage:
        if golden is not None or canary is not None:
            raise InvalidArgument("a staged version is promoted later, with its golden set or "
                                  "its shadow report: handle.promote(version, ...); "
                                  "stage=True takes no golden or canary")
        canary = 0.0
    if canary is not None:
        if golden is not None:
            raise InvalidArgument("a canary is promoted with its golden set later: "
                                  "handle.promote(version, golden=...)")
        lifecycle = {"canary": canary}
    elif golden is not None:
        cases = encode(golden, json.loads(artifact.config_json()))
        lifecycle = {"golden": cases, "atol": atol, "rtol": rtol}
    return _upload(name, artifact, lifecycle, source=obj)


def _serve_text_embedder(obj: Any, name: str, knobs: Knobs, unused: dict[str, Any]) -> ServedModel:
    """A Hugging Face model with its tokenizer, or a SentenceTransformer (kernel/huggingface.py):
    its tokenizer and its encoder (the knobs are the encoder's), then their ensemble."""
    given = [key for key, value in unused.items() if value is not None and value is not False]
    if given:
        raise ArtifactError(f"model '{name}': a Hugging Face embedder is served as a tokenize -> "
                            f"encode ensemble of its own tensors; {', '.join(given)} do(es) not apply")
    embedder = text_embedder(obj, name, knobs.max_batch_size)
    embedder.encoder.config = apply_knobs(embedder.encoder, knobs)
    for part in (embedder.tokenizer, embedder.encoder):
        _upload(part.config.name, part, source=obj)
    handle = ensemble(name, embedder.steps)
    handle.notes.extend(embedder.notes)
    return handle


def _upload(name: str, artifact: Any, lifecycle: dict | None = None, source: Any = None) -> ServedModel:
    """The repository load request every notebook model goes through: a new version,
    loaded before the old one retires, with its lineage (kernel/lineage.py: ``source`` is
    what was served, the golden set the lifecycle's)."""
    conn = connection()
    client = TritonHTTP(conn)
    started = time.monotonic()
    record = gather_lineage(source, (lifecycle or {}).get("golden"))
    try:
        client.load(name, artifact.config_json(), lineage_file(artifact.files, record),
                    lifecycle=lifecycle)
    except InvalidArgument as err:
        if lifecycle is None or "golden" not in lifecycle:
            raise
        raise PromotionRefused(PromotionResult.refused(name, err, len(lifecycle["golden"]))) from None
    if lifecycle is not None and "canary" in lifecycle:
        version = max(int(r["version"]) for r in client.index()
                      if r.get("name") == name and r.get("state") == "READY")
        uploaded[name] = artifact
        return ServedModel(name, version, conn, notes=artifact.notes,
                           load_seconds=time.monotonic() - started)
    elapsed = time.monotonic() - started
    uploaded[name] = artifact
    versions = client.metadata(name)["versions"]
    return ServedModel(name, max(int(v) for v in versions), conn, notes=artifact.notes,
                       load_seconds=elapsed)


def ensemble(name: str, steps: Sequence[StepSpec], *, max_batch_size: int | None = None,
             config: str = "") -> ServedModel:
    """Serve a Triton ensemble of served models as ``name``.

    ``steps``: ``[(model, {model_input: ensemble_tensor}, {model_output: ensemble_tensor}),
    ...]``, a fourth item pins the model's version (default: its latest ready one). The ensemble's inputs are the tensors no step produces, its outputs those no step
    reads, typed and shaped as the composing models declare them. ``max_batch_size``
    defaults to the smallest of the composing models'; ``config`` is more config.pbtxt text
    merged on top. Re-running makes a new version, as ``serve`` does.
    """
    client = _client()
    model_config = ensemble_config(name, steps, client.config, max_batch_size)
    artifact = ensemble_artifact(model_config)
    if config:
        artifact.config = apply_knobs(artifact, Knobs(config=config))
    return _upload(name, artifact)


def model(name: str) -> ServedModel:
    """A handle on a model the server already serves."""
    return ServedModel.from_server(name, connection())


def load(name: str) -> ServedModel:
    """(Re)load a model from the server's repository as it is on disk."""
    client = _client()
    started = time.monotonic()
    client.load(name)
    return ServedModel(name, max(int(v) for v in client.metadata(name)["versions"]), connection(),
                       load_seconds=time.monotonic() - started)


def rollback(name: str) -> ServedModel:
    """Serve again the version (and config) that served before the current one."""
    return model(name).rollback()


def history(name: str) -> list[dict]:
    """Loads, promotions, refusals and rollbacks of ``name``, oldest first."""
    return _client().history(name)


def lineage(name: str, version: int | None = None) -> dict | None:
    """What ``version`` of ``name`` (None: the newest on disk) was served from: cell or
    function source, execution count, Python, packages and their hash, git commit, golden
    set's hash; None for a version served without one."""
    path = TritonHTTP._model_path(name, str(version) if version else "") + "/lineage"
    return _client().get_json(path, what=f"lineage of '{name}'")["lineage"]


def models() -> list[dict]:
    """The repository index: one row per model version (name, version, state, reason)."""
    return _client().index()


def unload(name: str) -> None:
    _client().unload(name)


def capture(name: str, fraction: float = 1.0, max_rows: int = 10_000, *,
            max_bytes: int | None = None, capture: bool = True, clear: bool = False) -> dict:
    """``ServedModel.capture`` of the model ``name``."""
    return _client().capture(name, capture_body(fraction, max_rows, max_bytes, capture,
                                                clear))["capture"]


def traffic(name: str, n: int | None = None):
    """``ServedModel.traffic`` of the model ``name``: its captured requests as a DataFrame."""
    return traffic_frame(_client().traffic(name), n)


def dashboard(name: str | None = None, interval: float = 1.0):
    from ..widgets import Dashboard
    return Dashboard(connection(), model=name, interval=interval)
