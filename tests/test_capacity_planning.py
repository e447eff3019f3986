"""Capacity planning from the notebook: ``simulate`` measures a served model's execution
times through the protocol (a sweep over batch sizes), drives the engine's own batcher on a
virtual clock with them, and answers from one table: the config meeting an SLO, instances
for a target QPS, what a bulk class does to interactive latency; measured figures from
``tune()`` side by side; ``apply()`` serves the chosen config."""
from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

import jupyter_triton as jt
from jupyter_triton.engine.options import EngineOptions
from jupyter_triton.kernel import api, discovery
from jupyter_triton.planning import (Load, ServiceModel, TrafficClass, bursty, from_trace, measure,
                                     poisson, simulate)
from jupyter_triton.planning.capacity import LOOP_MODELLED, CapacityPlan
from jupyter_triton.planning.sweep import sweep_sizes
from jupyter_triton.protocol.errors import InvalidArgument, NotFound

sys.path.insert(0, str(Path(__file__).resolve().parent))
from onnx_models import linear  # noqa: E402

pytestmark = pytest.mark.timeout(240)

# An execution costs 3 ms plus 0.25 ms a row: batching pays, and the sweep must see the slope.
EMBEDDER_PY = '''
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        rows = sum(pb_utils.get_input_tensor_by_name(r, "X").as_numpy().shape[0] for r in requests)
        time.sleep(0.003 + 0.00025 * rows)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2)]) for r in requests]
'''
IO = dict(inputs=[("X", "FP32", [-1, 4])], outputs=[("Y", "FP32", [-1, 4])])


@pytest.fixture
def kernel_server(tmp_path: Path):
    discovery.reset()
    conn = discovery.start_in_kernel(tmp_path / "repo")
    yield conn
    discovery.stop_in_kernel()
    discovery.reset()
    api.uploaded.clear()


def test_a_simulated_grid_answers_from_its_table(kernel_server):
    jt.serve(EMBEDDER_PY, "embedder", max_batch_size=8, **IO)

    # the sweep: every size measured, each execution at least the model's sleep
    service = measure(kernel_server, "embedder", repeats=6)
    assert sorted(service.samples) == sweep_sizes(8) == [1, 2, 4, 8]
    for rows, samples in service.samples.items():
        assert len(samples) == 6
        assert min(samples) >= (3 + 0.25 * rows) * 1e6
    # 7 rows more: 1.75 ms more (the fastest samples: a stall only adds)
    assert min(service.samples[8]) > min(service.samples[1]) + 1e6
    m2, m4 = service.median_ns(2), service.median_ns(4)
    assert min(m2, m4) <= service.median_ns(3) <= max(m2, m4)      # interpolated
    assert service.median_ns(32) > service.median_ns(8)                  # extrapolated
    assert service.overhead_ns > 0
    # the saturating burst: an instance's hand-off per batch, the in-kernel server's event
    # loop's CPU per request (its thread found), the stalls it saw
    assert 0 <= service.handoff_ns < 20e6 and 0 < service.loop_ns < 20e6
    assert service.stall_rate >= 0 and all(v > 0 for v in service.stall_ns)
    assert service(1, random.Random(0)) >= min(service.samples[1]) + service.handoff_ns
    assert service.parallel_ns == max(0, service.overhead_ns - service.loop_ns - service.handoff_ns)
    assert measure(kernel_server, "embedder") is service                # kept per model version
    kept = ServiceModel.from_json(json.loads(json.dumps(service.to_json())))
    assert kept.samples == service.samples
    assert (kept.handoff_ns, kept.loop_ns, kept.stall_ns, kept.stall_rate) == \
        (service.handoff_ns, service.loop_ns, service.stall_ns, service.stall_rate)
    assert service.plot_png().startswith(b"\x89PNG")

    # 8 configs x 3 loads, planned for a host of the server's own: the stalls this shared
    # machine imposed in the burst depend on its neighbours of the moment, and every p99 with
    # them (they are drawn below, and in test_simulation)
    started = time.perf_counter()
    plan = simulate("embedder", qps=[100, 400, 1600], max_batch_size=[4, 8],
                    max_queue_delay_us=[0, 2000], instances=[1, 2], service=service,
                    slo_p99_ms=30, bulk=TrafficClass("bulk", qps=60, rows=8), stalls=False)
    took = time.perf_counter() - started
    stalled = simulate("embedder", qps=[400], max_batch_size=[8], max_queue_delay_us=[0],
                       service=service)
    if service.stall_ns:
        assert stalled.results[0]["p99_ms"] >= plan.run(8, 0, 1, Load("qps", 400.0))["p99_ms"]
    assert took < 30, f"24 simulations took {took:.1f} s"          # ~2 s here; shared machine
    assert len(plan.results) == 24
    for r in plan.results:
        assert r["p50_ms"] <= r["p95_ms"] <= r["p99_ms"]
        assert r["p50_ms"] >= 3 + service.overhead_ns / 1e6 - 0.5     # never below one execution
        assert 1 <= r["mean_batch"] <= r["max_batch_size"]
        assert sum(r["batch_histogram"].values()) > 0
    row = {(r["max_batch_size"], r["max_queue_delay_us"], r["instances"], r["offered"]): r
           for r in plan.results}
    # batching shows: at 1600 qps one instance of batch 4 cannot keep up (~4 ms a batch of 4),
    # batch 8 with a delay forms bigger batches than without
    assert not plan.kept_up(row[(4, 0, 1, 1600)])
    assert row[(8, 2000, 1, 400)]["mean_batch"] > row[(8, 0, 1, 100)]["mean_batch"]
    assert row[(8, 0, 2, 1600)]["throughput"] > row[(8, 0, 1, 1600)]["throughput"] * 0.99

    # the SLO answer is the table's: no row at a higher load meets the SLO
    best = plan.best(30)
    assert best.row in plan.results and best.row["p99_ms"] <= 30 and plan.kept_up(best.row)
    assert not [r for r in plan.results if r["offered"] > best.row["offered"]
                and plan.kept_up(r) and r["p99_ms"] <= 30]
    assert plan.best(0.001).config is None and "no config" in plan.best(0.001).why

    # instances for a target: the first count that meets it, the one before does not
    need = plan.instances_for(1600, 30, config={"max_batch_size": 4, "max_queue_delay_us": 0})
    n = need.config["instances"]
    assert n >= 2 and need.row["p99_ms"] <= 30 and plan.kept_up(need.row)
    assert need.row is plan.run(4, 0, n, Load("qps", 1600.0))
    if n == 2:
        assert need.rows[0] is row[(4, 0, 1, 1600)]                    # the table's own row
    assert not (plan.kept_up(need.rows[-2]) and need.rows[-2]["p99_ms"] <= 30)

    # a bulk class in the same window costs the interactive p95; at a lower priority less
    effect = plan.bulk_effect(qps=400, config={"max_batch_size": 8, "max_queue_delay_us": 2000,
                                               "instances": 1})
    alone, same, low, split = (effect.p95(i) for i in range(4))
    assert same > alone and low < same and split == alone
    assert all(r["bulk_throughput"] > 0 for r in effect.rows[1:])

    page = plan._repr_html_()
    assert 'src="data:image/png;base64,' in page and "<table>" in page and "interactive" in page
    assert "<script" not in page
    assert "CapacityPlan(embedder: 24 simulations" in repr(plan)


def test_closed_loop_beside_tune_and_apply(kernel_server):
    jt.serve(EMBEDDER_PY, "embedder", max_batch_size=4, **IO)
    t = jt.tune("embedder", max_batch_size=[4, 8], max_queue_delay_us=[0], concurrency=[4],
                seconds=1, load_generator="loadgen")
    plan = simulate("embedder", concurrency=[1, 4], max_batch_size=[4, 8], repeats=4, measured=t)
    # max_batch_size 8 is past the served 4: measured on a temporary copy, then removed
    assert max(plan.service.samples) == 8 and "copy" in plan.service.method
    assert not [r for r in jt.models() if r["name"] in ("embedder__sim", "embedder__tune")]
    side = plan.compare(t)
    assert [(r["max_batch_size"], r["concurrency"]) for r in side] == [(4, 4), (8, 4)]
    for r in side:
        assert r["measured_throughput"] > 0 and r["simulated_throughput"] > 0
        assert r["simulated_p50_ms"] <= r["simulated_p99_ms"]
        assert 1 <= r["simulated_mean_batch"] <= 4
    assert "measured by tune() beside simulated" in plan._repr_html_()
    # closed loop at c=1 never batches; four clients do
    c1 = plan.run(4, 0, 1, Load("concurrency", 1.0))
    assert c1["mean_batch"] == 1.0 and plan.run(4, 0, 1, Load("concurrency", 4.0))["mean_batch"] > 1

    served = plan.apply({"max_batch_size": 8, "max_queue_delay_us": 700, "instances": 2})
    config = api._client().config("embedder")
    assert served.version == 2 and config["max_batch_size"] == 8
    assert int(config["dynamic_batching"]["max_queue_delay_microseconds"]) == 700
    assert config["instance_group"][0]["count"] == 2
    y = served(np.ones((1, 4), np.float32))
    assert np.asarray(y).tolist() == [[2.0] * 4]


@pytest.mark.skipif(not LOOP_MODELLED, reason="engine.simulation has no loop_ns yet")
def test_the_servers_event_loop_spreads_a_closed_loop():
    """Answers written in turn come back apart: at a short queue delay the batches are smaller
    than the concurrency, and throughput stays under one request per loop_ns."""
    service = ServiceModel("m", "1", {b: [int((3 + 0.25 * b) * 1e6)] * 5 for b in (1, 4, 16)})
    config = {"name": "m", "backend": "python", "max_batch_size": 16, "dynamic_batching": {},
              "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [4]}],
              "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [4]}]}
    load = Load("concurrency", 16.0)
    fixed = CapacityPlan("m", config, service, [load], [(16, 500, 1)], overhead_ns=500_000)
    looped = CapacityPlan("m", config, service, [load], [(16, 500, 1)], overhead_ns=0, loop_ns=500_000)
    [a], [b] = fixed.results, looped.results
    # a delay spent side by side keeps the clients' groups whole (they start spread over one
    # round trip, so into a few groups); the loop taken in turn spreads them further
    assert a["mean_batch"] >= 6
    assert b["mean_batch"] < a["mean_batch"] and b["throughput"] < 1e9 / 500_000


def test_traffic_shapes():
    arrivals = poisson(500, 4000, seed=1)
    rate = len(arrivals) / (arrivals[-1].t_ns / 1e9)
    assert 450 < rate < 550 and arrivals == poisson(500, 4000, seed=1)
    assert arrivals != poisson(500, 4000, seed=2)
    on_off = bursty(1000, on_s=0.1, off_s=0.4, requests=600)
    phases = [(a.t_ns / 1e9) % 0.5 for a in on_off]
    assert all(p < 0.1 for p in phases)                  # nothing sent while off
    mixed = bursty(1000, 0.1, 0.4, 600, off_qps=50)
    assert any((a.t_ns / 1e9) % 0.5 >= 0.1 for a in mixed)
    with pytest.raises(InvalidArgument):
        poisson(0)


def test_a_recorded_trace_replays_as_traffic(tmp_path):
    from jupyter_triton.standalone import start_in_thread
    repo = tmp_path / "models"
    linear(np.ones((16, 4), np.float32), repo / "lin" / "1" / "model.onnx")
    trace = tmp_path / "trace.json"
    server = start_in_thread(EngineOptions(model_repository=repo, model_control_mode="explicit",
                                           load_models=["*"],
                                           trace_config=[f"triton,file={trace}", "level=TIMESTAMPS",
                                                         "rate=1"]),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=None)
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        x = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        x.set_data_from_numpy(np.ones((1, 16), np.float32))
        sent = []
        for _ in range(12):
            sent.append(time.monotonic_ns())
            client.infer("lin", [x])
            time.sleep(0.01)
    finally:
        server.close()
    arrivals = from_trace(trace, "lin")
    assert len(arrivals) == 12 and arrivals[0].t_ns == 0
    gaps = [b.t_ns - a.t_ns for a, b in zip(arrivals, arrivals[1:])]
    assert all(g >= 10e6 for g in gaps)                   # the client slept 10 ms between
    assert len(from_trace(trace, "lin", speed=2.0)) == 12
    assert from_trace(trace, "lin", speed=2.0)[-1].t_ns == pytest.approx(arrivals[-1].t_ns / 2, abs=1)
    with pytest.raises(InvalidArgument, match="no request"):
        from_trace(trace, "other")


def test_refusals(kernel_server, tmp_path):
    with pytest.raises(NotFound):
        simulate("nothing_here", qps=[10])
    jt.serve(EMBEDDER_PY, "embedder", max_batch_size=4, **IO)
    with pytest.raises(InvalidArgument, match="qps"):
        simulate("embedder")
    with pytest.raises(InvalidArgument, match="qps"):
        simulate("embedder", qps=[0])
    with pytest.raises(InvalidArgument, match="instances"):
        simulate("embedder", qps=[10], instances=[0])
    with pytest.raises(InvalidArgument, match="replicas"):
        simulate("embedder", qps=[10], replicas=0)
    from jupyter_triton.kernel import simulate as kernel_simulate     # the notebook API's names
    with pytest.raises(InvalidArgument, match="qps"):
        kernel_simulate("embedder", qps=[-5])
    with pytest.raises(InvalidArgument, match="instances"):
        jt.simulate("embedder", qps=[10], instances=[0])
