"""OpenAI-compatible routes (``v1/models``, ``v1/completions``, ``v1/chat/completions``)
over the models whose signature follows the generate extension's text convention: a BYTES
input ``text_input`` and a BYTES output ``text_output``. (``v1/embeddings`` is in
``frontends.openai_embeddings``; ``v1/models`` lists the models of both.)

A completion is one generate request (``frontends.generate``'s mapping): the prompt is
``text_input``; ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop`` (and the other
scalar sampling fields) travel as request parameters, for the model to read. ``stop`` is
applied here too: the text ends before the first stop sequence, and the model's request is
cancelled there; each response's text is searched once, with the unsent tail before it (the
longest stop sequence's length less one), so a stop split over responses is found and a long
answer costs no more than its length. At most ``MAX_STOPS`` stop sequences of at most
``MAX_STOP_CHARS`` characters each (OpenAI takes 4). ``stream: true`` needs a decoupled model
(each of its responses is one chunk); without it, a decoupled model's responses are joined
into one text.

The model is found as the v2 infer route finds it (``Engine.resident_version``): one the
operator opted in to loading on demand is loaded first if it is not (engine/lifecycle/on_demand.py).

``usage`` counts tokens as the streaming convention has them: each response of a decoupled
model is one token; a model that answers once has as many as its text has
whitespace-separated words, and so has the prompt (the server has no tokenizer of its own;
a large text is counted in slices, off the loop: ``frontends.large_text``).
``finish_reason`` is ``stop`` (the model ended, or a stop sequence), or ``length`` when the
answer reached ``max_tokens`` (or ``max_completion_tokens``): a decoupled model's stream is
cut, and its request cancelled, there. ``stream_options: {"include_usage": true}`` adds
OpenAI's last chunk with ``usage`` and no choices.

Chat messages become one prompt through a Jinja template (sandboxed): the model's own, from
its config parameter ``chat_template``, or ``DEFAULT_CHAT_TEMPLATE``, which writes one
``<role>: <content>`` line per message and ends with ``assistant:``. The template sees
``messages`` (each with ``role`` and ``content`` as text) and ``add_generation_prompt``
(true), as Hugging Face chat templates do.

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the
status of the TritonError; an error after a stream has begun is a ``data:`` event of that
shape (the ``openai`` client raises it).
"""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterator

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..engine import Engine
from ..protocol.errors import InvalidArgument, NotFound, TritonError
from ..protocol.types import InferRequest, InferResponse
from . import openai_embeddings
from .generate import close_stream, error_message, generate_request
from .large_text import off_loop, word_count

TEXT_INPUT, TEXT_OUTPUT = "text_input", "text_output"
CHAT_TEMPLATE_PARAMETER = "chat_template"
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message.role }}: {{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")
# Sampling fields passed to the model as request parameters when the client sets them.
_PARAMETERS = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
               "presence_penalty", "frequency_penalty", "n", "min_tokens", "repetition_penalty")
_CHAT_TEMPLATES: dict[str, Any] = {}        # template text -> compiled (bounded below)
MAX_STOPS = 16              # stop sequences in one request (OpenAI's own bound is 4)
# messages in one chat, and their content parts in all (OpenAI's bound on messages): each is
# a step of the chat template's loop, run here
MAX_MESSAGES = 2048
MAX_STOP_CHARS = 256        # characters in one stop sequence (the tail held back is one less)


def follows_text_convention(config: mc.ModelConfig) -> bool:
    """Whether a model can serve completions: BYTES ``text_input`` in, BYTES ``text_output``
    out."""
    return any(i.name == TEXT_INPUT and i.data_type == mc.TYPE_STRING for i in config.input) \
        and any(o.name == TEXT_OUTPUT and o.data_type == mc.TYPE_STRING for o in config.output)


def error_body(err: BaseException) -> dict:
    status = err.status if isinstance(err, TritonError) else 500
    kind = ("invalid_request_error" if status in (400, 404, 413, 415, 422)
            else "authentication_error" if status in (401, 403) else "server_error")
    return {"error": {"message": error_message(err), "type": kind, "param": None,
                      "code": None}}


def model_list(engine: Engine) -> dict:
    """``GET v1/models``: every ready model that follows the text convention or has an
    embedding signature."""
    names = {version.name for version in engine.models()
             if version.ready and _served(version.config)}
    return {"object": "list", "data": [_model_card(name) for name in sorted(names)]}


def _served(config: mc.ModelConfig) -> bool:
    return follows_text_convention(config) or openai_embeddings.signature(config) is not None


def model_card(engine: Engine, name: str) -> dict:
    config = engine.model_config(name, "")
    if not _served(config):
        raise NotFound(f"model '{name}' neither follows the text convention (a BYTES input "
                       f"'{TEXT_INPUT}' and a BYTES output '{TEXT_OUTPUT}') nor is an "
                       f"embedding model")
    return _model_card(name)


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "jupyter_triton"}


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):       # content parts: only text ones are understood
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise InvalidArgument(
                    f"messages[{index}].content: only text content parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidArgument(f"messages[{index}].content must be a string or a list of parts")


def render_chat(messages: Any, template: str | None = None) -> str:
    """The prompt of a chat: ``messages`` through the model's template or the default one."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("'messages' must be a non-empty array")
    if len(messages) > MAX_MESSAGES:
        raise InvalidArgument(f"'messages' has {len(messages)} items; at most {MAX_MESSAGES} "
                              f"are allowed")
    if sum(len(m["content"]) for m in messages
           if isinstance(m, dict) and isinstance(m.get("content"), list)) > MAX_MESSAGES:
        raise InvalidArgument(f"the messages have more than {MAX_MESSAGES} content parts in all")
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidArgument(f"messages[{i}] must be an object with a string 'role'")
        plain.append({"role": message["role"], "content": _message_text(message.get("content"), i)})
    text = template or DEFAULT_CHAT_TEMPLATE
    compiled = _CHAT_TEMPLATES.get(text)
    if compiled is None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        try:
            compiled = ImmutableSandboxedEnvironment(keep_trailing_newline=True).from_string(text)
        except TemplateError as err:
            raise InvalidArgument(f"the model's chat template does not compile: {err}") from None
        if len(_CHAT_TEMPLATES) >= 64:
            _CHAT_TEMPLATES.clear()
        _CHAT_TEMPLATES[text] = compiled
    try:
        return compiled.render(messages=plain, add_generation_prompt=True)
    except Exception as err:  # noqa: BLE001 - a template's failure is the request's
        raise InvalidArgument(f"the chat template failed on these messages: {err}") from None


def _stops(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or len(value) > MAX_STOPS or \
            not all(isinstance(s, str) for s in value):
        raise InvalidArgument(f"'stop' must be a string or an array of at most {MAX_STOPS} strings")
    if any(len(s) > MAX_STOP_CHARS for s in value):
        raise InvalidArgument(f"a stop sequence is at most {MAX_STOP_CHARS} characters long")
    return [s for s in value if s]


@dataclass
class Completion:
    """One OpenAI request, ready for the engine."""
    chat: bool
    model: str
    request: InferRequest
    batched: bool
    stream: bool
    stops: list[str] = field(default_factory=list)
    id: str = ""
    created: int = 0
    decoupled: bool = False
    max_tokens: int | None = None
    prompt: str = ""
    include_usage: bool = False
    prompt_tokens: int = 0          # counted (``count_prompt``) when usage is answered

    async def count_prompt(self) -> None:
        self.prompt_tokens = await off_loop(len(self.prompt), word_count, self.prompt)

    def usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def finish(self, stopped: bool, tokens: int) -> str:
        if not stopped and self.max_tokens is not None and tokens >= self.max_tokens:
            return "length"
        return "stop"


async def prepare(engine: Engine, body: dict, chat: bool) -> Completion:
    """Check an OpenAI request body and map it onto the model's generate request."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidArgument("'model' must be the name of a model")
    served = await engine.resident_version(model)
    config = served.config
    if not follows_text_convention(config):
        raise InvalidArgument(
            f"model '{model}' does not follow the text convention (a BYTES input "
            f"'{TEXT_INPUT}' and a BYTES output '{TEXT_OUTPUT}')")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise InvalidArgument("'stream' must be a boolean")
    stream = bool(stream)
    decoupled = served.decoupled
    if stream and not decoupled:
        raise InvalidArgument(
            f"'stream': true needs a decoupled model (model_transaction_policy "
            f"{{ decoupled: true }}); model '{model}' answers each request once")
    if body.get("n", 1) not in (1, None):
        raise InvalidArgument("only 'n': 1 is supported")
    if chat:
        param = config.parameters.get(CHAT_TEMPLATE_PARAMETER)
        prompt = render_chat(body.get("messages"), param.string_value if param else None)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise InvalidArgument("'prompt' must be a string (or an array of one string)")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or
                                not isinstance(options.get("include_usage", False), bool)):
        raise InvalidArgument("'stream_options' must be an object with a boolean 'include_usage'")
    if options and not stream:
        raise InvalidArgument("'stream_options' is only allowed with 'stream': true")
    stops = _stops(body.get("stop"))
    parameters: dict[str, Any] = {}
    for key in _PARAMETERS:
        value = body.get(key)
        if value is not None:
            if not isinstance(value, (int, float, bool)):
                raise InvalidArgument(f"'{key}' must be a number")
            parameters[key] = value
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InvalidArgument("'max_tokens' must be a positive integer")
    if stops:   # request parameters are scalars: one stop as itself, several as JSON text
        parameters["stop"] = stops[0] if len(stops) == 1 else json.dumps(stops)
    request = generate_request(config, model, "", {TEXT_INPUT: prompt, "parameters": parameters})
    prefix = "chatcmpl-" if chat else "cmpl-"
    return Completion(chat, model, request, config.max_batch_size > 0, stream, stops,
                      prefix + secrets.token_hex(12), int(time.time()), decoupled, limit, prompt,
                      bool(options and options.get("include_usage")))


def _text(response: InferResponse) -> str:
    for tensor in response.outputs:
        if tensor.name == TEXT_OUTPUT and tensor.data is not None:
            return "".join(v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v)
                           for v in np.asarray(tensor.data, dtype=object).reshape(-1))
    return ""


class _StopScan:
    """Text as it streams, cut before the first stop sequence. Each piece is searched with
    the tail before it that could begin a stop sequence (the longest one's length less one,
    held back, unsent): a stop split over two responses is found, and nothing else is
    searched twice. An earlier window had no stop sequence, so the first in this one is
    the first in the text."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.tail = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """The text that can be sent now that ``piece`` came."""
        window = self.tail + piece if self.tail else piece
        if self.stops:
            cut = min((i for i in map(window.find, self.stops) if i >= 0), default=-1)
            if cut >= 0:
                self.stopped, self.tail = True, ""
                return window[:cut]
        upto = max(len(window) - self.hold, 0)
        self.tail = window[upto:]
        return window[:upto]

    async def feed_large(self, piece: str) -> str:
        """``feed``, off the loop for a large piece."""
        return await off_loop(len(piece) * len(self.stops), self.feed, piece)

    def rest(self) -> str:
        out, self.tail = self.tail, ""
        return out


def _model_error(response: InferResponse) -> TritonError:
    err = response.error
    return err if isinstance(err, TritonError) else InvalidArgument(error_message(err))


async def complete(job: Completion, responses: AsyncGenerator[InferResponse, None]) -> dict:
    """A non-streamed completion: every response's text joined (up to a stop sequence)."""
    scan = _StopScan(job.stops)
    pieces: list[str] = []
    tokens = 0
    try:
        async for response in responses:
            if response.error is not None:
                raise _model_error(response)
            piece = _text(response)
            tokens += 1 if piece else 0
            pieces.append(await scan.feed_large(piece))
            if scan.stopped or (job.max_tokens is not None and tokens >= job.max_tokens):
                break
    finally:
        await close_stream(responses)
    pieces.append(scan.rest())
    text = "".join(pieces)
    if not job.decoupled:
        tokens = await off_loop(len(text), word_count, text)
    await job.count_prompt()
    finish = job.finish(scan.stopped, tokens)
    if job.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": finish}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    return {"id": job.id, "object": kind, "created": job.created, "model": job.model,
            "choices": [choice], "usage": job.usage(tokens)}


def _event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def _chunk(job: Completion, text: str | None, finish: str | None, role: bool = False) -> bytes:
    if job.chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    return _event({"id": job.id, "object": kind, "created": job.created, "model": job.model,
                   "choices": [choice]})


def _usage_chunk(job: Completion, tokens: int) -> bytes:
    kind = "chat.completion.chunk" if job.chat else "text_completion"
    return _event({"id": job.id, "object": kind, "created": job.created, "model": job.model,
                   "choices": [], "usage": job.usage(tokens)})


async def events(job: Completion, first: InferResponse | None,
                 responses: AsyncGenerator[InferResponse, None]) -> AsyncIterator[bytes]:
    """A streamed completion: one chunk per response (a chat's first names the role), a
    last chunk with ``finish_reason``, then ``data: [DONE]``. Leaving early (the client went
    away, a stop sequence) cancels the model's request."""
    scan = _StopScan(job.stops)
    tokens = 0
    try:
        if job.chat:
            yield _chunk(job, "", None, role=True)
        response = first
        while response is not None:
            if response.error is not None:
                yield _event(error_body(_model_error(response)))
                return
            text = _text(response)
            tokens += 1 if text else 0
            piece = await scan.feed_large(text)
            if piece:
                yield _chunk(job, piece, None)
            if scan.stopped or response.final or \
                    (job.max_tokens is not None and tokens >= job.max_tokens):
                break
            try:
                response = await responses.__anext__()
            except StopAsyncIteration:
                break
            except Exception as err:  # noqa: BLE001 - the status line is sent: an event
                yield _event(error_body(err))
                return
        if not scan.stopped:
            piece = scan.rest()
            if piece:
                yield _chunk(job, piece, None)
        yield _chunk(job, None if job.chat else "", job.finish(scan.stopped, tokens))
        if job.include_usage:
            await job.count_prompt()
            yield _usage_chunk(job, tokens)
        yield b"data: [DONE]\n\n"
    finally:
        await close_stream(responses)
