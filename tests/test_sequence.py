"""The sequence batcher, as a Triton user meets it: a stateful model served from a
repository the test writes, called with tritonclient over HTTP and gRPC."""
from __future__ import annotations

import http.client as http_client
import json
import logging
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from jupyter_triton.engine import EngineOptions
from jupyter_triton.standalone import start_in_thread
from server_waits import served_model, wait_for_queued, wait_until
from triton_example_models import published, run_published

# Triton's docs/examples simple_sequence, served by a python model: OUTPUT = INPUT + START
# while READY (what NVIDIA's sequence example clients expect of it).
SIMPLE_SEQUENCE_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            start = pb_utils.get_input_tensor_by_name(request, "START").as_numpy()
            ready = pb_utils.get_input_tensor_by_name(request, "READY").as_numpy()
            out = ((x + start) * ready).astype(np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)]))
        return responses
'''

SIMPLE_SEQUENCE_CONFIG = '''
name: "{name}"
backend: "python"
max_batch_size: 8
sequence_batching {{
  {extra}
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] }} ] }}
  ]
}}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU }} ]
'''


def simple_sequence(root: Path, name: str = "simple_sequence", extra: str = "") -> Path:
    (root / name / "1").mkdir(parents=True, exist_ok=True)
    (root / name / "1" / "model.py").write_text(SIMPLE_SEQUENCE_PY)
    (root / name / "config.pbtxt").write_text(SIMPLE_SEQUENCE_CONFIG.format(name=name, extra=extra))
    return root / name


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    root.mkdir()
    return root


@pytest.fixture
def server(repo: Path):
    server = start_in_thread(EngineOptions(model_repository=repo, model_control_mode="explicit"),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0)
    yield server
    server.close()


# An accumulator that keeps its sums itself, per correlation id, in the instance that runs
# it (as Triton's qa sequence models keep theirs per batch slot): a request routed to the
# wrong instance would miss its sum. It logs every execution for the test to read.
ACCUMULATOR_PY = '''
import json
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}
        self.instance = args["model_instance_name"]
        self.log = os.path.join(args["model_repository"], "executions.jsonl")
        config = json.loads(args["model_config"])
        self.sleep = float(config["parameters"]["SLEEP_S"]["string_value"])

    def execute(self, requests):
        time.sleep(self.sleep)
        entry = {"instance": self.instance, "corrid": [], "ready": [], "start": [], "end": []}
        responses = []
        for request in requests:
            get = lambda name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()
            x, corrid = get("INPUT"), get("CORRID")
            start, end, ready = get("START"), get("END"), get("READY")
            key = corrid.item()
            key = key.decode() if isinstance(key, bytes) else int(key)
            entry["corrid"].append(key)
            for name, flag in (("ready", ready), ("start", start), ("end", end)):
                entry[name].append(float(flag.item()))
            if ready.item():
                total = (0 if start.item() else self.sums.get(key, 0)) + int(x.item())
                self.sums[key] = total
                if end.item():
                    self.sums.pop(key, None)
                out = np.full(x.shape, total, dtype=np.int32)
            else:
                out = np.zeros(x.shape, dtype=np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)]))
        with open(self.log, "a") as f:
            f.write(json.dumps(entry) + "\\n")
        return responses
'''

ACCUMULATOR_CONFIG = '''
name: "{name}"
backend: "python"
max_batch_size: {max_batch_size}
sequence_batching {{
  {strategy}
  max_sequence_idle_microseconds: {idle_us}
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END bool_false_true: [ false, true ] }} ] }},
    {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: {corrid_type} }} ] }}
  ]
}}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: {dims} }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: {dims} }} ]
instance_group [ {{ kind: KIND_CPU count: {instances} }} ]
parameters {{ key: "SLEEP_S" value: {{ string_value: "{sleep_s}" }} }}
'''


def accumulator(root: Path, name: str = "acc", *, max_batch_size: int = 2, instances: int = 1,
                strategy: str = "direct { }", idle_us: int = 60_000_000,
                corrid_type: str = "TYPE_UINT64", sleep_s: float = 0.0) -> Path:
    (root / name / "1").mkdir(parents=True, exist_ok=True)
    (root / name / "1" / "model.py").write_text(ACCUMULATOR_PY)
    (root / name / "config.pbtxt").write_text(ACCUMULATOR_CONFIG.format(
        name=name, max_batch_size=max_batch_size, strategy=strategy, idle_us=idle_us,
        corrid_type=corrid_type, instances=instances, sleep_s=sleep_s,
        # the tests send [1, 1] either way: a batch of one row, or the whole tensor
        dims="[ 1 ]" if max_batch_size else "[ 1, 1 ]"))
    return root / name


def executions(model_dir: Path) -> list[dict]:
    path = model_dir / "executions.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def send(client, model: str, value: int, sequence_id, start: bool = False,
         end: bool = False) -> int:
    data = np.full([1, 1], value, dtype=np.int32)
    inp = httpclient.InferInput("INPUT", list(data.shape), "INT32")
    inp.set_data_from_numpy(data)
    result = client.infer(model, [inp], sequence_id=sequence_id, sequence_start=start,
                          sequence_end=end)
    return int(result.as_numpy("OUTPUT").item())


def http(server) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", concurrency=8)


def load(server, name: str) -> httpclient.InferenceServerClient:
    client = http(server)
    client.load_model(name)
    return client


def test_simple_sequence_errors_as_triton(repo: Path, server) -> None:
    simple_sequence(repo)
    client = load(server, "simple_sequence")
    assert send(client, "simple_sequence", 0, 5, start=True) == 1
    assert send(client, "simple_sequence", 11, 5) == 11
    assert send(client, "simple_sequence", 7, 5, end=True) == 7
    with pytest.raises(InferenceServerException) as err:      # ended: START needed again
        send(client, "simple_sequence", 3, 5)
    assert err.value.status() == "400"
    assert "inference request for sequence 5 to model 'simple_sequence' must specify the " \
           "START flag on the first request of the sequence" in str(err.value)
    for no_id in (0, ""):
        with pytest.raises(InferenceServerException) as err:
            send(client, "simple_sequence", 3, no_id, start=True)
        assert "must specify a non-zero or non-empty correlation ID" in str(err.value)
    two = np.zeros([2, 1], dtype=np.int32)
    inp = httpclient.InferInput("INPUT", [2, 1], "INT32")
    inp.set_data_from_numpy(two)
    with pytest.raises(InferenceServerException) as err:
        client.infer("simple_sequence", [inp], sequence_id=9, sequence_start=True)
    assert "must specify batch-size 1 due to requirements of sequence batcher" in str(err.value)
    # a string correlation id works like a number
    assert send(client, "simple_sequence", 20, "a-uuid", start=True) == 21
    assert send(client, "simple_sequence", -7, "a-uuid", end=True) == -7


def test_start_on_an_active_sequence_restarts_it(repo: Path, server) -> None:
    accumulator(repo)
    client = load(server, "acc")
    assert send(client, "acc", 5, 77, start=True) == 5
    assert send(client, "acc", 6, 77) == 11
    assert send(client, "acc", 1, 77, start=True) == 1     # the old sequence ends here
    assert send(client, "acc", 2, 77, end=True) == 3


def test_two_instances_interleaved_sequences_stay_on_their_instance(repo: Path, server) -> None:
    model_dir = accumulator(repo, max_batch_size=2, instances=2, sleep_s=0.02, strategy=(
        "direct { max_queue_delay_microseconds: 1000000 minimum_slot_utilization: 1.0 }"))
    load(server, "acc")
    ids = [101, 102, 103, 104]
    values = {sid: [sid % 10 + k for k in range(6)] for sid in ids}
    got: dict[int, list[int]] = {sid: [] for sid in ids}
    errors: list[BaseException] = []

    def run(sid: int) -> None:
        try:
            own = http(server)       # tritonclient.http (gevent) is one client per thread
            vals = values[sid]
            for k, v in enumerate(vals):
                got[sid].append(send(own, "acc", v, sid, start=k == 0, end=k == len(vals) - 1))
        except BaseException as err:    # reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(sid,)) for sid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for sid in ids:
        assert got[sid] == list(np.cumsum(values[sid]))
    runs = executions(model_dir)
    where: dict[int, set[str]] = {}
    for entry in runs:
        assert len(entry["corrid"]) <= 2                      # one request per slot
        real = [c for c, r in zip(entry["corrid"], entry["ready"]) if r]
        assert len(real) == len(set(real))                    # never two of one sequence
        for c in real:
            where.setdefault(c, set()).add(entry["instance"])
        for c, r in zip(entry["corrid"], entry["ready"]):
            if not r:
                assert c == 0                                 # a null request fills a slot
    assert all(len(instances) == 1 for instances in where.values())
    assert {i for s in where.values() for i in s} == {"acc_0_0", "acc_0_1"}
    # the batcher waited for both slots of an instance (minimum_slot_utilization 1.0):
    # 4 sequences x 6 requests ran in about 12 batches, not 24
    assert sum(sum(e["ready"]) == 2 for e in runs) >= 8


def test_idle_slot_gets_a_null_request(repo: Path, server) -> None:
    model_dir = accumulator(repo, max_batch_size=2)
    client = load(server, "acc")
    assert send(client, "acc", 1, 31, start=True) == 1      # slot 0
    assert send(client, "acc", 2, 32, start=True) == 2      # slot 1
    assert send(client, "acc", 3, 31, end=True) == 4        # slot 0 is free again
    assert send(client, "acc", 4, 32) == 6
    last = executions(model_dir)[-1]
    assert last["corrid"] == [0, 32] and last["ready"] == [0.0, 1.0]
    assert last["start"] == [0.0, 0.0] and last["end"] == [0.0, 0.0]


def test_backlog_waits_for_a_free_slot(repo: Path, server) -> None:
    accumulator(repo, max_batch_size=0)          # one slot: a second sequence waits
    client = load(server, "acc")
    assert send(client, "acc", 1, 1, start=True) == 1
    answer: dict = {}
    waiter = threading.Thread(target=lambda: answer.setdefault(
        "v", send(http(server), "acc", 40, 2, start=True, end=True)))
    waiter.start()
    wait_for_queued(served_model(server.engine, "acc"), 1)     # backlogged behind sequence 1
    assert waiter.is_alive()
    assert send(client, "acc", 2, 1, end=True) == 3
    waiter.join(30)
    assert answer["v"] == 40


IDLE_US = 1_500_000


def idled_out(caplog, model: str, sid, since: float) -> None:
    """Until the server logs that sequence ``sid`` of ``model`` lost its slot, idle since
    before ``since`` (time.time()); not before the idle time had passed."""
    found = wait_until(lambda: [r for r in caplog.records if r.getMessage().startswith(
        f"sequence {sid} of model '{model}' idle for more than")], f"sequence {sid} freed")
    assert found[0].created >= since + IDLE_US / 1e6, found[0].created - since


def test_idle_sequence_loses_its_slot(repo: Path, server, caplog) -> None:
    # an idle past any stall between two live requests of a busy machine
    caplog.set_level(logging.INFO, logger="jupyter_triton.engine.composition.sequence")
    accumulator(repo, max_batch_size=0, idle_us=IDLE_US)
    client = load(server, "acc")
    assert send(client, "acc", 4, 8, start=True) == 4
    since = time.time()
    assert send(client, "acc", 4, 8) == 8
    idled_out(caplog, "acc", 8, since)
    with pytest.raises(InferenceServerException) as err:
        send(client, "acc", 1, 8)
    assert "must specify the START flag" in str(err.value)
    # the freed slot serves the next sequence at once
    assert send(client, "acc", 9, 10, start=True, end=True) == 9


def test_oldest_batches_the_oldest_sequences(repo: Path, server) -> None:
    model_dir = accumulator(repo, max_batch_size=4, strategy=(
        "oldest { max_candidate_sequences: 4 preferred_batch_size: [ 4 ] "
        # a delay no stall of the four senders outlasts: the preferred size sends each batch
        "max_queue_delay_microseconds: 3000000 }"), corrid_type="TYPE_STRING", sleep_s=0.01)
    load(server, "acc")
    ids = ["s1", "s2", "s3", "s4"]
    got: dict[str, list[int]] = {sid: [] for sid in ids}
    barrier = threading.Barrier(len(ids))

    def run(sid: str) -> None:
        own = http(server)
        for k in range(3):
            barrier.wait(30)
            got[sid].append(send(own, "acc", k + 1, sid, start=k == 0, end=k == 2))

    threads = [threading.Thread(target=run, args=(sid,)) for sid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(got[sid] == [1, 3, 6] for sid in ids)
    runs = executions(model_dir)
    assert all(all(e["ready"]) for e in runs)             # oldest has no null requests
    assert all(len(set(e["corrid"])) == len(e["corrid"]) for e in runs)
    # each step's four requests met within the delay: batches of the preferred size 4
    assert [len(e["corrid"]) for e in runs] == [4, 4, 4]
    assert {tuple(e["start"]) for e in runs} == {(1.0,) * 4, (0.0,) * 4}
    assert [e["end"] for e in runs][-1] == [1.0] * 4


def test_unload_fails_backlogged_requests(repo: Path, server) -> None:
    accumulator(repo, max_batch_size=0, sleep_s=0.0)
    client = load(server, "acc")
    assert send(client, "acc", 1, 1, start=True) == 1
    outcome: dict = {}

    def waiting() -> None:
        try:
            outcome["v"] = send(http(server), "acc", 2, 2, start=True)
        except InferenceServerException as err:
            outcome["err"] = err

    waiter = threading.Thread(target=waiting)
    waiter.start()
    # backlogged: the server has it (an unload before it came would answer 404, no model)
    wait_for_queued(served_model(server.engine, "acc"), 1)
    assert waiter.is_alive()
    client.unload_model("acc")
    waiter.join(30)
    assert not waiter.is_alive()
    assert "unloaded" in str(outcome["err"]) and outcome["err"].status() == "503"


def state_accumulator_onnx(path: Path) -> None:
    """OUTPUT_STATE = INPUT + INPUT_STATE + 10 * START; OUTPUT = OUTPUT_STATE. The model
    keeps no state itself: the engine feeds INPUT_STATE from the last OUTPUT_STATE."""
    from onnx import TensorProto, helper

    from onnx_models import _save
    vec = lambda name: helper.make_tensor_value_info(name, TensorProto.INT32, ["batch", 1])
    ten = helper.make_tensor("TEN", TensorProto.INT32, [], [10])
    graph = helper.make_graph(
        [helper.make_node("Mul", ["START", "TEN"], ["start10"]),
         helper.make_node("Add", ["INPUT", "INPUT_STATE"], ["sum"]),
         helper.make_node("Add", ["sum", "start10"], ["OUTPUT_STATE"]),
         helper.make_node("Identity", ["OUTPUT_STATE"], ["OUTPUT"])], "state_acc",
        [vec("INPUT"), vec("INPUT_STATE"), vec("START")], [vec("OUTPUT"), vec("OUTPUT_STATE")],
        [ten])
    _save(graph, path)


def test_implicit_state_onnx(repo: Path, server) -> None:
    model_dir = repo / "state_acc"
    state_accumulator_onnx(model_dir / "1" / "model.onnx")
    (model_dir / "initial_state").mkdir()
    (model_dir / "initial_state" / "start_value").write_bytes(np.int32(1000).tobytes())
    (model_dir / "config.pbtxt").write_text('''
name: "state_acc"
backend: "onnxruntime"
max_batch_size: 4
sequence_batching {
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] }
  ]
  state [ {
    input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_INT32 dims: [ 1 ]
    initial_state { data_type: TYPE_INT32 dims: [ 1 ] name: "start" data_file: "start_value" }
  } ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
''')
    client = load(server, "state_acc")
    meta = client.get_model_metadata("state_acc")
    assert [t["name"] for t in meta["inputs"]] == ["INPUT"]          # state is not a client input
    assert [t["name"] for t in meta["outputs"]] == ["OUTPUT"]
    # two sequences side by side, each with its own state; START resets it to 1000
    assert send(client, "state_acc", 1, 1, start=True) == 1011
    assert send(client, "state_acc", 5, 2, start=True) == 1015
    assert send(client, "state_acc", 2, 1) == 1013
    assert send(client, "state_acc", 3, 2) == 1018
    result = client.infer("state_acc", [_int_input(4)], sequence_id=1, sequence_end=True)
    assert result.as_numpy("OUTPUT").item() == 1017
    assert result.as_numpy("OUTPUT_STATE") is None                   # never returned
    assert send(client, "state_acc", 7, 1, start=True) == 1017       # a new sequence: fresh state
    with pytest.raises(InferenceServerException) as err:              # not an output to ask for
        client.infer("state_acc", [_int_input(1)], sequence_id=2,
                     outputs=[httpclient.InferRequestedOutput("OUTPUT_STATE")])
    assert err.value.status() == "400"


def _int_input(value: int) -> httpclient.InferInput:
    inp = httpclient.InferInput("INPUT", [1, 1], "INT32")
    inp.set_data_from_numpy(np.full([1, 1], value, dtype=np.int32))
    return inp


# What NVIDIA's sequence example clients (simple_{http,grpc}_sequence_sync_infer_client.py,
# simple_grpc_sequence_stream_infer_client.py) send simple_sequence and expect back: three
# sequences, two with integer ids and one with a UUID string, each a START value then these
# values (negated in the second and third); the START request answers its value plus one,
# the others their own value.
EXAMPLE_VALUES = [11, 7, 5, 3, 2, 0, 1]


def _example_sequences() -> list[tuple[int | str, list[int]]]:
    return [(1000, [0] + EXAMPLE_VALUES), (1001, [100] + [-v for v in EXAMPLE_VALUES]),
            (str(uuid.uuid4()), [20] + [-v for v in EXAMPLE_VALUES])]


def _example_answers(values: list[int]) -> list[int]:
    return [values[0] + 1] + values[1:]


def _example_request(module, sequence_id, values: list[int], i: int) -> dict:
    tensor = module.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.full([1, 1], values[i], dtype=np.int32))
    return dict(model_name="simple_sequence", inputs=[tensor],
                outputs=[module.InferRequestedOutput("OUTPUT")], sequence_id=sequence_id,
                sequence_start=i == 0, sequence_end=i == len(values) - 1)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_sequence_examples_one_request_at_a_time(repo: Path, server, protocol: str) -> None:
    import tritonclient.grpc as grpcclient
    simple_sequence(repo)
    load(server, "simple_sequence")
    module, port = ((httpclient, server.http_port) if protocol == "http"
                    else (grpcclient, server.grpc_port))
    client = module.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        for sequence_id, values in _example_sequences():
            got = [client.infer(**_example_request(module, sequence_id, values, i)).as_numpy("OUTPUT")
                   for i in range(len(values))]
            assert [a.tolist() for a in got] == [[[v]] for v in _example_answers(values)], sequence_id
    finally:
        client.close()


def test_the_sequence_stream_example_three_sequences_on_one_stream(repo: Path, server) -> None:
    # every request sent before any answer is read; each answer carries its request's id
    # ("<sequence id>_<n>") and each sequence's answers come in its order
    import queue
    import tritonclient.grpc as grpcclient
    simple_sequence(repo)
    load(server, "simple_sequence")
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    answers: queue.Queue = queue.Queue()
    sequences = _example_sequences()
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        for sequence_id, values in sequences:
            for i in range(len(values)):
                client.async_stream_infer(**_example_request(grpcclient, sequence_id, values, i),
                                          request_id=f"{sequence_id}_{i + 1}")
        got: dict[str, list] = {}
        for _ in range(sum(len(values) for _, values in sequences)):
            result, error = answers.get(timeout=60)
            assert error is None, error
            sequence_id, _, n = result.get_response().id.rpartition("_")
            got.setdefault(sequence_id, []).append((int(n), result.as_numpy("OUTPUT").item()))
        assert got == {str(sequence_id): list(enumerate(_example_answers(values), start=1))
                       for sequence_id, values in sequences}
        client.stop_stream()
    finally:
        client.close()


@pytest.mark.parametrize("example, port", [
    ("simple_grpc_sequence_stream_infer_client.py", "grpc_port"),
    ("simple_grpc_sequence_sync_infer_client.py", "grpc_port"),
    ("simple_http_sequence_sync_infer_client.py", "http_port"),
])
def test_nvidia_sequence_examples_run_unchanged(repo: Path, server, example: str,
                                                port: str) -> None:
    script = published("JUPYTER_TRITON_CLIENT_EXAMPLES", example)
    simple_sequence(repo)
    load(server, "simple_sequence")
    done = run_published(script, "-u", f"127.0.0.1:{getattr(server, port)}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS: Sequence" in done.stdout


def _with_controls(controls: str, extra: str = "") -> str:
    return f'''
name: "bad"
backend: "python"
max_batch_size: 2
sequence_batching {{ control_input [ {controls} ] {extra} }}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
'''


@pytest.mark.parametrize("config, message", [
    (_with_controls('{ name: "S" control [ { kind: CONTROL_SEQUENCE_START } ] }'),
     "sequence batching must specify either 'int32_false_true', 'fp32_false_true' or "
     "'bool_false_true' for CONTROL_SEQUENCE_START for bad"),
    (_with_controls('{ name: "S" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0 ] } ] }'),
     "sequence batching control 'int32_false_true' must have exactly 2 entries for "
     "CONTROL_SEQUENCE_START for bad"),
    (_with_controls('{ name: "S" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] '
                    'fp32_false_true: [ 0, 1 ] } ] }'),
     "sequence batching specifies more than one from"),
    (_with_controls('{ name: "A" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },'
                    '{ name: "B" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] }'),
     "sequence batching specifies multiple CONTROL_SEQUENCE_END tensors for bad"),
    (_with_controls('{ name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_FP32 } ] }'),
     "CONTROL_SEQUENCE_CORRID data_type must be TYPE_UINT64"),
    (_with_controls('{ name: "INPUT" control [ { kind: CONTROL_SEQUENCE_START bool_false_true: [ false, true ] } ] }'),
     "is also a model input"),
    (_with_controls('{ name: "S" control [ { kind: CONTROL_SEQUENCE_START bool_false_true: [ false, true ] } ] }',
                    'state [ { input_name: "I" output_name: "O" data_type: TYPE_INT32 dims: [ 2 ] '
                    'initial_state { data_type: TYPE_INT32 dims: [ 3 ] name: "x" zero_data: true } } ]'),
     "'initial_state' dim for input name 'I' doesn't match 'state' dim description. 3 != 2"),
    (_with_controls('{ name: "S" control [ { kind: CONTROL_SEQUENCE_START bool_false_true: [ false, true ] } ] }',
                    "iterative_sequence: true"),
     "sequence_batching 'iterative_sequence' is not supported by this server"),
])
def test_bad_sequence_configs_are_refused_with_the_reason(repo: Path, server, config: str,
                                                          message: str) -> None:
    simple_sequence(repo, "bad")
    (repo / "bad" / "config.pbtxt").write_text(config)
    client = http(server)
    with pytest.raises(InferenceServerException) as err:
        client.load_model("bad")
    assert message in str(err.value)
    assert err.value.status() == "400"


def test_correlation_id_must_fit_the_corrid_control(repo: Path, server) -> None:
    (repo / "acc32").mkdir()
    accumulator(repo, "acc32", corrid_type="TYPE_INT32")
    client = load(server, "acc32")
    with pytest.raises(InferenceServerException) as err:
        send(client, "acc32", 1, 2**40, start=True)
    assert "does not fit the int32 control input 'CORRID'" in str(err.value)
    assert send(client, "acc32", 1, 2**31 - 1, start=True, end=True) == 1
    with pytest.raises(InferenceServerException) as err:       # numeric CORRID, string id
        send(client, "acc32", 1, "abc", start=True)
    assert err.value.status() == "400"


# Implicit state on a python model: the state is a BYTES tensor (here JSON) that the engine
# keeps between the requests of a sequence; the model itself remembers nothing.
STATEFUL_PY = '''
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = int(pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy().item())
            start = pb_utils.get_input_tensor_by_name(request, "START").as_numpy().item()
            raw = pb_utils.get_input_tensor_by_name(request, "STATE_IN").as_numpy().item()
            seen = [] if start or not raw else json.loads(raw)
            seen.append(x)
            state = np.array([[json.dumps(seen).encode()]], dtype=object)
            out = np.array([[sum(seen)]], dtype=np.int32)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT", out), pb_utils.Tensor("STATE_OUT", state)]))
        return responses
'''


def test_implicit_state_python_model(repo: Path, server, caplog) -> None:
    caplog.set_level(logging.INFO, logger="jupyter_triton.engine.composition.sequence")
    (repo / "stateful" / "1").mkdir(parents=True)
    (repo / "stateful" / "1" / "model.py").write_text(STATEFUL_PY)
    (repo / "stateful" / "config.pbtxt").write_text('''
name: "stateful"
backend: "python"
max_batch_size: 2
sequence_batching {
  max_sequence_idle_microseconds: 1500000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] }
  ]
  state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_STRING dims: [ 1 ] } ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
''')
    client = load(server, "stateful")
    assert send(client, "stateful", 3, "a", start=True) == 3
    assert send(client, "stateful", 4, "b", start=True) == 4
    assert send(client, "stateful", 5, "a") == 8
    since = time.time()
    result = client.infer("stateful", [_int_input(6)], sequence_id="b",
                          outputs=[httpclient.InferRequestedOutput("OUTPUT")])
    assert result.as_numpy("OUTPUT").item() == 10
    assert result.as_numpy("STATE_OUT") is None
    assert send(client, "stateful", 1, "a", end=True) == 9
    idled_out(caplog, "stateful", "b", since)      # 'b' idles past 1.5 s: its state is gone
    with pytest.raises(InferenceServerException) as err:
        send(client, "stateful", 1, "b")
    assert "must specify the START flag" in str(err.value)
    assert send(client, "stateful", 2, "b", start=True) == 2


def test_a_backlogged_client_that_hangs_up_is_forgotten(repo: Path, server) -> None:
    model_dir = accumulator(repo, max_batch_size=0)      # one slot
    client = load(server, "acc")
    assert send(client, "acc", 1, 1, start=True) == 1    # holds the slot
    gone = http_client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    gone.request("POST", "/v2/models/acc/infer", body=json.dumps({
        "parameters": {"sequence_id": 2, "sequence_start": True},
        "inputs": [{"name": "INPUT", "shape": [1, 1], "datatype": "INT32", "data": [50]}]}))
    wait_for_queued(served_model(server.engine, "acc"), 1)    # backlogged behind sequence 1
    gone.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and \
            client.get_inference_statistics("acc")["model_stats"][0]["inference_stats"][
                "fail"]["count"] == 0:
        time.sleep(0.05)
    assert send(client, "acc", 2, 1, end=True) == 3      # the slot is free again...
    assert send(client, "acc", 7, 3, start=True, end=True) == 7   # ...and not held by 2
    assert 2 not in [c for e in executions(model_dir) for c in e["corrid"]]   # never ran
    with pytest.raises(InferenceServerException):        # sequence 2 never started
        send(client, "acc", 1, 2)


def test_a_missing_initial_state_file_fails_the_load_before_any_instance(repo: Path,
                                                                         server) -> None:
    model_dir = accumulator(repo, "nofile")
    config = (model_dir / "config.pbtxt").read_text().replace(
        "  max_sequence_idle_microseconds", '''  state [ { input_name: "S" output_name: "S_OUT"
    data_type: TYPE_INT32 dims: [ 1 ]
    initial_state { data_type: TYPE_INT32 dims: [ 1 ] name: "s" data_file: "missing" } } ]
  max_sequence_idle_microseconds''')
    (model_dir / "config.pbtxt").write_text(config)
    client = http(server)
    with pytest.raises(InferenceServerException) as err:
        client.load_model("nofile")
    assert "initial_state/missing" in str(err.value) and err.value.status() == "400"
    assert not client.is_model_ready("nofile")
