"""Turns a backend's output dict into the InferResponse the client asked for: only the
requested outputs, in the config's datatypes, with Triton's classification extension."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..protocol.datatypes import config_to_triton, triton_to_numpy
from ..protocol.errors import Internal, InvalidArgument, Unavailable
from ..protocol.types import InferRequest, InferResponse, InferTensor


class OutputPlan:
    """What ``build_response`` needs from a config, computed once per loaded model version."""

    def __init__(self, config: mc.ModelConfig) -> None:
        self.config = config
        self.model = config.name
        self.names = [o.name for o in config.output]
        self.by_name = {o.name: o for o in config.output}
        self.datatypes = {o.name: config_to_triton(mc.DataType.Name(o.data_type)) for o in config.output}
        self.dtypes = {name: triton_to_numpy(dt) for name, dt in self.datatypes.items()}
        self.reshape = {o.name: list(o.dims) for o in config.output if o.HasField("reshape")}
        self.batched = config.max_batch_size > 0


def build_response(config: mc.ModelConfig, version: int, model_dir: Path, request: InferRequest,
                   outputs: dict[str, np.ndarray], max_output_size: int = 0,
                   plan: OutputPlan | None = None) -> InferResponse:
    """``max_output_size`` (bytes, 0: no bound): outputs together larger than this fail the
    request with Unavailable before anything is encoded. ``plan``: ``OutputPlan(config)``,
    when the caller keeps one."""
    if plan is None:
        plan = OutputPlan(config)
    model = plan.model
    wanted = request.outputs
    tensors = []
    total = 0
    for item in plan.names if wanted is None else wanted:
        if wanted is None:
            name, params = item, None
        else:
            name, params = item.name, item.parameters
        if name not in outputs:
            raise Internal(f"model '{model}' did not produce output '{name}'")
        datatype = plan.datatypes[name]
        value = outputs[name]
        if type(value) is not np.ndarray:
            value = np.asarray(value)
        dims = plan.reshape.get(name)
        if dims is not None and value.ndim:
            lead = [value.shape[0]] if plan.batched else []
            value = value.reshape(lead + dims)
        want = plan.dtypes[name]
        if value.dtype is not want and value.dtype != want:
            value = value.astype(want)
        k = int(params.get("classification", 0) or 0) if params else 0
        if k:
            value, datatype = _classify(value, k, plan.batched, model_dir, plan.by_name[name])
        if max_output_size:
            total += _nbytes(value)
            if total > max_output_size:
                raise Unavailable(
                    f"model '{model}' returned outputs larger than the server's limit of "
                    f"{max_output_size} bytes (at output '{name}'); the limit is the engine "
                    f"option max_output_size")
        tensors.append(InferTensor(name, datatype, value.shape, value))
    return InferResponse(model, str(version), request.id, tensors)


def _nbytes(value: np.ndarray) -> int:
    if value.dtype != object:
        return int(value.nbytes)
    # BYTES: what the wire carries, a 4-byte length and the bytes of each element
    return sum(4 + (len(v) if isinstance(v, (bytes, str)) else 8) for v in value.flat)


def _classify(value: np.ndarray, k: int, batched: bool, model_dir: Path,
              cfg: mc.ModelOutput) -> tuple[np.ndarray, str]:
    """Top-k as Triton spells it: BYTES "<score>:<index>[:<label>]" per row, the score as
    C++'s std::to_string writes the output's type ("5" for integers, "0.500000" for floats)."""
    if k < 0:
        raise InvalidArgument(f"classification count for output '{cfg.name}' must be positive")
    if value.dtype == object:
        # tritonserver 2.51's words (its core has no order for BYTES)
        raise InvalidArgument("class result not available for output due to unsupported type "
                              "'BYTES'")
    labels: list[str] = []
    if cfg.label_filename:
        path = model_dir / cfg.label_filename
        if path.exists():
            labels = path.read_text().splitlines()
    rows = value.reshape(value.shape[0], -1) if batched else value.reshape(1, -1)
    k = min(k, rows.shape[1])
    # Ranked on the values themselves, highest first, ties in index order: negating them
    # would wrap unsigned integers (-uint8(5) is 251) and fails for BOOL. A stable ascending
    # sort of the reversed row, read backwards, gives that order. Triton refuses BOOL, FP16
    # and BF16 (400); here they rank like any number (True above False).
    n = rows.shape[1]
    top_k = n - 1 - np.argsort(rows[:, ::-1], axis=1, kind="stable")[:, ::-1][:, :k]
    exact = value.dtype.kind in "biu"
    out = np.empty((rows.shape[0], k), dtype=object)
    for r, row in enumerate(rows):
        for j, idx in enumerate(top_k[r]):
            score = int(row[idx]) if exact else float(row[idx])
            text = f"{score}:{idx}" if exact else f"{score:f}:{idx}"
            if idx < len(labels):
                text += f":{labels[idx]}"
            out[r, j] = text.encode()
    return (out if batched else out[0]), "BYTES"

