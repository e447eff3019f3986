"""Python callables as python-backend artifacts (``model.pkl`` + a generic ``model.py``):
batched ones, called on an example (or on ones in the declared shapes) to read their outputs;
and those served one request at a time: generators (decoupled: each yield one response), the
generate extension's text convention (one string in, text out), stateful sequence models.
"""
from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc

from ..repository.callable_format import pack_callable
from .artifact_specs import (Artifact, ArtifactError, TensorSpec, _batchable, _config_dims, _decide_batch,
                             _describe, _first_line, _output_values, _parameter_names, _probe_values,
                             _PROBE_ROWS, _reshape_scalars, _run_module, _specs_of, _split_example,
                             _torch_example)


def _callable(fn: Callable, name: str, example, inputs, outputs, max_batch_size,
              notes: list[str] | None = None, keyword_names: list[str] | None = None) -> Artifact:
    notes = list(notes or [])
    target = fn.forward if hasattr(fn, "forward") else fn
    names = keyword_names or _parameter_names(target)
    if example is None and inputs is None:
        raise ArtifactError(
            f"model '{name}': cannot tell the inputs of {_describe(fn)}: pass example=<a batch "
            f"of inputs> (--example VAR) or inputs=[(\"x\", \"FP32\", [-1, 4])]")
    if example is not None:
        in_names, values, keyword = _split_example(example, names, name)
        in_specs = _specs_of(in_names, values)
        call_values = values
    else:
        in_specs = list(inputs)
        call_values = _probe_values(in_specs)
        keyword = False
    if outputs is None:
        result = _call(fn, name, in_specs, call_values, keyword,
                       "example" if example is not None else "ones in the declared input shapes")
        out_names, out_values = _output_values(result)
        out_specs = _specs_of(out_names, out_values)
    else:
        out_specs = list(outputs)

    if example is not None:
        batchable, why = _batchable(in_specs, out_specs) if outputs is None else (
            all(s[2] and s[2][0] == -1 for s in out_specs), "an output's first dimension is not -1")
        mbs = _decide_batch(name, batchable, max_batch_size, why)
        if mbs > 0:
            in_specs = [(n, d, [-1, *s[1:]]) for n, d, s in in_specs]
            if outputs is None:
                out_specs = [(n, d, [-1, *s[1:]]) for n, d, s in out_specs]
    else:
        declared_batch = bool(in_specs) and all(s[2] and s[2][0] == -1 for s in in_specs)
        if outputs is None and declared_batch:
            rows_ok = all(s[2] and s[2][0] == _PROBE_ROWS for s in out_specs)
            out_specs = [(n, d, [-1, *s[1:]]) if rows_ok else (n, d, s) for n, d, s in out_specs]
            batchable, why = rows_ok, ("its outputs do not keep the batch rows of the input "
                                       "(2 rows in, not 2 rows out)")
        else:
            batchable = declared_batch and all(s[2] and s[2][0] == -1 for s in out_specs)
            why = "not every declared input and output has -1 as its first dimension"
        mbs = _decide_batch(name, batchable, max_batch_size, why)
    batching = mbs > 0
    config_json, files = pack_callable(
        fn, name=name, max_batch_size=mbs, batched=True,
        inputs=[(n, d, _config_dims(s, batching)) for n, d, s in in_specs],
        outputs=[(n, d, _config_dims(s, batching)) for n, d, s in out_specs])
    config = json_format.Parse(config_json, mc.ModelConfig())
    _reshape_scalars(config, in_specs, out_specs, batching)
    return Artifact(config, files, "python", in_specs, batching, notes)


def _call(fn: Callable, model: str, specs: list[TensorSpec], values: list[Any], keyword: bool,
          what: str) -> Any:
    torch = sys.modules.get("torch")
    is_module = torch is not None and isinstance(fn, torch.nn.Module)
    if is_module:
        values = _torch_example(torch, values)
    try:
        if is_module:
            names = [s[0] for s in specs]
            return _run_module(torch, fn, [] if keyword else values,
                               dict(zip(names, values)) if keyword else {})
        if keyword:
            return fn(**{s[0]: v for s, v in zip(specs, values)})
        return fn(*values)
    except Exception as err:
        raise ArtifactError(f"model '{model}': calling {_describe(fn)} on the {what} failed "
                            f"({type(err).__name__}: {_first_line(err)}); pass outputs=[(\"y\", "
                            f"\"FP32\", [-1, 4])] or a working example=") from None


# ---- generators, the text convention, state ------------------------------------------------

#: the generate extension's text convention: what generate/generate_stream and the OpenAI
#: routes serve (Triton's extension_generate doc)
TEXT_INPUT, TEXT_OUTPUT = "text_input", "text_output"
STATE_PARAMETER = "state"
_PROBE_TEXT = "hello world"


def _call_target(fn: Any) -> Any:
    if inspect.isfunction(fn) or inspect.ismethod(fn):
        return fn
    return getattr(fn, "forward", None) or getattr(type(fn), "__call__", fn)


def _is_generator(fn: Any) -> bool:
    target = _call_target(fn)
    return inspect.isgeneratorfunction(target) or inspect.isasyncgenfunction(target)


def _text_convention(fn: Any, example: Any) -> str | None:
    """The name of the prompt parameter when ``fn`` takes one string (annotated ``str`` or
    given a ``str`` example), else None."""
    if not callable(fn) or isinstance(fn, (str, bytes)):
        return None
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                  and p.name != STATE_PARAMETER]
    except (TypeError, ValueError):
        return None
    if not params:
        return None
    first = params[0]
    if first.annotation in (str, "str") or isinstance(example, str):
        return first.name
    return None


def _keyword_parameters(fn: Any, skip: set[str]) -> list[str]:
    """Parameters with defaults that a request parameter may set (``max_tokens``...)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is not inspect.Parameter.empty
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            and p.name not in skip]


def _first_value(result: Any, model: str) -> Any:
    """What a call gave: a generator's first yield, a coroutine's value, else the value.
    Async work runs on its own loop in a thread: the kernel's loop is already running."""
    if inspect.isgenerator(result):
        try:
            return next(result)
        except StopIteration:
            raise ArtifactError(f"model '{model}': the generator yielded nothing on the example; "
                                f"pass outputs=[(\"y\", \"FP32\", [-1])]") from None
        finally:
            result.close()
    if inspect.isasyncgen(result) or inspect.iscoroutine(result):
        import asyncio
        import concurrent.futures

        async def first() -> Any:
            if inspect.iscoroutine(result):
                return await result
            try:
                return await result.__anext__()
            except StopAsyncIteration:
                raise ArtifactError(f"model '{model}': the async generator yielded nothing on the "
                                    f"example; pass outputs=[...]") from None
            finally:
                await result.aclose()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, first()).result()
    return result


def _streaming_callable(fn: Callable, name: str, example, inputs, outputs, max_batch_size,
                        decoupled: bool, sequence: bool) -> Artifact:
    """A callable served one request at a time: decoupled (each yield one response), the
    text convention (a prompt string in, text out), or stateful (``state``, per sequence)."""
    notes: list[str] = []
    state = None
    if sequence:
        try:
            has_state = STATE_PARAMETER in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            has_state = False
        if not has_state:
            raise ArtifactError(f"model '{name}': a sequence model receives its state in a "
                                f"parameter named '{STATE_PARAMETER}' (a dict per correlation id, "
                                f"new at the sequence's start); {_describe(fn)} has none")
        state = STATE_PARAMETER
    prompt = _text_convention(fn, example)
    skip = {state} if state else set()
    if prompt is not None:
        if inputs is not None or outputs is not None:
            raise ArtifactError(f"model '{name}': a function of one string follows the generate "
                                f"text convention ({TEXT_INPUT} -> {TEXT_OUTPUT}); inputs= and "
                                f"outputs= do not apply")
        kwargs = {state: {}} if state else {}
        text = example if isinstance(example, str) else _PROBE_TEXT
        try:
            value = _first_value(fn(text, **kwargs), name)
        except ArtifactError:
            raise
        except Exception as err:
            raise ArtifactError(f"model '{name}': calling {_describe(fn)} on {text!r} failed "
                                f"({type(err).__name__}: {_first_line(err)})") from None
        if not isinstance(value, (str, bytes)):
            raise ArtifactError(f"model '{name}': {_describe(fn)} takes a string but gave a "
                                f"{type(value).__name__}; under the generate text convention it "
                                f"returns (or yields) strings")
        in_specs = [(TEXT_INPUT, "BYTES", [1])]
        out_specs = [(TEXT_OUTPUT, "BYTES", [1])]
        skip.add(prompt)
        notes.append(f"text convention: '{prompt}' is {TEXT_INPUT}, each "
                     f"{'yield' if decoupled else 'result'} is {TEXT_OUTPUT} (generate, OpenAI routes)")
        mbs = 0
        if max_batch_size:
            raise ArtifactError(f"model '{name}': a text model takes one prompt a request; "
                                f"max_batch_size must be 0")
        keyword = False
    else:
        names = [n for n in (_parameter_names(_call_target(fn)) or []) if n != state]
        if example is None and inputs is None:
            raise ArtifactError(
                f"model '{name}': cannot tell the inputs of {_describe(fn)}: pass example=<inputs> "
                f"(--example VAR), inputs=[(\"x\", \"FP32\", [4])], or annotate a single "
                f"string parameter (': str') for the text convention")
        if example is not None:
            in_names, values, keyword = _split_example(example, names or None, name)
            in_specs = _specs_of(in_names, values)
        else:
            in_specs, values, keyword = list(inputs), _probe_values(list(inputs), 1), False
        if outputs is None:
            call_kwargs = {state: {}} if state else {}
            try:
                if keyword:
                    result = fn(**{s[0]: v for s, v in zip(in_specs, values)}, **call_kwargs)
                else:
                    result = fn(*values, **call_kwargs)
                value = _first_value(result, name)
            except ArtifactError:
                raise
            except Exception as err:
                raise ArtifactError(f"model '{name}': calling {_describe(fn)} on the example failed "
                                    f"({type(err).__name__}: {_first_line(err)}); pass outputs=[...]") from None
            out_names, out_values = _output_values(value)
            out_specs = _specs_of(out_names, out_values)
        else:
            out_specs = list(outputs)
        mbs = int(max_batch_size or 0)
        skip.update(s[0] for s in in_specs)
    config_json, files = pack_callable(
        fn, name=name, max_batch_size=mbs, batched=True, decoupled=decoupled,
        text=prompt is not None, state=state, parameters=_keyword_parameters(fn, skip),
        inputs=[(n, d, _config_dims(s, mbs > 0)) for n, d, s in in_specs],
        outputs=[(n, d, _config_dims(s, mbs > 0)) for n, d, s in out_specs])
    if decoupled:
        notes.append("decoupled: each yield is one response (gRPC stream, generate_stream)")
    if state:
        notes.append("sequence: 'state' is one dict per correlation id (sequence_start/_end)")
    config = json_format.Parse(config_json, mc.ModelConfig())
    return Artifact(config, files, "python", in_specs, mbs > 0, notes)
