"""Triton's classification extension: a requested output's top-k classes, with the labels
of the config's ``label_filename``, instead of the output itself (an output's
``classification`` parameter; engine/model.py's OutputPlan asks here)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..protocol.errors import InvalidArgument


def classify(value: np.ndarray, k: int, batched: bool, model_dir: Path,
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

