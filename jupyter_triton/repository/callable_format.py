"""The stored form of a notebook callable: a Triton python-backend model.

A function, a ``torch.nn.Module`` or any object with ``__call__`` becomes a version
directory of two files: ``model.pkl`` (the callable, cloudpickled) and a generic
``model.py`` that unpickles and calls it. That model.py uses only the pb_utils API,
numpy and cloudpickle, so the same directory loads in NVIDIA Triton's python backend
(with cloudpickle installed there). The kernel side builds these files and uploads them
with the repository API; nothing here imports the server.
"""
from __future__ import annotations

import inspect
import os
import site
import sys
import sysconfig
from types import ModuleType
from typing import Any, Callable

import cloudpickle
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from ..protocol.datatypes import parse_datatype
from ..protocol.errors import InvalidArgument

PAYLOAD_FORMAT = "jupyter_triton.callable/1"

TensorSpec = tuple[str, str, list[int]]     # (name, datatype as "FP32" or "TYPE_FP32", dims)

#: The generic model.py stored next to model.pkl. Kept free of jupyter_triton imports.
CALLABLE_MODEL_PY = '''\
\"\"\"Serves the Python callable pickled in model.pkl (written by jupyter_triton).

Only Triton's python-backend API, numpy and cloudpickle are used, so this version
directory also loads in NVIDIA Triton's python backend. pb_utils.TritonError is looked up
only when an error is made: Triton's stub adds it to the module after importing this file.

With model_transaction_policy { decoupled: true } each value a generator (or async
generator) yields is one response, then COMPLETE_FINAL; an exception is an error response.
With sequence_batching, the callable's state parameter gets one dict per correlation id,
new at START, dropped at END.
\"\"\"
import asyncio
import inspect
import json
import os
import sys

import cloudpickle
import numpy as np
import triton_python_backend_utils as pb_utils

_SEQUENCE_START, _SEQUENCE_END = 1, 2      # TRITONSERVER_REQUEST_FLAG_SEQUENCE_START / _END
_MAX_STATES = 4096                          # live sequences' states kept by one instance


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.max_batch_size = int(config.get("max_batch_size") or 0)
        self.decoupled = bool((config.get("model_transaction_policy") or {}).get("decoupled"))
        here = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(here, "model.pkl"), "rb") as f:
            spec = _load(f)
        self.fn = spec["callable"]
        self.input_names = list(spec["inputs"])
        self.keyword = bool(spec["keyword"])
        self.batched = bool(spec["batched"])
        self.text = bool(spec.get("text"))
        self.state_name = spec.get("state")
        self.parameter_names = set(spec.get("parameters") or ())
        self.states = {}
        self.outputs = []
        for name in spec["outputs"]:
            props = pb_utils.get_output_config_by_name(config, name)
            dtype = pb_utils.triton_string_to_numpy(props["data_type"]) if props else None
            self.outputs.append((name, dtype))
        # Torch is imported by unpickling a module, never by this file.
        torch = sys.modules.get("torch")
        self.torch = torch if torch is not None and isinstance(self.fn, torch.nn.Module) else None
        if self.torch is not None:
            gpu = args.get("model_instance_kind") == "GPU" and torch.cuda.is_available()
            device = "cuda:%s" % args.get("model_instance_device_id", "0") if gpu else "cpu"
            self.device = torch.device(device)
            self.fn = self.fn.to(self.device).eval()

    def execute(self, requests):
        if self.decoupled:
            for request in requests:
                self._stream(request)
            return None
        responses = [None] * len(requests)
        ready = []
        for i, request in enumerate(requests):
            tensors = [pb_utils.get_input_tensor_by_name(request, n) for n in self.input_names]
            missing = [n for n, t in zip(self.input_names, tensors) if t is None]
            if missing:
                responses[i] = self._error("missing input(s) " + ", ".join(missing), "INVALID_ARG")
            elif self.state_name or self.text:
                responses[i] = self._one(request)
            else:
                ready.append((i, [t.as_numpy() for t in tensors]))
        # With max_batch_size > 0 the callable sees the whole dynamic batch at once.
        groups = [[r] for r in ready]
        if self.max_batch_size > 0 and len(ready) > 1 and self.input_names:
            groups = [ready]
        for group in groups:
            self._run_group(group, responses)
        return responses

    # ---- one request at a time: text, state, streams ---------------------------------
    def _arguments(self, request):
        \"\"\"(positional, keyword) arguments of one request: its inputs (the prompt as a str
        under the text convention), request parameters the callable names, its state.\"\"\"
        arrays = []
        for name in self.input_names:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is None:
                raise _ClientError("missing input(s) " + name)
            arrays.append(tensor.as_numpy())
        if self.text:
            arrays = [_text(a) for a in arrays]
        kwargs = {}
        if self.parameter_names:
            try:
                parameters = json.loads(request.parameters() or "{}")
            except ValueError:
                parameters = {}
            kwargs = {k: v for k, v in parameters.items() if k in self.parameter_names}
        if self.state_name:
            kwargs[self.state_name] = self._state(request)
        if self.keyword:
            kwargs.update(zip(self.input_names, arrays))
            return [], kwargs
        return arrays, kwargs

    def _state(self, request):
        key = request.correlation_id()
        flags = request.flags()
        if flags & _SEQUENCE_START or key not in self.states:
            self.states.pop(key, None)
            if len(self.states) >= _MAX_STATES:
                # sequences that never sent END (their client left, the server timed them
                # out): the longest-started goes first
                del self.states[next(iter(self.states))]
            self.states[key] = {}
        state = self.states[key]
        if flags & _SEQUENCE_END:
            del self.states[key]
        return state

    def _one(self, request):
        try:
            args, kwargs = self._arguments(request)
            result = _resolve(self._invoke(args, kwargs))
            return pb_utils.InferenceResponse(output_tensors=self._tensors(result))
        except _ClientError as err:
            return self._error(str(err), "INVALID_ARG")
        except Exception as err:
            return self._error("%s: %s" % (type(err).__name__, err))

    def _stream(self, request):
        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        values = None
        try:
            args, kwargs = self._arguments(request)
            values = _responses(self._invoke(args, kwargs))
            for value in values:
                if _cancelled(sender):
                    break
                sender.send(pb_utils.InferenceResponse(output_tensors=self._tensors(value)))
        except _ClientError as err:
            sender.send(self._error(str(err), "INVALID_ARG"), flags=final)
            return
        except Exception as err:
            sender.send(self._error("%s: %s" % (type(err).__name__, err)), flags=final)
            return
        finally:
            if values is not None:
                values.close()      # a generator left by a cancelled request runs its finally
        sender.send(flags=final)

    def _tensors(self, result):
        if self.text and isinstance(result, (str, bytes)):
            result = np.array([result.encode("utf-8") if isinstance(result, str) else result],
                              dtype=np.object_)
        return [pb_utils.Tensor(name, value)
                for (name, _), value in zip(self.outputs, self._outputs(result))]

    # ---- batches ---------------------------------------------------------------------
    def _run_group(self, group, responses):
        rows = [arrays[0].shape[0] if arrays and arrays[0].ndim else 1 for _, arrays in group]
        if len(group) > 1:
            try:
                arrays = [np.concatenate([a[k] for _, a in group]) for k in range(len(self.input_names))]
            except ValueError:   # shapes differ beyond the batch dimension: run one by one
                for member in group:
                    self._run_group([member], responses)
                return
        else:
            arrays = group[0][1]
        try:
            outputs = self._run(arrays, sum(rows) if self.max_batch_size > 0 else None)
        except Exception as err:
            for i, _ in group:
                responses[i] = self._error("%s: %s" % (type(err).__name__, err))
            return
        start = 0
        for (i, _), n in zip(group, rows):
            values = [v[start:start + n] for v in outputs] if len(group) > 1 else outputs
            start += n
            responses[i] = pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor(name, value) for (name, _), value in zip(self.outputs, values)])

    def _run(self, arrays, rows):
        if rows is not None and not self.batched:
            per_row = [self._call([a[j] for a in arrays]) for j in range(rows)]
            if not per_row:
                raise ValueError("empty batch")
            outputs = [np.stack([r[k] for r in per_row]) for k in range(len(self.outputs))]
        else:
            outputs = self._call(arrays)
        if rows is not None:
            for (name, _), value in zip(self.outputs, outputs):
                got = value.shape[0] if value.ndim else 0
                if got != rows:
                    raise ValueError("the callable returned %d rows for output '%s' but the batch "
                                     "had %d" % (got, name, rows))
        return outputs

    def _call(self, arrays):
        if self.keyword:
            return self._outputs(_resolve(self._invoke([], dict(zip(self.input_names, arrays)))))
        return self._outputs(_resolve(self._invoke(arrays, {})))

    def _invoke(self, args, kwargs):
        if self.torch is None:
            return self.fn(*args, **kwargs)
        device = self.device

        def tensor(a):
            if isinstance(a, np.ndarray) and a.dtype != np.object_:
                return self.torch.from_numpy(np.ascontiguousarray(a)).to(device)
            return a
        with self.torch.inference_mode():
            return self.fn(*[tensor(a) for a in args], **{k: tensor(v) for k, v in kwargs.items()})

    def _outputs(self, result):
        names = [name for name, _ in self.outputs]
        if isinstance(result, dict):
            missing = [n for n in names if n not in result]
            if missing:
                raise ValueError("the callable returned no value for output(s) " + ", ".join(missing))
            values = [result[n] for n in names]
        elif isinstance(result, (tuple, list)) and (len(names) != 1 or isinstance(result, tuple)):
            if len(result) != len(names):
                raise ValueError("the callable returned %d values for %d output(s) (%s)"
                                 % (len(result), len(names), ", ".join(names)))
            values = list(result)
        else:
            if len(names) != 1:
                raise ValueError("the callable returned one value for %d outputs (%s)"
                                 % (len(names), ", ".join(names)))
            values = [result]
        return [self._array(v, dtype) for v, (_, dtype) in zip(values, self.outputs)]

    @staticmethod
    def _array(value, dtype):
        if hasattr(value, "detach"):
            value = value.detach().cpu().numpy()
        array = np.asarray(value)
        if dtype is np.object_:
            if array.dtype.kind == "U":
                array = np.char.encode(array, "utf-8")
            return array.astype(np.object_)
        return array if dtype is None else array.astype(dtype, copy=False)

    @staticmethod
    def _error(message, code="INTERNAL"):
        error = pb_utils.TritonError
        code = getattr(error, code, None)
        return pb_utils.InferenceResponse(
            output_tensors=[], error=error(message) if code is None else error(message, code))


def _load(f):
    # cloudpickle 3 pickles name helpers in cloudpickle.cloudpickle that cloudpickle 2 (still
    # the one in many Triton images) keeps in cloudpickle_fast: found there, they load.
    import cloudpickle.cloudpickle as current
    try:
        import cloudpickle.cloudpickle_fast as fast
    except ImportError:
        fast = None
    if fast is not None and fast is not current:
        for name in dir(fast):
            if name.startswith("_") and not name.startswith("__") and not hasattr(current, name):
                setattr(current, name, getattr(fast, name))
    return cloudpickle.load(f)


class _ClientError(ValueError):
    \"\"\"A request the model cannot take (answered as INVALID_ARG).\"\"\"


def _text(array):
    \"\"\"The one string of a BYTES tensor (the generate extension's text_input).\"\"\"
    flat = np.asarray(array, dtype=np.object_).reshape(-1)
    if flat.size != 1:
        raise _ClientError("expected one string, got %d elements" % flat.size)
    value = flat[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _resolve(result):
    \"\"\"The value of a call; an async function's coroutine is run to its value.
    (inspect's test, not asyncio's: Python 3.11's asyncio counts a generator as one.)\"\"\"
    if inspect.iscoroutine(result):
        return _run_on_own_loop(result)
    return result


def _run_on_own_loop(coroutine):
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        loop.close()


class _responses:
    \"\"\"Iterates what a decoupled callable gives: each item of a generator or async
    generator, else its one value; close() ends the generator early.\"\"\"

    def __init__(self, result):
        self.result = result
        self.loop = asyncio.new_event_loop() if hasattr(result, "__anext__") else None
        if self.loop is None and inspect.iscoroutine(result):
            self.result = [_run_on_own_loop(result)]
        elif self.loop is None and not hasattr(result, "__next__"):
            self.result = [result]

    def __iter__(self):
        if self.loop is None:
            for value in self.result:
                yield value
            return
        while True:
            try:
                value = self.loop.run_until_complete(self.result.__anext__())
            except StopAsyncIteration:
                return
            yield value

    def close(self):
        if self.loop is not None:
            try:
                self.loop.run_until_complete(self.result.aclose())
            finally:
                self.loop.close()
                self.loop = None
        elif hasattr(self.result, "close"):
            self.result.close()


def _cancelled(sender):
    check = getattr(sender, "is_cancelled", None)
    return bool(check()) if check is not None else False
'''


def model_config_json(name: str, inputs: list[TensorSpec] = (), outputs: list[TensorSpec] = (),
                      max_batch_size: int = 0, extra_config: str = "", *, decoupled: bool = False,
                      sequence: bool = False) -> str:
    """A python-backend config as the JSON that ``load_model(config=...)`` sends.

    ``extra_config`` is config.pbtxt text merged on top (``dynamic_batching { }``,
    ``instance_group [...]``, ``parameters {...}``).
    """
    config = mc.ModelConfig(name=name, backend="python", max_batch_size=max_batch_size)
    for kind, specs in (("input", inputs), ("output", outputs)):
        for tensor_name, datatype, dims in specs:
            getattr(config, kind).add(name=tensor_name, data_type=_data_type(datatype, name, tensor_name),
                                      dims=[int(d) for d in dims])
    if decoupled:
        config.model_transaction_policy.decoupled = True
    if sequence:
        config.sequence_batching.SetInParent()
    if extra_config:
        try:
            text_format.Merge(extra_config, config)
        except text_format.ParseError as err:
            raise ValueError(f"model '{name}': extra_config is not valid config.pbtxt text: {err}") from None
    return json_format.MessageToJson(config, preserving_proto_field_name=True, indent=None)


def _data_type(datatype: str, model: str, tensor: str) -> int:
    try:
        return parse_datatype(datatype).code
    except InvalidArgument:
        raise ValueError(f"model '{model}', tensor '{tensor}': unknown datatype '{datatype}'") from None


def pack_model_py(source: str, *, name: str, inputs: list[TensorSpec] = (),
                  outputs: list[TensorSpec] = (), max_batch_size: int = 0,
                  extra_config: str = "") -> tuple[str, dict[str, bytes]]:
    """A ``model.py`` (Triton's ``TritonPythonModel``) as a config and the files to upload."""
    return (model_config_json(name, inputs, outputs, max_batch_size, extra_config),
            {"1/model.py": source.encode("utf-8")})


def pack_callable(obj: Callable[..., Any], *, name: str, inputs: list[TensorSpec],
                  outputs: list[TensorSpec], max_batch_size: int = 0, batched: bool = True,
                  extra_config: str = "", decoupled: bool = False, text: bool = False,
                  state: str | None = None, parameters: list[str] = ()
                  ) -> tuple[str, dict[str, bytes]]:
    """A callable as a python-backend model: ``(config JSON, {"1/model.py", "1/model.pkl"})``.

    ``obj`` takes numpy arrays, positionally in ``inputs`` order or by input name when its
    parameters are named after every input, and returns an array, a tuple (in ``outputs``
    order) or a dict keyed by output name. With ``max_batch_size > 0`` it receives the whole
    dynamic batch (rows of every request, concatenated on dim 0) and must return as many
    rows; with ``batched=False`` it is called once per row instead (without the batch dim).

    ``decoupled``: a generator (or async generator) whose every yield is one response
    (``model_transaction_policy { decoupled: true }``). ``text``: the generate extension's
    convention, the callable takes the ``text_input`` string and returns (or yields) the
    ``text_output`` string. ``state``: the name of the parameter that receives one dict per
    sequence (``sequence_batching``; kept by correlation id, new at START, dropped at END).
    ``parameters``: the callable's keyword parameters filled from request parameters.
    """
    if not callable(obj):
        raise TypeError(f"model '{name}': {type(obj).__name__} object is not callable")
    input_names = [spec[0] for spec in inputs]
    payload = {
        "format": PAYLOAD_FORMAT,
        "callable": obj,
        "inputs": input_names,
        "outputs": [spec[0] for spec in outputs],
        "keyword": _takes_keywords(obj, input_names),
        "batched": bool(batched),
        "text": bool(text),
        "state": state,
        "parameters": list(parameters),
        "python": ".".join(map(str, sys.version_info[:3])),
    }
    config = model_config_json(name, inputs, outputs, max_batch_size, extra_config,
                               decoupled=decoupled, sequence=state is not None)
    return config, {"1/model.py": CALLABLE_MODEL_PY.encode("utf-8"), "1/model.pkl": _dumps(obj, payload)}


def _takes_keywords(obj: Any, input_names: list[str]) -> bool:
    """Keyword call when the callable's parameters are named after every input."""
    target = obj
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.nn.Module):
        target = obj.forward
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):   # builtins and ufuncs: positional
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return False
    named = {n for n, p in params.items()
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    return bool(input_names) and set(input_names) <= named


def _dumps(obj: Any, payload: dict) -> bytes:
    # Code from the notebook or from modules next to it is not importable where the model
    # runs: pickle it by value. Installed packages stay references.
    registered = []
    for module in _local_modules(obj):
        if module.__name__ not in cloudpickle.list_registry_pickle_by_value():
            cloudpickle.register_pickle_by_value(module)
            registered.append(module)
    try:
        return cloudpickle.dumps(payload)
    finally:
        for module in registered:
            cloudpickle.unregister_pickle_by_value(module)


def _local_modules(obj: Any) -> list[ModuleType]:
    names = {getattr(obj, "__module__", None), type(obj).__module__}
    found = []
    for name in names:
        if not name or name in ("__main__", "builtins"):
            continue
        top = sys.modules.get(name.split(".")[0])
        if top is not None and _is_local(top) and top not in found:
            found.append(top)
    return found


def _installed_roots() -> list[str]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.update(getattr(site, "getsitepackages", lambda: [])())
    roots.add(site.getusersitepackages())
    return [os.path.realpath(r) + os.sep for r in roots if r]


def _is_local(module: ModuleType) -> bool:
    path = getattr(module, "__file__", None)
    if not path:
        return False
    path = os.path.realpath(path)
    return not any(path.startswith(root) for root in _installed_roots())
