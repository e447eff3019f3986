"""The ``%%serve`` knobs, each one field of config.pbtxt, applied to an artifact's config."""
from __future__ import annotations

from dataclasses import dataclass, field

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from ..protocol.datatypes import triton_to_config
from .artifacts import Artifact, ArtifactError, TensorSpec

_KINDS = {"auto": mc.ModelInstanceGroup.KIND_AUTO, "cpu": mc.ModelInstanceGroup.KIND_CPU,
          "gpu": mc.ModelInstanceGroup.KIND_GPU}


@dataclass
class Knobs:
    max_batch_size: int | None = None              # max_batch_size
    preferred_batch_sizes: list[int] = field(default_factory=list)   # dynamic_batching.preferred_batch_size
    max_queue_delay_us: int | None = None          # dynamic_batching.max_queue_delay_microseconds
    priority_levels: int | None = None             # dynamic_batching.priority_levels
    instances: int = 1                             # instance_group.count
    kind: str = "auto"                             # instance_group.kind
    gpus: list[int] | None = None                  # instance_group.gpus
    warmup: int | None = None                      # model_warmup.count (zero data, batch 1)
    config: str = ""                               # any other config.pbtxt text, merged last


def apply_knobs(artifact: Artifact, knobs: Knobs) -> mc.ModelConfig:
    """The config to upload: the artifact's, the knobs, then the ``config`` text on top."""
    config = mc.ModelConfig()
    config.CopyFrom(artifact.config)
    name = config.name
    if knobs.max_batch_size is not None:
        if knobs.max_batch_size < 0:
            raise ArtifactError(f"model '{name}': max_batch_size must be >= 0")
        config.max_batch_size = knobs.max_batch_size
    batching_knobs = (knobs.preferred_batch_sizes or knobs.max_queue_delay_us is not None
                      or knobs.priority_levels)
    # A notebook that allows batches wants them formed: dynamic batching whenever the model
    # batches (the server adds it too when it picks max_batch_size itself).
    if batching_knobs or config.max_batch_size > 0:
        if config.WhichOneof("scheduling_choice") in (None, "dynamic_batching"):
            config.dynamic_batching.SetInParent()
    batcher = config.dynamic_batching
    if knobs.preferred_batch_sizes:
        batcher.preferred_batch_size.extend(int(b) for b in knobs.preferred_batch_sizes)
    if knobs.max_queue_delay_us is not None:
        batcher.max_queue_delay_microseconds = int(knobs.max_queue_delay_us)
    if knobs.priority_levels:
        batcher.priority_levels = int(knobs.priority_levels)
        # requests that name no priority go last
        batcher.default_priority_level = int(knobs.priority_levels)
    kind = knobs.kind.lower()
    if kind not in _KINDS:
        raise ArtifactError(f"model '{name}': kind must be one of {', '.join(_KINDS)}, got '{knobs.kind}'")
    if knobs.instances != 1 or kind != "auto" or knobs.gpus:
        if knobs.instances < 1:
            raise ArtifactError(f"model '{name}': instances must be >= 1")
        group = config.instance_group.add(count=int(knobs.instances), kind=_KINDS[kind])
        if knobs.gpus:
            if kind == "cpu":
                raise ArtifactError(f"model '{name}': gpus are given but kind is cpu")
            group.kind = _KINDS["gpu"]
            group.gpus.extend(int(g) for g in knobs.gpus)
    if knobs.warmup:
        _add_warmup(config, artifact, int(knobs.warmup))
    if knobs.config:
        try:
            text_format.Merge(knobs.config, config)
        except text_format.ParseError as err:
            raise ArtifactError(f"model '{name}': --config is not valid config.pbtxt text: {err}") from None
        if config.name != name:
            raise ArtifactError(f"model '{name}': --config may not rename the model "
                                f"(name: \"{config.name}\")")
    return config


def _add_warmup(config: mc.ModelConfig, artifact: Artifact, count: int) -> None:
    specs: list[TensorSpec] | None = artifact.inputs
    if not specs:
        raise ArtifactError(f"model '{config.name}': warmup needs the model's inputs; pass "
                            f"inputs=[(\"x\", \"FP32\", [-1, 4])] or an example")
    # the server batches what the kernel side established, or what max_batch_size says
    batching = config.max_batch_size > 0 or bool(artifact.batching)
    sample = config.model_warmup.add(name="warmup", batch_size=1, count=count)
    for tensor, datatype, shape in specs:
        dims = shape[1:] if batching else shape
        warm = sample.inputs[tensor]
        warm.data_type = mc.DataType.Value(triton_to_config(datatype))
        warm.dims.extend([1 if d < 0 else d for d in dims] or [1])
        warm.zero_data = True
