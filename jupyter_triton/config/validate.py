"""Triton's ModelConfig rules, with Triton's wording, each error naming model and field.

``complete=False`` checks a config as the user wrote it, before a backend auto-completes
it (inputs may still lack a data type or dims, max_batch_size may still be 0);
``complete=True`` (the default) is the check Triton makes before it loads a model.
"""
from __future__ import annotations

from tritonclient.grpc import model_config_pb2 as mc

from ..protocol.errors import InvalidArgument
from .padding import padding

WILDCARD_DIM = -1
_TENSORRT_PLATFORM = "tensorrt_plan"
_ENSEMBLE_PLATFORM = "ensemble"


def _fail(config: mc.ModelConfig, field: str, rule: str) -> InvalidArgument:
    return InvalidArgument(f"model '{config.name}' config field '{field}': {rule}")


def validate_config(config: mc.ModelConfig, complete: bool = True) -> None:
    """Raise InvalidArgument for the first rule the config breaks."""
    if not config.name:
        raise InvalidArgument("model configuration must specify 'name'")
    if config.max_batch_size < 0:
        raise _fail(config, "max_batch_size", "'max_batch_size' must be non-negative value")
    _validate_version_policy(config)
    _validate_file_names(config)
    _validate_io(config, complete)
    _validate_batch_io(config)
    if complete:
        padding(config)         # ragged_batching "pad" and its parameters (config/padding.py)
    _validate_dynamic_batching(config, complete)
    _validate_sequence_batching(config, complete)
    _validate_instance_groups(config)
    _validate_ensemble(config, complete)
    if config.model_transaction_policy.decoupled and config.response_cache.enable:
        raise _fail(config, "response_cache",
                    "Response Cache does not currently support models with 'decoupled' "
                    "transaction policy. Please disable the response cache.")


def _validate_file_names(config: mc.ModelConfig) -> None:
    """Files a config names live inside the model directory: no absolute path, no '..'
    (the engine also checks where a symlink leads, at load)."""
    named = [("default_model_filename", config.default_model_filename)]
    named += [(f"output '{o.name}' label_filename", o.label_filename) for o in config.output]
    for field, value in named:
        if not value:
            continue
        parts = value.replace("\\", "/").split("/")
        if value.startswith(("/", "\\")) or (len(value) > 1 and value[1] == ":") \
                or ".." in parts or "\0" in value:
            raise _fail(config, field, f"'{value}' must be a path inside the model directory "
                                       f"(relative, without '..')")


def _validate_version_policy(config: mc.ModelConfig) -> None:
    if not config.HasField("version_policy"):
        return
    policy = config.version_policy
    kind = policy.WhichOneof("policy_choice")
    if kind == "latest" and policy.latest.num_versions < 1:
        raise _fail(config, "version_policy.latest.num_versions",
                    "'num_versions' must be >= 1")
    if kind == "specific":
        if not policy.specific.versions:
            raise _fail(config, "version_policy.specific.versions",
                        "a 'specific' version policy must list at least one version")
        bad = [v for v in policy.specific.versions if v < 1]
        if bad:
            raise _fail(config, "version_policy.specific.versions",
                        f"versions must be positive integers, got {bad}")


def _validate_io(config: mc.ModelConfig, complete: bool) -> None:
    for group, kind in ((config.input, "input"), (config.output, "output")):
        seen: set[str] = set()
        for index, io in enumerate(group):
            field = f"{kind}[{index}]"
            prefix = f"model {kind} "
            if not io.name:
                raise _fail(config, f"{field}.name", f"{prefix}must specify 'name'")
            if io.name in seen:
                raise _fail(config, f"{field}.name",
                            f"{prefix}'{io.name}' is specified more than once")
            seen.add(io.name)
            prefix += f"'{io.name}' "
            if complete and io.data_type == mc.TYPE_INVALID:
                raise _fail(config, f"{field}.data_type", f"{prefix}must specify 'data_type'")
            if complete and not io.dims and not io.HasField("reshape"):
                raise _fail(config, f"{field}.dims",
                            f"{prefix}must specify 'dims' (for one value per batch item use "
                            f"dims: [ 1 ] with reshape: {{ shape: [ ] }})")
            for dim in io.dims:
                if dim < 1 and dim != WILDCARD_DIM:
                    raise _fail(config, f"{field}.dims",
                                f"{prefix}dimension must be integer >= 1, or -1 to indicate "
                                f"a variable-size dimension, got {list(io.dims)}")
            if io.HasField("reshape"):
                _validate_reshape(config, io, field, prefix, complete)
            if kind == "input" and io.format in (mc.ModelInput.FORMAT_NHWC,
                                                 mc.ModelInput.FORMAT_NCHW) \
                    and len(io.dims) != 3:
                raise _fail(config, f"{field}.format", "model input NHWC/NCHW require 3 dims")
            if complete and io.is_shape_tensor and not _is_tensorrt(config):
                raise _fail(config, f"{field}.is_shape_tensor",
                            "shape tensors are only supported for TensorRT platform")
            if complete and io.is_non_linear_format_io and not _is_tensorrt(config):
                raise _fail(config, f"{field}.is_non_linear_format_io",
                            "Non-linear IO format is only supported for the TensorRT platform")


def _validate_reshape(config: mc.ModelConfig, io, field: str, prefix: str,
                      complete: bool) -> None:
    shape = list(io.reshape.shape)
    if not shape and config.max_batch_size == 0 and complete:
        raise _fail(config, f"{field}.reshape",
                    f"{prefix}cannot have empty reshape for non-batching model as scalar "
                    f"tensors are not supported")
    for dim in shape:
        if dim < 1 and dim != WILDCARD_DIM:
            raise _fail(config, f"{field}.reshape.shape",
                        f"{prefix}reshape dimensions must be integer >= 1, or -1 to indicate "
                        f"a variable-size dimension")
    dims = list(io.dims)
    if not shape:
        # an empty reshape turns a [1] into a scalar per batch item
        if _runs(dims) != [1]:
            raise _fail(config, f"{field}.reshape",
                        f"{prefix}has different size for dims and reshape")
        return
    # Between wildcards, each run of fixed dims must hold the same element count:
    # [2, 4, -1, 6] -> [8, -1, 1, 6] is a valid reshape, [2, 3] -> [7] is not.
    dim_runs, shape_runs = _runs(dims), _runs(shape)
    if len(dim_runs) != len(shape_runs):
        raise _fail(config, f"{field}.reshape",
                    f"{prefix}has different number of variable-size dimensions for dims "
                    f"and reshape")
    if dim_runs != shape_runs:
        raise _fail(config, f"{field}.reshape",
                    f"{prefix}has different size for dims and reshape")


def _runs(dims: list[int]) -> list[int]:
    counts, current = [], 1
    for dim in dims:
        if dim == WILDCARD_DIM:
            counts.append(current)
            current = 1
        else:
            current *= dim
    counts.append(current)
    return counts


def _is_tensorrt(config: mc.ModelConfig) -> bool:
    return config.platform == _TENSORRT_PLATFORM or config.backend == "tensorrt"


def _validate_batch_io(config: mc.ModelConfig) -> None:
    inputs = {io.name for io in config.input}
    outputs = {io.name for io in config.output}
    for index, batch_input in enumerate(config.batch_input):
        field = f"batch_input[{index}]"
        if len(batch_input.source_input) != 1:
            raise _fail(config, f"{field}.source_input",
                        f"batch input kind '{mc.BatchInput.Kind.Name(batch_input.kind)}' "
                        f"expects 1 source input, got {len(batch_input.source_input)}")
        if batch_input.data_type not in (mc.TYPE_INT32, mc.TYPE_FP32):
            raise _fail(config, f"{field}.data_type",
                        "batch input data type must be TYPE_INT32 or TYPE_FP32")
        for name in batch_input.source_input:
            if name not in inputs:
                raise _fail(config, f"{field}.source_input",
                            f"unknown source input name '{name}'")
    for index, batch_output in enumerate(config.batch_output):
        field = f"batch_output[{index}]"
        if len(batch_output.source_input) != 1:
            raise _fail(config, f"{field}.source_input",
                        f"batch output kind '{mc.BatchOutput.Kind.Name(batch_output.kind)}' "
                        f"expects 1 source input, got {len(batch_output.source_input)}")
        for name in batch_output.source_input:
            if name not in inputs:
                raise _fail(config, f"{field}.source_input",
                            f"unknown source input name '{name}'")
        targets: set[str] = set()
        for name in batch_output.target_name:
            if name not in outputs:
                raise _fail(config, f"{field}.target_name",
                            f"unknown target output name '{name}'")
            if name in targets:
                raise _fail(config, f"{field}.target_name",
                            f"target output name '{name}' can only be specified once")
            targets.add(name)


def _validate_dynamic_batching(config: mc.ModelConfig, complete: bool) -> None:
    if not config.HasField("dynamic_batching"):
        return
    batching = config.dynamic_batching
    if complete and config.max_batch_size == 0:
        raise _fail(config, "dynamic_batching",
                    "dynamic batching requires 'max_batch_size' > 0 (a model with "
                    "max_batch_size 0 does not support batching)")
    for size in batching.preferred_batch_size:
        if size <= 0:
            raise _fail(config, "dynamic_batching.preferred_batch_size",
                        "dynamic batching preferred size must be positive")
        if complete and size > config.max_batch_size:
            raise _fail(config, "dynamic_batching.preferred_batch_size",
                        f"dynamic batching preferred size must be <= max batch size "
                        f"({size} > {config.max_batch_size})")
    levels = batching.priority_levels
    if levels != 0:
        if batching.default_priority_level == 0 or batching.default_priority_level > levels:
            raise _fail(config, "dynamic_batching.default_priority_level",
                        f"default priority level must be in range [1, {levels}]")
        for level in batching.priority_queue_policy:
            if level == 0 or level > levels:
                raise _fail(config, "dynamic_batching.priority_queue_policy",
                            f"priority queue policy must have priority level in range "
                            f"[1, {levels}], got {level}")
    elif batching.priority_queue_policy:
        raise _fail(config, "dynamic_batching.priority_queue_policy",
                    "priority queue policy needs 'priority_levels' > 0")
    elif batching.default_priority_level != 0:
        raise _fail(config, "dynamic_batching.default_priority_level",
                    "'default_priority_level' needs 'priority_levels' > 0")
    if batching.preserve_ordering:
        if levels > 1:
            raise _fail(config, "dynamic_batching.preserve_ordering",
                        "Only one priority level is allowed when 'preserve_ordering' is true")
        policies = [batching.default_queue_policy, *batching.priority_queue_policy.values()]
        if any(p.default_timeout_microseconds != 0
               and p.timeout_action == mc.ModelQueuePolicy.DELAY for p in policies):
            raise _fail(config, "dynamic_batching.default_queue_policy.timeout_action",
                        "Queue policy can not have DELAY as timeout action when "
                        "'preserve_ordering' is true")


def _validate_sequence_batching(config: mc.ModelConfig, complete: bool) -> None:
    if not config.HasField("sequence_batching"):
        return
    batching = config.sequence_batching
    if config.response_cache.enable:
        raise _fail(config, "response_cache",
                    "Response Cache does not currently support models with sequence "
                    "batching scheduler. Please disable the response cache.")
    seen: set[str] = set()
    for index, control in enumerate(batching.control_input):
        if not control.name:
            raise _fail(config, f"sequence_batching.control_input[{index}].name",
                        "sequence batching control tensor must have a name")
        if control.name in seen:
            raise _fail(config, f"sequence_batching.control_input[{index}].name",
                        f"sequence batching control tensor '{control.name}' is specified "
                        f"for multiple control kinds")
        seen.add(control.name)
    _validate_sequence_controls(config)
    _validate_sequence_states(config)
    if batching.HasField("oldest"):
        for size in batching.oldest.preferred_batch_size:
            if size <= 0:
                raise _fail(config, "sequence_batching.oldest.preferred_batch_size",
                            "sequence batching preferred batch size must be positive")
            if complete and size > config.max_batch_size:
                raise _fail(config, "sequence_batching.oldest.preferred_batch_size",
                            "sequence batching preferred batch size must be <= max batch size")
    if batching.HasField("direct"):
        utilization = batching.direct.minimum_slot_utilization
        if utilization < 0.0 or utilization > 1.0:
            raise _fail(config, "sequence_batching.direct.minimum_slot_utilization",
                        "sequence batching minimum slot utilization must be in range (0.0, 1.0]")


_CORRID_TYPES = (mc.TYPE_UINT64, mc.TYPE_INT64, mc.TYPE_UINT32, mc.TYPE_INT32, mc.TYPE_STRING)


def _validate_sequence_controls(config: mc.ModelConfig) -> None:
    """Triton's GetBooleanSequenceControlProperties / GetTypedSequenceControlProperties."""
    kinds = mc.ModelSequenceBatching.Control
    inputs = {i.name for i in config.input}
    seen: set[int] = set()
    for index, control_input in enumerate(config.sequence_batching.control_input):
        field = f"sequence_batching.control_input[{index}]"
        if control_input.name in inputs:
            raise _fail(config, f"{field}.name",
                        f"sequence batching control tensor '{control_input.name}' is also a "
                        f"model input: the sequence batcher supplies it, clients do not")
        for control in control_input.control:
            kind = kinds.Kind.Name(control.kind)
            if control.kind in seen:
                raise _fail(config, f"{field}.control",
                            f"sequence batching specifies multiple {kind} tensors for "
                            f"{config.name}")
            seen.add(control.kind)
            given = [name for name in ("int32_false_true", "fp32_false_true", "bool_false_true")
                     if len(getattr(control, name))]
            if control.kind == kinds.CONTROL_SEQUENCE_CORRID:
                if given:
                    raise _fail(config, f"{field}.control",
                                f"sequence batching must not specify either 'int32_false_true', "
                                f"'fp32_false_true' or 'bool_false_true' for {kind} for "
                                f"{config.name}")
                if control.data_type not in _CORRID_TYPES:
                    raise _fail(config, f"{field}.control.data_type",
                                f"sequence batching {kind} data_type must be TYPE_UINT64, "
                                f"TYPE_INT64, TYPE_UINT32, TYPE_INT32 or TYPE_STRING, got "
                                f"{mc.DataType.Name(control.data_type)}")
                continue
            if not given:
                raise _fail(config, f"{field}.control",
                            f"sequence batching must specify either 'int32_false_true', "
                            f"'fp32_false_true' or 'bool_false_true' for {kind} for "
                            f"{config.name}")
            if len(given) > 1:
                raise _fail(config, f"{field}.control",
                            f"sequence batching specifies more than one from 'int32_false_true', "
                            f"'fp32_false_true' and 'bool_false_true' for {kind} for "
                            f"{config.name}")
            if len(getattr(control, given[0])) != 2:
                raise _fail(config, f"{field}.control.{given[0]}",
                            f"sequence batching control '{given[0]}' must have exactly 2 entries "
                            f"for {kind} for {config.name}")


def _validate_sequence_states(config: mc.ModelConfig) -> None:
    inputs = {i.name for i in config.input}
    seen: set[str] = set()
    for index, state in enumerate(config.sequence_batching.state):
        field = f"sequence_batching.state[{index}]"
        if not state.input_name or not state.output_name:
            raise _fail(config, field, "a state must specify 'input_name' and 'output_name'")
        if state.input_name in seen:
            raise _fail(config, f"{field}.input_name",
                        f"State input name '{state.input_name}' specified more than once.")
        seen.add(state.input_name)
        if state.input_name in inputs:
            raise _fail(config, f"{field}.input_name",
                        f"state input '{state.input_name}' is also a model input: the sequence "
                        f"batcher supplies it, clients do not")
        if state.data_type == mc.TYPE_INVALID:
            raise _fail(config, f"{field}.data_type", "a state must specify 'data_type'")
        if not state.dims:
            raise _fail(config, f"{field}.dims", "a state must specify 'dims'")
        for init in state.initial_state:
            if len(init.dims) != len(state.dims):
                raise _fail(config, f"{field}.initial_state.dims",
                            f"Number of dimensions in 'initial_state' doesn't match the size of "
                            f"'state' dimensions for state input '{state.input_name}'. "
                            f"{len(init.dims)} != {len(state.dims)}")
            for got, want in zip(init.dims, state.dims):
                if want != WILDCARD_DIM and got != want:
                    raise _fail(config, f"{field}.initial_state.dims",
                                f"'initial_state' dim for input name '{state.input_name}' "
                                f"doesn't match 'state' dim description. {got} != {want}")
            if not init.name:
                raise _fail(config, f"{field}.initial_state.name",
                            f"Field 'name' must be set when using initial_state for state "
                            f"input '{state.input_name}'.")


def _validate_instance_groups(config: mc.ModelConfig) -> None:
    names: set[str] = set()
    for index, group in enumerate(config.instance_group):
        field = f"instance_group[{index}]"
        label = f"instance group {group.name or index}"
        if group.count < 0:
            raise _fail(config, f"{field}.count",
                        f"{label} 'count' must be >= 0 (0 means the default), got {group.count}")
        if group.kind in (mc.ModelInstanceGroup.KIND_CPU, mc.ModelInstanceGroup.KIND_MODEL) \
                and group.gpus:
            kind = mc.ModelInstanceGroup.Kind.Name(group.kind)
            raise _fail(config, f"{field}.gpus",
                        f"{label} has kind {kind} but specifies one or more GPUs")
        if any(gpu < 0 for gpu in group.gpus):
            raise _fail(config, f"{field}.gpus",
                        f"{label} specifies invalid gpu id {min(group.gpus)}")
        if group.name:
            if group.name in names:
                raise _fail(config, f"{field}.name",
                            f"{label} is specified more than once")
            names.add(group.name)


def _validate_ensemble(config: mc.ModelConfig, complete: bool) -> None:
    if config.HasField("ensemble_scheduling"):
        if complete and config.platform != _ENSEMBLE_PLATFORM:
            raise _fail(config, "platform",
                        f"ensemble scheduling cannot be set for a model whose platform is "
                        f"not {_ENSEMBLE_PLATFORM}")
        if config.instance_group:
            raise _fail(config, "instance_group",
                        "instance group should not be specified for ensemble")
        if config.model_warmup:
            raise _fail(config, "model_warmup", "model_warmup can not be specified for ensemble")
        steps = config.ensemble_scheduling.step
        if not steps:
            raise _fail(config, "ensemble_scheduling.step", "must specify 'step' for ensemble")
        for index, step in enumerate(steps):
            field = f"ensemble_scheduling.step[{index}]"
            for attr in ("model_name", "input_map", "output_map"):
                if not getattr(step, attr):
                    raise _fail(config, f"{field}.{attr}",
                                f"must specify '{attr}' in step {index} of ensemble")
    elif config.platform == _ENSEMBLE_PLATFORM:
        raise _fail(config, "ensemble_scheduling",
                    f"ensemble scheduling must be set for ensemble whose platform is "
                    f"{_ENSEMBLE_PLATFORM}")
