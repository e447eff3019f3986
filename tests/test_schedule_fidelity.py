"""Scheduling details where tritonserver 2.51's code decides (issue 22): a priority above the
model's levels runs at the default level (``InferenceRequest::SetPriority``); a request's
``timeout`` is ignored where the level's default timeout is 0 (``PolicyQueue::Enqueue``); the
rate limiter is off unless ``--rate-limit=execution_count``, whose resources
``--rate-limit-resource`` sizes. The queue rules run on the real batcher through the
simulator (virtual time: exact answers); the rate limiter on real instances."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from jupyter_triton.engine.model import ModelVersion
from jupyter_triton.engine.options import EngineOptions
from jupyter_triton.engine.batching.rate_limiter import RateLimiter, resource_limits
from jupyter_triton.engine.batching.simulation import Arrival, simulate
from jupyter_triton.protocol.errors import InvalidArgument
from jupyter_triton.protocol.types import InferRequest, InferTensor
from python_models import SLEEPY_MODEL_PY, THREAD_MODE, executions

pytestmark = pytest.mark.timeout(90)

MS = 1_000_000


def config(text: str) -> mc.ModelConfig:
    return text_format.Parse(f'name: "m" input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 2 ] }} ] {text}',
                             mc.ModelConfig())


def test_a_priority_above_the_levels_runs_at_the_default_level():
    cfg = config("max_batch_size: 1 dynamic_batching { priority_levels: 2 default_priority_level: 2 }")
    traffic = [Arrival(0, cls="first"), Arrival(1, priority=7, cls="above"),
               Arrival(2, priority=1, cls="urgent"), Arrival(3, priority=2, cls="default")]
    r = simulate(cfg, lambda rows, rng: 10 * MS, traffic)
    assert all(o.status == "ok" for o in r.requests)
    order = [o.cls for o in sorted(r.requests, key=lambda o: o.start_ns)]
    # 7 means level 2 (the default): behind level 1, ahead of a later level-2 request
    assert order == ["first", "urgent", "above", "default"]
    # priority 0 is the default level too; 1 at default level 1 stays ahead
    cfg = config("max_batch_size: 1 dynamic_batching { priority_levels: 3 default_priority_level: 1 }")
    r = simulate(cfg, lambda rows, rng: 10 * MS,
                 [Arrival(0, cls="first"), Arrival(1, priority=2, cls="two"), Arrival(2, priority=9, cls="nine")])
    assert [o.cls for o in sorted(r.requests, key=lambda o: o.start_ns)] == ["first", "nine", "two"]


@pytest.mark.parametrize("policy, statuses", [
    # default 0: no timeouts at this level, whatever the request asks (Triton)
    ("timeout_action: REJECT allow_timeout_override: true", ["ok", "ok", "ok"]),
    # a default: the request may lower it...
    ("timeout_action: REJECT allow_timeout_override: true default_timeout_microseconds: 50000",
     ["ok", "ok", "timeout"]),
    # ...not raise it (the third waits 20 ms, past its 15 ms default)
    ("timeout_action: REJECT default_timeout_microseconds: 15000", ["ok", "ok", "timeout"]),
])
def test_a_request_timeout_applies_only_under_a_default_timeout(policy, statuses):
    cfg = config(f"max_batch_size: 1 dynamic_batching {{ default_queue_policy {{ {policy} }} }}")
    traffic = [Arrival(0), Arrival(1, timeout_us=100_000), Arrival(2, timeout_us=5_000)]
    r = simulate(cfg, lambda rows, rng: 10 * MS, traffic)
    assert [o.status for o in r.requests] == statuses


def test_rate_limit_resource_values():
    assert resource_limits(["R:2", "G:1:0", "G:3:1"]) == {"R": 2, "G:0": 1, "G:1": 3}
    for bad in ["R", "R:x", ":1", "R:1:2:3", "R:-1", "R:1:-2"]:
        with pytest.raises(InvalidArgument, match="rate-limit-resource"):
            resource_limits([bad])
    with pytest.raises(InvalidArgument, match="--rate-limit 'sometimes'"):
        RateLimiter.from_options(EngineOptions(Path("."), rate_limit="sometimes"))
    assert not RateLimiter.from_options(EngineOptions(Path("."))).enabled
    assert not RateLimiter().enabled          # tritonserver's default: off


def limited_model(root: Path, sleep_s: float) -> Path:
    """Two instances, each holding one 'R' while it executes."""
    model_dir = root / "limited"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.py").write_text(SLEEPY_MODEL_PY)
    (model_dir / "config.pbtxt").write_text(f'''
name: "limited"
backend: "python"
max_batch_size: 1
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 2
                   rate_limiter {{ resources [ {{ name: "R" count: 1 }} ] }} }} ]
{THREAD_MODE}
parameters {{ key: "SLEEP_S" value: {{ string_value: "{sleep_s}" }} }}
''')
    return model_dir


def overlapped(model_dir: Path) -> bool:
    a, b = sorted(executions(model_dir), key=lambda e: e["start"])
    return b["start"] < a["end"]


@pytest.mark.parametrize("rate_limit, resources, parallel", [
    ("off", [], True),                        # the config's rate_limiter is ignored
    ("execution_count", [], False),           # R: the most one instance needs, 1
    ("execution_count", ["R:2"], True),       # sized by --rate-limit-resource
    ("execution_count", ["R:1:0"], False),    # a per-device limit for device 0
])
def test_the_rate_limiter_is_on_only_with_execution_count(tmp_path, rate_limit, resources, parallel):
    model_dir = limited_model(tmp_path, 0.3)
    cfg = text_format.Parse((model_dir / "config.pbtxt").read_text(), mc.ModelConfig())
    limiter = RateLimiter.from_options(EngineOptions(tmp_path, rate_limit=rate_limit,
                                                     rate_limit_resources=resources))

    async def main():
        mv = ModelVersion(cfg, "python", 1, model_dir, limiter)
        await mv.load()
        try:
            def req(i: int) -> InferRequest:
                x = np.array([[i, 0]], dtype=np.float32)
                return InferRequest("limited", inputs=[InferTensor("INPUT0", "FP32", x.shape, x)])
            return await asyncio.wait_for(asyncio.gather(mv.infer(req(1)), mv.infer(req(2))), 30)
        finally:
            await mv.unload(drain_seconds=5)

    responses = asyncio.run(main())
    assert len(responses) == 2
    assert len(executions(model_dir)) == 2
    assert overlapped(model_dir) is parallel, json.dumps(executions(model_dir))
