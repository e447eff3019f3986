"""``torch.nn.Module`` and TorchScript as artifacts: a module with an example batch is exported
(``torch.export``, a dynamic batch dimension), else traced (TorchScript), else served as a
python-backend callable; without an example, a callable whose input width is read from a
leading ``nn.Linear``. torch is never imported here: the object given brings it.
"""
from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from ..protocol.datatypes import triton_to_config
from .artifact_callables import _callable
from .artifact_files import _pt2
from .artifact_specs import (_PROBE_ROWS, Artifact, ArtifactError, TensorSpec, _base_config, _batchable,
                             _config_dims, _decide_batch, _first_line, _flat, _output_values,
                             _parameter_names, _probe_values, _reshape_scalars, _run_module,
                             _specs_of, _split_example, _torch_example, triton_dtype)


def _leading_linear(torch, module) -> tuple[int, Any] | None:
    """(in_features, dtype) of a module that starts with nn.Linear, else None."""
    first = module
    while isinstance(first, torch.nn.Sequential) and len(first):
        first = first[0]
    if isinstance(first, torch.nn.Linear):
        return first.in_features, first.weight.dtype
    return None


def _torch_module(module, name: str, example, inputs, outputs, max_batch_size) -> Artifact:
    torch = sys.modules["torch"]
    names = _parameter_names(module.forward)
    notes: list[str] = []
    if example is None:
        if inputs is None:
            found = _leading_linear(torch, module)
            if found is None:
                raise ArtifactError(
                    f"model '{name}': cannot tell the inputs of this {type(module).__name__}: pass "
                    f"example=<a batch of inputs> (--example VAR) or inputs=[(\"x\", \"FP32\", "
                    f"[-1, 16])]")
            width, dtype = found
            input_name = names[0] if names else "INPUT__0"
            inputs = [(input_name, triton_dtype(dtype), [-1, width])]
            notes.append(f"input '{input_name}' of width {width} read from the leading nn.Linear")
        return _callable(module, name, None, inputs, outputs, max_batch_size, notes=notes)

    in_names, values, keyword = _split_example(example, names, name)
    values = _torch_example(torch, values)
    args, kwargs = ([], dict(zip(in_names, values))) if keyword else (values, {})
    try:
        result = _run_module(torch, module, args, kwargs)
    except Exception as err:
        raise ArtifactError(f"model '{name}': running the module on the example failed: "
                            f"{type(err).__name__}: {err}") from None
    out_names, out_values = _output_values(result)
    in_specs, out_specs = _specs_of(in_names, values), _specs_of(out_names, out_values)
    batchable, why = _batchable(in_specs, out_specs)
    mbs = _decide_batch(name, batchable, max_batch_size, why)
    batching = mbs > 0
    full_inputs = [(n, d, [-1, *s[1:]] if batching else s) for n, d, s in in_specs]

    try:
        data = _export(torch, module, args, kwargs, batching)
        art = _pt2(data, name, mbs, full_inputs, batching)
        art.config.max_batch_size = mbs
        return art
    except Exception as err:  # unsupported ops, data-dependent control flow, ...
        notes.append(f"torch.export failed ({type(err).__name__}: {_first_line(err)}); ")
    if not keyword and all(isinstance(v, torch.Tensor) for v in _flat(result)):
        try:
            traced = _trace(torch, module, args)
            specs_in = [(f"INPUT__{i}", d, s) for i, (_, d, s) in enumerate(full_inputs)]
            specs_out = [(f"OUTPUT__{i}", d, [-1, *s[1:]] if batching else s)
                         for i, (_, d, s) in enumerate(out_specs)]
            notes[-1] += "served as a TorchScript trace"
            return _script_artifact(traced, name, specs_in, specs_out, mbs, notes)
        except Exception as err:
            notes[-1] += f"TorchScript trace failed too ({type(err).__name__}: {_first_line(err)}); "
    notes[-1] += "served as a Python callable"
    specs_out = [(n, d, [-1, *s[1:]] if batching else s) for n, d, s in out_specs]
    return _callable(module, name, None, full_inputs, outputs or specs_out, mbs, notes=notes,
                     keyword_names=in_names if keyword else None)


def _export(torch, module, args: list[Any], kwargs: dict[str, Any], batching: bool) -> bytes:
    values = list(args) + list(kwargs.values())
    if batching and values and values[0].shape[0] == 1:
        # torch.export specializes a dimension of size 1: trace with two rows
        args = [torch.cat([a, a]) for a in args]
        kwargs = {k: torch.cat([v, v]) for k, v in kwargs.items()}
    dynamic = None
    if batching:
        batch = torch.export.Dim("batch")
        dynamic = ({k: {0: batch} for k in kwargs} if kwargs else tuple({0: batch} for _ in args))
    training = module.training
    module.eval()
    try:
        with _quiet_torch_logs():
            program = torch.export.export(module, tuple(args), kwargs or None, dynamic_shapes=dynamic)
    finally:
        module.train(training)
    buf = io.BytesIO()
    torch.export.save(program, buf)
    return buf.getvalue()


def _trace(torch, module, args: list[Any]):
    """A TorchScript trace, refused when the tracer warns that it froze a data-dependent
    decision (the trace would silently give wrong answers for other inputs)."""
    training = module.training
    module.eval()
    try:
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", torch.jit.TracerWarning)
            traced = torch.jit.trace(module, tuple(args), check_trace=False)
    finally:
        module.train(training)
    frozen = [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]
    if frozen:
        raise RuntimeError(f"the trace would be wrong for other inputs: {frozen[0].message}")
    return traced


@contextlib.contextmanager
def _quiet_torch_logs():
    # A failed export logs and prints the graph it got stuck in; the note we keep says enough.
    handlers = {h for name, lg in logging.root.manager.loggerDict.items()
                if name.startswith("torch") and isinstance(lg, logging.Logger) for h in lg.handlers}
    drop = _DropBelowError()
    for h in handlers:
        h.addFilter(drop)
    try:
        with contextlib.redirect_stderr(io.StringIO()):   # export also prints the graph
            yield
    finally:
        for h in handlers:
            h.removeFilter(drop)


class _DropBelowError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


def _script_artifact(script, name: str, inputs: list[TensorSpec], outputs: list[TensorSpec],
                     max_batch_size: int | None, notes: list[str]) -> Artifact:
    if isinstance(script, bytes):
        data = script
    else:
        buf = io.BytesIO()
        sys.modules["torch"].jit.save(script, buf)
        data = buf.getvalue()
    batching = all(s[2] and s[2][0] == -1 for s in inputs + outputs) and max_batch_size != 0
    mbs = _decide_batch(name, batching, max_batch_size,
                        "not every input and output has -1 as its first dimension")
    config = _base_config(name, "pytorch", "pytorch_libtorch", mbs)
    for kind, specs in (("input", inputs), ("output", outputs)):
        for tensor, datatype, shape in specs:
            getattr(config, kind).add(name=tensor, data_type=mc.DataType.Value(
                triton_to_config(datatype)), dims=_config_dims(shape, mbs > 0))
    _reshape_scalars(config, inputs, outputs, mbs > 0)
    return Artifact(config, {"1/model.pt": data}, "torchscript", list(inputs), mbs > 0, notes)


def _torchscript(script, name: str, example, inputs, outputs, max_batch_size) -> Artifact:
    torch = sys.modules["torch"]
    if example is None and inputs is None:
        raise ArtifactError(f"model '{name}': a TorchScript module does not record its tensor "
                            f"shapes: pass example=<a batch of inputs> or inputs=[(\"INPUT__0\", "
                            f"\"FP32\", [-1, 4])] (and outputs=[...])")
    if example is not None:
        _, values, keyword = _split_example(example, None, name)
        if keyword:
            raise ArtifactError(f"model '{name}': a TorchScript module takes positional inputs; "
                                f"pass the example as a tensor or a tuple of tensors")
        values = _torch_example(torch, values)
        in_specs = _specs_of([f"INPUT__{i}" for i in range(len(values))], values)
    else:
        in_specs = [(f"INPUT__{i}", d, s) for i, (_, d, s) in enumerate(inputs)]
        values = [torch.as_tensor(z) for z in _probe_values(in_specs)]
    if outputs is None:
        try:
            result = _run_module(torch, script, values, {})
        except Exception as err:
            raise ArtifactError(f"model '{name}': running the TorchScript module on the "
                                f"{'example' if example is not None else 'declared inputs'} failed "
                                f"({type(err).__name__}: {_first_line(err)}); pass outputs=[...]") from None
        out_specs = _specs_of([f"OUTPUT__{i}" for i in range(len(_flat(result)))], _flat(result))
    else:
        out_specs = [(f"OUTPUT__{i}", d, s) for i, (_, d, s) in enumerate(outputs)]
    if example is not None:
        batchable, why = _batchable(in_specs, out_specs)
        mbs = _decide_batch(name, batchable, max_batch_size, why)
        if mbs > 0:
            in_specs = [(n, d, [-1, *s[1:]]) for n, d, s in in_specs]
            out_specs = [(n, d, [-1, *s[1:]]) for n, d, s in out_specs]
        max_batch_size = mbs
    elif outputs is None and in_specs and all(s[2] and s[2][0] == -1 for s in in_specs):
        out_specs = [(n, d, [-1, *s[1:]]) if s and s[0] == _PROBE_ROWS else (n, d, s) for n, d, s in out_specs]
    return _script_artifact(script, name, in_specs, out_specs, max_batch_size, [])
