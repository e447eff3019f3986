"""Python models for the streaming tests, written into a test's repository.

``words``: decoupled; one ``text_output`` response per word of ``text_input``, then the
final flag alone. The word ``FAIL`` is answered with an error response (the stream goes on).
Request parameters: ``delay`` (seconds after each word); ``cancel_marker`` (a path the model
writes once it sees ``is_cancelled()``, so a test can tell that a client going away reached
the model).

``echo``: not decoupled; ``text_output`` is ``text_input`` upper-cased, and the request's
parameters (JSON) in ``parameters_seen``.
"""
from __future__ import annotations

from pathlib import Path

WORDS_MODEL = '''\
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            prompt = text.reshape(-1)[0].decode()
            params = json.loads(request.parameters() or "{}")
            delay = float(params.get("delay", 0))
            marker = params.get("cancel_marker")
            for word in prompt.split():
                if sender.is_cancelled():
                    if marker:
                        with open(marker, "w") as f:
                            f.write("cancelled")
                    break
                if word == "FAIL":
                    sender.send(pb_utils.InferenceResponse(
                        error=pb_utils.TritonError("the model failed on FAIL")))
                    continue
                out = pb_utils.Tensor("text_output", np.array([word.encode()], dtype=np.object_))
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
                if delay:
                    time.sleep(delay)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

WORDS_CONFIG = '''\
name: "words"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "text_input", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "text_output", data_type: TYPE_STRING, dims: [ 1 ] } ]
'''

ECHO_MODEL = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            upper = np.array([t.upper() for t in text.reshape(-1)], dtype=np.object_)
            seen = np.array([[(request.parameters() or "{}").encode()]] * text.shape[0],
                            dtype=np.object_)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("text_output", upper.reshape(text.shape)),
                pb_utils.Tensor("parameters_seen", seen)]))
        return responses
'''

ECHO_CONFIG = '''\
name: "echo"
backend: "python"
max_batch_size: 4
input [ { name: "text_input", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "text_output", data_type: TYPE_STRING, dims: [ 1 ] },
         { name: "parameters_seen", data_type: TYPE_STRING, dims: [ 1 ] } ]
'''


def write_model(root: Path, name: str, model: str, config: str) -> None:
    (root / name / "1").mkdir(parents=True, exist_ok=True)
    (root / name / "1" / "model.py").write_text(model)
    (root / name / "config.pbtxt").write_text(config)


def write_words(root: Path, config: str = WORDS_CONFIG) -> Path:
    write_model(root, "words", WORDS_MODEL, config)
    return root


def write_echo(root: Path) -> Path:
    write_model(root, "echo", ECHO_MODEL, ECHO_CONFIG)
    return root


FLOOD_MODEL = '''\
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """COUNT responses of ``bytes`` bytes each, as fast as the server takes them; the number
    sent so far is written to the request parameter ``progress`` (a path), and to
    ``<progress>.cancelled`` once the request is cancelled."""

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            params = json.loads(request.parameters() or "{}")
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            chunk = np.zeros(int(params.get("bytes", 65536)), np.uint8)
            sent = 0
            for _ in range(count):
                if sender.is_cancelled():
                    with open(params["progress"] + ".cancelled", "w") as f:
                        f.write(str(sent))
                    break
                sender.send(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("CHUNK", chunk)]))
                sent += 1
                with open(params["progress"], "w") as f:
                    f.write(str(sent))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

FLOOD_CONFIG = '''\
name: "flood"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "COUNT", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "CHUNK", data_type: TYPE_UINT8, dims: [ -1 ] } ]
'''


def write_flood(root: Path) -> Path:
    write_model(root, "flood", FLOOD_MODEL, FLOOD_CONFIG)
    return root
