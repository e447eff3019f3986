"""The Jupyter traits of the observability features: ``JupyterTriton.trace_config`` (as
tritonserver's --trace-config) and ``histogram_latencies`` / ``histogram_buckets_ms``."""
from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import TOKEN

AUTH = {"Authorization": f"token {TOKEN}"}
ROW = json.dumps({"id": "traited", "inputs": [
    {"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}]})


@pytest.fixture
def jp_server_config(jp_server_config):
    traits = {**jp_server_config["JupyterTriton"], "trace_config": ["level=TIMESTAMPS", "rate=1"],
              "histogram_latencies": True, "histogram_buckets_ms": [1.0, 30000.0]}
    return {**jp_server_config, "JupyterTriton": traits}


async def test_traits_turn_on_tracing_and_histograms(jp_triton, jp_fetch):
    settings = json.loads((await jp_fetch("v2/trace/setting", headers=AUTH)).body)
    assert settings["trace_level"] == ["TIMESTAMPS"] and settings["trace_rate"] == "1"
    for _ in range(2):
        await jp_fetch("v2/models/linear/infer", method="POST", body=ROW, headers=AUTH)
    body = (await jp_fetch("metrics", headers=AUTH)).body.decode()
    buckets = {s.labels["le"]: s.value for fam in text_string_to_metric_families(body)
               for s in fam.samples
               if s.name == "nv_inference_request_histogram_ms_bucket" and s.labels["model"] == "linear"}
    assert set(buckets) == {"1", "30000", "+Inf"} and buckets["+Inf"] == 2
    engine = jp_triton.extension_manager.extension_apps["jupyter_triton"].copy().pop().engine
    assert sum(1 for e in engine.tracing.recent() if e.get("request_id") == "traited") == 2
