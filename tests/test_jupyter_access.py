"""Who reaches what on the Jupyter server's v2 routes: an inference key is enough for
Triton's own load generator (statistics are in its scope, load is not); load/unload are
their own authorizer action ("execute"); a header-token API call is as checked as Jupyter
checks it, without a login cookie minted for a client that never sends it back."""
from __future__ import annotations

import asyncio
import csv
import json
import logging
import subprocess
from http.cookies import SimpleCookie

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from jupyter_server.auth import IdentityProvider, User
from jupyter_server.auth.authorizer import AllowAllAuthorizer, Authorizer
from tornado.httpclient import HTTPClientError
from tritonclient.utils import InferenceServerException

from conftest import INFER_KEY, TOKEN, W, in_thread
from onnx_models import linear
from server_waits import until
from test_perf_analyzer import PERF_ANALYZER, requires_perf_analyzer

AUTH = {"Authorization": f"token {TOKEN}"}
KEY = {"Authorization": f"Bearer {INFER_KEY}"}
ROW = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                              "data": [1.0] * 16}]})


class RecordingAuthorizer(Authorizer):
    """Jupyter's authorizer hook as a deployment would configure it: records what it was
    asked and refuses the actions in ``denied``."""
    denied: set[str] = set()
    asked: list[tuple[str, str]] = []

    def is_authorized(self, handler, user, action, resource) -> bool:
        RecordingAuthorizer.asked.append((action, resource))
        return action not in RecordingAuthorizer.denied


@pytest.fixture
def authorizer(request) -> type[Authorizer]:
    """The server's authorizer class: RecordingAuthorizer unless a test parametrizes it."""
    return getattr(request, "param", RecordingAuthorizer)


@pytest.fixture
def identity_provider(request) -> type[IdentityProvider] | None:
    """The server's identity provider class (None: Jupyter's) where a test parametrizes it."""
    return getattr(request, "param", None)


@pytest.fixture
def triton_options(request) -> dict:
    """JupyterTriton traits a test parametrizes, on top of this module's."""
    return getattr(request, "param", {})


@pytest.fixture
def jp_server_config(jp_server_config, authorizer, identity_provider, triton_options):
    RecordingAuthorizer.denied, RecordingAuthorizer.asked = set(), []
    server = {**jp_server_config["ServerApp"], "authorizer_class": authorizer}
    if identity_provider is not None:
        server["identity_provider_class"] = identity_provider
    return {**jp_server_config, "ServerApp": server,
            "JupyterTriton": {**jp_server_config["JupyterTriton"], "grpc_port": 0, "http_data_port": 0,
                              **triton_options}}


def client(port: int, base: str) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(f"127.0.0.1:{port}{base.rstrip('/')}", network_timeout=60)


def one_row() -> list[httpclient.InferInput]:
    inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(np.ones((1, 16), np.float32))
    return [inp]


async def test_an_inference_key_reads_statistics_but_never_loads(jp_triton, jp_http_port, jp_base_url):
    def story():
        c = client(jp_http_port, jp_base_url)
        try:
            out = c.infer("linear", one_row(), headers=dict(KEY)).as_numpy("OUTPUT0")
            stats = c.get_inference_statistics("linear", headers=dict(KEY))
            config = c.get_model_config("linear", headers=dict(KEY))
            refused = []
            for call in (lambda: c.load_model("linear", headers=dict(KEY)),
                         lambda: c.unload_model("linear", headers=dict(KEY)),
                         lambda: c.get_model_repository_index(headers=dict(KEY))):
                with pytest.raises(InferenceServerException) as err:
                    call()
                refused.append((err.value.status(), err.value.message()))
            return out, stats, config, refused
        finally:
            c.close()

    out, stats, config, refused = await in_thread(story)
    np.testing.assert_allclose(out, np.ones((1, 16), np.float32) @ W, rtol=1e-5)
    assert stats["model_stats"][0]["inference_stats"]["success"]["count"] == 1
    assert config["name"] == "linear"
    assert [status for status, _ in refused] == ["403"] * 3
    assert all("does not reach the 'model-repository' API" in message for _, message in refused)


@requires_perf_analyzer
async def test_perf_analyzer_with_an_inference_key(jp_triton, jp_http_port, jp_base_url, tmp_path):
    # perf_analyzer reads /v2, the model's config and metadata, and /stats (statistics).
    # A fixed count of requests, stability not required: what is tested is access, not speed.
    cmd = [PERF_ANALYZER, "-m", "linear", "-u", f"127.0.0.1:{jp_http_port}{jp_base_url.rstrip('/')}",
           "-H", f"Authorization: Bearer {INFER_KEY}", "--concurrency-range", "1",
           "--measurement-mode", "count_windows", "--measurement-request-count", "30",
           "--max-trials", "6", "--stability-percentage", "10000", "-f", str(tmp_path / "r.csv")]
    proc = await in_thread(lambda: subprocess.run(cmd, capture_output=True, text=True, timeout=120))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    with (tmp_path / "r.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 and float(rows[0]["Inferences/Second"]) > 0
    assert "Server:" in proc.stdout and "Successful request count" in proc.stdout


async def test_load_is_the_execute_action_apart_from_inference(jp_triton, jp_http_port, jp_base_url):
    RecordingAuthorizer.denied = {"execute"}

    def story():
        c = client(jp_http_port, jp_base_url)
        try:
            out = c.infer("linear", one_row(), headers=dict(AUTH)).as_numpy("OUTPUT0")
            names = {row["name"] for row in c.get_model_repository_index(headers=dict(AUTH))}
            with pytest.raises(InferenceServerException) as load:
                c.load_model("linear_copy", headers=dict(AUTH), config=json.dumps(
                    {"name": "linear_copy", "backend": "onnxruntime", "max_batch_size": 8}),
                    files={"file:1/model.onnx": linear(W)})
            with pytest.raises(InferenceServerException) as unload:
                c.unload_model("linear", headers=dict(AUTH))
            return out, names, load.value, unload.value, c.is_model_ready("linear", headers=dict(AUTH))
        finally:
            c.close()

    out, names, load, unload, still_ready = await in_thread(story)
    np.testing.assert_allclose(out, np.ones((1, 16), np.float32) @ W, rtol=1e-5)
    assert "linear" in names                                   # the index is a read
    assert load.status() == "403" and "not authorized to execute jupyter_triton" in load.message()
    assert unload.status() == "403" and still_ready
    asked = {action for action, resource in RecordingAuthorizer.asked if resource == "jupyter_triton"}
    assert asked == {"read", "write", "execute"}

    RecordingAuthorizer.denied = {"write"}                     # inference refused, reads still fine
    def refused_infer():
        c = client(jp_http_port, jp_base_url)
        try:
            with pytest.raises(InferenceServerException) as err:
                c.infer("linear", one_row(), headers=dict(AUTH))
            return err.value, c.is_model_ready("linear", headers=dict(AUTH))
        finally:
            c.close()
    err, ready = await in_thread(refused_infer)
    assert err.status() == "403" and ready


async def test_a_header_token_call_gets_no_cookie_and_every_check(jp_triton, jp_fetch):
    resp = await jp_fetch("v2/models/linear/infer", method="POST", body=ROW, headers=AUTH)
    assert resp.code == 200 and "Set-Cookie" not in resp.headers
    assert json.loads(resp.body)["outputs"][0]["shape"] == [1, 4]

    # the same token from a name this server is not (DNS rebinding): refused as Jupyter does
    for headers in ({**AUTH, "Host": "attacker.example"}, {**KEY, "Host": "attacker.example"}):
        with pytest.raises(HTTPClientError) as err:
            await jp_fetch("v2/models/linear/infer", method="POST", body=ROW, headers=headers)
        assert err.value.code == 403
    with pytest.raises(HTTPClientError) as err:
        await jp_fetch("v2/models/linear/infer", method="POST", body=ROW,
                       headers={"Authorization": f"token {TOKEN}x"})
    assert err.value.code == 403

    # ?token= is Jupyter's own path (and it logs the browser in, with a cookie) ...
    resp = await jp_fetch("v2/models/linear/ready", headers={"Authorization": ""},
                          params={"token": TOKEN})
    assert resp.code == 200
    cookie = SimpleCookie()
    for header in resp.headers.get_list("Set-Cookie"):
        cookie.load(header)
    login = "; ".join(f"{k}={m.value}" for k, m in cookie.items())
    assert login
    # ... whose cookie reads, but cannot POST without Jupyter's XSRF token
    resp = await jp_fetch("v2/models/linear/config", headers={"Authorization": "", "Cookie": login})
    assert json.loads(resp.body)["name"] == "linear"
    with pytest.raises(HTTPClientError) as err:
        await jp_fetch("v2/models/linear/infer", method="POST", body=ROW,
                       headers={"Authorization": "", "Cookie": login})
    assert err.value.code == 403


class Outcomes(dict):
    """label -> ("ok", what the call returned) or (its status, its message)."""

    def attempt(self, label: str, fn) -> None:
        try:
            self[label] = ("ok", fn())
        except InferenceServerException as err:
            self[label] = (err.status(), err.message())


@pytest.mark.parametrize("authorizer", [AllowAllAuthorizer, RecordingAuthorizer], indirect=True)
async def test_the_grpc_port_takes_exactly_the_http_credentials(jp_triton, authorizer):
    (ext,) = jp_triton.extension_manager.extension_apps["jupyter_triton"]
    assert ext.grpc_address == "127.0.0.1"                       # loopback unless configured
    server_token = ext.server_token
    denied, unauthenticated = str(grpc.StatusCode.PERMISSION_DENIED), str(grpc.StatusCode.UNAUTHENTICATED)

    def story():
        g = grpcclient.InferenceServerClient(f"127.0.0.1:{ext.bound_grpc_port}")
        bearer = lambda t: {"authorization": f"Bearer {t}"}      # noqa: E731
        row = [grpcclient.InferInput("INPUT0", [1, 16], "FP32")]
        row[0].set_data_from_numpy(np.ones((1, 16), np.float32))
        outcome = Outcomes()
        attempt = outcome.attempt
        try:
            attempt("live, nothing", lambda: g.is_server_live())
            attempt("infer, nothing", lambda: g.infer("linear", row))
            attempt("infer, wrong", lambda: g.infer("linear", row, headers=bearer("nope")))
            attempt("infer, key", lambda: g.infer("linear", row, headers=bearer(INFER_KEY)).as_numpy("OUTPUT0"))
            attempt("stats, key", lambda: g.get_inference_statistics("linear", headers=bearer(INFER_KEY),
                                                                     as_json=True))
            attempt("load, key", lambda: g.load_model("linear", headers=bearer(INFER_KEY)))
            attempt("load, jupyter token", lambda: g.load_model("linear", headers={"authorization": f"token {TOKEN}"}))
            attempt("unload, server token", lambda: g.unload_model("simple", headers=bearer(server_token)))
            attempt("ready, server token", lambda: g.is_model_ready("simple", headers=bearer(server_token)))
        finally:
            g.close()
        return outcome

    outcome = await in_thread(story)
    assert outcome["live, nothing"][0] == unauthenticated
    assert outcome["infer, nothing"][0] == unauthenticated
    assert outcome["infer, wrong"][0] == unauthenticated
    status, out = outcome["infer, key"]
    assert status == "ok"
    np.testing.assert_allclose(out, np.ones((1, 16), np.float32) @ W, rtol=1e-5)
    assert outcome["stats, key"][0] == "ok"
    assert outcome["load, key"][0] == denied
    # Jupyter's token is what Jupyter's identity provider and authorizer say it is, as over
    # HTTP: a custom authorizer is asked (through a handler of the routes' class)
    assert outcome["load, jupyter token"][0] == "ok"
    if authorizer is RecordingAuthorizer:
        assert ("execute", "jupyter_triton") in RecordingAuthorizer.asked
    assert outcome["unload, server token"][0] == "ok"
    assert outcome["ready, server token"] == ("ok", False)


async def test_the_access_log_and_request_metric_of_the_data_path(jp_triton, jp_fetch, caplog):
    def infers_logged() -> int:
        return sum("200 POST /user/alice/v2/models/linear/infer" in r.getMessage() for r in caplog.records)

    def duration_count() -> float:
        from prometheus_client import REGISTRY
        return REGISTRY.get_sample_value("http_request_duration_seconds_count", {
            "handler": "jupyter_triton.frontends.http.ModelInfer", "method": "POST",
            "status_code": "200"}) or 0.0

    before = duration_count()
    caplog.set_level(logging.DEBUG)                 # someone reads DEBUG: Jupyter's own line
    await jp_fetch("v2/models/linear/infer", method="POST", body=ROW, headers=AUTH)
    assert infers_logged() == 1
    caplog.set_level(logging.INFO)                  # nobody does: the line is not even built
    caplog.clear()
    await jp_fetch("v2/models/linear/infer", method="POST", body=ROW, headers=AUTH)
    assert infers_logged() == 0
    with pytest.raises(HTTPClientError):            # a failure is logged as Jupyter logs it
        await jp_fetch("v2/models/linear/infer", method="POST", body=b"{oops", headers=AUTH)
    assert any("400 POST /user/alice/v2/models/linear/infer" in r.getMessage() for r in caplog.records)
    assert duration_count() == before + 2           # Jupyter's request metric counts both


async def test_the_data_port_takes_header_credentials_only(jp_triton):
    (ext,) = jp_triton.extension_manager.extension_apps["jupyter_triton"]
    assert ext.http_data_address == "127.0.0.1"

    def story():
        c = httpclient.InferenceServerClient(f"127.0.0.1:{ext.bound_http_data_port}", network_timeout=60)
        bearer = lambda t: {"Authorization": f"Bearer {t}"}      # noqa: E731
        outcome = Outcomes()
        attempt = outcome.attempt
        try:
            attempt("infer, nothing", lambda: c.infer("linear", one_row()))
            attempt("infer, jupyter token", lambda: c.infer("linear", one_row(), headers=dict(AUTH)))
            attempt("infer, wrong", lambda: c.infer("linear", one_row(), headers=bearer("nope")))
            attempt("infer, cookie", lambda: c.infer("linear", one_row(), headers={"Cookie": "a=b"}))
            attempt("infer, key", lambda: c.infer("linear", one_row(), headers=bearer(INFER_KEY)).as_numpy("OUTPUT0"))
            attempt("stats, key", lambda: c.get_inference_statistics("linear", headers=bearer(INFER_KEY)))
            attempt("load, key", lambda: c.load_model("linear", headers=bearer(INFER_KEY)))
            attempt("load, server token", lambda: c.load_model("linear", headers=bearer(ext.server_token)))
        finally:
            c.close()
        return outcome

    outcome = await in_thread(story)
    assert outcome["infer, nothing"][0] == "401" and outcome["infer, jupyter token"][0] == "ok"
    assert outcome["infer, wrong"][0] == "401" and outcome["infer, cookie"][0] == "401"
    status, out = outcome["infer, key"]
    assert status == "ok"
    np.testing.assert_allclose(out, np.ones((1, 16), np.float32) @ W, rtol=1e-5)
    assert outcome["stats, key"][0] == "ok"
    assert outcome["load, key"][0] == "403" and "model-repository" in outcome["load, key"][1]
    assert outcome["load, server token"][0] == "ok"



HUB_TOKENS = {"hub-token-alice": "alice", "hub-token-bob": "bob"}


class HubLikeIdentityProvider(IdentityProvider):
    """What a JupyterHub deployment configures (jupyterhub.singleuser's identity provider):
    the user is found from a hub API token in the Authorization header by an awaitable
    get_user that asks the hub (here: a table); each question is recorded."""
    asked: list[str] = []

    async def get_user(self, handler):
        scheme, _, token = handler.request.headers.get("Authorization", "").partition(" ")
        await asyncio.sleep(0)               # the hub's API is asked over the network
        HubLikeIdentityProvider.asked.append(token)
        name = HUB_TOKENS.get(token) if scheme.lower() == "token" else None
        return User(username=name) if name else None

    def is_token_authenticated(self, handler) -> bool:
        # A header token is no browser's: no XSRF check (as jupyterhub's HubAuth says)
        return handler.request.headers.get("Authorization", "").lower().startswith("token ")


class HubLikeAuthorizer(Authorizer):
    """Scopes per user, as a hub's scopes map onto Jupyter's actions: bob may only read."""

    def is_authorized(self, handler, user, action, resource) -> bool:
        return user.username == "alice" or action == "read"


@pytest.mark.parametrize("authorizer", [HubLikeAuthorizer], indirect=True)
@pytest.mark.parametrize("identity_provider", [HubLikeIdentityProvider], indirect=True)
async def test_a_hub_token_reaches_every_port_with_the_hubs_scopes(jp_triton, jp_fetch):
    """A JupyterHub API token is what a hub user sends: Jupyter's identity provider judges it
    on the Jupyter routes and, asked through the same public API, on the gRPC and data ports,
    with the scopes Jupyter's authorizer grants; a verdict is remembered, not asked per call."""
    (ext,) = jp_triton.extension_manager.extension_apps["jupyter_triton"]
    HubLikeIdentityProvider.asked = []
    alice = {"authorization": "token hub-token-alice"}
    bob = {"authorization": "token hub-token-bob"}

    def story():
        g = grpcclient.InferenceServerClient(f"127.0.0.1:{ext.bound_grpc_port}")
        c = httpclient.InferenceServerClient(f"127.0.0.1:{ext.bound_http_data_port}", network_timeout=60)
        row = [grpcclient.InferInput("INPUT0", [1, 16], "FP32")]
        row[0].set_data_from_numpy(np.ones((1, 16), np.float32))
        outcome = Outcomes()
        attempt = outcome.attempt
        try:
            for i in range(3):
                attempt(f"grpc infer, alice {i}",
                        lambda: g.infer("linear", row, headers=dict(alice)).as_numpy("OUTPUT0"))
                attempt(f"data infer, alice {i}",
                        lambda: c.infer("linear", one_row(), headers=dict(alice)).as_numpy("OUTPUT0"))
            attempt("grpc infer, bob", lambda: g.infer("linear", row, headers=dict(bob)))
            attempt("grpc metadata, bob", lambda: g.get_model_metadata("linear", headers=dict(bob)))
            attempt("data infer, bob", lambda: c.infer("linear", one_row(), headers=dict(bob)))
            attempt("grpc infer, no hub token",
                    lambda: g.infer("linear", row, headers={"authorization": "token x"}))
            attempt("data infer, no hub token",
                    lambda: c.infer("linear", one_row(), headers={"authorization": "token x"}))
        finally:
            g.close()
            c.close()
        return outcome

    outcome = await in_thread(story)
    for i in range(3):
        for port in ("grpc", "data"):
            status, out = outcome[f"{port} infer, alice {i}"]
            assert status == "ok", out
            np.testing.assert_allclose(out, np.ones((1, 16), np.float32) @ W, rtol=1e-5)
    assert outcome["grpc infer, bob"][0] == str(grpc.StatusCode.PERMISSION_DENIED)
    assert outcome["grpc metadata, bob"][0] == "ok"
    assert outcome["data infer, bob"][0] == "403"
    assert outcome["grpc infer, no hub token"][0] == str(grpc.StatusCode.UNAUTHENTICATED)
    assert outcome["data infer, no hub token"][0] == "401"
    # each credential asked once, whatever the port and however many calls
    assert sorted(HubLikeIdentityProvider.asked) == ["hub-token-alice", "hub-token-bob", "x"]
    # the Jupyter routes ask Jupyter's identity provider themselves: the same answers
    ok = await jp_fetch("v2/models/linear/infer", method="POST", body=ROW,
                        headers={"Authorization": alice["authorization"]})
    assert ok.code == 200
    with pytest.raises(HTTPClientError) as err:
        await jp_fetch("v2/models/linear/infer", method="POST", body=ROW,
                       headers={"Authorization": bob["authorization"]})
    assert err.value.code == 403


PAD = 20_000        # bytes of a request parameter that makes a request this large


@pytest.mark.parametrize("triton_options", [{"max_inflight_bytes": 60_000}], indirect=True)
async def test_every_port_shares_one_bytes_in_flight_budget(jp_triton, jp_http_port, jp_base_url):
    """A body arriving on Jupyter's port holds the server's one budget: the data port and
    gRPC refuse what would pass it, and serve again once it is released."""
    (ext,) = jp_triton.extension_manager.extension_apps["jupyter_triton"]
    budget = ext.admission.budget
    assert budget.limit == 60_000
    head = (f"POST {jp_base_url}v2/models/linear/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: token {TOKEN}\r\nContent-Length: 50000\r\n\r\n{{").encode()
    _, writer = await asyncio.open_connection("127.0.0.1", jp_http_port)
    writer.write(head)                       # the rest of the body never comes
    await until(lambda: budget.held >= 50_000, "the unfinished body's bytes held")
    padded = {"pad": "x" * PAD}

    def story():
        g = grpcclient.InferenceServerClient(f"127.0.0.1:{ext.bound_grpc_port}")
        c = httpclient.InferenceServerClient(f"127.0.0.1:{ext.bound_http_data_port}", network_timeout=60)
        key = {"authorization": f"Bearer {INFER_KEY}"}
        row = [grpcclient.InferInput("INPUT0", [1, 16], "FP32")]
        row[0].set_data_from_numpy(np.ones((1, 16), np.float32))
        outcome = Outcomes()
        attempt = outcome.attempt
        try:
            attempt("grpc", lambda: g.infer("linear", row, headers=dict(key), parameters=padded))
            attempt("data", lambda: c.infer("linear", one_row(), headers=dict(key), parameters=padded))
        finally:
            g.close()
            c.close()
        return outcome

    outcome = await in_thread(story)
    assert outcome["grpc"][0] == str(grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert outcome["data"][0] == "503" and "in flight" in outcome["data"][1]
    writer.close()
    await until(lambda: budget.held == 0, "the closed body's bytes given back")
    c = await in_thread(httpclient.InferenceServerClient, f"127.0.0.1:{ext.bound_http_data_port}")
    try:
        out = await in_thread(lambda: c.infer("linear", one_row(), headers={
            "authorization": f"Bearer {INFER_KEY}"}, parameters=padded).as_numpy("OUTPUT0"))
    finally:
        await in_thread(c.close)
    np.testing.assert_allclose(out, np.ones((1, 16), np.float32) @ W, rtol=1e-5)


async def test_a_call_without_credentials_is_told_what_is_missing(jp_triton, jp_fetch):
    # Every method, not only GET: a POST used to be told "'_xsrf' argument missing from POST"
    # (Jupyter checks its form field before it refuses a request it found no user for).
    for method, route, body in (("GET", "v2/models/linear/config", None),
                                ("POST", "v2/models/linear/infer", ROW),
                                ("POST", "v2/repository/models/linear/load", "{}")):
        with pytest.raises(HTTPClientError) as err:
            await jp_fetch(route, method=method, body=body, headers={"Authorization": ""})
        assert err.value.code == 403, (method, route)
        error = json.loads(err.value.response.body)["error"]
        assert "authentication required" in error and "Authorization: token" in error, error
        assert "argument missing" not in error
