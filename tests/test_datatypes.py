"""protocol.datatypes is the one table of Triton datatypes; every mapping elsewhere is derived
from it, so each Triton datatype must come back out of each mapping it goes into."""
from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import np_to_triton_dtype, triton_to_np_dtype

from jupyter_triton.backends import onnxruntime, pytorch, tensorrt
from jupyter_triton.backends.python import triton_python_backend_utils as pb_utils
from jupyter_triton.backends.signature import numpy_dtype
from jupyter_triton.kernel import artifact_specs as artifacts
from jupyter_triton.protocol import datatypes
from jupyter_triton.protocol.datatypes import DATATYPES, TRITON_DATATYPES
from jupyter_triton.protocol.errors import InvalidArgument


def test_table_covers_triton_exactly():
    # model_config.proto's DataType, less TYPE_INVALID, is Triton's set of datatypes
    assert sorted(d.config for d in DATATYPES.values()) == \
        sorted(set(mc.DataType.keys()) - {"TYPE_INVALID"})
    assert set(TRITON_DATATYPES) == set(DATATYPES)
    for name, d in DATATYPES.items():
        assert d.name == name
        assert mc.DataType.Value(d.config) == d.code
        if name != "BF16":      # numpy has no bfloat16; tritonclient's own helpers agree otherwise
            assert np.dtype(triton_to_np_dtype(name)) == d.numpy
        if d.size is not None:
            assert datatypes.wire_dtype(name).itemsize == d.size


@pytest.mark.parametrize("name", TRITON_DATATYPES)
def test_every_datatype_round_trips_through_every_mapping(name):
    d = DATATYPES[name]
    # v2 name <-> config name <-> enum value
    assert datatypes.config_to_triton(datatypes.triton_to_config(name)) == name
    assert datatypes.config_to_triton(mc.DataType.Name(d.code)) == name
    assert datatypes.is_valid_datatype(name)
    # numpy: BF16 lives as float32, so it comes back as FP32 (as Triton's clients do)
    back = datatypes.numpy_to_triton(datatypes.triton_to_numpy(name))
    assert back == ("FP32" if name == "BF16" else name)
    assert numpy_dtype(d.code) == datatypes.triton_to_numpy(name)
    if name not in ("BF16", "BYTES"):
        assert np_to_triton_dtype(d.numpy) == name
    # framework spellings: ORT knows all of them, torch all but BYTES, TensorRT a subset
    assert onnxruntime._ORT_TYPES[d.onnx] == d.code
    if name == "BYTES":
        assert d.torch is None
    else:
        assert pytorch._TORCH_TYPES[d.torch] == d.code
        assert artifacts._TORCH_DTYPES[d.torch] == name
    if d.tensorrt is not None:
        assert tensorrt._TRT_TYPES[d.tensorrt] == (d.code, d.torch)
    # the kernel's spelled names: v2 and config spellings, any case
    assert artifacts.triton_dtype(name) == name
    assert artifacts.triton_dtype(d.config.lower()) == name
    # pb_utils (Triton's API): no BF16, as in Triton; otherwise numpy <-> enum <-> string name
    if name == "BF16":
        assert pb_utils.triton_to_numpy_type(d.code) is None
        assert d.config not in pb_utils.TRITON_STRING_TO_NUMPY
    else:
        np_type = pb_utils.triton_to_numpy_type(d.code)
        assert np.dtype(np_type) == d.numpy
        assert pb_utils.numpy_to_triton_type(np_type) == d.code
        assert np.dtype(pb_utils.triton_string_to_numpy(d.config)) == d.numpy


def test_mappings_hold_nothing_but_triton_datatypes():
    codes = {d.code for d in DATATYPES.values()}
    assert len(onnxruntime._ORT_TYPES) == len(DATATYPES)
    assert set(pytorch._TORCH_TYPES.values()) == codes - {mc.TYPE_STRING}
    assert set(artifacts._TORCH_DTYPES.values()) == set(DATATYPES) - {"BYTES"}
    assert set(tensorrt._TRT_TYPES) == {"FLOAT", "HALF", "BF16", "INT8", "INT32", "INT64",
                                        "BOOL", "UINT8"}
    # pb_utils' builtin bool for TYPE_BOOL and np.bool_ for enum 1 are Triton's own choices
    assert pb_utils.triton_string_to_numpy("TYPE_BOOL") is bool
    assert pb_utils.triton_to_numpy_type(mc.TYPE_BOOL) is np.bool_
    assert pb_utils.numpy_to_triton_type(np.dtype("S3")) == mc.TYPE_STRING


@pytest.mark.parametrize("bad", ["FLOAT32", "TYPE_INVALID", "fp32", ""])
def test_unknown_spellings_are_invalid_argument(bad):
    with pytest.raises(InvalidArgument):
        datatypes.config_to_triton(bad)
    with pytest.raises(InvalidArgument):
        datatypes.triton_to_config(bad)
    with pytest.raises(InvalidArgument):
        datatypes.triton_to_numpy(bad)
