"""The admission decides an HTTP/2 connection's stream slots and a gRPC call's deadline too:
``ConnectionSlot.open_stream`` (the slot its listener got from ``Admission.connect``, capped
at the port's max_concurrent_streams) lets each stream open or not, and ``Admission.admit``
puts the call's deadline (from its ``grpc-timeout``) on the ticket the call layer enforces.
Each decision is recorded where it is made and attacked through a real server."""
from __future__ import annotations

import struct

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from conftest import W
from hostile import CANCEL, DATA, END_STREAM, HEADERS, H2, REFUSED_STREAM, RST_STREAM, SETTINGS, frame
from jupyter_triton.engine import EngineOptions
from jupyter_triton.frontends.admission import Admission, ConnectionSlot, grpc_timeout
from jupyter_triton.frontends.limits import HTTP2Limits
from jupyter_triton.standalone import start_in_thread
from onnx_models import linear
from server_waits import wait_until
from test_grpc_bounds import HOLD_S, SLOW_CONFIG, _x


@pytest.fixture
def slow_repo(tmp_path):
    """``slow``: its batcher holds a lone request HOLD_S before it runs."""
    linear(W, tmp_path / "slow" / "1" / "model.onnx")
    (tmp_path / "slow" / "config.pbtxt").write_text(SLOW_CONFIG)
    return tmp_path


def grpc_server(repo, **limits):
    return start_in_thread(EngineOptions(model_repository=repo), host="127.0.0.1", http_port=0,
                           metrics_port=None, grpc_port=0, grpc_limits=HTTP2Limits(**limits))


def test_streams_past_a_connections_cap_are_refused_by_its_slot(model_repo, monkeypatch):
    """gRPC's port with ``max_concurrent_streams=2`` advertises 2; two streams left open take
    the connection's two stream slots, a third is refused by the slot's decision
    (RST_STREAM REFUSED_STREAM); once the client resets one of the two, a call on the same
    connection is served."""
    decisions: list[tuple[int, bool]] = []
    open_stream = ConnectionSlot.open_stream

    def recorded(self, open_now):
        allowed = open_stream(self, open_now)
        decisions.append((open_now, allowed))
        return allowed
    monkeypatch.setattr(ConnectionSlot, "open_stream", recorded)
    server = grpc_server(model_repo, max_concurrent_streams=2)
    try:
        with H2(server.grpc_port) as c:
            assert c.read_until(lambda f: f.type == SETTINGS, 10) is not None
            assert c.server_settings[3] == 2
            c.headers(1, "ModelStreamInfer")
            c.headers(3, "ModelStreamInfer")
            c.headers(5, "ModelStreamInfer")
            refusal = c.read_until(lambda f: f.type == RST_STREAM and f.sid == 5, 10)
            assert refusal is not None and refusal.error_code == REFUSED_STREAM
            assert decisions == [(0, True), (1, True), (2, False)]
            # streams 1 and 3 are still open (no answer); the client gives one back
            assert not [f for f in c.frames if f.sid in (1, 3)]
            c.send(frame(RST_STREAM, 0, 1, struct.pack(">L", CANCEL)))
            c.request(7, "ServerLive", b"")
            assert c.read_until(lambda f: f.sid == 7 and f.type == HEADERS
                                and f.flags & END_STREAM, 10) is not None
            assert c.statuses()[7] == "0"
            assert decisions[3:] == [(1, True)]
    finally:
        server.close()


@pytest.fixture
def deadlines(monkeypatch) -> list[float | None]:
    """The deadline on the ticket of every gRPC call the admission let in."""
    seen: list[float | None] = []
    admit = Admission.admit

    def recorded(self, door, *args, **kwargs):
        ticket = admit(self, door, *args, **kwargs)
        if door.kind == "grpc":
            seen.append(ticket.deadline)
        return ticket
    monkeypatch.setattr(Admission, "admit", recorded)
    return seen


def test_an_expired_deadline_on_the_ticket_ends_the_call(slow_repo, deadlines):
    """A ModelInfer with a client deadline of a fifth of the time the batcher holds it: the
    admission puts that deadline on its ticket, the call layer ends the call with
    DEADLINE_EXCEEDED (the server counts it failed), and a call with no deadline is served."""
    server = grpc_server(slow_repo)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    engine = server.engine

    def failures() -> int:
        return engine.statistics("slow")["model_stats"][0]["inference_stats"]["fail"]["count"]
    try:
        with pytest.raises(InferenceServerException) as err:
            client.infer("slow", _x(), client_timeout=HOLD_S / 5)
        assert err.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        (deadline,) = deadlines
        # the client's grpc-timeout is rounded up to its unit (CI once read 301m for 0.3 s)
        assert deadline is not None and 0 < deadline <= HOLD_S / 5 + 0.01
        wait_until(lambda: failures() == 1, "the server counts the call as failed")
        result = client.infer("slow", _x())
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), np.ones((1, 16)) @ W, rtol=1e-5)
        assert deadlines[1:] == [None]
    finally:
        client.close()
        server.close()


def _slow_request() -> pb.ModelInferRequest:
    """One ModelInfer for the slow model, as a raw HTTP/2 client sends it."""
    request = pb.ModelInferRequest(model_name="slow")
    tensor = request.inputs.add(name="INPUT0", datatype="FP32")
    tensor.shape.extend([1, 16])
    request.raw_input_contents.append(np.ones((1, 16), np.float32).tobytes())
    return request


def _status(c: H2, sid: int, method: str, extra=(), seconds: float = 30) -> str:
    """The grpc-status a raw call of the slow request on stream ``sid`` ends with."""
    c.request(sid, method, _slow_request().SerializeToString(), extra=list(extra))
    assert c.read_until(lambda f: f.sid == sid and f.type == HEADERS
                        and f.flags & END_STREAM, seconds) is not None
    return c.statuses()[sid]


def test_a_grpc_timeout_of_thousands_of_digits_is_no_deadline(slow_repo, deadlines):
    """A hostile ``grpc-timeout`` (5,000 digits: past what Python converts) is not a timeout:
    the call is served without a deadline, and the connection serves the next call."""
    server = grpc_server(slow_repo)
    try:
        with H2(server.grpc_port) as c:
            for sid, extra in ((1, [("grpc-timeout", "1" * 5000 + "S")]), (3, [])):
                assert _status(c, sid, "ModelInfer", extra) == "0"     # OK
        assert deadlines == [None, None]
    finally:
        server.close()


def test_a_raw_grpc_timeout_is_the_tickets_deadline(slow_repo, deadlines):
    """The deadline is the client's ``grpc-timeout`` read at the admission: a raw call that
    says 100 ms is ended with DEADLINE_EXCEEDED while the batcher still holds it."""
    server = grpc_server(slow_repo)
    try:
        with H2(server.grpc_port) as c:
            assert _status(c, 1, "ModelInfer", [("grpc-timeout", "100m")], 10) == "4"
        assert deadlines == [pytest.approx(0.1)]
    finally:
        server.close()


def test_a_streams_deadline_ends_the_stream(slow_repo, deadlines):
    """A ModelStreamInfer whose ``grpc-timeout`` (100 ms) passes while the batcher holds its
    request ends DEADLINE_EXCEEDED, as grpc's own servers end a stream past its deadline (its
    request's work is cancelled: the server counts none served); a stream on the same
    connection without a deadline is answered."""
    server = grpc_server(slow_repo)
    engine = server.engine

    def executed() -> int:
        return engine.statistics("slow")["model_stats"][0]["inference_stats"]["success"]["count"]
    try:
        with H2(server.grpc_port) as c:
            assert _status(c, 1, "ModelStreamInfer", [("grpc-timeout", "100m")], 10) == "4"
            assert executed() == 0
            assert _status(c, 3, "ModelStreamInfer") == "0"
            answer = b"".join(f.payload for f in c.frames if f.sid == 3 and f.type == DATA)
            response = pb.ModelStreamInferResponse.FromString(answer[5:])
            assert response.error_message == ""
            out = np.frombuffer(response.infer_response.raw_output_contents[0], np.float32)
            np.testing.assert_allclose(out, (np.ones((1, 16)) @ W).ravel(), rtol=1e-5)
        assert deadlines == [pytest.approx(0.1), None]
    finally:
        server.close()


@pytest.mark.parametrize("value, seconds", [
    ("100m", 0.1), ("2S", 2.0), ("1H", 3600.0), ("5u", 5e-6), ("0S", None),
    ("", None), ("S", None), ("10x", None), ("-1S", None), ("1.5S", None), ("\u00b2S", None),
    ("99999999S", 99999999.0), ("123456789S", None), ("1" * 5000 + "S", None)])
def test_grpc_timeout_values(value, seconds):
    assert grpc_timeout(value) == (pytest.approx(seconds) if seconds else None)
