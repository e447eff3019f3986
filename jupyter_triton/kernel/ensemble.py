"""Ensembles defined from the notebook: steps in, a Triton ensemble config out.

A step is ``(model, {model_input: ensemble_tensor}, {model_output: ensemble_tensor})``.
The ensemble's inputs are the tensors no step produces, its outputs those no step reads;
their datatypes and shapes come from the composing models' configs as the server reports
them (the kernel side asks over the protocol, like any client). The result is the
``config.pbtxt`` a Triton user would write by hand (``platform: "ensemble"``,
``ensemble_scheduling``), so the same repository loads in NVIDIA Triton. An ensemble with a
decoupled (streaming) step is decoupled itself.

``parse_steps`` reads the ``%%ensemble`` cell syntax, one step a line::

    tokenize: TEXT=TEXT -> IDS=ids
    embed:    IDS=ids -> EMBEDDING=EMBEDDING
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc

from ..protocol.datatypes import config_to_triton
from .artifacts import Artifact, ArtifactError

#: what a user passes: (model, {model_input: ensemble_tensor}, {model_output: ensemble_tensor}),
#: and a fourth item, the composing model's version, to pin one (default: its latest)
StepSpec = tuple  # (str, Mapping[str, str], Mapping[str, str][, int])

#: the file of an ensemble's version directory: Triton needs the directory, not its contents,
#: and the repository API creates a version only from uploaded files
README_FILE = "1/README.txt"

_NAME = re.compile(r"[A-Za-z0-9_.\-:/]+")


@dataclass
class _Tensor:
    data_type: int
    dims: list[int]
    where: str                       # "step 2 ('embed') input 'IDS'", for error messages


def _step_label(index: int, model: str) -> str:
    return f"step {index + 1} ('{model}')"


def _check_steps(name: str, steps: Sequence[Any]) -> list[tuple[str, dict, dict, int]]:
    if isinstance(steps, (str, bytes)) or not steps:
        raise ArtifactError(f"ensemble '{name}': steps is a list of (model, {{model_input: "
                            f"tensor}}, {{model_output: tensor}}), got {steps!r}")
    checked = []
    for i, step in enumerate(steps):
        try:
            model, inputs, outputs, *pinned = step
            inputs, outputs = dict(inputs), dict(outputs)
            version = int(pinned[0]) if pinned and pinned[0] is not None else -1
            if len(pinned) > 1 or version == 0 or version < -1:
                raise ValueError("bad version")
        except (TypeError, ValueError):
            raise ArtifactError(f"ensemble '{name}': step {i + 1} is not (model, {{model_input: "
                                f"tensor}}, {{model_output: tensor}}[, version]): {step!r}") from None
        if not isinstance(model, str) or not model:
            raise ArtifactError(f"ensemble '{name}': step {i + 1} names no model: {step!r}")
        if not outputs:
            raise ArtifactError(f"ensemble '{name}': {_step_label(i, model)} maps no output; "
                                f"a step that produces nothing cannot feed the ensemble")
        for mapping in (inputs, outputs):
            for key, value in mapping.items():
                if not isinstance(key, str) or not isinstance(value, str) or not key or not value:
                    raise ArtifactError(f"ensemble '{name}': {_step_label(i, model)} maps "
                                        f"{key!r} to {value!r}; both must be tensor names")
        checked.append((model, inputs, outputs, version))
    return checked


def ensemble_config(name: str, steps: Sequence[StepSpec],
                    model_config: Callable[..., dict], max_batch_size: int | None = None
                    ) -> mc.ModelConfig:
    """The ensemble's ``ModelConfig``; ``model_config(model)`` (``model_config(model,
    version)`` for a pinned step) is the composing model's config JSON as ``GET
    v2/models/{model}[/versions/{v}]/config`` answers it."""
    checked = _check_steps(name, steps)
    by_step: dict[tuple[str, int], mc.ModelConfig] = {}
    for i, (model, _, _, version) in enumerate(checked):
        if model == name:
            raise ArtifactError(f"ensemble '{name}': {_step_label(i, model)} is the ensemble itself")
        if (model, version) not in by_step:
            try:
                raw = model_config(model) if version == -1 else model_config(model, str(version))
            except Exception as err:  # NotFound, Unavailable: said with the step it breaks
                raise ArtifactError(f"ensemble '{name}': {_step_label(i, model)}: {err}") from None
            by_step[(model, version)] = json_format.ParseDict(raw, mc.ModelConfig(),
                                                              ignore_unknown_fields=True)
    batches = {model: int(c.max_batch_size) for model, c in _named(by_step).items()}
    batching = sorted(m for m, b in batches.items() if b > 0)
    unbatched = sorted(m for m, b in batches.items() if b == 0)
    if batching and unbatched:
        raise ArtifactError(
            f"ensemble '{name}': model(s) {', '.join(batching)} batch (max_batch_size > 0) but "
            f"{', '.join(unbatched)} do(es) not; an ensemble passes tensors of one shape "
            f"convention between its steps: serve them all with batching or all without")
    limit = min(batches[m] for m in batching) if batching else 0
    if max_batch_size is None:
        mbs = limit
    elif max_batch_size < 0 or max_batch_size > limit:
        raise ArtifactError(f"ensemble '{name}': max_batch_size {max_batch_size} must be between "
                            f"0 and {limit}, the smallest max_batch_size of its models")
    else:
        mbs = int(max_batch_size)

    produced: dict[str, _Tensor] = {}
    consumed: dict[str, _Tensor] = {}
    order: list[str] = []
    for i, (model, inputs, outputs, version) in enumerate(checked):
        config, label = by_step[(model, version)], _step_label(i, model)
        declared_in = {t.name: t for t in config.input}
        declared_out = {t.name: t for t in config.output}
        for key in inputs:
            if key not in declared_in:
                raise ArtifactError(f"ensemble '{name}': {label} maps input '{key}', but "
                                    f"'{model}' has inputs {sorted(declared_in)}")
        missing = [t for t in declared_in if t not in inputs and not declared_in[t].optional]
        if missing:
            raise ArtifactError(f"ensemble '{name}': {label} leaves input(s) "
                                f"{', '.join(missing)} of '{model}' unmapped")
        for key in outputs:
            if key not in declared_out:
                raise ArtifactError(f"ensemble '{name}': {label} maps output '{key}', but "
                                    f"'{model}' has outputs {sorted(declared_out)}")
        for key, tensor in inputs.items():
            seen = _Tensor(declared_in[key].data_type, list(declared_in[key].dims),
                           f"{label} input '{key}'")
            for other in (consumed.get(tensor), produced.get(tensor)):
                if other is not None:
                    _same(name, tensor, other, seen)
            consumed.setdefault(tensor, seen)
            order.append(tensor)
        for key, tensor in outputs.items():
            made = _Tensor(declared_out[key].data_type, list(declared_out[key].dims),
                           f"{label} output '{key}'")
            if tensor in produced:
                raise ArtifactError(f"ensemble '{name}': tensor '{tensor}' is produced twice "
                                    f"({produced[tensor].where} and {made.where})")
            if tensor in consumed:
                _same(name, tensor, consumed[tensor], made)
            produced[tensor] = made
            order.append(tensor)

    order = list(dict.fromkeys(order))
    ensemble_inputs = [t for t in order if t in consumed and t not in produced]
    ensemble_outputs = [t for t in order if t in produced and t not in consumed]
    if not ensemble_inputs:
        raise ArtifactError(f"ensemble '{name}': every tensor a step reads is produced by a step; "
                            f"an ensemble needs at least one input")
    config = mc.ModelConfig(name=name, platform="ensemble", max_batch_size=mbs)
    for tensor in ensemble_inputs:
        config.input.add(name=tensor, data_type=consumed[tensor].data_type, dims=consumed[tensor].dims)
    for tensor in ensemble_outputs:
        config.output.add(name=tensor, data_type=produced[tensor].data_type, dims=produced[tensor].dims)
    for model, inputs, outputs, version in checked:
        config.ensemble_scheduling.step.add(model_name=model, model_version=version,
                                            input_map=inputs, output_map=outputs)
    if any(c.model_transaction_policy.decoupled for c in by_step.values()):
        # a streaming step makes the ensemble stream (Triton sets this at load; said here so
        # the config the notebook shows is the one the server runs)
        config.model_transaction_policy.decoupled = True
    return config


def _named(by_step: dict[tuple[str, int], mc.ModelConfig]) -> dict[str, mc.ModelConfig]:
    """One config per composing model and version, named "model" or "model v2"."""
    return {(m if v == -1 else f"{m} v{v}"): c for (m, v), c in by_step.items()}


def _same(name: str, tensor: str, a: _Tensor, b: _Tensor) -> None:
    """Two ends of one ensemble tensor agree: one datatype, dims equal where both are fixed."""
    if a.data_type != b.data_type:
        raise ArtifactError(
            f"ensemble '{name}': tensor '{tensor}' is {_dtype(a.data_type)} at {a.where} but "
            f"{_dtype(b.data_type)} at {b.where}")
    fits = len(a.dims) == len(b.dims) and all(x == y or -1 in (x, y) for x, y in zip(a.dims, b.dims))
    if not fits:
        raise ArtifactError(f"ensemble '{name}': tensor '{tensor}' has dims {a.dims} at {a.where} "
                            f"but {b.dims} at {b.where}")


def _dtype(value: int) -> str:
    return config_to_triton(mc.DataType.Name(value))


def ensemble_artifact(config: mc.ModelConfig) -> Artifact:
    steps = " -> ".join(s.model_name for s in config.ensemble_scheduling.step)
    readme = (f"Ensemble '{config.name}' ({steps}), defined in a notebook with jupyter_triton.\n"
              f"Triton needs this version directory; the steps are in ../config.pbtxt.\n")
    return Artifact(config, {README_FILE: readme.encode()}, "ensemble",
                    batching=config.max_batch_size > 0, notes=[f"steps: {steps}"])


def parse_steps(text: str) -> list[StepSpec]:
    """The ``%%ensemble`` cell: one ``model: IN=tensor, ... -> OUT=tensor, ...`` a line
    (``model@2: ...`` pins version 2). ``NAME`` alone stands for ``NAME=NAME``; blank lines
    and ``#`` comments are skipped."""
    steps = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        model, colon, rest = line.partition(":")
        model, at, version = (p.strip() for p in model.strip().partition("@"))
        if not colon or not model or "->" not in rest or (at and not version.isdigit()):
            raise ArtifactError(f"line {number}: expected 'model: IN=tensor, ... -> "
                                f"OUT=tensor, ...' (or 'model@version: ...'), got {raw.strip()!r}")
        left, _, right = rest.partition("->")
        step = (model, _pairs(left, number, raw), _pairs(right, number, raw))
        steps.append((*step, int(version)) if at else step)
    if not steps:
        raise ArtifactError("the cell has no steps; write one 'model: IN=tensor -> OUT=tensor' a line")
    return steps


def _pairs(text: str, number: int, raw: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, eq, value = (p.strip() for p in part.partition("="))
        value = value if eq else key
        if not _NAME.fullmatch(key) or not _NAME.fullmatch(value):
            raise ArtifactError(f"line {number}: {part!r} is not NAME=tensor in {raw.strip()!r}")
        if key in pairs:
            raise ArtifactError(f"line {number}: '{key}' is mapped twice in {raw.strip()!r}")
        pairs[key] = value
    return pairs
