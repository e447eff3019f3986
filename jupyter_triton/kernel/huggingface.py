"""Hugging Face models from a cell: ``serve((model, tokenizer), "emb")`` for a ``transformers``
model with its tokenizer, ``serve(sentence_transformer, "emb")`` for a ``sentence-transformers``
object; ``%%serve emb`` of a cell ending in ``model, tokenizer`` (or the object) is the same.

Each becomes three models, the tokenize -> encode ensemble a Triton user would write:

* ``<name>_tokenizer``: a python-backend ``model.py`` running the object's own tokenizer (its
  files saved beside ``model.py`` with ``save_pretrained``, read back with ``AutoTokenizer``):
  ``text`` (BYTES, one string a row) in; ``input_ids``, ``attention_mask`` (INT64, each
  request padded only to its own longest text) and ``num_input_tokens`` out. It truncates at
  the encoder's limit, as the object's own ``encode`` does.
* ``<name>_encoder``: the model as ONNX (``torch.onnx.export``, dynamic batch and length),
  ``input_ids`` and ``attention_mask`` in, ``embedding`` (FP32) out: a sentence-transformers
  object's whole module chain (its pooling as its config says, Dense, Normalize); a
  ``transformers`` model's ``last_hidden_state`` mean-pooled over the attention mask. It
  batches texts of different lengths with ``ragged_batching: "pad"`` (config/padding.py),
  padded with the tokenizer's pad id, ``max_length`` the tokenizer's limit.
* ``<name>``: the ensemble, ``text`` in, ``embedding`` and ``num_input_tokens`` out: what
  ``v1/embeddings`` and v2 clients call.

The knobs of ``serve`` (max_batch_size, delay, instances, kind, gpus, warmup, config) apply
to the encoder, the model that batches; the tokenizer takes the same max_batch_size. The
ONNX encoder is checked against the object on a batch it was not traced with before anything
is uploaded. ``jupyter-triton export`` writes all three for tritonserver as they are (its
python backend needs ``transformers`` importable for the tokenizer step).

``transformers`` and ``sentence-transformers`` are an optional extra (``jupyter-triton[hf]``);
nothing here imports them before an object of theirs is served.
"""
from __future__ import annotations

import contextlib
import io
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from .artifacts import Artifact, ArtifactError
from .ensemble import StepSpec

TOKENIZER_SUFFIX, ENCODER_SUFFIX = "_tokenizer", "_encoder"
TEXT, IDS, MASK = "text", "input_ids", "attention_mask"
EMBEDDING, TOKEN_COUNT = "embedding", "num_input_tokens"
#: rows a batch may hold when serve() is given no max_batch_size: texts are small requests
DEFAULT_MAX_BATCH_SIZE = 32
#: abs/rel tolerance of the ONNX encoder against the object, on a batch it was not traced with
CHECK_TOLERANCE = 1e-4
ONNX_OPSET = 17

_TRACE_TEXTS = ["a short text", "a longer text, with more words in it, to pad the other one"]
_CHECK_TEXTS = ["one", "a text of a length the trace did not see, neither short nor long",
                "and a third"]

# Runs in the python backend, ours and tritonserver's alike: nothing from jupyter_triton.
TOKENIZER_MODEL_PY = '''"""Tokenizer step of a Hugging Face text embedder served by jupyter_triton: text in,
input_ids / attention_mask / num_input_tokens out. The tokenizer's files are beside this
file; tritonserver's python backend needs `transformers` importable."""
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer


class TritonPythonModel:
    def initialize(self, args):
        here = os.path.join(args["model_repository"], args["model_version"])
        self.tokenizer = AutoTokenizer.from_pretrained(here, local_files_only=True)
        params = json.loads(args["model_config"]).get("parameters", {})
        self.max_length = int(params["max_length"]["string_value"])
        self.lowercase = params.get("lowercase", {}).get("string_value") == "true"

    def execute(self, requests):
        responses = []
        for request in requests:
            rows = pb_utils.get_input_tensor_by_name(request, "text").as_numpy().reshape(-1)
            try:
                texts = [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in rows]
            except UnicodeDecodeError as err:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"input 'text' is not UTF-8: {err}", pb_utils.TritonError.INVALID_ARG)))
                continue
            if self.lowercase:
                texts = [t.lower() for t in texts]
            # each request padded to its own longest text: the encoder pads across requests
            enc = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length,
                                 return_tensors="np")
            ids = np.asarray(enc["input_ids"], dtype=np.int64)
            mask = np.asarray(enc["attention_mask"], dtype=np.int64)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("input_ids", ids), pb_utils.Tensor("attention_mask", mask),
                pb_utils.Tensor("num_input_tokens", mask.sum(axis=1, keepdims=True))]))
        return responses
'''


@dataclass
class TextEmbedder:
    """The three models of one served Hugging Face object (see the module docstring)."""

    tokenizer: Artifact
    encoder: Artifact
    steps: list[StepSpec]
    notes: list[str] = field(default_factory=list)


def _kind(obj: Any) -> str | None:
    """"sentence-transformers", "transformers" (a (model, tokenizer) pair) or None, read off
    the classes' names: nothing is imported to tell."""
    def is_a(value: Any, package: str, cls: str) -> bool:
        return any(k.__name__ == cls and k.__module__.split(".")[0] == package
                   for k in type(value).__mro__)

    if is_a(obj, "sentence_transformers", "SentenceTransformer"):
        return "sentence-transformers"
    if isinstance(obj, tuple) and len(obj) == 2 and is_a(obj[0], "transformers", "PreTrainedModel") \
            and is_a(obj[1], "transformers", "PreTrainedTokenizerBase"):
        return "transformers"
    return None


def is_text_embedder(obj: Any) -> bool:
    return _kind(obj) is not None


def text_embedder(obj: Any, name: str, max_batch_size: int | None) -> TextEmbedder:
    """The tokenizer, the encoder and the ensemble steps of ``obj`` (``is_text_embedder``)."""
    import torch
    kind = _kind(obj)
    mbs = DEFAULT_MAX_BATCH_SIZE if max_batch_size is None else int(max_batch_size)
    if mbs < 1:
        raise ArtifactError(f"model '{name}': a Hugging Face embedder batches texts: "
                            f"max_batch_size must be at least 1")
    if kind == "sentence-transformers":
        tokenizer, lowercase = _sentence_tokenizer(obj, name)
        max_length = _limit(obj.max_seq_length, tokenizer, None)
        module = _torch_encoder(torch, obj, True, getattr(obj, "truncate_dim", None))
        pooling = _pooling_note(obj)
    elif kind == "transformers":
        model, tokenizer = obj
        lowercase = False
        max_length = _limit(None, tokenizer, getattr(model.config, "max_position_embeddings", None))
        module = _torch_encoder(torch, model, False, None)
        pooling = "last_hidden_state mean-pooled over the attention mask"
    else:
        raise ArtifactError(f"model '{name}': not a Hugging Face text embedder; serve "
                            f"(transformers_model, tokenizer) or a SentenceTransformer")
    if tokenizer.pad_token_id is None:
        raise ArtifactError(f"model '{name}': the tokenizer has no pad token, so texts of "
                            f"different lengths cannot be batched; set tokenizer.pad_token")
    data, width = _onnx_encoder(torch, module, tokenizer, max_length, name)
    tok_name, enc_name = name + TOKENIZER_SUFFIX, name + ENCODER_SUFFIX
    steps: list[StepSpec] = [
        (tok_name, {TEXT: TEXT}, {IDS: IDS, MASK: MASK, TOKEN_COUNT: TOKEN_COUNT}),
        (enc_name, {IDS: IDS, MASK: MASK}, {EMBEDDING: EMBEDDING}),
    ]
    notes = [f"{kind}: {tok_name} (python backend, the object's tokenizer, up to {max_length} "
             f"tokens) -> {enc_name} (ONNX, {pooling}, {width} values, ragged_batching: pad)"]
    return TextEmbedder(_tokenizer_artifact(tok_name, tokenizer, mbs, max_length, lowercase),
                        _encoder_artifact(enc_name, data, width, mbs, tokenizer.pad_token_id,
                                          max_length), steps, notes)


def _limit(declared: int | None, tokenizer: Any, positions: int | None) -> int:
    """The longest token sequence the encoder takes: what the object says, else the
    tokenizer's model_max_length, capped by the model's position table."""
    candidates = [v for v in (declared, getattr(tokenizer, "model_max_length", None), positions)
                  if isinstance(v, int) and 0 < v < 1 << 20]
    if not candidates:
        raise ArtifactError("the tokenizer has no model_max_length and the model no "
                            "max_position_embeddings: set tokenizer.model_max_length")
    return candidates[0] if declared else min(candidates)


def _pooling_note(st: Any) -> str:
    names = [type(m).__name__ for m in list(st)[1:]]
    return " + ".join(names) if names else "the token embeddings"


def _sentence_tokenizer(st: Any, name: str) -> tuple[Any, bool]:
    """The Hugging Face tokenizer of a SentenceTransformer and whether it lowercases first;
    ArtifactError for what its encode does that the tokenizer step would not."""
    tokenizer = getattr(st, "tokenizer", None)
    if not hasattr(tokenizer, "save_pretrained") or not hasattr(st[0], "auto_model"):
        raise ArtifactError(f"model '{name}': the SentenceTransformer's first module is not a "
                            f"Hugging Face Transformer with its tokenizer "
                            f"({type(st[0]).__name__}); only those are served")
    if getattr(st, "default_prompt_name", None):
        raise ArtifactError(f"model '{name}': the SentenceTransformer prepends the prompt "
                            f"'{st.default_prompt_name}' to every text; set "
                            f"default_prompt_name = None (clients then send it themselves)")
    return tokenizer, bool(getattr(st[0], "do_lower_case", False))


def _torch_encoder(torch, inner: Any, sentence_transformer: bool, truncate_dim: int | None):
    """``inner`` as a torch module from token ids to one vector a text: a SentenceTransformer's
    whole module chain (cut to its ``truncate_dim`` as its encode cuts), or a transformers
    model's last hidden state mean-pooled over the attention mask."""

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask):
            if sentence_transformer:
                features = {IDS: input_ids, MASK: attention_mask}
                embedding = self.inner(features)["sentence_embedding"]
                return embedding[:, :truncate_dim] if truncate_dim else embedding
            out = self.inner(input_ids=input_ids, attention_mask=attention_mask)
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)

    return Encoder()


def _device(module: Any) -> Any:
    return next((p.device for p in module.parameters()), "cpu")


def _batch(torch, tokenizer: Any, texts: list[str], max_length: int, device: Any) -> tuple:
    enc = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="np")
    return tuple(torch.as_tensor(np.asarray(enc[k], dtype=np.int64), device=device)
                 for k in (IDS, MASK))


def _onnx_encoder(torch, module: Any, tokenizer: Any, max_length: int, name: str) -> tuple[bytes, int]:
    """The ONNX bytes of ``module`` and its embedding width, checked with onnxruntime against
    the module on a batch of another size and length than the trace's."""
    import onnxruntime as ort
    device = _device(module)
    module.eval()
    trace = _batch(torch, tokenizer, _TRACE_TEXTS, max_length, device)
    buf = io.BytesIO()
    dynamic = {IDS: {0: "batch", 1: "length"}, MASK: {0: "batch", 1: "length"},
               EMBEDDING: {0: "batch"}}
    try:
        with torch.no_grad(), _quiet():
            torch.onnx.export(module, trace, buf, input_names=[IDS, MASK], output_names=[EMBEDDING],
                              dynamic_axes=dynamic, opset_version=ONNX_OPSET, dynamo=False)
    except Exception as err:
        raise ArtifactError(f"model '{name}': torch.onnx.export of the encoder failed: "
                            f"{type(err).__name__}: {str(err).strip()[:300]}") from None
    data = buf.getvalue()
    check = _batch(torch, tokenizer, _CHECK_TEXTS, max_length, device)
    with torch.no_grad():
        want = module(*check).detach().float().cpu().numpy()
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    got = session.run([EMBEDDING], {IDS: check[0].cpu().numpy(), MASK: check[1].cpu().numpy()})[0]
    if want.ndim != 2 or got.shape != want.shape or \
            not np.allclose(got, want, atol=CHECK_TOLERANCE, rtol=CHECK_TOLERANCE):
        diff = float(np.abs(got - want).max()) if got.shape == want.shape else None
        raise ArtifactError(f"model '{name}': the ONNX encoder does not answer as the model does "
                            f"(shapes {list(got.shape)} and {list(want.shape)}, largest "
                            f"difference {diff}): the trace took a path that depends on the input")
    return data, int(want.shape[1])


@contextlib.contextmanager
def _quiet():
    # the TorchScript exporter warns at every data-dependent branch of transformers' masks; the
    # check against onnxruntime below is what tells whether one mattered
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def _parameters(config: mc.ModelConfig, values: dict[str, Any]) -> None:
    for key, value in values.items():
        config.parameters[key].string_value = str(value)


def _tokenizer_artifact(name: str, tokenizer: Any, mbs: int, max_length: int,
                        lowercase: bool) -> Artifact:
    config = mc.ModelConfig(name=name, backend="python", max_batch_size=mbs)
    config.input.add(name=TEXT, data_type=mc.TYPE_STRING, dims=[1])
    for tensor in (IDS, MASK):
        config.output.add(name=tensor, data_type=mc.TYPE_INT64, dims=[-1])
    config.output.add(name=TOKEN_COUNT, data_type=mc.TYPE_INT64, dims=[1])
    config.dynamic_batching.SetInParent()
    config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    _parameters(config, {"max_length": max_length, "lowercase": str(lowercase).lower()})
    files = {"1/model.py": TOKENIZER_MODEL_PY.encode()}
    with tempfile.TemporaryDirectory(prefix="jt-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        for path in sorted(Path(tmp).rglob("*")):
            if path.is_file():
                files[f"1/{path.relative_to(tmp).as_posix()}"] = path.read_bytes()
    return Artifact(config, files, "python", [(TEXT, "BYTES", [-1, 1])], True)


def _encoder_artifact(name: str, data: bytes, width: int, mbs: int, pad_id: int,
                      max_length: int) -> Artifact:
    config = mc.ModelConfig(name=name, backend="onnxruntime", platform="onnxruntime_onnx",
                            max_batch_size=mbs)
    for tensor in (IDS, MASK):
        config.input.add(name=tensor, data_type=mc.TYPE_INT64, dims=[-1])
    config.output.add(name=EMBEDDING, data_type=mc.TYPE_FP32, dims=[width])
    config.dynamic_batching.SetInParent()
    _parameters(config, {"ragged_batching": "pad", f"pad_value.{IDS}": pad_id,
                         "max_length": max_length})
    return Artifact(config, {"1/model.onnx": data}, "onnx",
                    [(IDS, "INT64", [-1, -1]), (MASK, "INT64", [-1, -1])], True)

