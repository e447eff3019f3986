"""The trace and logging extensions on the Jupyter server's routes: the user's own
credentials reach them (changing what the server traces or logs is the user's), an
inference key does not."""
from __future__ import annotations

import json

import pytest
from tornado.httpclient import HTTPClientError

from conftest import INFER_KEY, TOKEN

AUTH = {"Authorization": f"token {TOKEN}"}
KEY = {"Authorization": f"Bearer {INFER_KEY}"}


async def test_trace_and_log_settings_through_jupyter(jp_triton, jp_fetch):
    resp = await jp_fetch("v2/trace/setting", headers=AUTH)
    assert json.loads(resp.body)["trace_level"] == ["OFF"]
    resp = await jp_fetch("v2/models/linear/trace/setting", method="POST", headers=AUTH,
                          body=json.dumps({"trace_level": ["TIMESTAMPS"], "trace_rate": "1"}))
    assert json.loads(resp.body)["trace_level"] == ["TIMESTAMPS"]
    row = json.dumps({"id": "through-jupyter", "inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}]})
    await jp_fetch("v2/models/linear/infer", method="POST", body=row, headers=AUTH)
    engine = jp_triton.extension_manager.extension_apps["jupyter_triton"].copy().pop().engine
    assert any(e.get("request_id") == "through-jupyter" and e["model_name"] == "linear"
               for e in engine.tracing.recent())
    resp = await jp_fetch("v2/logging", headers=AUTH)
    assert set(json.loads(resp.body)) == {"log_file", "log_info", "log_warning", "log_error",
                                          "log_verbose_level", "log_format"}


@pytest.mark.parametrize("path,method,body", [
    ("v2/trace/setting", "GET", None),
    ("v2/trace/setting", "POST", json.dumps({"trace_level": ["TIMESTAMPS"]})),
    ("v2/models/linear/trace/setting", "POST", json.dumps({"trace_rate": "1"})),
    ("v2/logging", "POST", json.dumps({"log_verbose_level": 1})),
])
async def test_an_inference_key_cannot_change_tracing_or_logging(jp_triton, jp_fetch, path, method, body):
    with pytest.raises(HTTPClientError) as err:
        await jp_fetch(path, method=method, body=body, headers=KEY)
    assert err.value.code == 403
    assert "error" in json.loads(err.value.response.body)
