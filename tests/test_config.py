"""config.pbtxt and Triton's JSON config: parse, print, validate, normalize."""
from __future__ import annotations

import json

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from jupyter_triton.config import (config_from_json, config_to_json, config_to_pbtxt,
                                   enable_default_batching, fill_defaults, load_config_file,
                                   parse_config, validate_config)
from jupyter_triton.protocol.errors import InvalidArgument

# The shape of the examples in Triton's model_configuration.md, written for these tests.
DENSENET = """
name: "densenet_onnx"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  {
    name: "data_0"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 224, 224 ]
    reshape { shape: [ 1, 3, 224, 224 ] }
  }
]
output [
  {
    name: "fc6_1"
    data_type: TYPE_FP32
    dims: [ 1000 ]
    label_filename: "densenet_labels.txt"
  }
]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 100
  priority_levels: 2
  default_priority_level: 1
  priority_queue_policy {
    key: 2
    value { timeout_action: DELAY default_timeout_microseconds: 5000 max_queue_size: 16 }
  }
}
instance_group [ { count: 2 kind: KIND_CPU } ]
version_policy: { specific: { versions: [ 1, 3 ] } }
parameters { key: "intra_op_thread_count" value { string_value: "1" } }
"""

ENSEMBLE = """
name: "pipeline"
platform: "ensemble"
max_batch_size: 4
input [ { name: "RAW" data_type: TYPE_UINT8 dims: [ -1 ] } ]
output [ { name: "SCORES" data_type: TYPE_FP32 dims: [ 10 ] } ]
ensemble_scheduling {
  step [
    { model_name: "preprocess" model_version: -1
      input_map { key: "IN" value: "RAW" } output_map { key: "OUT" value: "image" } },
    { model_name: "classifier" model_version: -1
      input_map { key: "x" value: "image" } output_map { key: "y" value: "SCORES" } }
  ]
}
"""


def parse_ok(text: str, name: str) -> mc.ModelConfig:
    config = parse_config(text, name)
    validate_config(config)
    return config


# ---- parsing -----------------------------------------------------------------

def test_parses_a_triton_onnx_config():
    config = parse_ok(DENSENET, "densenet_onnx")
    assert config.max_batch_size == 8
    assert config.input[0].format == mc.ModelInput.FORMAT_NCHW
    assert list(config.input[0].reshape.shape) == [1, 3, 224, 224]
    assert list(config.dynamic_batching.preferred_batch_size) == [4, 8]
    assert config.dynamic_batching.priority_queue_policy[2].max_queue_size == 16
    assert list(config.version_policy.specific.versions) == [1, 3]
    assert config.parameters["intra_op_thread_count"].string_value == "1"


def test_parses_an_ensemble_config():
    config = parse_ok(ENSEMBLE, "pipeline")
    assert [s.model_name for s in config.ensemble_scheduling.step] == ["preprocess", "classifier"]


@pytest.mark.parametrize("text, line, field", [
    ('name: "m"\nmax_batch_size: 8\ninput [ { name: "a" data_type: TYPE_FOO } ]', 3, "data_type"),
    ('max_batch_size: eight', 1, "max_batch_size"),
    ('input [\n  { name: "a"\n    dims:\n      [ 1, x ] } ]', 4, "dims"),
])
def test_parse_errors_name_model_file_line_and_field(text, line, field):
    with pytest.raises(InvalidArgument) as err:
        parse_config(text, "mymodel", "mymodel/config.pbtxt")
    message = str(err.value)
    assert "model 'mymodel'" in message
    assert "mymodel/config.pbtxt" in message
    assert f"line {line}," in message
    assert f"field '{field}'" in message


def test_unknown_field_is_named():
    with pytest.raises(InvalidArgument, match=r"line 2.*no field named \"max_batch\""):
        parse_config('name: "m"\nmax_batch: 8', "m")


def test_load_config_file_rules(tmp_path):
    missing = tmp_path / "auto"
    missing.mkdir()
    assert load_config_file(missing) == mc.ModelConfig(name="auto")

    unnamed = tmp_path / "unnamed"
    unnamed.mkdir()
    (unnamed / "config.pbtxt").write_text("max_batch_size: 2\n")
    config = load_config_file(unnamed)
    assert config.name == "unnamed" and config.max_batch_size == 2

    wrong = tmp_path / "dirname"
    wrong.mkdir()
    (wrong / "config.pbtxt").write_text('name: "other"\n')
    with pytest.raises(InvalidArgument, match="unexpected directory name 'dirname' for model "
                                              "'other', directory name must equal model name"):
        load_config_file(wrong)

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.pbtxt").write_text('name: "broken"\ninput [ { dims: [ 1 ] }\n')
    with pytest.raises(InvalidArgument, match="model 'broken'.*config.pbtxt"):
        load_config_file(broken)


# ---- JSON ----------------------------------------------------------------------

def test_json_is_tritons_form_with_int64_as_numbers():
    out = config_to_json(parse_config(DENSENET, "densenet_onnx"))
    json.dumps(out)   # plain JSON
    assert out["input"][0]["dims"] == [3, 224, 224]
    assert out["input"][0]["reshape"]["shape"] == [1, 3, 224, 224]
    assert out["input"][0]["data_type"] == "TYPE_FP32"
    assert out["version_policy"]["specific"]["versions"] == [1, 3]
    batching = out["dynamic_batching"]
    assert batching["max_queue_delay_microseconds"] == 100
    assert batching["priority_levels"] == 2
    policy = batching["priority_queue_policy"]["2"]   # map keys stay strings, as in Triton
    assert policy["default_timeout_microseconds"] == 5000
    assert policy["timeout_action"] == "DELAY"
    # Triton prints fields left at their defaults
    assert out["backend"] == "" and out["output"][0]["is_shape_tensor"] is False
    assert out["batch_input"] == [] and batching["preserve_ordering"] is False


def test_json_round_trip():
    for text, name in ((DENSENET, "densenet_onnx"), (ENSEMBLE, "pipeline")):
        config = fill_defaults(parse_config(text, name))
        assert config_from_json(config_to_json(config), name) == config
        assert config_from_json(json.dumps(config_to_json(config)), name) == config
        assert parse_config(config_to_pbtxt(config), name) == config


def test_json_accepts_int64_as_strings_or_numbers():
    doc = {"name": "m", "max_batch_size": 4,
           "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": ["-1", 3]}],
           "dynamic_batching": {"max_queue_delay_microseconds": "250"}}
    config = config_from_json(doc, "m")
    assert list(config.input[0].dims) == [-1, 3]
    assert config.dynamic_batching.max_queue_delay_microseconds == 250


def test_json_without_name_takes_model_name():
    assert config_from_json('{"max_batch_size": 2}', "m").name == "m"


@pytest.mark.parametrize("doc, words", [
    ('{"max_batch_size": "lots"}', "max_batch_size"),
    ('{"inputs": []}', "inputs"),
    ('{"input": [{"name": "x", "data_type": "FLOAT"}]}', "data_type"),
    ("[1, 2]", "JSON object"),
    ("{not json", "not valid JSON"),
    ('{"name": "other"}', "directory name must equal model name"),
])
def test_json_errors_name_the_field(doc, words):
    with pytest.raises(InvalidArgument) as err:
        config_from_json(doc, "m")
    assert words in str(err.value)
    assert "'m'" in str(err.value)


def test_empty_config_is_empty_json():
    assert config_to_json(mc.ModelConfig()) == {}


# ---- validation ------------------------------------------------------------------

BASE = 'name: "m"\nbackend: "onnxruntime"\nmax_batch_size: 8\n'
IO = 'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\n' \
     'output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'


@pytest.mark.parametrize("text, field, words", [
    ('name: "m"\nmax_batch_size: -1', "max_batch_size", "must be non-negative"),
    (BASE + 'input [ { data_type: TYPE_FP32 dims: [ 1 ] } ]', "input[0].name",
     "must specify 'name'"),
    (BASE + 'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] },'
            ' { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]', "input[1].name",
     "more than once"),
    (BASE + 'output [ { name: "y" dims: [ 1 ] } ]', "output[0].data_type",
     "must specify 'data_type'"),
    (BASE + 'input [ { name: "x" data_type: TYPE_FP32 } ]', "input[0].dims",
     "must specify 'dims'"),
    (BASE + 'input [ { name: "x" data_type: TYPE_FP32 dims: [ -2 ] } ]', "input[0].dims",
     "dimension must be integer >= 1, or -1"),
    (BASE + 'input [ { name: "x" data_type: TYPE_FP32 dims: [ 0 ] } ]', "input[0].dims",
     "dimension must be integer >= 1, or -1"),
    (BASE + 'input [ { name: "x" data_type: TYPE_FP32 dims: [ 2, 3 ] reshape { shape: [ 7 ] } } ]',
     "input[0].reshape", "different size for dims and reshape"),
    (BASE + 'input [ { name: "x" data_type: TYPE_FP32 dims: [ 2, -1 ] reshape { shape: [ 2 ] } } ]',
     "input[0].reshape", "different number of variable-size dimensions"),
    ('name: "m"\nmax_batch_size: 0\ndynamic_batching { }', "dynamic_batching",
     "max_batch_size"),
    (BASE + 'dynamic_batching { preferred_batch_size: [ 16 ] }',
     "dynamic_batching.preferred_batch_size", "must be <= max batch size"),
    (BASE + 'dynamic_batching { preferred_batch_size: [ 0 ] }',
     "dynamic_batching.preferred_batch_size", "must be positive"),
    (BASE + 'dynamic_batching { priority_levels: 2 default_priority_level: 3 }',
     "dynamic_batching.default_priority_level", "in range [1, 2]"),
    (BASE + 'dynamic_batching { priority_levels: 2 default_priority_level: 1 '
            'priority_queue_policy { key: 3 value { } } }',
     "dynamic_batching.priority_queue_policy", "in range [1, 2]"),
    (BASE + 'dynamic_batching { preserve_ordering: true priority_levels: 2 default_priority_level: 1 }',
     "dynamic_batching.preserve_ordering", "Only one priority level"),
    (BASE + 'instance_group [ { count: -1 kind: KIND_CPU } ]', "instance_group[0].count", ">= 0"),
    (BASE + 'instance_group [ { count: 1 kind: KIND_CPU gpus: [ 0 ] } ]',
     "instance_group[0].gpus", "KIND_CPU but specifies one or more GPUs"),
    (BASE + 'version_policy { specific { } }', "version_policy.specific.versions",
     "at least one version"),
    (BASE + 'version_policy { latest { } }', "version_policy.latest.num_versions", ">= 1"),
    (BASE + IO + 'batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "n" '
                 'data_type: TYPE_INT32 source_input: "nope" } ]',
     "batch_input[0].source_input", "unknown source input name 'nope'"),
    ('name: "m"\nplatform: "ensemble"\nmax_batch_size: 1', "ensemble_scheduling",
     "ensemble scheduling must be set"),
    (ENSEMBLE.replace('model_name: "classifier"', 'model_name: ""').replace('"pipeline"', '"m"'),
     "ensemble_scheduling.step[1].model_name", "must specify 'model_name' in step 1"),
])
def test_validation_names_model_field_and_rule(text, field, words):
    config = parse_config(text, "m")
    with pytest.raises(InvalidArgument) as err:
        validate_config(config)
    message = str(err.value)
    assert "model 'm'" in message
    assert f"'{field}'" in message
    assert words in message


def test_valid_configs_pass():
    validate_config(parse_config(BASE + IO + "dynamic_batching { }", "m"))
    # one value per batch item: dims [1] reshaped to a scalar
    validate_config(parse_config(
        BASE + 'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] reshape { shape: [ ] } } ]', "m"))
    # wildcard runs that hold the same element counts
    validate_config(parse_config(
        BASE + 'input [ { name: "x" data_type: TYPE_FP32 dims: [ 2, 4, -1, 6 ] '
               'reshape { shape: [ 8, -1, 1, 6 ] } } ]', "m"))


def test_incomplete_config_passes_before_auto_complete():
    # what a user writes and a backend completes: no data types, no dims, batching pending
    config = parse_config('name: "m"\ninput [ { name: "x" } ]\ndynamic_batching { }', "m")
    validate_config(config, complete=False)
    with pytest.raises(InvalidArgument):
        validate_config(config)
    # structural faults are caught even before auto-complete
    with pytest.raises(InvalidArgument, match="dimension must be integer"):
        validate_config(parse_config('name: "m"\ninput [ { name: "x" dims: [ -5 ] } ]', "m"),
                        complete=False)


# ---- defaults ----------------------------------------------------------------------

def test_fill_defaults_is_tritons_normalization():
    config = parse_config(BASE + IO + 'instance_group [ { count: 0 kind: KIND_CPU }, '
                          '{ name: "gpu_group" kind: KIND_GPU count: 2 } ]', "m")
    filled = fill_defaults(config)
    assert filled.version_policy.latest.num_versions == 1
    assert [(g.name, g.count) for g in filled.instance_group] == [("m_0", 1), ("gpu_group", 2)]
    assert filled.optimization.input_pinned_memory.enable
    assert not config.HasField("version_policy")   # the input is left alone
    validate_config(filled)


def test_dynamic_batching_without_preferred_sizes_prefers_max_batch_size():
    # tritonserver 2.51 serves `max_batch_size: 8 dynamic_batching { }` back with
    # "preferred_batch_size": [8]; sizes given are kept; without batching there are none.
    filled = fill_defaults(parse_config(BASE + IO + "dynamic_batching { }", "m"))
    assert list(filled.dynamic_batching.preferred_batch_size) == [filled.max_batch_size]
    given = fill_defaults(parse_config(BASE + IO + "dynamic_batching { preferred_batch_size: [2] }", "m"))
    assert list(given.dynamic_batching.preferred_batch_size) == [2]
    unbatched = parse_config(BASE.replace("max_batch_size: 8", "max_batch_size: 0") + IO
                             + "dynamic_batching { }", "m")
    assert not fill_defaults(unbatched).dynamic_batching.preferred_batch_size
    validate_config(filled)


def test_fill_defaults_adds_one_group_and_keeps_policy():
    config = parse_config(BASE + 'version_policy { all { } }', "m")
    filled = fill_defaults(config)
    assert filled.version_policy.WhichOneof("policy_choice") == "all"
    assert len(filled.instance_group) == 1
    group = filled.instance_group[0]
    assert (group.name, group.kind, group.count) == ("m", mc.ModelInstanceGroup.KIND_AUTO, 1)


def test_fill_defaults_leaves_ensembles_without_instances():
    filled = fill_defaults(parse_config(ENSEMBLE, "pipeline"))
    assert not filled.instance_group
    validate_config(filled)


def test_enable_default_batching():
    config = mc.ModelConfig(name="m")
    assert enable_default_batching(config) is config
    assert config.max_batch_size == 4 and config.HasField("dynamic_batching")

    explicit = mc.ModelConfig(name="m", max_batch_size=2)
    enable_default_batching(explicit, 16)
    assert explicit.max_batch_size == 2 and not explicit.HasField("dynamic_batching")

    sequence = parse_config('name: "m"\nsequence_batching { }', "m")
    enable_default_batching(sequence, 8)
    assert sequence.max_batch_size == 8
    assert sequence.WhichOneof("scheduling_choice") == "sequence_batching"


def test_deeply_nested_config_json_is_a_clear_error():
    from jupyter_triton.config import config_from_json
    for text in ("[" * 100_000, '{"parameters": ' * 50_000 + "1" + "}" * 50_000):
        with pytest.raises(InvalidArgument, match="nested too deeply"):
            config_from_json(text, "m")


@pytest.mark.parametrize("field,value", [
    ("default_model_filename", "../model.onnx"), ("default_model_filename", "/etc/passwd"),
    ("default_model_filename", "a/../../b"), ("label_filename", "../../labels.txt"),
    ("label_filename", "/tmp/labels.txt")])
def test_files_a_config_names_stay_inside_the_model(field, value):
    config = mc.ModelConfig(name="m")
    if field == "label_filename":
        config.output.add(name="y", data_type=mc.TYPE_FP32, dims=[4], label_filename=value)
    else:
        config.default_model_filename = value
    with pytest.raises(InvalidArgument, match="inside the model directory"):
        validate_config(config, complete=False)
    ok = mc.ModelConfig(name="m", default_model_filename="sub/model.onnx")
    validate_config(ok, complete=False)
