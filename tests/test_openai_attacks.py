"""The OpenAI routes attacked (issue 32), as ``test_h2_attacks`` attacks the transports: a
real ``jupyter-triton serve`` in a subprocess (its memory and CPU time measurable), a
legitimate client served meanwhile, memory bounded.

- ``v1/embeddings`` with a body of millions of words: the loop keeps answering (a health
  probe in flight with it), RSS stays a few times the body, and ``usage`` still counts
  every word.
- ``v1/completions`` with 16 stop sequences over a long streamed answer costs the server
  about what it costs without them (each response searched once, not the whole text again),
  and the stop semantics hold: a stop split over responses is caught, the text ends before
  it, the earliest wins; too many or too long stops are a 400.
- ``v1/*`` after an eviction loads the model again, as the v2 infer route does.
"""
from __future__ import annotations

import http.client
import json
import os
import threading
import time
from pathlib import Path

import openai
import pytest

from conftest import build_repository
from decoupled_models import write_echo, write_model, write_words
from hostile import LEGIT_DEADLINE_S, legit_infer, repeats_add_nothing, start_standalone
from jupyter_triton.engine import EngineOptions
from jupyter_triton.frontends.large_text import word_count
from jupyter_triton.frontends.openai import MAX_MESSAGES, MAX_STOP_CHARS, MAX_STOPS, _StopScan
from jupyter_triton.standalone import start_in_thread

# The length of a text, read whole: as an embedding ("vec": TEXT -> VECTOR [length, 1]) and
# as a completion ("length": text_input -> text_output "<length> characters"); neither
# counts tokens itself.
LENGTH_MODEL = '''\
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.vector = json.loads(args["model_config"])["name"] == "vec"

    def execute(self, requests):
        out = []
        for r in requests:
            text = pb_utils.get_input_tensor_by_name(
                r, "TEXT" if self.vector else "text_input").as_numpy().reshape(-1)[0]
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("VECTOR", np.array([len(text), 1.0], np.float32)) if self.vector
                else pb_utils.Tensor("text_output", np.array([f"{len(text)} characters".encode()],
                                                             np.object_))]))
        return out
'''

VEC_CONFIG = '''\
name: "vec"
backend: "python"
max_batch_size: 0
input [ { name: "TEXT", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "VECTOR", data_type: TYPE_FP32, dims: [ 2 ] } ]
'''

LENGTH_CONFIG = '''\
name: "length"
backend: "python"
max_batch_size: 0
input [ { name: "text_input", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "text_output", data_type: TYPE_STRING, dims: [ 1 ] } ]
'''

# opts a model in to loading on demand (engine/lifecycle/on_demand.py; off by default)
ON_DEMAND = 'parameters { key: "load_on_demand" value: { string_value: "true" } }\n'

BIG_WORDS = 10_000_000          # "ab " each: a 28.6 MiB body
# a probe waits at most twice as long behind v1/embeddings as behind v2 generate of the same
# body, plus this (the old word count: 2.5 s on an idle machine, 10 times v2 generate's)
PROBE_SLACK_S = 0.5
PROBE_INTERVAL_S = 0.01
PEAK_MIB = 400                  # over the RSS before one request (the old count: +800 MiB)
TIMEOUT_S = 120


def repository(root: Path) -> Path:
    build_repository(root)          # linear: the legitimate client's model
    write_words(write_echo(root))
    write_model(root, "vec", LENGTH_MODEL, VEC_CONFIG)
    write_model(root, "length", LENGTH_MODEL, LENGTH_CONFIG)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = start_standalone(repository(tmp_path_factory.mktemp("models")),
                              extra_args=("--model-control-mode", "explicit", "--load-model", "*"))
    yield served
    served.close()


def request(port: int, method: str, path: str, body: bytes | None = None,
            timeout: float = TIMEOUT_S) -> tuple[int, dict | None]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body,
                     headers={"Content-Type": "application/json"} if body is not None else {})
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, json.loads(raw) if raw else None
    finally:
        conn.close()


def post(port: int, path: str, obj: dict) -> tuple[int, dict]:
    status, body = request(port, "POST", path, json.dumps(obj).encode())
    assert body is not None
    return status, body


def cpu_seconds(pid: int) -> float:
    """The user and system time of process ``pid`` itself (not its model workers)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- v1/embeddings: a body of ten million words ------------------------------------------------

class PeakRss:
    """The largest RSS of the server while in use, sampled in a thread of its own (a
    sample taken between two probes would miss what a stalled loop allocated)."""

    def __init__(self, server) -> None:
        self.server = server
        self.peak = server.rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.server.rss())

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def big_request(server, path: str, model: str, field: str) -> tuple[dict, list[float], float]:
    """A 28.6 MiB body whose ``field`` is the text, POSTed to ``path``, and a health probe
    after another while it is in flight: the answer, the probes' latencies and the server's
    peak RSS."""
    body = f'{{"model": "{model}", "{field}": "'.encode() + b"ab " * BIG_WORDS + b'"}'
    result: dict = {}

    def big() -> None:
        result["answer"] = request(server.http_port, "POST", path, body)

    sender = threading.Thread(target=big)
    probes: list[float] = []
    probe = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    with PeakRss(server) as rss:
        sender.start()
        deadline = time.monotonic() + TIMEOUT_S
        while sender.is_alive() and time.monotonic() < deadline:
            started = time.monotonic()
            probe.request("GET", "/v2/health/live")
            response = probe.getresponse()
            response.read()
            probes.append(time.monotonic() - started)
            assert response.status == 200
            sender.join(PROBE_INTERVAL_S)       # paced: the probe is a client, not a load
        sender.join(TIMEOUT_S)
    probe.close()
    status, answer = result["answer"]
    assert status == 200, answer
    assert len(probes) >= 2, "the big request was answered before a probe could run"
    return answer, probes, rss.peak


def test_a_huge_embeddings_body_holds_neither_the_loop_nor_memory(server):
    status, small = post(server.http_port, "/v1/embeddings", {"model": "vec", "input": "ab ab ab"})
    assert status == 200 and small["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    # what the loop does for such a body on the v2 generate route (receive, parse, the
    # tensor, the model's answer): the measure of the machine's speed now
    answer, baseline, _ = big_request(server, "/v2/models/vec/generate", "vec", "TEXT")
    assert answer["VECTOR"] == [float(3 * BIG_WORDS), 1.0]
    bound = 2 * max(baseline) + PROBE_SLACK_S
    before = server.rss()

    def attack() -> float:
        start = server.rss()
        answer, probes, peak = big_request(server, "/v1/embeddings", "vec", "input")
        # every word counted, the whole text reached the model
        assert answer["usage"] == {"prompt_tokens": BIG_WORDS, "total_tokens": BIG_WORDS}
        assert answer["data"][0]["embedding"] == [float(3 * BIG_WORDS), 1.0]
        print(f"\nprobes {len(probes)} max {max(probes):.3f} s (v2 generate: "
              f"{max(baseline):.3f} s), peak RSS +{peak - start:.0f} MiB, "
              f"after +{server.rss() - before:.0f} MiB")
        assert max(probes) < bound, (f"a health probe waited {max(probes):.2f} s behind the "
                                     f"embeddings request ({max(baseline):.2f} s behind v2 generate)")
        # the body is 28.6 MiB: its bytes, the parsed text and the input tensor, not a list
        # of ten million words
        assert peak - start < PEAK_MIB, f"RSS peaked {peak - start:.0f} MiB over a 28.6 MiB body"
        assert legit_infer(server) < LEGIT_DEADLINE_S
        return server.rss() - before

    # malloc keeps some of what one request freed for the next; a repeat adds nothing
    repeats_add_nothing(attack, "a 28.6 MiB embeddings body", repeat_mib=40)
    assert server.alive()


def test_a_huge_prompt_is_counted_off_the_loop(server):
    """``usage`` of a completion counts the prompt's words (and a one-response model's
    answer's) as v1/embeddings counts its input's."""
    answer, baseline, _ = big_request(server, "/v2/models/length/generate", "length", "text_input")
    assert answer["text_output"] == f"{3 * BIG_WORDS} characters"
    answer, probes, _ = big_request(server, "/v1/completions", "length", "prompt")
    assert answer["usage"] == {"prompt_tokens": BIG_WORDS, "completion_tokens": 2,
                               "total_tokens": BIG_WORDS + 2}
    assert answer["choices"][0]["text"] == f"{3 * BIG_WORDS} characters"
    print(f"\nprobes {len(probes)} max {max(probes):.3f} s (v2 generate: {max(baseline):.3f} s)")
    assert max(probes) < 2 * max(baseline) + PROBE_SLACK_S, \
        f"a health probe waited {max(probes):.2f} s ({max(baseline):.2f} s behind v2 generate)"


def test_a_chat_is_bounded_in_messages_and_parts(server):
    """Each message and content part is a step of the chat template's loop on the server's
    loop (a 29 MiB body of a million messages held it 4.5 s): OpenAI's bound of 2048."""
    def chat(messages: list) -> tuple[int, dict]:
        return post(server.http_port, "/v1/chat/completions", {"model": "echo", "messages": messages})

    status, answer = chat([{"role": "u", "content": "a"}] * MAX_MESSAGES)
    assert status == 200 and answer["choices"][0]["message"]["content"].count("U: A") == MAX_MESSAGES
    status, answer = chat([{"role": "u", "content": "a"}] * (MAX_MESSAGES + 1))
    assert status == 400 and f"at most {MAX_MESSAGES}" in answer["error"]["message"]
    parts = [{"type": "text", "text": "a"}] * (MAX_MESSAGES // 2 + 1)
    status, answer = chat([{"role": "u", "content": parts}] * 2)
    assert status == 400 and f"more than {MAX_MESSAGES} content parts" in answer["error"]["message"]
    assert legit_infer(server) < LEGIT_DEADLINE_S


def test_an_embeddings_body_past_the_input_limit_is_refused_unread(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        conn.putrequest("POST", "/v1/embeddings")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(65 << 20))     # past the default 64 MiB
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 400 and b"maximum input size" in resp.read()
    finally:
        conn.close()
    assert legit_infer(server) < LEGIT_DEADLINE_S


def test_word_counts_in_slices_match_split():
    texts = ["", " ", "a", "ab ab", " a  b ", "x" * 50, "é\u3000ü\tv\n", "ab " * 40, " ab" * 40]
    for text in texts:
        for slice_chars in (1, 2, 3, 5, 7, 64):
            assert word_count(text, slice_chars) == len(text.split()), (text, slice_chars)


# -- v1/completions: stop sequences over a long answer -----------------------------------------

STOPS = [f"<|stop-{i:02d}|>" for i in range(MAX_STOPS)]
LONG_WORDS = 3000
WORD = "lorem-ipsum-dolor-sit-amet-<|stop-" * 3        # close to every stop, never one


def completion_cpu(server, stops: list[str] | None) -> float:
    """Server CPU seconds of one non-streamed completion of LONG_WORDS responses."""
    prompt = " ".join(f"{WORD}{i}" for i in range(LONG_WORDS))
    before = cpu_seconds(server.pid)
    status, answer = post(server.http_port, "/v1/completions",
                          {"model": "words", "prompt": prompt, "stop": stops})
    took = cpu_seconds(server.pid) - before
    assert status == 200, answer
    assert answer["choices"][0]["text"] == prompt.replace(" ", "")
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == LONG_WORDS
    return took


def test_stop_sequences_cost_about_nothing_over_a_long_answer(server):
    completion_cpu(server, None)        # warm: the words model's first request
    # the cheaper of two of each, interleaved: the machine may be busy for one of them
    without = min(completion_cpu(server, None), completion_cpu(server, None))
    with_stops = min(completion_cpu(server, STOPS), completion_cpu(server, STOPS))
    # searched again from the start at every response they cost 15 times the rest;
    # searched once they cost a small part of it
    print(f"\ncpu with {with_stops:.2f} without {without:.2f}")
    assert with_stops < 2 * without + 0.5, \
        f"16 stop sequences: {with_stops:.2f} s of server CPU against {without:.2f} s without"


def stream_text(client: openai.OpenAI, prompt: str, stop) -> tuple[str, str]:
    chunks = list(client.completions.create(model="words", prompt=prompt, stream=True, stop=stop))
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


def test_stop_semantics(server):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="any",
                           max_retries=0, timeout=30)
    # the words model answers one response per word, without the spaces: "abcdef"
    for stop, text in [("cde", "ab"),          # across three responses
                       ("bc", "a"),            # across two
                       (["de", "bc"], "a"),    # the earliest in the text wins, not the first given
                       ("a", ""),              # at once
                       ("f", "abcde"),         # in the last response
                       ("zz", "abcdef"),       # never: the held-back tail is sent at the end
                       ("abcdefg", "abcdef")]:  # longer than the whole text
        assert stream_text(client, "a b c d e f", stop) == \
            (text, "stop"), stop
        answer = client.completions.create(model="words", prompt="a b c d e f", stop=stop)
        assert (answer.choices[0].text, answer.choices[0].finish_reason) == (text, "stop"), stop
    # the chat route cuts the same way
    chat = client.chat.completions.create(model="words", stop=["r:h"],
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == "use"
    # bounds: a 400 naming them, the server unharmed
    for stop, words in [(["x"] * (MAX_STOPS + 1), f"at most {MAX_STOPS} strings"),
                        (["x" * (MAX_STOP_CHARS + 1)], f"at most {MAX_STOP_CHARS} characters")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="words", prompt="a b", stop=stop)
        assert words in err.value.message
    longest = [("y" * (MAX_STOP_CHARS - 2)) + f"{i:02d}" for i in range(MAX_STOPS)]
    assert stream_text(client, "a b", longest) == ("ab", "stop")


def test_stop_scan_searches_each_piece_once_with_the_tail():
    scan = _StopScan(["STOP", "xy"])
    assert scan.hold == 3
    sent = [scan.feed(p) for p in ["abc", "deS", "T", "OPz"]]
    assert "".join(sent) == "abcde" and scan.stopped
    # the tail held back is at most the longest stop less one, whatever came before
    scan = _StopScan(["STOP"])
    for _ in range(100):
        scan.feed("word ")
    assert len(scan.tail) == 3 and scan.rest() == "rd "


# -- v1/* after an eviction ------------------------------------------------------------------------

def test_v1_routes_load_an_evicted_model_again(tmp_path):
    root = tmp_path / "models"
    write_echo(root)
    write_model(root, "vec", LENGTH_MODEL, VEC_CONFIG)
    for name in ("echo", "vec"):
        config = root / name / "config.pbtxt"
        config.write_text(config.read_text() + ON_DEMAND)
    served = start_in_thread(EngineOptions(model_repository=root, model_control_mode="explicit",
                                           max_loaded_models=1),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=None)
    port = served.http_port
    echo_infer = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1],
                              "data": ["hi"]}]}
    vec_infer = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}
    try:
        status, answer = post(port, "/v1/completions", {"model": "echo", "prompt": "hi"})
        assert status == 200, answer                                          # never loaded
        assert post(port, "/v2/models/vec/infer", vec_infer)[0] == 200      # evicts echo
        assert request(port, "GET", "/v2/models/echo/config")[0] == 200
        assert request(port, "GET", "/v2/models/echo/ready")[0] != 200

        status, answer = post(port, "/v1/completions", {"model": "echo", "prompt": "hi"})
        assert status == 200, answer                                          # evicts vec
        assert answer["choices"][0]["text"] == "HI"
        status, answer = post(port, "/v1/embeddings", {"model": "vec", "input": "hi there"})
        assert status == 200, answer                                          # evicts echo
        assert answer["data"][0]["embedding"] == [8.0, 1.0]
        status, answer = post(port, "/v1/chat/completions",
                              {"model": "echo", "messages": [{"role": "user", "content": "yo"}]})
        assert status == 200, answer
        assert answer["choices"][0]["message"]["content"] == "USER: YO\nASSISTANT:"

        status, stats = request(port, "GET", "/v2/models/stats")
        per_model = {m["name"]: m for m in stats["residency"]["models"]}
        assert per_model["echo"]["cold_starts"] == 3 and per_model["vec"]["cold_starts"] == 2
        assert post(port, "/v2/models/echo/infer", echo_infer)[0] == 200
        # a name the repository does not have is still OpenAI's 404
        status, answer = post(port, "/v1/completions", {"model": "nope", "prompt": "hi"})
        assert status == 404 and answer["error"]["type"] == "invalid_request_error"
    finally:
        served.close()
