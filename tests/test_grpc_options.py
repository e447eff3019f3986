"""The gRPC port's operator options, as tritonserver spells them: TLS (``--grpc-use-ssl``,
``--grpc-use-ssl-mutual`` and their certificate files) called by tritonclient.grpc, the
keep-alive and connection-age flags (milliseconds) accepted and refused as tritonserver's are,
and what NVIDIA's ``simple_grpc_infer_client.py`` does (one infer of the 'simple' model, plain,
``-C gzip``, ``-C deflate``) over mutual TLS against ``jupyter-triton serve``."""
from __future__ import annotations

import asyncio
import datetime
import ipaddress
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import INFER_KEY, in_thread
from jupyter_triton.cli import build_parser, grpc_connection_options
from jupyter_triton.engine import Engine, EngineOptions
from jupyter_triton.frontends.grpc import start_grpc_server
from jupyter_triton.frontends.grpc_options import GrpcTLS
from jupyter_triton.frontends.limits import HTTP2Limits
from ports import free_port

EXE = str(Path(sys.executable).parent / "jupyter-triton")


# -- a certificate authority, the server's certificate and a client's ----------------------
def _pki(root: Path) -> dict[str, str]:
    """ca.pem; server.pem/server.key for 127.0.0.1 and localhost; client.pem/client.key;
    and other-client.pem/.key signed by another CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    root.mkdir(parents=True, exist_ok=True)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def issue(cn: str, issuer: tuple | None, *, ca: bool = False, usage=None, san=None):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(cn))
                   .issuer_name(name(cn) if issuer is None else issuer[1].subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if usage is not None:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if san is not None:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        signer = key if issuer is None else issuer[0]
        return key, builder.sign(signer, hashes.SHA256())

    def write(stem: str, key, cert) -> None:
        (root / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (root / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))

    ca = issue("test CA", None, ca=True)
    write("ca", *ca)
    write("server", *issue("server", ca, usage=ExtendedKeyUsageOID.SERVER_AUTH, san=[
        x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]))
    write("client", *issue("client", ca, usage=ExtendedKeyUsageOID.CLIENT_AUTH))
    other = issue("another CA", None, ca=True)
    write("other-client", *issue("client", other, usage=ExtendedKeyUsageOID.CLIENT_AUTH))
    return {stem: str(root / stem) for stem in ("ca", "server", "client", "other-client")}


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    return _pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def simple_repo(tmp_path: Path) -> Path:
    """Triton's example 'simple': INPUT0, INPUT1 INT32 [16] -> OUTPUT0 sum, OUTPUT1 difference."""
    from onnx import TensorProto
    from onnx_models import add_sub
    root = tmp_path / "models"
    add_sub(root / "simple" / "1" / "model.onnx", dims=16, elem=TensorProto.INT32)
    (root / "simple" / "config.pbtxt").write_text('name: "simple"\nbackend: "onnxruntime"\n'
                                                   'max_batch_size: 8\n')
    return root


@contextmanager
def grpc_port(repo: Path, **kwargs):
    """The engine and its gRPC port alone on a loop in a thread;
    yields the port."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        engine = Engine(EngineOptions(model_repository=repo, model_control_mode="explicit",
                                      load_models=["*"]))
        await engine.start()
        server, port = await start_grpc_server(engine, "127.0.0.1", 0, **kwargs)
        return engine, server, port

    engine, server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(60)

    async def stop():
        await server.stop(0.5)
        await engine.stop()
    try:
        yield port
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _simple_inputs() -> tuple[list[grpcclient.InferInput], np.ndarray, np.ndarray]:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.ones((1, 16), dtype=np.int32)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
              grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs, a, b


def _infers(client: grpcclient.InferenceServerClient) -> None:
    inputs, a, b = _simple_inputs()
    result = client.infer("simple", inputs, client_timeout=10)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def _refused(client: grpcclient.InferenceServerClient) -> str:
    try:
        with pytest.raises(InferenceServerException) as err:
            client.is_server_live(client_timeout=5)
        return err.value.status()
    finally:
        client.close()


# -- TLS -----------------------------------------------------------------------------------
def test_tls_serves_tls_clients_only(simple_repo: Path, pki: dict):
    tls = GrpcTLS(f"{pki['server']}.pem", f"{pki['server']}.key")
    with grpc_port(simple_repo, ssl=tls) as port:
        url = f"127.0.0.1:{port}"
        client = grpcclient.InferenceServerClient(url, ssl=True,
                                                  root_certificates=f"{pki['ca']}.pem")
        try:
            assert client.is_server_live() and client.is_model_ready("simple")
            _infers(client)
        finally:
            client.close()
        assert _refused(grpcclient.InferenceServerClient(url)) == "StatusCode.UNAVAILABLE"


def test_mutual_tls_needs_a_client_certificate_the_root_signed(simple_repo: Path, pki: dict):
    tls = GrpcTLS(f"{pki['server']}.pem", f"{pki['server']}.key", f"{pki['ca']}.pem",
                  mutual=True)
    ca = f"{pki['ca']}.pem"
    with grpc_port(simple_repo, ssl=tls) as port:
        url = f"127.0.0.1:{port}"
        client = grpcclient.InferenceServerClient(
            url, ssl=True, root_certificates=ca, private_key=f"{pki['client']}.key",
            certificate_chain=f"{pki['client']}.pem")
        try:
            _infers(client)
        finally:
            client.close()
        for refused in (
                grpcclient.InferenceServerClient(url),                      # plaintext
                grpcclient.InferenceServerClient(url, ssl=True, root_certificates=ca),  # no cert
                grpcclient.InferenceServerClient(                           # another CA's cert
                    url, ssl=True, root_certificates=ca,
                    private_key=f"{pki['other-client']}.key",
                    certificate_chain=f"{pki['other-client']}.pem")):
            assert _refused(refused) == "StatusCode.UNAVAILABLE"


@pytest.fixture
def jp_server_config(jp_server_config, pki):
    return {**jp_server_config, "JupyterTriton": {
        **jp_server_config["JupyterTriton"], "grpc_port": 0, "grpc_use_ssl": True,
        "grpc_server_cert": f"{pki['server']}.pem", "grpc_server_key": f"{pki['server']}.key",
        "grpc_keepalive_time": 60000, "grpc_max_connection_age": 600000}}


async def test_the_extension_grpc_port_takes_the_same_tls_traits(jp_triton, pki):
    (ext,) = jp_triton.extension_manager.extension_apps["jupyter_triton"]
    limits, tls = ext.grpc_connection_options()
    assert (limits.keepalive_time, limits.max_connection_age) == (60.0, 600.0) and not tls.mutual
    url = f"127.0.0.1:{ext.bound_grpc_port}"

    def story():
        client = grpcclient.InferenceServerClient(url, ssl=True,
                                                  root_certificates=f"{pki['ca']}.pem")
        try:
            live = client.is_server_live(headers={"authorization": f"Bearer {INFER_KEY}"})
        finally:
            client.close()
        return live, _refused(grpcclient.InferenceServerClient(url))

    assert await in_thread(story) == (True, "StatusCode.UNAVAILABLE")


def test_bad_grpc_traits_are_refused_by_name(tmp_path: Path):
    from traitlets import TraitError
    from jupyter_triton.serverext import JupyterTriton
    app = JupyterTriton(grpc_use_ssl=True, grpc_server_cert=str(tmp_path / "missing.pem"),
                        grpc_server_key=str(tmp_path / "missing.key"))
    with pytest.raises(TraitError, match="--grpc-server-cert .*missing.pem: no such file"):
        app.grpc_connection_options()
    with pytest.raises(TraitError, match="--grpc-keepalive-time must be a whole number, 0 or more"):
        JupyterTriton(grpc_keepalive_time=-5).grpc_connection_options()


# -- the CLI's flags -----------------------------------------------------------------------
KEEPALIVE = ["--grpc-keepalive-time", "60000", "--grpc-keepalive-timeout", "5000",
             "--grpc-keepalive-permit-without-calls", "true",
             "--grpc-http2-max-pings-without-data", "0",
             "--grpc-http2-min-recv-ping-interval-without-data", "10000",
             "--grpc-http2-max-ping-strikes", "3", "--grpc-max-connection-age", "600000",
             "--grpc-max-connection-age-grace", "30000"]


def test_keepalive_flags_are_tritonservers_in_milliseconds():
    limits, tls = grpc_connection_options(
        build_parser().parse_args(["serve", "--model-repository", "m", *KEEPALIVE]))
    assert tls is None
    assert (limits.keepalive_time, limits.keepalive_timeout, limits.keepalive_permit_without_calls,
            limits.max_pings_without_data, limits.min_recv_ping_interval_without_data,
            limits.max_ping_strikes, limits.max_connection_age,
            limits.max_connection_age_grace) == (60.0, 5.0, True, 0, 10.0, 3, 600.0, 30.0)
    # unset flags keep HTTP2Limits' defaults (tritonserver's)
    defaults, _ = grpc_connection_options(
        build_parser().parse_args(["serve", "--model-repository", "m"]))
    assert defaults == HTTP2Limits()
    help_text = subprocess.run([EXE, "serve", "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    for flag in KEEPALIVE[::2] + ["--grpc-use-ssl", "--grpc-use-ssl-mutual",
                                  "--grpc-server-cert", "--grpc-server-key", "--grpc-root-cert"]:
        assert flag in help_text, flag


@pytest.mark.parametrize("flags, words", [
    (["--grpc-keepalive-time", "soon"], "argument --grpc-keepalive-time: invalid int value: 'soon'"),
    (["--grpc-max-connection-age", "-1"],
     "argument --grpc-max-connection-age: must be 0 or more, got -1"),
    (["--grpc-keepalive-permit-without-calls", "maybe"],
     "argument --grpc-keepalive-permit-without-calls: expected true or false, got 'maybe'"),
    (["--grpc-use-ssl", "true"], "gRPC TLS needs --grpc-server-cert"),
    (["--grpc-use-ssl", "true", "--grpc-server-cert", "/nonexistent/server.pem",
      "--grpc-server-key", "/nonexistent/server.key"],
     "--grpc-server-cert /nonexistent/server.pem: no such file"),
])
def test_bad_grpc_flags_are_refused_by_name(tmp_path: Path, flags: list[str], words: str):
    done = subprocess.run([EXE, "serve", "--model-repository", str(tmp_path), "--http-port", "0",
                           "--grpc-port", "0", "--allow-metrics", "false", *flags],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and words in done.stderr, done.stderr[-2000:]


def test_a_key_that_does_not_match_is_refused(pki: dict):
    with pytest.raises(ValueError, match="does not load"):
        GrpcTLS(f"{pki['server']}.pem", f"{pki['client']}.key").check()


def test_serve_with_every_grpc_flag_serves_mutual_tls_compressed(simple_repo: Path, pki: dict):
    port = free_port()
    proc = subprocess.Popen(
        [EXE, "serve", "--model-repository", str(simple_repo), "--model-control-mode", "explicit",
         "--load-model", "simple", "--allow-http", "false", "--allow-metrics", "false",
         "--grpc-address", "127.0.0.1", "--grpc-port", str(port), *KEEPALIVE,
         "--grpc-use-ssl", "true", "--grpc-use-ssl-mutual", "true",
         "--grpc-server-cert", f"{pki['server']}.pem", "--grpc-server-key", f"{pki['server']}.key",
         "--grpc-root-cert", f"{pki['ca']}.pem"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        client = grpcclient.InferenceServerClient(
            f"127.0.0.1:{port}", ssl=True, root_certificates=f"{pki['ca']}.pem",
            private_key=f"{pki['client']}.key", certificate_chain=f"{pki['client']}.pem")
        deadline = time.monotonic() + 60
        while True:
            try:
                if client.is_model_ready("simple", client_timeout=2):
                    break
            except InferenceServerException:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        for algorithm in (None, "gzip", "deflate"):
            infer_simple(client, algorithm)
        client.close()
        # the same client without its certificate does not get through
        bare = grpcclient.InferenceServerClient(
            f"127.0.0.1:{port}", ssl=True, root_certificates=f"{pki['ca']}.pem")
        with pytest.raises(InferenceServerException):
            infer_simple(bare, None, timeout=5)
        bare.close()
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def infer_simple(client: grpcclient.InferenceServerClient, algorithm: str | None,
                 timeout: float = 30) -> None:
    """simple_grpc_infer_client.py's call: INPUT0 = 0..15, INPUT1 = ones; sum and difference."""
    inputs, a, b = _simple_inputs()
    outputs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT1")]
    result = client.infer("simple", inputs, outputs=outputs, client_timeout=timeout,
                          compression_algorithm=algorithm)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
