"""Planning by input length (issue 36 item 5): ``simulate(..., lengths=...)`` recommends
``length_buckets``, ``max_batch_tokens`` and the queue delay for a p99 target, from a served
``[batch, length]`` model's execution measured per (batch size, length).

The simulator's padded batches are the real batcher's: the same arrivals and lengths, through
the simulation and through the engine's ``DynamicBatcher`` with real inputs and a fake backend
on the same virtual clock, form the same batches at the same moments."""
from __future__ import annotations

import asyncio
import random
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from onnx import TensorProto, helper, numpy_helper
from tritonclient.grpc import model_config_pb2 as mc

import jupyter_triton as jt
from jupyter_triton.config.padding import padding
from jupyter_triton.engine.batching.batcher import DynamicBatcher
from jupyter_triton.engine.batching.clock import VirtualClock, VirtualLoop
from jupyter_triton.engine.batching.pending import Pending
from jupyter_triton.engine.batching.simulation import Arrival, ClosedLoop, simulate
from jupyter_triton.engine.observation.statistics import ModelStatistics
from jupyter_triton.planning.capacity import Load
from jupyter_triton.planning.length_service import LengthService
from jupyter_triton.planning.lengths import (MAX_LENGTHS, LengthPlan, bucket_candidates, plan_by_length,
                                            token_counts)
from jupyter_triton.planning.service import ServiceModel
from jupyter_triton.protocol.errors import InvalidArgument
from jupyter_triton.protocol.types import InferRequest
from onnx_models import _save
from test_capacity_planning import kernel_server  # noqa: F401  (a fixture)

pytestmark = pytest.mark.timeout(300)

MS = 1_000_000
INPUTS = ('input [ { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] },'
          ' { name: "attention_mask" data_type: TYPE_INT64 dims: [ -1 ] } ]')


def config(params: dict[str, str], delay_us: int = 2000, mbs: int = 8) -> mc.ModelConfig:
    listed = " ".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in params.items())
    return text_format.Parse(f'name: "m" max_batch_size: {mbs} dynamic_batching {{ max_queue_delay_microseconds: '
                             f'{delay_us} }} {INPUTS} {listed}', mc.ModelConfig())


def execution(rows: int, length: int) -> int:
    return 500_000 + 2_000 * rows * length


class FakeBackend:
    """``scheduler.Pool`` over one instance whose backend takes ``execution(rows, padded
    length)`` virtual ns: it reads the length from the batch's real inputs."""

    def __init__(self, loop: VirtualLoop) -> None:
        self.loop, self.instances, self.busy = loop, [0], False
        self.on_release = None
        self.batches: list[tuple[int, tuple[int, ...]]] = []

    @property
    def size(self) -> int:
        return 1

    def idle_count(self) -> int:
        return 0 if self.busy else 1

    def can_hold(self) -> bool:
        return False

    def run(self, batch: list[Pending], instance: int | None = None) -> asyncio.Future:
        self.busy = True
        lengths = tuple(sorted(p.inputs["input_ids"].shape[1] for p in batch))
        self.batches.append((self.loop.now, lengths))
        done = self.loop.create_future()
        self.loop.call_at((self.loop.now + execution(len(batch), max(lengths))) / 1e9, self._ran, batch, done)
        return done

    def _ran(self, batch: list[Pending], done: asyncio.Future) -> None:
        for p in batch:
            p.future.set_result(None)
        done.set_result(None)
        self.busy = False
        self.on_release()


def real_batches(cfg: mc.ModelConfig, arrivals: list[Arrival]) -> list[tuple[int, tuple[int, ...]]]:
    loop = VirtualLoop()
    pool = FakeBackend(loop)
    futures = []

    def arrive(batcher: DynamicBatcher, a: Arrival) -> None:
        ids = np.ones((1, a.length), np.int64)
        p = Pending(InferRequest("m", "1", []), {"input_ids": ids, "attention_mask": ids}, 1,
                    loop.create_future(), enqueue_ns=loop.now)
        futures.append(p.future)
        step = batcher.submit(p)
        with pytest.raises(StopIteration):
            step.send(None)

    async def main() -> None:
        batcher = DynamicBatcher(cfg, pool, ModelStatistics("m", "1"), clock=VirtualClock(loop))
        for a in arrivals:
            loop.call_at(a.t_ns / 1e9, arrive, batcher, a)
        while len(futures) < len(arrivals) or not all(f.done() for f in futures):
            await asyncio.sleep(0.001)
        await batcher.close()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return pool.batches


def simulated_batches(cfg: mc.ModelConfig, arrivals: list[Arrival]) -> list[tuple[int, tuple[int, ...]]]:
    r = simulate(cfg, lambda rows, rng, length=1: execution(rows, length), arrivals)
    by_start: dict[int, list[int]] = {}
    for o in r.requests:
        by_start.setdefault(o.start_ns, []).append(o.length)
    assert len(by_start) == len(r.batches) == len(r.tokens)
    for (start, rows, _), (padded, real) in zip(r.batches, r.tokens):
        lengths = by_start[start]
        assert rows == len(lengths) and padded == rows * max(lengths) and real == sum(lengths)
    return sorted((start, tuple(sorted(v))) for start, v in by_start.items())


def schedule(seed: int, n: int = 300) -> list[Arrival]:
    rng = random.Random(seed)
    t, out = 0, []
    for _ in range(n):
        t += int(rng.expovariate(1 / 150_000))          # a busy instance: queues build up
        out.append(Arrival(t, length=int(min(400, max(2, rng.lognormvariate(3.5, 0.9))))))
    return out


@pytest.mark.parametrize("params", [
    {"ragged_batching": "pad", "length_buckets": "16,32,64,128", "max_batch_tokens": "256"},
    {"ragged_batching": "pad"},
    {"ragged_batching": "pad", "max_batch_tokens": "100"},      # many requests over it: alone
    {},                                                          # no padding: equal lengths only
])
def test_the_simulators_padded_batches_are_the_real_batchers(params):
    cfg = config(params)
    for seed in (0, 1):
        arrivals = schedule(seed)
        real = real_batches(cfg, arrivals)
        assert simulated_batches(cfg, arrivals) == real
        assert sum(len(b) for _, b in real) == len(arrivals)
        rules = padding(cfg)
        for _, lengths in real:
            if rules is None:
                assert len(set(lengths)) == 1
                continue
            assert len({rules.bucket(n) for n in lengths}) == 1
            if rules.max_batch_tokens and len(lengths) > 1:
                assert len(lengths) * max(lengths) <= rules.max_batch_tokens
        assert max(len(b) for _, b in real) >= (3 if rules else 2)     # it did batch


def test_a_closed_loop_draws_its_lengths_in_turn():
    cfg = config({"ragged_batching": "pad"}, delay_us=0)
    r = simulate(cfg, lambda rows, rng, length=1: execution(rows, length), [ClosedLoop(1, 5, lengths=(3, 7))])
    assert [o.length for o in r.requests] == [3, 7, 3, 7, 3]
    assert r.tokens == [(3, 3), (7, 7), (3, 3), (7, 7), (3, 3)]
    with pytest.raises(ValueError, match="lengths"):
        simulate(cfg, lambda rows, rng: 1, [Arrival(0, length=-1)])


def synthetic_service(a_ns: int = 400_000, per_token_ns: int = 3_000) -> LengthService:
    base = ServiceModel("m", "1", {1: [a_ns] * 5}, overhead_ns=200_000, overhead_samples=[200_000] * 5)
    samples = {(b, n): [a_ns + per_token_ns * b * n + d for d in (-1000, 0, 1000)]
               for b in (1, 4, 8) for n in (8, 40, 200)}
    return LengthService("m", "1", samples, base)


def base_config(delay_us: int = 2000) -> dict:
    return {"name": "m", "max_batch_size": 8, "dynamic_batching": {"max_queue_delay_microseconds": delay_us},
            "input": [{"name": n, "data_type": "TYPE_INT64", "dims": [-1]} for n in ("input_ids", "attention_mask")],
            "parameters": {"max_length": {"string_value": "512"}}}


def corpus(n: int = 2000) -> list[int]:
    rng = np.random.default_rng(0)
    return [int(v) for v in np.clip(np.rint(rng.lognormal(np.log(40), 0.8, n)), 4, 512)]


def test_the_service_model_fits_batch_by_length():
    service = synthetic_service()
    assert service.median_ns(4, 40) == pytest.approx(400_000 + 3_000 * 160, rel=0.01)
    assert service.median_ns(16, 300) > service.median_ns(8, 200)        # beyond the grid
    assert all(abs(r["fit_error"]) < 0.01 for r in service.table())
    kept = LengthService.from_json(service.to_json())
    assert kept.samples == service.samples and kept.coefficients == service.coefficients


def test_the_recommendation_meets_the_target_on_the_simulator():
    lengths = corpus()
    assert bucket_candidates(lengths)[0] == () and all(b[-1] < max(lengths) for b in bucket_candidates(lengths)[1:])
    plan = plan_by_length("m", base_config(), synthetic_service(), lengths, [Load("concurrency", 16.0)],
                          delays=[0, 2000], slo_p99_ms=40.0, requests=1500)
    assert isinstance(plan, LengthPlan) and plan.chosen is not None
    chosen = plan.chosen
    assert chosen["p99_ms"] <= 40.0 and chosen["meets"] and chosen["padding"] == "pad"
    meeting = [r for r in plan.results if r["meets"]]
    assert round(chosen["throughput"], -1) == max(round(r["throughput"], -1) for r in meeting)
    # padding pays here: at 16 clients the padded batches serve more than equal lengths alone
    unpadded = max(r["throughput"] for r in plan.results if r["padding"] == "none")
    assert chosen["throughput"] > 1.5 * unpadded
    assert all(r["waste"] >= 1.0 for r in plan.results if r["padding"] == "pad")
    assert all(r["waste"] == 1.0 for r in plan.results if r["padding"] == "none")
    # the same candidate simulated again gives the same figures (seeded)
    again = plan.run(chosen["candidate"], Load("concurrency", 16.0))
    assert again["p99_ms"] == chosen["p99_ms"] and again["throughput"] == chosen["throughput"]
    # its config text is config.pbtxt that the padding rules read back
    text = plan.config_text()
    cfg = text_format.Parse(f'name: "m" max_batch_size: 8 {INPUTS} {text}', mc.ModelConfig())
    rules = padding(cfg)
    assert rules is not None and cfg.dynamic_batching.max_queue_delay_microseconds == chosen["max_queue_delay_us"]
    assert rules.max_batch_tokens == chosen["max_batch_tokens"]
    page = plan._repr_html_()
    assert "<table>" in page and "length_buckets" in page and "<script" not in page
    assert "chosen:" in repr(plan)
    # a target nothing meets: no recommendation, and why
    none = plan_by_length("m", base_config(), synthetic_service(), lengths, [Load("concurrency", 16.0)],
                          buckets=[()], budgets=[0], delays=[0], slo_p99_ms=0.01, requests=300)
    assert none.chosen is None and "no candidate" in none.why and "no candidate" in none.config_text()


@pytest.mark.parametrize("bad, words", [
    ([], "empty"),
    ([3, -1], r"lengths\[1\] is -1"),
    ([3, 0], r"lengths\[1\] is 0"),
    ([2.5], "whole number"),
    ([float("nan")], "whole number"),
    (["a text", None], r"lengths\[1\] is NoneType"),
    ([True], "bool"),
    ("one text", "list of texts"),
    (42, "list of texts"),
    (range(MAX_LENGTHS + 1), "random sample"),
])
def test_bad_lengths_are_refused(bad, words):
    with pytest.raises(InvalidArgument, match=words):
        token_counts(bad)


def test_texts_are_counted():
    assert token_counts(["one two three", "", np.int64(5), 7.0]) == [3, 1, 5, 7]

    class Tokenizer:
        def encode(self, text: str) -> list[int]:
            return [101] + [7] * len(text) + [102]
    assert token_counts(["abc", "de"], Tokenizer()) == [5, 4]
    assert token_counts(["abc"], lambda text: {"input_ids": [1, 2]}) == [2]


def test_refusals_of_the_plan():
    with pytest.raises(InvalidArgument, match="exceed the model's max_length 512"):
        plan_by_length("m", base_config(), synthetic_service(), [10, 600], [Load("qps", 10.0)])
    with pytest.raises(InvalidArgument, match="increasing"):
        plan_by_length("m", base_config(), synthetic_service(), [10, 60], [Load("qps", 10.0)], buckets=[(64, 16)])
    fixed = base_config()
    fixed["input"] = [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}]
    with pytest.raises(InvalidArgument, match="ragged_batching"):
        plan_by_length("m", fixed, synthetic_service(), [10], [Load("qps", 10.0)])


# -- a served ONNX [batch, length] model, measured end to end -------------------------------------

VOCAB, HIDDEN = 100, 16


def encoder() -> bytes:
    """The masked mean of token embeddings, each through a matrix product: work per token."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Constant", [], ["axis1"], value=helper.make_tensor("a1", TensorProto.INT64, [1], [1])),
        helper.make_node("Constant", [], ["axis2"], value=helper.make_tensor("a2", TensorProto.INT64, [1], [2])),
        helper.make_node("Gather", ["TABLE", "input_ids"], ["emb"], axis=0),
        helper.make_node("MatMul", ["emb", "W"], ["h"]),
        helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["maskf", "axis2"], ["mask3"]),
        helper.make_node("Mul", ["h", "mask3"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "axis1"], ["pooled"], keepdims=0),
    ]
    return _save(helper.make_graph(
        nodes, "encoder",
        [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "length"])
         for n in ("input_ids", "attention_mask")],
        [helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", HIDDEN])],
        [numpy_helper.from_array(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32), "TABLE"),
         numpy_helper.from_array(rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32), "W")]), None)


def test_a_served_model_is_measured_by_length_and_planned(kernel_server):
    jt.serve(encoder(), "enc", max_batch_size=8, max_queue_delay_us=1000,
             config='parameters { key: "max_length" value: { string_value: "256" } }')
    texts = [" ".join(["word"] * n) for n in corpus(400) if n <= 256]
    plan = jt.simulate("enc", concurrency=4, lengths=texts, slo_p99_ms=1000, length_grid=([1, 8], [8, 64, 256]),
                       repeats=6, max_queue_delay_us=[0, 1000], length_buckets=[(), (32, 96)],
                       max_batch_tokens=[0, 512], requests=400, burst_s=0, progress=False)
    assert isinstance(plan, LengthPlan)
    service = plan.service
    assert sorted(service.samples) == [(b, n) for b in (1, 8) for n in (8, 64, 256)]
    assert all(1 <= len(v) <= 2 for v in service.samples.values())  # repeats // 3 (a delta another
    # request shared is dropped)
    assert service.base.overhead_ns > 0
    assert "on a copy without queue delay" in service.base.method      # the served one has a delay
    # more tokens take longer: the fit rises with the batch's tokens
    assert service.median_ns(8, 256) > service.median_ns(1, 8)
    assert len(plan.results) == 2 * 2 * 2 + 2 and plan.chosen is not None
    assert {r["padding"] for r in plan.results} == {"pad", "none"}
    # the served model's config with a padded candidate's settings pads (the chosen one may be
    # without padding: a model this fast at 4 clients may not need it)
    padded = next(r for r in plan.results if r["padding"] == "pad" and r["length_buckets"] == "32,96")
    rules = padding(jt_config(plan.config(padded["candidate"])))
    assert rules is not None and rules.buckets == (32, 96) and rules.max_length == 256
    with pytest.raises(InvalidArgument, match="empty"):
        jt.simulate("enc", concurrency=4, lengths=[])
    with pytest.raises(InvalidArgument, match="qps= "):
        jt.simulate("enc", lengths=[3, 4], service=service)
    with pytest.raises(InvalidArgument, match="LengthService"):
        jt.simulate("enc", concurrency=2, lengths=[3, 4], service=service.base)


def jt_config(config: dict) -> mc.ModelConfig:
    from jupyter_triton.config.formats import config_from_json
    return config_from_json(config, "enc")
