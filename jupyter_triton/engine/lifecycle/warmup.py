"""Triton's model_warmup: the requests each instance runs before its model is READY.

Like Triton, a sample with ``batch_size: N`` is one execution of N requests that each
carry one row (the same data), repeated ``count`` times (0 means once). Data comes from
``zero_data``, ``random_data`` or ``input_data_file`` (raw row-major bytes, or Triton's
length-prefixed serialization for TYPE_STRING, read from ``<model_dir>/warmup/``).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import deserialize_bytes_tensor

from ...protocol.datatypes import config_to_triton, triton_to_numpy
from ...protocol.errors import InvalidArgument
from ...protocol.types import InferRequest
from ..batching.instances import execute
from ..composition.streaming import CollectingSender

if TYPE_CHECKING:
    from ..batching.instances import Instance

Tensors = dict[str, np.ndarray]


@dataclass
class WarmupSample:
    name: str
    batch_size: int      # requests in the one execution
    count: int           # executions (Triton's 0 already turned into 1)
    inputs: Tensors      # one request's inputs (a leading dim of 1 when the model batches)

    def requests(self) -> list[Tensors]:
        """One execution's requests (engine/batching/instances.py ``execute``)."""
        return [self.inputs] * self.batch_size


def warmup_samples(config: mc.ModelConfig, model_dir: Path | str) -> list[WarmupSample]:
    """Build every ``model_warmup`` sample of ``config``; raise InvalidArgument naming the fault."""
    model_dir = Path(model_dir)
    rng = np.random.default_rng(0)
    known = {i.name for i in config.input}
    samples = []
    for setting in config.model_warmup:
        where = f"model_warmup '{setting.name}' of model '{config.name}'"
        if setting.batch_size < 1:
            raise InvalidArgument(f"{where}: batch_size must be at least 1")
        if config.max_batch_size == 0 and setting.batch_size != 1:
            raise InvalidArgument(f"{where}: batch_size must be 1 for a model without batching "
                                  f"(max_batch_size 0), got {setting.batch_size}")
        if config.max_batch_size > 0 and setting.batch_size > config.max_batch_size:
            raise InvalidArgument(f"{where}: batch_size {setting.batch_size} exceeds max_batch_size "
                                  f"{config.max_batch_size}")
        inputs = {}
        for name, spec in setting.inputs.items():
            if known and name not in known:
                raise InvalidArgument(f"{where}: '{name}' is not an input of the model")
            inputs[name] = _input_data(spec, name, where, model_dir, rng, config.max_batch_size > 0)
        samples.append(WarmupSample(setting.name, setting.batch_size, max(1, setting.count), inputs))
    return samples


def _input_data(spec: mc.ModelWarmup.Input, name: str, where: str, model_dir: Path,
                rng: np.random.Generator, batching: bool) -> np.ndarray:
    if spec.data_type == mc.TYPE_INVALID:
        raise InvalidArgument(f"{where}: input '{name}' needs a data_type")
    datatype = config_to_triton(mc.DataType.Name(spec.data_type))
    if any(d < 0 for d in spec.dims):
        raise InvalidArgument(f"{where}: input '{name}' dims {list(spec.dims)} must all be >= 0 "
                              f"(warmup data has a fixed shape)")
    shape = ((1,) if batching else ()) + tuple(spec.dims)
    count = int(np.prod(shape))
    source = spec.WhichOneof("input_data_type")
    if datatype == "BYTES":
        if source == "input_data_file":
            raw = _read(model_dir, spec.input_data_file, name, where)
            values = deserialize_bytes_tensor(raw)
            if values.size < count:
                raise InvalidArgument(f"{where}: input '{name}' needs {count} strings but "
                                      f"'{spec.input_data_file}' holds {values.size}")
            return values[:count].reshape(shape)
        # Triton's zero and random strings are both empty strings.
        return np.full(shape, b"", dtype=object)
    # numpy has no bfloat16: BF16 tensors live as float32 (see protocol.types).
    dtype = triton_to_numpy(datatype)
    if source == "input_data_file":
        raw = _read(model_dir, spec.input_data_file, name, where)
        itemsize = 2 if datatype == "BF16" else dtype.itemsize
        if len(raw) < count * itemsize:
            raise InvalidArgument(f"{where}: input '{name}' needs {count * itemsize} bytes but "
                                  f"'{spec.input_data_file}' holds {len(raw)}")
        if datatype == "BF16":
            bits = np.frombuffer(raw, dtype="<u2", count=count).astype(np.uint32) << 16
            return bits.view(np.float32).reshape(shape)
        return np.frombuffer(raw, dtype=dtype, count=count).reshape(shape).copy()
    if source == "random_data":
        if dtype == np.bool_:
            return rng.integers(0, 2, size=shape).astype(bool)
        if dtype.kind in "iu":
            return rng.integers(0, 100, size=shape).astype(dtype)   # small: safe as indices/ids
        return rng.random(size=shape).astype(dtype)
    return np.zeros(shape, dtype=dtype)


def _read(model_dir: Path, filename: str, name: str, where: str) -> bytes:
    base = (model_dir / "warmup").resolve()
    path = (base / filename).resolve()
    if base not in path.parents:
        raise InvalidArgument(f"{where}: input '{name}' input_data_file '{filename}' must be a file "
                              f"under the model's warmup/ directory")
    try:
        return path.read_bytes()
    except OSError as err:
        raise InvalidArgument(f"{where}: input '{name}' cannot read input_data_file "
                              f"'{filename}': {err.strerror}") from None


async def warm_up(config: mc.ModelConfig, model_dir: Path, instances: list["Instance"],
                  decoupled: bool) -> int:
    """Run every sample on every instance, on its own thread, before the version is READY;
    the nanoseconds it took (0: no samples). Raises the first failure: the load fails."""
    samples = warmup_samples(config, model_dir)
    if not samples:
        return 0
    loop = asyncio.get_running_loop()
    start = time.monotonic_ns()
    for inst in instances:
        for sample in samples:
            for _ in range(sample.count):
                if decoupled:
                    results = await loop.run_in_executor(
                        inst.thread, _warmup_decoupled, inst.backend, config.name, sample.requests())
                else:
                    results, _ = await loop.run_in_executor(inst.thread, execute, inst.backend,
                                                            sample.requests())
                failed = [r for r in results if isinstance(r, BaseException)]
                if failed:
                    raise failed[0]
    return time.monotonic_ns() - start


def _warmup_decoupled(backend: Any, model: str, requests: list[dict]) -> list:
    senders = [CollectingSender() for _ in requests]
    backend.execute_decoupled(requests, [InferRequest(model, id="warmup") for _ in requests], senders)
    return [s.error for s in senders if s.error is not None]
