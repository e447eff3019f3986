"""torch models in the forms NVIDIA Triton's backends load, made at export.

Two stored forms are ours only: a ``torch.export`` program (``model.pt2``, platform
``torch_export``) and a ``torch.nn.Module`` pickled as a notebook callable (``model.pkl``:
Triton's python backend would need torch and cloudpickle in its environment). Each is
converted to TorchScript (``model.pt``, ``pytorch_libtorch``: traced from the program) or to
ONNX (``model.onnx``, ``onnxruntime_onnx``: exported from that trace), keeping the config's
tensor names and a dynamic batch. Before anything is written the converted model is loaded
back as Triton's backend loads it (``torch.jit.load``; an onnxruntime session fed by the
config's tensor names) and compared with the original on probe batches of two sizes, so a
trace that froze a shape or a branch is refused with the reason instead of exported.
"""
from __future__ import annotations

import contextlib
import io
import keyword
import logging
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..protocol.datatypes import DATATYPES
from ..protocol.errors import InvalidArgument

FORMATS = ("torchscript", "onnx")
#: rows of the probe batches (two sizes: a trace that baked the batch size fails one)
PROBE_ROWS = (1, 3)
#: sizes given to the other variable dimensions in the two probes
PROBE_WIDTHS = (2, 5)
RTOL, ATOL = 1e-4, 1e-5

_NUMPY = {d.code: d.numpy for d in DATATYPES.values()}

log = logging.getLogger(__name__)
_INDEXED = re.compile(r".*__(\d+)")


class ConversionRefused(InvalidArgument):
    """The model cannot be converted faithfully; the message says why."""


@dataclass
class Converted:
    config: mc.ModelConfig         # the model's config for Triton's backend
    filename: str                  # model.pt | model.onnx
    data: bytes
    note: str


def convertible_source(config: mc.ModelConfig, version_dir: Path) -> str | None:
    """'pt2' or 'callable' when the version holds one of our torch forms, else None."""
    if (version_dir / "model.pt2").is_file() and (config.platform == "torch_export" or (
            not config.platform and not (version_dir / "model.pt").exists())):
        return "pt2"
    if config.backend == "python" and (version_dir / "model.pkl").is_file():
        return "callable"
    return None


def convert(config: mc.ModelConfig, version_dir: Path, target: str = "torchscript") -> Converted | None:
    """The converted model, None when ``version_dir`` holds nothing to convert (a python
    callable that is not a torch module), ConversionRefused when it cannot be converted."""
    if target not in FORMATS:
        raise InvalidArgument(f"unknown torch export format '{target}': one of {', '.join(FORMATS)}")
    source = convertible_source(config, version_dir)
    if source is None:
        return None
    try:
        import torch
    except ImportError:
        if source == "callable":
            return None      # no torch here: the pickle holds no torch module we could load
        raise ConversionRefused(f"model '{config.name}': converting model.pt2 needs torch "
                                f"installed where the export runs") from None
    if source == "pt2":
        config, module, named_run, inputs = _from_program(torch, config, version_dir)
        what = "torch.export program (model.pt2)"
    else:
        found = _from_callable(torch, config, version_dir)
        if found is None:
            return None
        config, module, named_run, inputs = found
        what = "torch.nn.Module callable (model.pkl)"
    outputs = _output_order(config)

    def run(*args):
        values = named_run(*args)
        return tuple(values[name] for name in outputs)
    batching = config.max_batch_size > 0
    probes = [_probe(config, rows, width) for rows, width in zip(PROBE_ROWS, PROBE_WIDTHS)]
    try:
        expected = [_run_reference(torch, run, p) for p in probes]
    except Exception as err:
        raise ConversionRefused(
            f"model '{config.name}': the original model fails on the probe inputs "
            f"({type(err).__name__}: {_last_line(err)}), so a conversion cannot be checked") from None
    wrapper = _positional(torch, module, run, inputs)
    example = [torch.from_numpy(a) for a in _probe(config, 2, 3)]
    with _quiet():
        traced = _trace(torch, wrapper, example, config.name)
    if target == "torchscript":
        buf = io.BytesIO()
        torch.jit.save(traced, buf)
        data, filename = buf.getvalue(), "model.pt"
        out = _triton_config(config, "pytorch", "pytorch_libtorch")
        run_converted = lambda probe: _run_torchscript(torch, data, probe)  # noqa: E731
    else:
        data, filename = _to_onnx(torch, traced, example, config, outputs, batching)
        out = _triton_config(config, "onnxruntime", "onnxruntime_onnx")
        run_converted = lambda probe: _run_onnx(data, config, outputs, probe)  # noqa: E731
    for probe, want in zip(probes, expected):
        try:
            have = run_converted(probe)
        except Exception as err:
            raise ConversionRefused(
                f"model '{config.name}': the converted model fails{_where(config, probe)} where the "
                f"original answers ({_last_line(err)}): the trace froze a shape") from None
        _check_parity(config, outputs, probe, want, have)
    shapes = " and ".join(f"batch {p[0].shape[0] if p and batching else '-'}" for p in probes)
    return Converted(out, filename, data,
                     f"{what} converted to {'TorchScript (model.pt, pytorch_libtorch)' if target == 'torchscript' else 'ONNX (model.onnx, onnxruntime)'}; "
                     f"outputs checked against the original on probe inputs ({shapes})")


# ---- sources --------------------------------------------------------------------------------

def _from_program(torch, config: mc.ModelConfig, version_dir: Path):
    from ..backends.base import ModelFiles
    from ..backends.exported_program import load_program
    from ..backends.pytorch import PyTorchBackend, _children, export_signature
    files = ModelFiles(config.name or version_dir.parent.name, int(version_dir.name),
                       version_dir.parent, version_dir, "model.pt2")
    complete = PyTorchBackend.auto_complete_config(config, files)
    program = load_program(version_dir / "model.pt2", files.model_name, files.version)
    signature = export_signature(program, config.name, complete)
    inputs = [t.name for t in signature.inputs]
    outputs = [t.name for t in signature.outputs]
    # the config lists tensors in call order, as TorchScript's positional forward takes them
    _order(complete.input, inputs)
    module = program.module()
    # a program exported from keyword arguments is called with them
    in_spec = program.call_spec.in_spec
    by_name = bool(in_spec is not None and len(_children(in_spec)) > 1
                   and list(_children(in_spec)[1].context or ()))

    def run(*args):
        result = module(**dict(zip(inputs, args))) if by_name else module(*args)
        if isinstance(result, dict):
            return {k: result[k] for k in outputs}
        return dict(zip(outputs, result if isinstance(result, (tuple, list)) else (result,)))
    _same_names(complete, outputs)
    return complete, module, run, inputs


def _from_callable(torch, config: mc.ModelConfig, version_dir: Path):
    import cloudpickle
    try:
        with open(version_dir / "model.pkl", "rb") as f:
            spec = cloudpickle.load(f)
    except Exception as err:   # a package the callable needs is not installed here
        log.info("model '%s': model.pkl not read (%s: %s); exported as a python model",
                 config.name, type(err).__name__, err)
        return None
    fn = spec.get("callable") if isinstance(spec, dict) else None
    if not isinstance(fn, torch.nn.Module):
        return None
    why = ("it streams responses (decoupled)" if config.model_transaction_policy.decoupled else
           "it keeps a state per sequence" if spec.get("state") else
           "it takes text" if spec.get("text") else
           "it is called once per row" if not spec.get("batched", True) else
           "it reads request parameters" if spec.get("parameters") else None)
    if why:
        raise ConversionRefused(f"model '{config.name}': the torch.nn.Module cannot become a "
                                f"TorchScript or ONNX model: {why}")
    inputs, outputs = list(spec["inputs"]), list(spec["outputs"])
    fn = fn.eval()
    by_name = bool(spec.get("keyword"))

    def run(*args):
        result = fn(**dict(zip(inputs, args))) if by_name else fn(*args)
        if isinstance(result, dict):
            return {k: result[k] for k in outputs}
        return dict(zip(outputs, result if isinstance(result, (tuple, list)) else (result,)))
    out = mc.ModelConfig()
    out.CopyFrom(config)
    _order(out.input, inputs)
    _same_names(out, outputs)
    return out, fn, run, inputs


def _order(tensors, names: list[str]) -> None:
    by_name = {t.name: t for t in tensors}
    if set(by_name) != set(names):
        raise ConversionRefused(f"the config's tensors {sorted(by_name)} are not the model's "
                                f"{names}")
    ordered = []
    for name in names:
        slot = type(by_name[name])()
        slot.CopyFrom(by_name[name])
        ordered.append(slot)
    del tensors[:]
    tensors.extend(ordered)


def _same_names(config: mc.ModelConfig, outputs: list[str]) -> None:
    if sorted(o.name for o in config.output) != sorted(outputs):
        raise ConversionRefused(f"model '{config.name}': the config's outputs "
                                f"{sorted(o.name for o in config.output)} are not the model's {outputs}")


def _output_order(config: mc.ModelConfig) -> list[str]:
    """The order Triton's pytorch backend reads a returned tuple in: by the index of names
    like OUTPUT__1 when every output has one, else the config's order."""
    names = [o.name for o in config.output]
    indexed = [_INDEXED.fullmatch(n) for n in names]
    if all(indexed) and sorted(int(m.group(1)) for m in indexed) == list(range(len(names))):
        return sorted(names, key=lambda n: int(_INDEXED.fullmatch(n).group(1)))
    return names


def _positional(torch, module, run, inputs: list[str]):
    """A module whose forward takes the inputs by the config's names (Triton's pytorch backend
    matches forward()'s argument names) and returns a tuple in the order it reads outputs."""
    names = inputs if all(n.isidentifier() and not keyword.iskeyword(n) and n != "self"
                          for n in inputs) else [f"INPUT__{i}" for i in range(len(inputs))]
    # Only identifiers checked above reach this source.
    source = f"def forward(self, {', '.join(names)}):\n    return self.run({', '.join(names)})\n"
    scope: dict[str, Any] = {}
    exec(source, scope)  # noqa: S102 - names are validated identifiers

    class Positional(torch.nn.Module):
        forward = scope["forward"]

        def __init__(self) -> None:
            super().__init__()
            self.model = module     # a submodule: the trace keeps its weights as parameters
            self.run = run
    return Positional()


# ---- conversion -----------------------------------------------------------------------------

def _trace(torch, wrapper, example: list, name: str):
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            traced = torch.jit.trace(wrapper, tuple(example), check_trace=False, strict=False)
        except Exception as err:
            raise ConversionRefused(f"model '{name}': TorchScript trace failed: "
                                    f"{type(err).__name__}: {_first_line(err)}") from None
    del caught   # the probes below decide: a warning about a guard is not a wrong answer
    return traced


def _to_onnx(torch, traced, example: list, config: mc.ModelConfig, names_out: list[str],
             batching: bool) -> tuple[bytes, str]:
    names_in = [t.name for t in config.input]
    dynamic: dict[str, dict[int, str]] = {}
    for t in list(config.input) + list(config.output):
        axes = {0: "batch"} if batching else {}
        for i, d in enumerate(t.dims):
            if d == -1:
                axes[i + (1 if batching else 0)] = f"{t.name}_{i}"
        if axes:
            dynamic[t.name] = axes
    buf = io.BytesIO()
    try:
        # the TorchScript exporter warns that it is deprecated for the dynamo one, which
        # needs onnxscript; the result is checked below either way
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(traced, tuple(example), buf, dynamo=False, input_names=names_in,
                              output_names=names_out, dynamic_axes=dynamic or None)
    except Exception as err:
        raise ConversionRefused(f"model '{config.name}': ONNX export failed: "
                                f"{type(err).__name__}: {_first_line(err)}") from None
    return buf.getvalue(), "model.onnx"


def _triton_config(config: mc.ModelConfig, backend: str, platform: str) -> mc.ModelConfig:
    out = mc.ModelConfig()
    out.CopyFrom(config)
    out.backend, out.platform = backend, platform
    out.ClearField("default_model_filename")
    return out


# ---- checking -------------------------------------------------------------------------------

def _probe(config: mc.ModelConfig, rows: int, width: int) -> list[np.ndarray]:
    rng = np.random.default_rng(rows * 1000 + width)
    arrays = []
    for t in config.input:
        shape = ([rows] if config.max_batch_size > 0 else []) + [width if d == -1 else int(d) for d in t.dims]
        dtype = _NUMPY.get(t.data_type)
        if dtype is None or dtype == np.object_:
            raise ConversionRefused(f"model '{config.name}': input '{t.name}' is "
                                    f"{mc.DataType.Name(t.data_type)}, which a torch model cannot take")
        if np.dtype(dtype).kind == "f":
            arrays.append(rng.standard_normal(shape).astype(dtype))
        elif np.dtype(dtype).kind == "b":
            arrays.append(rng.integers(0, 2, shape).astype(bool))
        else:
            arrays.append(rng.integers(0, 8, shape).astype(dtype))
    return arrays


def _run_reference(torch, run, probe: list[np.ndarray]) -> list[np.ndarray]:
    with torch.no_grad():
        return [_numpy(v) for v in run(*[torch.from_numpy(a.copy()) for a in probe])]


def _run_torchscript(torch, data: bytes, probe: list[np.ndarray]) -> list[np.ndarray]:
    module = torch.jit.load(io.BytesIO(data), map_location="cpu")
    module.eval()
    with torch.no_grad():
        result = module(*[torch.from_numpy(a.copy()) for a in probe])
    return [_numpy(v) for v in (result if isinstance(result, (tuple, list)) else (result,))]


def _run_onnx(data: bytes, config: mc.ModelConfig, outputs: list[str],
              probe: list[np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    feed = {t.name: a for t, a in zip(config.input, probe)}
    return list(session.run(outputs, feed))


def _numpy(value) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":     # numpy has none; BF16 travels as float32
            value = value.float()
        return value.numpy()
    return np.asarray(value)


def _check_parity(config: mc.ModelConfig, outputs: list[str], probe, want, have) -> None:
    at = _where(config, probe)
    if len(want) != len(have):
        raise ConversionRefused(f"model '{config.name}': the converted model gives {len(have)} "
                                f"output(s), the original {len(want)}{at}")
    types = {o.name: o.data_type for o in config.output}
    for name, w, h in zip(outputs, want, have):
        declared = _NUMPY.get(types[name])
        if declared is not None and declared != np.object_ and h.dtype != np.dtype(declared):
            raise ConversionRefused(
                f"model '{config.name}': output '{name}' is {h.dtype} converted where the config "
                f"says {mc.DataType.Name(types[name])} (Triton's backend refuses the mismatch; "
                f"this server casts it): return {np.dtype(declared)} from the model")
        if w.shape != h.shape:
            raise ConversionRefused(f"model '{config.name}': output '{name}' has shape "
                                    f"{list(h.shape)} converted, {list(w.shape)} originally{at} "
                                    f"(the trace froze a shape)")
        exact = w.dtype.kind not in "fc"
        same = np.array_equal(w, h) if exact else np.allclose(w, h, rtol=RTOL, atol=ATOL, equal_nan=True)
        if not same:
            diff = "" if exact else f" (max difference {float(np.max(np.abs(w - h))):.3g})"
            raise ConversionRefused(f"model '{config.name}': output '{name}' differs between the "
                                    f"converted and the original model{at}{diff} (the trace froze "
                                    f"a data-dependent decision)")


def _where(config: mc.ModelConfig, probe: list[np.ndarray]) -> str:
    rows = probe[0].shape[0] if probe and config.max_batch_size > 0 else None
    return f" on a probe batch of {rows} row(s)" if rows is not None else " on a probe input"


def _last_line(err: Exception) -> str:
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else type(err).__name__


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else ""


@contextlib.contextmanager
def _quiet():
    with contextlib.redirect_stderr(io.StringIO()):
        yield
