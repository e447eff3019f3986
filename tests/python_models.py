"""A Python-backend model that the end-to-end batching and metrics tests build: it sleeps,
echoes its input, and logs every execution (which requests ran together, on which instance,
when) to ``<model dir>/executions.jsonl`` so a test can see what the batcher formed; and
``Caller``, which sends it requests in an order the server shows."""
from __future__ import annotations

import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from server_waits import served_model, started, wait_for_queued, wait_for_start

# INPUT0 rows are [id, extra_sleep_s]; the model sleeps SLEEP_S plus the largest extra_sleep_s
# of the batch. A request whose id is negative gets an error response (a BACKEND failure).
# While a file ``hold.<id>`` exists in the model's directory (``held``), a batch holding that
# id waits before it runs: a test keeps an instance busy for exactly as long as it needs.
SLEEPY_MODEL_PY = '''
import json
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        sleep = config.get("parameters", {}).get("SLEEP_S", {}).get("string_value", "0")
        self.sleep = float(sleep)
        self.dir = args["model_repository"]
        self.log = os.path.join(self.dir, "executions.jsonl")
        self.instance = args["model_instance_name"]

    def execute(self, requests):
        start = time.time()
        xs = [pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() for r in requests]
        holds = [os.path.join(self.dir, "hold.%d" % i) for x in xs for i in x[..., 0].reshape(-1)]
        while any(os.path.exists(h) for h in holds):
            time.sleep(0.005)
        time.sleep(self.sleep + max(float(x[..., 1].max()) for x in xs))
        entry = {"instance": self.instance, "start": start, "end": time.time(),
                 "ids": [x[..., 0].reshape(-1).tolist() for x in xs],
                 "rows": sum(len(x) if x.ndim > 1 else 1 for x in xs)}
        with open(self.log, "a") as f:
            f.write(json.dumps(entry) + "\\n")
        responses = []
        for x in xs:
            if (x[..., 0] < 0).any():
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("negative id asked for a failure")))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return responses
'''

THREAD_MODE = 'parameters { key: "EXECUTION_MODE" value: { string_value: "thread" } }'


def sleepy_model(root: Path, name: str, *, sleep_s: float = 0.0, max_batch_size: int = 8,
                 extra: str = "", instances: int = 1) -> Path:
    """Write ``root/name`` (config.pbtxt + 1/model.py); ``extra`` is more config text
    (dynamic_batching, model_warmup...)."""
    model_dir = root / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "1" / "model.py").write_text(SLEEPY_MODEL_PY)
    (model_dir / "config.pbtxt").write_text(f'''
name: "{name}"
backend: "python"
max_batch_size: {max_batch_size}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] }} ]
instance_group [ {{ kind: KIND_CPU count: {instances} }} ]
{THREAD_MODE}
parameters {{ key: "SLEEP_S" value: {{ string_value: "{sleep_s}" }} }}
{extra}
''')
    return model_dir


def executions(model_dir: Path) -> list[dict]:
    """Every execution the model logged, in the order they finished."""
    log = model_dir / "executions.jsonl"
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line]


def request(ident: float, extra_sleep_s: float = 0.0, rows: int = 1) -> list[httpclient.InferInput]:
    x = np.tile(np.array([[ident, extra_sleep_s]], dtype=np.float32), (rows, 1))
    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return [inp]



@contextmanager
def held(model_dir: Path, *idents: int) -> Iterator[None]:
    """Within the block, an execution of a request whose id is in ``idents`` waits to run."""
    holds = [model_dir / f"hold.{int(i)}" for i in idents]
    for h in holds:
        h.touch()
    try:
        yield
    finally:
        for h in holds:
            h.unlink(missing_ok=True)


@dataclass
class Outcome:
    elapsed: float        # seconds from sending to the answer, as the caller saw them
    output: np.ndarray | None
    error: InferenceServerException | None


class Caller:
    """Sends inferences to one model, each on a thread and a client of its own, and waits
    for what the server shows of them (started, queued), never for time: a call sent after
    another is sent once the server holds the one before it, whatever a busy machine's
    threads do meanwhile."""

    def __init__(self, server, client, model: str) -> None:
        self.url = f"127.0.0.1:{server.http_port}"
        self.client = client
        self.model = model
        self.version = served_model(server.engine, model)
        self.started = started(client, model)
        self.pool = ThreadPoolExecutor(max_workers=8)

    def send(self, ident: int, priority: int = 0, timeout_us: int | None = None) -> Future:
        """The call's future Outcome."""
        def call() -> Outcome:
            client = httpclient.InferenceServerClient(self.url, network_timeout=60)
            sent = time.monotonic()
            try:
                result = client.infer(self.model, request(ident), priority=priority,
                                      timeout=timeout_us)
                return Outcome(time.monotonic() - sent, result.as_numpy("OUTPUT0"), None)
            except InferenceServerException as err:
                return Outcome(time.monotonic() - sent, None, err)
            finally:
                client.close()
        return self.pool.submit(call)

    def running(self, count: int = 1) -> None:
        """Until ``count`` more of this caller's requests left the queue for an instance."""
        wait_for_start(self.client, self.model, self.started + count - 1)
        self.started += count

    def queued(self, count: int) -> None:
        wait_for_queued(self.version, count)

    def line_up(self, *idents: int, priorities: list[int] | None = None) -> list[Future]:
        """Send the first of ``idents`` and wait until it runs, then each next one once those
        before it wait in the queue (with ``priorities``, one per ident); their futures."""
        priorities = priorities or [0] * len(idents)
        futures = [self.send(idents[0], priorities[0])]
        self.running()
        for queued, (ident, priority) in enumerate(zip(idents[1:], priorities[1:]), start=1):
            futures.append(self.send(ident, priority))
            self.queued(queued)
        return futures

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def __enter__(self) -> "Caller":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def outcome(future: Future) -> Outcome:
    return future.result(timeout=60)


def model_stats(client, model: str) -> dict:
    return client.get_inference_statistics(model)["model_stats"][0]


def ids_in_execution_order(model_dir: Path) -> list[int]:
    return [int(i) for e in sorted(executions(model_dir), key=lambda e: e["start"])
            for ids in e["ids"] for i in ids]
