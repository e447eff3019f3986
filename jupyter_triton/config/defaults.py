"""What Triton fills into a config after the backend has auto-completed it."""
from __future__ import annotations

from tritonclient.grpc import model_config_pb2 as mc

# Triton's SEQUENCE_IDLE_DEFAULT_MICROSECONDS
SEQUENCE_IDLE_DEFAULT_MICROSECONDS = 1_000_000


def fill_defaults(config: mc.ModelConfig) -> mc.ModelConfig:
    """A copy of ``config`` normalized as Triton does before loading.

    version_policy defaults to latest 1; a model with no instance_group gets one group
    named after the model, KIND_AUTO (the engine resolves it to GPU or CPU), count 1;
    unnamed groups are named ``<model>_<index>`` and a count below 1 becomes 1;
    ``dynamic_batching`` without ``preferred_batch_size`` gets ``[max_batch_size]``.
    """
    out = mc.ModelConfig()
    out.CopyFrom(config)
    if not out.HasField("version_policy"):
        out.version_policy.latest.num_versions = 1
    if out.HasField("sequence_batching") and not out.sequence_batching.max_sequence_idle_microseconds:
        out.sequence_batching.max_sequence_idle_microseconds = SEQUENCE_IDLE_DEFAULT_MICROSECONDS
    if out.HasField("ensemble_scheduling"):
        out.model_transaction_policy.SetInParent()      # Triton serves it for ensembles
        return out
    if not out.instance_group:
        out.instance_group.add(name=out.name, kind=mc.ModelInstanceGroup.KIND_AUTO, count=1)
    for index, group in enumerate(out.instance_group):
        if not group.name:
            group.name = f"{out.name}_{index}"
        if group.count < 1:
            group.count = 1
    # Triton's NormalizeModelConfig: dynamic batching without preferred sizes prefers
    # max_batch_size, and the config it serves says so (the batcher does the same either way)
    if (out.HasField("dynamic_batching") and not out.dynamic_batching.preferred_batch_size
            and out.max_batch_size > 0):
        out.dynamic_batching.preferred_batch_size.append(out.max_batch_size)
    # Triton reports these in every non-ensemble config it serves
    if not out.optimization.HasField("input_pinned_memory"):
        out.optimization.input_pinned_memory.enable = True
    if not out.optimization.HasField("output_pinned_memory"):
        out.optimization.output_pinned_memory.enable = True
    return out


def has_scheduler(config: mc.ModelConfig) -> bool:
    return config.WhichOneof("scheduling_choice") is not None


def enable_default_batching(config: mc.ModelConfig, max_batch_size: int = 4) -> mc.ModelConfig:
    """Backends' auto-complete for a model that can batch: Triton sets ``max_batch_size``
    (default-max-batch-size, 4) when the config left it 0, and adds ``dynamic_batching {}``
    when no scheduler is configured. Changes ``config`` in place and returns it."""
    if config.max_batch_size == 0:
        config.max_batch_size = max_batch_size
        if not has_scheduler(config):
            config.dynamic_batching.SetInParent()
    return config
