"""pb_utils.Tensor as a model.py builds it: a numeric ndarray is kept as it is, anything else is
converted the way Triton's python backend converts it, and the objects take no attributes of
their own (Triton's are pybind11 objects without a __dict__)."""
import numpy as np
import pytest

from jupyter_triton.backends.python import triton_python_backend_utils as pb_utils


def test_a_numeric_ndarray_is_kept_as_it_is():
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    tensor = pb_utils.Tensor("OUTPUT0", array)
    assert tensor.as_numpy() is array
    assert tensor.triton_dtype() == pb_utils.numpy_to_triton_type(np.float32) == 11
    assert tensor.name() == "OUTPUT0" and tensor.shape() == [2, 3]


def test_other_values_are_converted():
    assert pb_utils.Tensor("X", [1.0, 2.0]).as_numpy().dtype == np.float64
    text = pb_utils.Tensor("X", np.array(["héllo", "b"]))
    assert text.as_numpy().dtype == np.object_ and text.as_numpy().tolist() == ["héllo".encode(), b"b"]
    assert text.triton_dtype() == 13
    # an explicit Triton type reinterprets the bytes, as Triton's does
    as_int = pb_utils.Tensor("X", np.zeros(2, np.float32), pb_utils.numpy_to_triton_type(np.int32))
    assert as_int.as_numpy().dtype == np.int32
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.Tensor("X", np.zeros(2, dtype=[("a", np.int8)]))


@pytest.mark.parametrize("make", [
    lambda: pb_utils.Tensor("X", np.zeros(1, np.float32)),
    lambda: pb_utils.InferenceRequest(model_name="m", inputs=[], requested_output_names=[]),
    lambda: pb_utils.InferenceResponse(output_tensors=[]),
])
def test_no_attributes_of_their_own(make):
    with pytest.raises(AttributeError):
        make().extra = 1
