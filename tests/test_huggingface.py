"""Hugging Face models from a cell (kernel/huggingface.py): a ``transformers`` model with its
tokenizer and a ``sentence-transformers`` object are served as a tokenize -> encode ensemble,
answer as the objects themselves do (v2 and ``v1/embeddings``), batch texts of different
lengths from concurrent clients, and export for tritonserver: the tokenizer step answers in
tritonserver 2.51's python backend, the encoder in onnxruntime, as ours do.

The models and tokenizers are built here with random weights and a vocabulary of a few words:
nothing is downloaded."""
from __future__ import annotations

import json
import os
import shutil
import sys
import urllib.request
import warnings
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
sentence_transformers = pytest.importorskip("sentence_transformers")

import jupyter_triton as jt  # noqa: E402
from batch_clients import together  # noqa: E402
from jupyter_triton.kernel.artifacts import ArtifactError  # noqa: E402
from jupyter_triton.repository.export import export_repository  # noqa: E402
from test_tune import kernel_server  # noqa: E402,F401 - the fixture: a server in this process

pytestmark = pytest.mark.timeout(300)

WORDS = "the a cat dog sat on mat ran fast slow red blue big small house tree under over".split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
MAX_POSITIONS = 64
# 16 texts of 1 to 16 words (3 to 18 tokens with [CLS] and [SEP]): 16 lengths
TEXTS = [" ".join(WORDS[(i + k) % len(WORDS)] for k in range(i + 1)) for i in range(16)]


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]", model_max_length=MAX_POSITIONS)


def tiny_bert(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=len(SPECIAL) + len(WORDS), hidden_size=32,
                                     num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=MAX_POSITIONS)
    return transformers.BertModel(config).eval()


def tiny_sentence_transformer(path: Path):
    """Transformer -> mean Pooling -> Normalize, as sentence-transformers builds one from a
    saved model folder."""
    tiny_bert(1).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    with warnings.catch_warnings():      # sentence-transformers 6 moved the modules
        warnings.simplefilter("ignore")
        from sentence_transformers import models
        body = models.Transformer(str(path), max_seq_length=48)
        pooling = models.Pooling(32, pooling_mode="mean")
        return sentence_transformers.SentenceTransformer(
            modules=[body, pooling, models.Normalize()], device="cpu")


def alone(model, tokenizer, texts: list[str]) -> np.ndarray:
    """Each text's mean-pooled last hidden state, the text run alone (no padding)."""
    rows = []
    for text in texts:
        enc = tokenizer([text], return_tensors="pt")
        with torch.no_grad():
            hidden = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])[0]
        rows.append(hidden[0].mean(0).numpy())
    return np.stack(rows)


def _http(conn) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(conn.url.split("://")[1].rstrip("/"))


def embed_v2(conn, model: str, texts: list[str]) -> dict[str, np.ndarray]:
    result = _http(conn).infer(model, [_text_input(texts)], headers=conn.headers)
    return {k: result.as_numpy(k) for k in ("embedding", "num_input_tokens")}


def embeddings_route(conn, model: str, texts: list[str]) -> dict:
    body = json.dumps({"model": model, "input": texts}).encode()
    request = urllib.request.Request(conn.url + "v1/embeddings", data=body, method="POST",
                                     headers={**conn.headers, "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())


def stats(conn, model: str) -> dict:
    return _http(conn).get_inference_statistics(model, headers=conn.headers)["model_stats"][0]


def test_a_transformers_model_answers_as_itself_and_batches_texts_of_different_lengths(kernel_server):
    model, tokenizer = tiny_bert(), tiny_tokenizer()
    handle = jt.serve((model, tokenizer), "emb", max_queue_delay_us=300_000)
    assert handle.name == "emb"
    names = {row["name"] for row in jt.models() if row["state"] == "READY"}
    assert {"emb", "emb_tokenizer", "emb_encoder"} <= names
    encoder = json.loads(json.dumps(_http(kernel_server).get_model_config(
        "emb_encoder", headers=kernel_server.headers)))
    params = {k: v["string_value"] for k, v in encoder["parameters"].items()}
    assert params["ragged_batching"] == "pad" and params["max_length"] == str(MAX_POSITIONS)
    assert params["pad_value.input_ids"] == str(tokenizer.pad_token_id)
    want = alone(model, tokenizer, TEXTS)

    # 16 clients, 16 lengths, at once: padded into shared batches, each answered as alone
    answers = together(lambda i: embed_v2(kernel_server, "emb", [TEXTS[i]]), len(TEXTS))
    for i, got in enumerate(answers):
        np.testing.assert_allclose(got["embedding"][0], want[i], atol=1e-4, rtol=1e-4)
        assert int(got["num_input_tokens"][0, 0]) == i + 3          # the words, [CLS], [SEP]
    encoder_stats = stats(kernel_server, "emb_encoder")
    assert encoder_stats["inference_count"] == len(TEXTS)
    assert encoder_stats["execution_count"] < len(TEXTS)

    # several texts in one request: padded by the tokenizer, the mask keeps them apart
    many = embed_v2(kernel_server, "emb", TEXTS[::5])
    np.testing.assert_allclose(many["embedding"], want[::5], atol=1e-4, rtol=1e-4)

    # OpenAI's route, with the tokens the tokenizer counted
    body = embeddings_route(kernel_server, "emb", TEXTS[:3])
    got = np.array([row["embedding"] for row in body["data"]], dtype=np.float32)
    np.testing.assert_allclose(got, want[:3], atol=1e-4, rtol=1e-4)
    assert body["usage"]["prompt_tokens"] == 3 + 4 + 5


def test_a_sentence_transformer_from_a_serve_cell_answers_as_its_encode(kernel_server, tmp_path):
    from IPython.testing.globalipapp import get_ipython
    st = tiny_sentence_transformer(tmp_path / "st")
    ip = get_ipython()
    ip.run_line_magic("load_ext", "jupyter_triton")
    ip.user_ns["st"] = st
    handle = ip.run_cell_magic("serve", "st_emb --max-queue-delay-us 1000", "st")
    assert handle.name == "st_emb" and any("Pooling + Normalize" in n for n in handle.notes)
    want = st.encode(TEXTS)
    np.testing.assert_allclose(np.linalg.norm(want, axis=1), 1.0, rtol=1e-5)
    got = embed_v2(kernel_server, "st_emb", TEXTS)["embedding"]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    body = embeddings_route(kernel_server, "st_emb", TEXTS[:2])
    np.testing.assert_allclose([row["embedding"] for row in body["data"]], want[:2], atol=1e-4)
    # a text longer than max_seq_length is cut where encode cuts it
    long_text = " ".join(WORDS * 4)
    np.testing.assert_allclose(embed_v2(kernel_server, "st_emb", [long_text])["embedding"][0],
                               st.encode([long_text])[0], atol=1e-4, rtol=1e-4)

    # a Matryoshka cut: encode's truncate_dim is the served width
    st.truncate_dim = 8
    jt.serve(st, "st_cut")
    got = embed_v2(kernel_server, "st_cut", TEXTS[:3])["embedding"]
    assert got.shape == (3, 8)
    np.testing.assert_allclose(got, st.encode(TEXTS[:3]), atol=1e-4, rtol=1e-4)
    # a default prompt encode would prepend is refused, not dropped
    st.truncate_dim = None
    st.prompts = {"query": "query: "}
    st.default_prompt_name = "query"
    with pytest.raises(ArtifactError, match="prompt 'query'"):
        jt.serve(st, "st_prompt")


def test_bad_text_is_a_400_and_unused_arguments_are_refused(kernel_server):
    model, tokenizer = tiny_bert(), tiny_tokenizer()
    jt.serve((model, tokenizer), "emb_bad", max_batch_size=4)
    tensor = httpclient.InferInput("text", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[b"\xff\xfe not utf-8"]], dtype=np.object_))
    with pytest.raises(Exception) as err:
        _http(kernel_server).infer("emb_bad", [tensor], headers=kernel_server.headers)
    assert "400" in str(err.value.status()) and "UTF-8" in str(err.value)
    with pytest.raises(ArtifactError, match="example do"):
        jt.serve((model, tokenizer), "emb_bad", example=np.ones(3))
    with pytest.raises(ArtifactError, match="max_batch_size must be at least 1"):
        jt.serve((model, tokenizer), "emb_bad", max_batch_size=0)


# -- the export, in tritonserver 2.51 (tokenizer) and onnxruntime (encoder) ---------------------

def _pip_installed(requirement: str) -> list[Path]:
    """What ``pip install <requirement>`` puts in a Triton image, taken from this environment:
    the distribution and its requirements (no extras), less those tritonserver's venv has
    (its numpy 1.x stays), each as its top-level folders or files and its dist-info."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from tritonserver_peer import VENV
    site = sorted(VENV.glob("lib/python3*/site-packages"))[0]
    theirs = {canonicalize_name(p.name.split("-")[0]) for p in site.glob("*.dist-info")}
    found, todo, seen = set(), [requirement], set()
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen or name in theirs:
            continue
        seen.add(name)
        dist = metadata.distribution(name)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
        root = Path(dist.locate_file(""))
        for file in dist.files or []:
            top = file.parts[0]
            if top not in ("..", "__pycache__") and not top.endswith(".pth"):
                found.add(root / top)
    return sorted(found)


def test_the_export_answers_in_tritonserver_and_onnxruntime_as_ours_does(kernel_server, tmp_path):
    from tritonserver_peer import TritonServer, tritonserver_dist
    tritonserver_dist()                  # skips with the reason where tritonserver is absent
    import onnxruntime as ort
    model, tokenizer = tiny_bert(2), tiny_tokenizer()
    jt.serve((model, tokenizer), "exp")
    ours = embed_v2(kernel_server, "exp", TEXTS)
    tokens_ours = _http(kernel_server).infer("exp_tokenizer", [_text_input(TEXTS[:4])],
                                             headers=kernel_server.headers)

    out = tmp_path / "exported"
    export_repository(Path(kernel_server.repository), out, ["exp", "exp_tokenizer", "exp_encoder"],
                      progress=False)
    assert "ragged_batching" in (out / "exp_encoder" / "config.pbtxt").read_text()
    assert 'platform: "ensemble"' in (out / "exp" / "config.pbtxt").read_text()
    version = out / "exp_tokenizer" / "1"
    assert {"model.py", "tokenizer_config.json"} <= {p.name for p in version.iterdir()}

    # tritonserver 2.51 here has the python backend only: the tokenizer alone
    only = tmp_path / "tokenizer_repo"
    only.mkdir()
    shutil.copytree(out / "exp_tokenizer", only / "exp_tokenizer")
    server = TritonServer(only, tmp_path / "triton", load=["exp_tokenizer"],
                          packages=_pip_installed("transformers"))
    try:
        client = httpclient.InferenceServerClient(server.url)
        theirs = client.infer("exp_tokenizer", [_text_input(TEXTS[:4])])
        for name in ("input_ids", "attention_mask", "num_input_tokens"):
            np.testing.assert_array_equal(theirs.as_numpy(name), tokens_ours.as_numpy(name))
        # each text through tritonserver's tokenizer, then the exported ONNX encoder
        session = ort.InferenceSession(str(out / "exp_encoder" / "1" / "model.onnx"),
                                       providers=["CPUExecutionProvider"])
        for i, text in enumerate(TEXTS):
            tokens = client.infer("exp_tokenizer", [_text_input([text])])
            vector = session.run(["embedding"], {k: tokens.as_numpy(k)
                                                 for k in ("input_ids", "attention_mask")})[0]
            np.testing.assert_allclose(vector[0], ours["embedding"][i], atol=1e-4, rtol=1e-4)
    finally:
        server.close()


def _text_input(texts: list[str]) -> httpclient.InferInput:
    tensor = httpclient.InferInput("text", [len(texts), 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=np.object_))
    return tensor
