"""Shadow traffic (issue 37, item 2) through a real server: a version loaded staged
(``serve(..., stage=True)``) gets a copy of the served model's live requests
(``handle.shadow``); clients get the served answers only, the report
(``handle.shadow_report()``, ``GET v2/models/{m}/shadow``) says how far the staged answers
are, a slow or failing shadow never delays or fails a served answer, and a promotion with
``shadow_max_diff`` (or a golden set made of captured traffic) serves the staged version
only if it holds."""
from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

import jupyter_triton as jt
from test_ensemble_graph import run_node, walk
from jupyter_triton.engine import EngineOptions
from jupyter_triton.frontends.admission import AccessPolicy, Restriction
from jupyter_triton.kernel import discovery
from jupyter_triton.kernel.discovery import Connection
from jupyter_triton.standalone import start_in_thread
from jupyter_triton.widgets.dashboard import Dashboard

SECRET = "s3cret"
# the model-repository group (load, traffic, shadow) needs this header; inference is open
RESTRICTED = [Restriction.parse(f"model-repository:authorization=token {SECRET}")]
ADMIN = {"Authorization": f"token {SECRET}"}
X = np.arange(12, dtype=np.float32).reshape(3, 4)
OUT = "OUTPUT__0"


def double(x):
    return x * 2


def nudged(x):                  # the changed version: 0.01 off on every value
    return x * 2 + 0.01


def twice(x):                   # the same answers as double, another version
    return x + x


def broken(armed: str):
    """A version that fails once ``armed`` exists (serving it calls it on the example)."""
    def fails(x):
        import os
        if os.path.exists(armed):
            raise RuntimeError("the staged version fails")
        return x * 2
    return fails


def gated(armed: str, gate: str, started: str):
    """A version that, once ``armed`` exists, answers only once ``gate`` exists (files: the
    model runs in a worker process; serving it calls it on the example first), and says it
    started by writing ``started``."""
    def slow(x):
        import os
        import time
        if not os.path.exists(armed):
            return x * 2
        open(started, "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        return x * 2
    return slow


@pytest.fixture
def server(tmp_path: Path, monkeypatch):
    """A standalone server whose repository routes need ``ADMIN``, that this process's
    notebook API talks to with that credential (as a kernel would)."""
    server = start_in_thread(EngineOptions(model_repository=tmp_path / "models",
                                           model_control_mode="explicit"),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=None,
                             access=AccessPolicy.open(RESTRICTED))
    monkeypatch.setenv(discovery.ENV_URL, server.url)
    monkeypatch.setenv(discovery.ENV_TOKEN, SECRET)
    discovery.reset()
    yield server
    discovery.reset()
    server.close()


def infer(server, x: np.ndarray = X, version: str = "") -> tuple[np.ndarray, str]:
    """(the answer, the version that gave it), as any tritonclient user gets them."""
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    try:
        inp = httpclient.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer("scale", [inp], model_version=version)
        return result.as_numpy(OUT), result.get_response()["model_version"]
    finally:
        client.close()


def route(server, method: str, body: object = None, model: str = "scale",
          headers: dict | None = None) -> tuple[int, dict]:
    """(status, JSON) of ``{method} v2/models/{model}/shadow``, with ``ADMIN`` unless told."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(f"{server.url}/v2/models/{model}/shadow", data=data,
                                     method=method, headers=ADMIN if headers is None else headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def wait_for_report(handle, done, seconds: float = 60) -> dict:
    """Until the shadow report satisfies ``done`` (the shadow's copies run after the
    answers, in tasks of their own)."""
    deadline = time.monotonic() + seconds
    while True:
        report = handle.shadow_report()
        if done(report):
            return report
        assert time.monotonic() < deadline, f"shadow report never got there: {report}"
        time.sleep(0.02)


def dashboard_shows(server, report: dict, tmp_path: Path) -> None:
    """The model's dashboard reads the report (the kernel's poller) and draws it (its
    dashboard.js, run in node where there is one)."""
    dash = Dashboard(Connection(server.url + "/", token=SECRET), model="scale", poll_kernel=False)
    try:
        shown = dash.poller.poll_once().shadow
    finally:
        dash.close()
    assert shown["outputs"] == report["outputs"] and shown["version"] == report["version"]
    if shutil.which("node") is None:
        return
    box = run_node(tmp_path, f"console.log(JSON.stringify(m.shadowTable({json.dumps(shown)})));\n")
    cells = {n["attrs"]["data-output"]: [c["text"] for c in n["children"]]
             for n in walk(box) if "data-output" in n["attrs"]}
    assert cells == {OUT: [OUT, "20", "0.0100", "100.0 %", cells[OUT][4]]}
    title = next(n["text"] for n in walk(box) if n["attrs"].get("class") == "jt-card-title")
    assert title == f"shadow of v{report['version']} · 20 compared · 0 dropped · 0 failed"


def test_a_staged_version_is_shadowed_then_promoted_only_within_its_diff(server, tmp_path):
    served = jt.serve(double, "scale", example=X)
    staged = jt.serve(nudged, "scale", example=X, stage=True)
    assert staged.version == served.version + 1
    # staged: called by its version only; the served version keeps answering the rest
    np.testing.assert_allclose(infer(server, X, str(staged.version))[0], X * 2 + 0.01, rtol=1e-6)
    assert {infer(server)[1] for _ in range(10)} == {str(served.version)}

    report = served.shadow(staged.version, fraction=1.0)
    assert (report["version"], report["enabled"], report["requests_sent"]) == (staged.version, True, 0)
    for i in range(20):
        answer, version = infer(server, X + i)
        # the client gets the served answer, never the shadow's
        assert version == str(served.version)
        np.testing.assert_array_equal(answer, (X + i) * 2)
    report = wait_for_report(served, lambda r: r["requests_compared"] == 20)
    assert (report["requests_seen"], report["requests_sent"], report["errors"],
            report["requests_dropped"]) == (20, 20, 0, 0)
    diff = report["outputs"][OUT]
    assert diff["compared"] == 20 and diff["max_abs_diff"] == pytest.approx(0.01, rel=1e-3)
    assert diff["agreement"] == 1.0          # [batch, classes]: the argmax of each row agrees
    assert 0 < diff["cosine_distance"]["max"] < 1e-4
    for side in ("served", "shadow"):
        latency = report["latency_ms"][side]
        assert latency["count"] == 20 and 0 < latency["p50"] <= latency["p99"]
    # the same report over HTTP, for other clients, and on the model's dashboard
    assert route(server, "GET")[1]["shadow"]["outputs"] == report["outputs"]
    dashboard_shows(server, report, tmp_path)

    # too tight a bound: refused, naming the output and its difference; nothing changes
    refused = served.promote(staged.version, shadow_max_diff=0.001)
    assert not refused.promoted
    assert f"shadow output '{OUT}' max |diff| 0.01" in refused.message
    assert "> shadow_max_diff 0.001" in refused.message
    assert infer(server)[1] == str(served.version)
    assert infer(server, X, str(staged.version))[1] == str(staged.version)   # still staged

    promoted = served.promote(staged.version, shadow_max_diff=0.05)
    assert promoted.promoted, promoted
    assert {infer(server)[1] for _ in range(5)} == {str(staged.version)}
    assert [r["action"] for r in jt.history("scale")] == ["load", "staged", "refused", "promote"]


def test_a_failing_or_blocked_shadow_never_fails_or_delays_the_served_answer(server, tmp_path):
    served = jt.serve(double, "scale", example=X)
    failing = str(tmp_path / "failing")
    staged = jt.serve(broken(failing), "scale", example=X, stage=True)
    Path(failing).touch()
    served.shadow(staged.version)
    for i in range(5):
        answer, version = infer(server, X + i)        # tritonclient raises on any error status
        assert version == str(served.version)
        np.testing.assert_array_equal(answer, (X + i) * 2)
    report = wait_for_report(served, lambda r: r["errors"] == 5)
    assert "the staged version fails" in report["last_error"] and report["outputs"] == {}
    served.stop_canary()                    # the staged version set aside: its shadow ends
    assert infer(server)[1] == str(served.version)
    report = served.shadow_report()
    assert report["enabled"] is False and report["errors"] == 5 and report["requests_sent"] == 5
    assert report["last_error"].startswith("shadow stopped:")
    assert served.shadow(None)["enabled"] is False

    armed, gate, started = (str(tmp_path / f) for f in ("armed", "gate", "started"))
    blocked = jt.serve(gated(armed, gate, started), "scale", example=X, stage=True)
    Path(armed).touch()
    served.shadow(blocked.version)
    try:
        answer, version = infer(server)
        assert version == str(served.version)
        np.testing.assert_array_equal(answer, X * 2)
        # the served answer is here; its copy is still held inside the staged version
        wait_for_report(served, lambda r: r["in_flight"] == 1)
        deadline = time.monotonic() + 60
        while not os.path.exists(started):
            assert time.monotonic() < deadline, "the shadow copy never reached the staged version"
            time.sleep(0.02)
        # more requests, all answered while the shadow is blocked; past its bound of copies
        # in flight the rest are dropped, not queued
        for _ in range(20):
            assert infer(server)[1] == str(served.version)
        report = served.shadow_report()
        assert report["requests_compared"] == 0
        assert report["in_flight"] == report["max_in_flight"] == 16
        assert report["requests_dropped"] == 21 - 16
    finally:
        Path(gate).touch()
    report = wait_for_report(served, lambda r: r["in_flight"] == 0)
    assert report["requests_compared"] == 16 and report["outputs"][OUT]["max_abs_diff"] == 0


def test_golden_set_from_captured_traffic(server):
    served = jt.serve(double, "scale", example=X)
    served.capture()
    for i in range(6):
        infer(server, X + i)
    golden = served.traffic(n=200)
    assert len(golden) == 6

    wrong = jt.serve(nudged, "scale", example=X, stage=True)
    refused = served.promote(wrong.version, golden=golden)
    assert not refused.promoted and refused.cases == 6 and len(refused.failed) == 6
    assert infer(server)[1] == str(served.version)

    right = jt.serve(twice, "scale", example=X, stage=True)
    promoted = served.promote(right.version, golden=served.traffic(n=3))
    assert promoted.promoted and promoted.cases == 3
    assert infer(server)[1] == str(right.version)


def test_the_shadow_route_refuses_what_it_cannot_do(server):
    served = jt.serve(double, "scale", example=X)
    staged = jt.serve(nudged, "scale", example=X, stage=True)
    status, body = route(server, "POST", {"version": 9})
    assert status == 404 and "version 9 is not found" in body["error"]
    status, body = route(server, "POST", {"version": served.version})
    assert status == 400 and "is the one served" in body["error"]
    for fraction in (0, 1.5, -1, "all", True):
        status, body = route(server, "POST", {"version": staged.version, "fraction": fraction})
        assert status == 400 and "'fraction' must be a number in (0, 1]" in body["error"], fraction
    for bad in ({"version": "two"}, {"fraction": 1}, {"version": 2, "extra": 1}, [2], b"{"):
        status, body = route(server, "POST", bad)
        assert status == 400 and set(body) == {"error"}, bad
    assert route(server, "GET", model="nope")[0] == 404
    assert route(server, "POST", {"version": 1}, model="nope")[0] == 404
    # the model-repository scope, as the traffic route: without it, nothing starts
    for method in ("POST", "GET"):
        status, body = route(server, method, {"version": staged.version}, headers={})
        assert status == 403 and set(body) == {"error"}
    assert not server.engine.traffic.active
    assert route(server, "GET") == (200, {"model_name": "scale", "shadow": None})
    # the handle says the same as the route
    with pytest.raises(Exception, match="is not found"):
        served.shadow(9)
    with pytest.raises(Exception, match="fraction"):
        served.shadow(staged.version, fraction=2)
