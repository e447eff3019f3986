"""Triton's datatype table and the wire formats that need more than ``np.frombuffer``.

Inside the server every tensor is a numpy array: BYTES are ``object`` arrays of ``bytes``
and BF16 are ``float32`` arrays (numpy has no bfloat16); on the wire BF16 is 2 bytes per
element and BYTES are 4-byte little-endian length prefixes followed by the bytes.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from tritonclient.utils import serialize_byte_tensor

from .errors import InvalidArgument


@dataclass(frozen=True)
class Datatype:
    """One Triton datatype and every spelling of it the server meets."""

    name: str                # KServe v2 / tritonclient: "FP32"
    config: str              # model_config.proto DataType name: "TYPE_FP32"
    code: int                # that enum's value (pb_utils hands models these ints)
    numpy: np.dtype          # in-server dtype (BF16: float32, BYTES: object)
    size: int | None         # bytes per element on the wire; None = variable (BYTES)
    torch: str | None        # torch dtype name, where torch has one
    onnx: str                # onnxruntime NodeArg.type
    tensorrt: str | None     # trt.DataType name, where TensorRT has one


def _dt(name: str, config: str, code: int, numpy: type, size: int | None, torch: str | None,
        onnx: str, tensorrt: str | None = None) -> Datatype:
    return Datatype(name, config, code, np.dtype(numpy), size, torch, onnx, tensorrt)


#: Triton name -> its spellings: the one table every other module derives its mappings from
DATATYPES: dict[str, Datatype] = {d.name: d for d in (
    _dt("BOOL", "TYPE_BOOL", 1, np.bool_, 1, "bool", "tensor(bool)", "BOOL"),
    _dt("UINT8", "TYPE_UINT8", 2, np.uint8, 1, "uint8", "tensor(uint8)", "UINT8"),
    _dt("UINT16", "TYPE_UINT16", 3, np.uint16, 2, "uint16", "tensor(uint16)"),
    _dt("UINT32", "TYPE_UINT32", 4, np.uint32, 4, "uint32", "tensor(uint32)"),
    _dt("UINT64", "TYPE_UINT64", 5, np.uint64, 8, "uint64", "tensor(uint64)"),
    _dt("INT8", "TYPE_INT8", 6, np.int8, 1, "int8", "tensor(int8)", "INT8"),
    _dt("INT16", "TYPE_INT16", 7, np.int16, 2, "int16", "tensor(int16)"),
    _dt("INT32", "TYPE_INT32", 8, np.int32, 4, "int32", "tensor(int32)", "INT32"),
    _dt("INT64", "TYPE_INT64", 9, np.int64, 8, "int64", "tensor(int64)", "INT64"),
    _dt("FP16", "TYPE_FP16", 10, np.float16, 2, "float16", "tensor(float16)", "HALF"),
    _dt("FP32", "TYPE_FP32", 11, np.float32, 4, "float32", "tensor(float)", "FLOAT"),
    _dt("FP64", "TYPE_FP64", 12, np.float64, 8, "float64", "tensor(double)"),
    _dt("BYTES", "TYPE_STRING", 13, np.object_, None, None, "tensor(string)"),
    _dt("BF16", "TYPE_BF16", 14, np.float32, 2, "bfloat16", "tensor(bfloat16)", "BF16"),
)}

TRITON_DATATYPES: tuple[str, ...] = tuple(DATATYPES)

_FROM_NUMPY: dict[np.dtype, str] = {
    d.numpy: name for name, d in DATATYPES.items() if name not in ("BF16",)
}


def parse_datatype(spelled: str) -> Datatype:
    """A datatype as users and configs spell it: ``FP32``, ``fp32``, ``TYPE_FP32``; BYTES
    also as model_config.proto's ``STRING`` / ``TYPE_STRING``."""
    name = str(spelled).upper().removeprefix("TYPE_")
    try:
        return DATATYPES["BYTES" if name == "STRING" else name]
    except KeyError:
        raise InvalidArgument(f"invalid datatype '{spelled}'") from None


def is_valid_datatype(dt: str) -> bool:
    return dt in DATATYPES


def as_numpy(value, datatype: str) -> np.ndarray:
    """A user's value (list, array, torch tensor) as the array a ``datatype`` input sends."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    if datatype == "BYTES":
        return np.asarray(value, dtype=np.object_)
    return np.asarray(value, dtype=triton_to_numpy(datatype))


def triton_to_numpy(dt: str) -> np.dtype:
    """The numpy dtype a tensor of Triton type ``dt`` has inside the server."""
    try:
        return DATATYPES[dt].numpy
    except KeyError:
        raise InvalidArgument(f"invalid datatype '{dt}'") from None


def numpy_to_triton(dtype: np.dtype | type | str) -> str:
    """Triton's name for a numpy dtype; ``str``/``bytes`` arrays are BYTES, ml_dtypes.bfloat16 is BF16."""
    d = np.dtype(dtype)
    if d.kind in ("S", "U", "O"):
        return "BYTES"
    if d.name == "bfloat16":
        return "BF16"
    try:
        return _FROM_NUMPY[d.newbyteorder("=")]
    except KeyError:
        raise InvalidArgument(f"numpy dtype '{d}' has no Triton datatype") from None


_WIRE_DTYPES: dict[str, np.dtype] = {}     # (newbyteorder builds a new dtype every call)


def wire_dtype(dt: str) -> np.dtype:
    """The little-endian dtype of one element on the wire (BF16: its 16 raw bits)."""
    found = _WIRE_DTYPES.get(dt)
    if found is None:
        found = np.dtype("<u2") if dt == "BF16" else triton_to_numpy(dt).newbyteorder("<")
        _WIRE_DTYPES[dt] = found        # only Triton's names get here (others raise)
    return found


def element_size(dt: str) -> int | None:
    """Bytes per element on the wire; None for BYTES (variable length)."""
    try:
        return DATATYPES[dt].size
    except KeyError:
        raise InvalidArgument(f"invalid datatype '{dt}'") from None


def config_to_triton(config_dtype: str) -> str:
    """``"TYPE_FP32"`` (model_config_pb2.DataType name) -> ``"FP32"``; TYPE_STRING is BYTES."""
    if config_dtype == "TYPE_STRING":
        return "BYTES"
    if config_dtype.startswith("TYPE_"):
        dt = config_dtype[len("TYPE_"):]
        if dt in DATATYPES:
            return dt
    raise InvalidArgument(f"unsupported data type '{config_dtype}'")


def triton_to_config(dt: str) -> str:
    """``"FP32"`` -> ``"TYPE_FP32"``; BYTES is TYPE_STRING."""
    try:
        return DATATYPES[dt].config
    except KeyError:
        raise InvalidArgument(f"invalid datatype '{dt}'") from None


# -- BF16 ------------------------------------------------------------------------------

def float32_to_bf16_bits(arr: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bfloat16 (ties to even), as uint16 bit patterns."""
    bits = np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32)
    nan = np.isnan(bits.view(np.float32))
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    out = ((bits + rounding) >> 16).astype(np.uint16)
    if nan.any():
        # rounding could carry a NaN's payload into the exponent and make it Inf
        out[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    return out


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bit patterns (uint16) to float32 exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_to_bf16(arr: np.ndarray) -> np.ndarray:
    """float32 values rounded to what a bfloat16 can hold (still float32)."""
    return bf16_bits_to_float32(float32_to_bf16_bits(arr)).reshape(np.shape(arr))


# -- BYTES -----------------------------------------------------------------------------

def serialize_bytes_tensor(arr: np.ndarray) -> bytes:
    """Row-major elements, each as a 4-byte little-endian length then its bytes.

    ``str`` elements are UTF-8 encoded, ``bytes`` kept as they are, anything else ``str()``-ed.
    """
    arr = np.asarray(arr)
    if arr.size == 0:
        return b""  # tritonclient's helper returns an empty object array here
    if arr.dtype.kind == "U":
        arr = arr.astype(np.object_)
    return serialize_byte_tensor(arr).item()


def deserialize_bytes_tensor(buf: bytes | memoryview, count: int, name: str) -> np.ndarray:
    """Split a length-prefixed BYTES buffer into a 1-D object array of exactly ``count`` elements.

    Raises InvalidArgument naming the input when a length runs past the buffer, or when the
    buffer holds more or fewer than ``count`` elements.
    """
    view = memoryview(buf).cast("B")
    end = len(view)
    # Each element needs at least its 4-byte prefix: refuse before allocating for ``count``.
    if count * 4 > end:
        raise InvalidArgument(
            f"unexpected number of string elements {end // 4 if end else 0} or fewer for input "
            f"'{name}', expecting {count}")
    out = np.empty(count, dtype=np.object_)
    offset = 0
    unpack = struct.Struct("<I").unpack_from
    for i in range(count):
        if offset + 4 > end:
            raise InvalidArgument(
                f"unexpected number of string elements {i} for input '{name}', expecting {count}")
        (length,) = unpack(view, offset)
        offset += 4
        if offset + length > end:
            raise InvalidArgument(
                f"element {i} of input '{name}' has length {length} which runs past the end of "
                f"its {end}-byte buffer")
        out[i] = bytes(view[offset:offset + length])
        offset += length
    if offset != end:
        raise InvalidArgument(
            f"unexpected number of string elements for input '{name}': {end - offset} bytes "
            f"remain after the expected {count} elements")
    return out


def count_bytes_elements(buf: bytes | memoryview, name: str) -> int:
    """Number of length-prefixed elements in ``buf`` (for raw requests, where shape is inferred)."""
    view = memoryview(buf).cast("B")
    end, offset, n = len(view), 0, 0
    unpack = struct.Struct("<I").unpack_from
    while offset < end:
        if offset + 4 > end:
            raise InvalidArgument(f"input '{name}' ends inside a 4-byte string length prefix")
        (length,) = unpack(view, offset)
        offset += 4 + length
        if offset > end:
            raise InvalidArgument(
                f"element {n} of input '{name}' has length {length} which runs past the end of "
                f"its {end}-byte buffer")
        n += 1
    return n


# -- whole tensors on the wire (shared by the HTTP binary extension and gRPC raw contents) ---

def element_count(shape: tuple[int, ...] | list[int]) -> int:
    """Product of ``shape`` in Python ints, so an absurd shape cannot overflow."""
    n = 1
    for d in shape:
        n *= int(d)
    return n


def tensor_from_wire(buf: bytes | memoryview, dt: str, shape: tuple[int, ...], name: str,
                     model_name: str) -> np.ndarray:
    """The array of ``shape`` encoded in ``buf``; a zero-copy view for fixed-size types
    (except BF16, widened to float32). Sizes are checked before anything is allocated."""
    count = element_count(shape)
    size = element_size(dt)
    if size is None:
        return deserialize_bytes_tensor(buf, count, name).reshape(shape)
    nbytes = memoryview(buf).nbytes
    if nbytes != count * size:
        raise InvalidArgument(
            f"input byte size mismatch for input '{name}' for model '{model_name}'. "
            f"Expected {count * size}, got {nbytes}")
    arr = np.frombuffer(buf, dtype=wire_dtype(dt), count=count)
    if dt == "BF16":
        arr = bf16_bits_to_float32(arr)
    elif dt == "BOOL" and count and arr.view(np.uint8).max() > 1:
        raise InvalidArgument(
            f"input '{name}' for model '{model_name}' holds a BOOL byte other than 0 or 1")
    return arr.reshape(shape)


def tensor_wire_buffer(arr: np.ndarray, dt: str) -> bytes | memoryview:
    """``arr`` as Triton's wire bytes, without a copy where the array already is contiguous."""
    if dt == "BYTES":
        return serialize_bytes_tensor(arr)
    arr = np.asarray(arr)
    if dt == "BF16":
        if arr.dtype.name == "bfloat16":
            return memoryview(np.ascontiguousarray(arr).view(np.uint16)).cast("B")
        return memoryview(float32_to_bf16_bits(arr)).cast("B")
    wire = wire_dtype(dt)
    if arr.dtype == wire and arr.flags.c_contiguous and arr.size:
        return memoryview(arr).cast("B")        # as it is (the usual case): no reshape
    arr = np.ascontiguousarray(arr, dtype=wire)
    return memoryview(arr.reshape(-1)).cast("B")


def tensor_to_wire(arr: np.ndarray, dt: str) -> bytes:
    """``arr`` as Triton's wire bytes (row-major, little-endian, BYTES length-prefixed)."""
    buf = tensor_wire_buffer(arr, dt)
    return buf if isinstance(buf, bytes) else buf.tobytes()
