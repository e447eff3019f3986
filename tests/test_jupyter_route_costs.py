"""What the Jupyter server's v2 routes keep of Jupyter while paying less per request: the
default headers (recorded once per route class, copied with the current Date) are Jupyter's
own, configured headers included; the request-duration metric counts every request with
Jupyter's labels; the remembered route matches send every path where tornado's walk
through the patterns would, also past the bound on remembered paths."""
from __future__ import annotations

import email.utils
import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tornado.httpclient import HTTPClientError

from conftest import TOKEN
from jupyter_triton import serverext

AUTH = {"Authorization": f"token {TOKEN}"}
CSP = "frame-ancestors 'none'; default-src 'self'"
ROW = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                              "data": [1.0] * 16}]})
# Set per request: not part of the defaults the two handlers should share.
PER_REQUEST = {"Date", "Content-Length", "Content-Type", "Etag", "Access-Control-Allow-Origin",
               "Set-Cookie"}     # Jupyter mints a login cookie; ours never does (test_jupyter_access)


@pytest.fixture
def jp_server_config(jp_server_config):
    headers = {"X-Frame-Options": "DENY", "Content-Security-Policy": CSP}
    return {**jp_server_config,
            "ServerApp": {**jp_server_config["ServerApp"], "tornado_settings": {"headers": headers}}}


def defaults(resp) -> dict[str, str]:
    return {k: v for k, v in resp.headers.get_all() if k not in PER_REQUEST}


async def test_default_headers_are_jupyters_on_every_request(jp_triton, jp_fetch):
    jupyter_own = defaults(await jp_fetch("api/status", headers=AUTH))
    assert jupyter_own["X-Frame-Options"] == "DENY" and jupyter_own["X-Content-Type-Options"] == "nosniff"
    # Jupyter's API handlers add "default-src 'none'" to the policy; a plain JupyterHandler
    # (ours) sends the configured one as it is.
    assert jupyter_own["Content-Security-Policy"].startswith(CSP)
    jupyter_own["Content-Security-Policy"] = CSP
    for _ in range(3):      # the first request of the class records, the next ones copy
        live = await jp_fetch("v2/health/live", headers=AUTH)
        assert defaults(live) == jupyter_own
        sent = email.utils.parsedate_to_datetime(live.headers["Date"]).timestamp()
        assert abs(sent - time.time()) < 5
        infer = await jp_fetch("v2/models/linear/infer", method="POST", body=ROW, headers=AUTH)
        assert defaults(infer) == jupyter_own
        assert infer.headers["Content-Type"] == "application/json"
    # An error response is cleared and rebuilt from the same record.
    with pytest.raises(HTTPClientError) as err:
        await jp_fetch("v2/models/missing/infer", method="POST", body=ROW, headers=AUTH)
    assert err.value.code == 404 and defaults(err.value.response) == jupyter_own
    assert "missing" in json.loads(err.value.response.body)["error"]


def duration_counts(body: str) -> dict[tuple[str, str, str], float]:
    return {(s.labels["handler"], s.labels["method"], s.labels["status_code"]): s.value
            for fam in text_string_to_metric_families(body) for s in fam.samples
            if s.name == "http_request_duration_seconds_count"}


@pytest.mark.parametrize("debug_shown", [False, True])
async def test_request_duration_metric_counts_every_request(jp_triton, jp_fetch, monkeypatch,
                                                            debug_shown):
    # pytest's log capture shows DEBUG (Jupyter's own log_request then runs); a server's
    # default logging does not, and then only the metric is recorded: both counted alike.
    monkeypatch.setattr(serverext, "_shows_debug", lambda logger: debug_shown)
    before = duration_counts((await jp_fetch("metrics", headers=AUTH)).body.decode())
    for _ in range(5):
        await jp_fetch("v2/models/linear/infer", method="POST", body=ROW, headers=AUTH)
    for _ in range(2):
        with pytest.raises(HTTPClientError) as err:
            await jp_fetch("v2/models/missing/ready", headers=AUTH)
    refused = str(err.value.code)           # an error goes through Jupyter's own log_request
    after = duration_counts((await jp_fetch("metrics", headers=AUTH)).body.decode())
    infer = ("jupyter_triton.frontends.http.ModelInfer", "POST", "200")
    missing = ("jupyter_triton.frontends.http.ModelReady", "GET", refused)
    assert after[infer] - before.get(infer, 0) == 5
    assert after[missing] - before.get(missing, 0) == 2


async def test_remembered_routes_match_as_tornado_does(jp_triton, jp_fetch, monkeypatch):
    routers = [r.target for r in jp_triton.web_app.default_router.rules
               if isinstance(r.target, serverext._RememberedRoutes)]
    assert len(routers) == 1 and routers[0].prefix == "/user/alice/v2"
    monkeypatch.setattr(serverext._RememberedRoutes, "LIMIT", 4)
    for _ in range(2):      # the first pass matches, the second finds what was remembered
        assert json.loads((await jp_fetch("v2/models/linear/versions/1/ready", headers=AUTH)).body
                          ) == {"name": "linear", "ready": True}
        meta = json.loads((await jp_fetch("v2/models/linear", headers=AUTH)).body)
        assert meta["name"] == "linear" and meta["versions"] == ["1"]
        assert json.loads((await jp_fetch("v2", headers=AUTH)).body)["name"] == "triton"
        assert (await jp_fetch("api/status", headers=AUTH)).code == 200     # Jupyter's own
        for name in ("m0", "m1", "m2", "m3", "m4", "m5"):                  # past the bound
            with pytest.raises(HTTPClientError) as err:
                await jp_fetch(f"v2/models/{name}/versions/7/config", headers=AUTH)
            assert err.value.code in (400, 404)
            assert name in json.loads(err.value.response.body)["error"]
        with pytest.raises(HTTPClientError) as err:                         # our catch-all
            await jp_fetch("v2/nothing/here", headers=AUTH)
        assert err.value.code == 404 and set(json.loads(err.value.response.body)) == {"error"}
        with pytest.raises(HTTPClientError) as err:                         # not ours: Jupyter's 404
            await jp_fetch("v2x/models", headers=AUTH)
        assert err.value.code == 404 and not err.value.response.body.startswith(b'{"error"')
    assert len(routers[0].matches) <= 4
