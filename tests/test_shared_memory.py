"""Triton's system shared memory extension, driven the way NVIDIA's example clients drive it
(simple_{http,grpc}_shm[_string]_client.py, reuse_infer_objects_client.py): tritonclient's
``utils.shared_memory`` creates POSIX regions, the client registers them, sends inputs and asks
for outputs by region, reads the outputs back from the region, and unregisters.

Also what a client must never be able to do: crash or wedge the server with a bad region, a
bad offset or size, a key that names some other file, or an object it shrinks after
registering it.
"""
from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from onnx import TensorProto
from tritonclient import utils
from tritonclient.utils import InferenceServerException

from conftest import TOKEN
from jupyter_triton.engine import EngineOptions
from jupyter_triton.engine.shared_memory import INLINE_BYTES
from onnx_models import add_sub, identity
from test_perf_analyzer import PERF_ANALYZER

pytestmark = pytest.mark.timeout(120)

# Triton's "simple_string": the same sums on BYTES holding decimal integers.
SIMPLE_STRING_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a, b = (pb_utils.get_input_tensor_by_name(request, n).as_numpy().astype(np.int64)
                    for n in ("INPUT0", "INPUT1"))
            as_text = lambda x: np.array([str(v).encode() for v in x.reshape(-1)],
                                         dtype=np.object_).reshape(x.shape)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", as_text(a + b)),
                pb_utils.Tensor("OUTPUT1", as_text(a - b))]))
        return responses
'''

SIMPLE_STRING_CONFIG = '''
name: "simple_string"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_STRING dims: [ 16 ] },
        { name: "INPUT1" data_type: TYPE_STRING dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ 16 ] },
         { name: "OUTPUT1" data_type: TYPE_STRING dims: [ 16 ] } ]
parameters { key: "EXECUTION_MODE" value: { string_value: "thread" } }
'''

# past the size at which region reads and writes leave the event loop
LARGE = 2 * INLINE_BYTES // 4
# one step over "simple": regions are the ensemble's inputs and outputs, its steps never see them
SIMPLE_ENSEMBLE_CONFIG = '''
name: "simple_ensemble"
platform: "ensemble"
max_batch_size: 4
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
        { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
         { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
ensemble_scheduling { step [ { model_name: "simple" model_version: -1
  input_map { key: "INPUT0" value: "INPUT0" } input_map { key: "INPUT1" value: "INPUT1" }
  output_map { key: "OUTPUT0" value: "OUTPUT0" } output_map { key: "OUTPUT1" value: "OUTPUT1" } } ] }
'''

IN0 = np.arange(16, dtype=np.int32).reshape(1, 16)
IN1 = np.ones((1, 16), dtype=np.int32)
NBYTES = IN0.nbytes


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A standalone server (HTTP + gRPC) with Triton's 'simple' and 'simple_string' models."""
    from jupyter_triton.standalone import start_in_thread
    repo = tmp_path_factory.mktemp("models")
    add_sub(repo / "simple" / "1" / "model.onnx", dims=16, elem=TensorProto.INT32)
    identity(TensorProto.FLOAT, repo / "identity_large" / "1" / "model.onnx", dims=LARGE)
    (repo / "simple_string" / "1").mkdir(parents=True)
    (repo / "simple_string" / "1" / "model.py").write_text(SIMPLE_STRING_PY)
    (repo / "simple_string" / "config.pbtxt").write_text(SIMPLE_STRING_CONFIG)
    (repo / "simple_ensemble" / "1").mkdir(parents=True)
    (repo / "simple_ensemble" / "config.pbtxt").write_text(SIMPLE_ENSEMBLE_CONFIG)
    srv = start_in_thread(EngineOptions(model_repository=repo, model_control_mode="explicit",
                                        load_models=["*"]),
                          host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0)
    yield srv
    srv.close()


def client(server, protocol: str):
    if protocol == "http":
        return httpclient, httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    return grpcclient, grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")


@pytest.fixture
def regions():
    """Create POSIX regions with unique keys; every one is destroyed at the end."""
    made = []

    def create(byte_size: int) -> tuple[str, str, object]:
        tag = uuid.uuid4().hex[:10]
        name, key = f"region_{tag}", f"/test_shm_{tag}"
        handle = shm.create_shared_memory_region(name, key, byte_size)
        made.append(handle)
        return name, key, handle

    yield create
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def status_names(status) -> set[str]:
    """Region names in a status answer: HTTP's JSON list or gRPC's message."""
    if isinstance(status, list):
        return {r["name"] for r in status}
    return set(status.regions)


def field(output, key: str):
    return output[key] if isinstance(output, dict) else getattr(output, key)


def error_of(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as e:
        call()
    return e.value


def assert_client_error(err: InferenceServerException, protocol: str, text: str) -> None:
    want = "400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT"
    assert err.status() == want, (err.status(), err.message())
    assert text in err.message(), err.message()


def assert_serving(server) -> None:
    """The server is alive and still computes correctly after whatever a test did."""
    _, c = client(server, "http")
    assert c.is_server_live()
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    inputs[0].set_data_from_numpy(IN0)
    inputs[1].set_data_from_numpy(IN1)
    np.testing.assert_array_equal(c.infer("simple", inputs).as_numpy("OUTPUT0"), IN0 + IN1)


def shm_request(lib, in_region: str, out_region: str):
    """The example clients' request: both inputs in one region, both outputs in another."""
    inputs = [lib.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    inputs[0].set_shared_memory(in_region, NBYTES)
    inputs[1].set_shared_memory(in_region, NBYTES, offset=NBYTES)
    outputs = [lib.InferRequestedOutput(n) for n in ("OUTPUT0", "OUTPUT1")]
    outputs[0].set_shared_memory(out_region, NBYTES)
    outputs[1].set_shared_memory(out_region, NBYTES, offset=NBYTES)
    return inputs, outputs


# -- registration ----------------------------------------------------------------------------

@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_register_status_unregister(server, regions, protocol):
    lib, c = client(server, protocol)
    c.unregister_system_shared_memory()
    a, key_a, _ = regions(128)
    b, key_b, _ = regions(64)
    c.register_system_shared_memory(a, key_a, 128)
    c.register_system_shared_memory(b, key_b, 32, offset=16)
    assert status_names(c.get_system_shared_memory_status()) == {a, b}
    one = c.get_system_shared_memory_status(b)
    if protocol == "http":
        assert one == [{"name": b, "key": key_b, "offset": 16, "byte_size": 32}]
    else:
        r = one.regions[b]
        assert (r.name, r.key, r.offset, r.byte_size) == (b, key_b, 16, 32)

    err = error_of(lambda: c.register_system_shared_memory(a, key_a, 128))
    assert f"shared memory region '{a}' already in manager" in err.message()
    assert err.status() == ("400" if protocol == "http" else "StatusCode.ALREADY_EXISTS")

    c.unregister_system_shared_memory(a)
    assert status_names(c.get_system_shared_memory_status()) == {b}
    err = error_of(lambda: c.get_system_shared_memory_status(a))
    assert f"Unable to find system shared memory region: '{a}'" in err.message()
    c.unregister_system_shared_memory(a)            # unknown: nothing to do, as in Triton
    c.unregister_system_shared_memory()
    assert status_names(c.get_system_shared_memory_status()) == set()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_registration_is_bounds_checked(server, regions, protocol):
    lib, c = client(server, protocol)
    name, key, _ = regions(64)
    assert_client_error(error_of(lambda: c.register_system_shared_memory(name, key, 65)),
                        protocol, f"failed to register shared memory region '{name}': invalid args")
    assert_client_error(error_of(lambda: c.register_system_shared_memory(name, key, 8, offset=60)),
                        protocol, "past the end of the 64-byte shared memory object")
    assert_client_error(error_of(lambda: c.register_system_shared_memory(name, "/no_such_key", 8)),
                        protocol, "Unable to open shared memory region: '/no_such_key'")
    # a key is a name in /dev/shm, never a path to some other file
    for key in ("/../../etc/passwd", "/a/b", "/", "/.."):
        assert_client_error(error_of(lambda: c.register_system_shared_memory(name, key, 8)),
                            protocol, "invalid shared memory key")
    # nor a way out of it through a link, nor a FIFO that would block the server on open
    tag = uuid.uuid4().hex[:10]
    link, fifo = Path(f"/dev/shm/test_link_{tag}"), Path(f"/dev/shm/test_fifo_{tag}")
    target = Path(f"/dev/shm/{key[1:]}")
    link.symlink_to(target)
    os.mkfifo(fifo)
    try:
        assert_client_error(error_of(lambda: c.register_system_shared_memory(name, f"/{link.name}", 8)),
                            protocol, f"Unable to open shared memory region: '/{link.name}'")
        assert_client_error(error_of(lambda: c.register_system_shared_memory(name, f"/{fifo.name}", 8)),
                            protocol, "not a shared memory object")
    finally:
        link.unlink()
        fifo.unlink()
    assert status_names(c.get_system_shared_memory_status()) == set()
    assert_serving(server)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_cuda_shared_memory_is_refused_without_a_gpu(server, protocol):
    lib, c = client(server, protocol)
    c.unregister_cuda_shared_memory()               # what every example client does first
    err = error_of(lambda: c.register_cuda_shared_memory("gpu_region", b"\0" * 64, 0, 64))
    assert_client_error(err, protocol, "GPUs not supported")
    assert "system_shared_memory" in str(c.get_server_metadata())


# -- inference -------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["simple", "simple_ensemble"])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_inputs_and_outputs_in_shared_memory(server, regions, protocol, model):
    lib, c = client(server, protocol)
    in_name, in_key, in_handle = regions(2 * NBYTES)
    out_name, out_key, out_handle = regions(2 * NBYTES)
    shm.set_shared_memory_region(in_handle, [IN0])
    shm.set_shared_memory_region(in_handle, [IN1], offset=NBYTES)
    c.register_system_shared_memory(in_name, in_key, 2 * NBYTES)
    c.register_system_shared_memory(out_name, out_key, 2 * NBYTES)
    inputs, outputs = shm_request(lib, in_name, out_name)
    try:
        for round_ in range(3):         # the same objects again and again, as reuse_infer_objects
            shm.set_shared_memory_region(in_handle, [IN0 * round_])
            result = c.infer(model, inputs, outputs=outputs)
            out0, out1 = (result.get_output(n) for n in ("OUTPUT0", "OUTPUT1"))
            assert [int(d) for d in field(out0, "shape")] == [1, 16]
            dtype = utils.triton_to_np_dtype(field(out0, "datatype"))
            got0 = shm.get_contents_as_numpy(out_handle, dtype, [1, 16])
            got1 = shm.get_contents_as_numpy(out_handle, dtype, [1, 16], offset=NBYTES)
            np.testing.assert_array_equal(got0, IN0 * round_ + IN1)
            np.testing.assert_array_equal(got1, IN0 * round_ - IN1)
            if protocol == "http":          # the data is in the region, not in the response
                assert "data" not in out0 and "binary_data_size" not in out0.get("parameters", {})
            else:
                assert result.get_response().raw_output_contents[0] == b""
    finally:
        c.unregister_system_shared_memory()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_some_tensors_in_shared_memory_some_in_the_request(server, regions, protocol):
    """INPUT0 from a region, INPUT1 in the body; OUTPUT0 inline, OUTPUT1 into a region: the
    inline tensors must still line up with their names (gRPC's raw contents skip regions)."""
    lib, c = client(server, protocol)
    in_name, in_key, in_handle = regions(NBYTES)
    out_name, out_key, out_handle = regions(NBYTES)
    shm.set_shared_memory_region(in_handle, [IN0])
    c.register_system_shared_memory(in_name, in_key, NBYTES)
    c.register_system_shared_memory(out_name, out_key, NBYTES)
    try:
        inputs = [lib.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_shared_memory(in_name, NBYTES)
        inputs[1].set_data_from_numpy(IN1 * 5)
        outputs = [lib.InferRequestedOutput(n) for n in ("OUTPUT1", "OUTPUT0")]
        outputs[0].set_shared_memory(out_name, NBYTES)
        result = c.infer("simple", inputs, outputs=outputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), IN0 + 5)
        np.testing.assert_array_equal(
            shm.get_contents_as_numpy(out_handle, np.int32, [1, 16]), IN0 - 5)
    finally:
        c.unregister_system_shared_memory()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bytes_tensors_in_shared_memory(server, regions, protocol):
    lib, c = client(server, protocol)
    as_text = lambda x: np.array([str(v).encode() for v in x.reshape(-1)], dtype=np.object_)
    in0, in1 = utils.serialize_byte_tensor(as_text(IN0)), utils.serialize_byte_tensor(as_text(IN1))
    want_sum = utils.serialize_byte_tensor(as_text(IN0 + IN1))
    want_diff = utils.serialize_byte_tensor(as_text(IN0 - IN1))
    sizes = [utils.serialized_byte_size(t) for t in (in0, in1, want_sum, want_diff)]
    made = [regions(size) for size in sizes]
    for (name, key, handle), size, data in zip(made, sizes, (in0, in1, None, None)):
        if data is not None:
            shm.set_shared_memory_region(handle, [data])
        c.register_system_shared_memory(name, key, size)
    try:
        inputs = [lib.InferInput(n, [1, 16], "BYTES") for n in ("INPUT0", "INPUT1")]
        outputs = [lib.InferRequestedOutput(n) for n in ("OUTPUT0", "OUTPUT1")]
        for tensor, (name, _, _), size in zip(inputs + outputs, made, sizes):
            tensor.set_shared_memory(name, size)
        result = c.infer("simple_string", inputs, outputs=outputs)
        for out, (_, _, handle), want in zip(("OUTPUT0", "OUTPUT1"), made[2:], (IN0 + IN1, IN0 - IN1)):
            got = shm.get_contents_as_numpy(handle, np.object_, [1, 16])
            assert [int(v) for v in got.reshape(-1)] == want.reshape(-1).tolist()
            assert field(result.get_output(out), "datatype") == "BYTES"
    finally:
        c.unregister_system_shared_memory()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_large_tensors_in_shared_memory(server, regions, protocol):
    lib, c = client(server, protocol)
    x = np.random.default_rng(0).standard_normal((1, LARGE)).astype(np.float32)
    in_name, in_key, in_handle = regions(x.nbytes)
    out_name, out_key, out_handle = regions(x.nbytes)
    shm.set_shared_memory_region(in_handle, [x])
    c.register_system_shared_memory(in_name, in_key, x.nbytes)
    c.register_system_shared_memory(out_name, out_key, x.nbytes)
    try:
        inp = lib.InferInput("INPUT0", [1, LARGE], "FP32")
        inp.set_shared_memory(in_name, x.nbytes)
        out = lib.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory(out_name, x.nbytes)
        c.infer("identity_large", [inp], outputs=[out])
        np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [1, LARGE]), x)
    finally:
        c.unregister_system_shared_memory()


def test_inputs_in_shared_memory_are_bounded_like_a_request_body(server, regions):
    """They are copied out of the region: no more than --http-max-input-size a request."""
    from jupyter_triton.standalone import start_in_thread
    small = start_in_thread(EngineOptions(model_repository=server.engine.options.model_repository,
                                          model_control_mode="explicit", load_models=["identity_large"],
                                          max_input_size=INLINE_BYTES),
                            host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=None)
    try:
        _, c = client(small, "http")
        name, key, _ = regions(LARGE * 4)
        c.register_system_shared_memory(name, key, LARGE * 4)
        inp = httpclient.InferInput("INPUT0", [1, LARGE], "FP32")
        inp.set_shared_memory(name, LARGE * 4)
        err = error_of(lambda: c.infer("identity_large", [inp]))
        assert_client_error(err, "http", f"more than the maximum input size of {INLINE_BYTES} bytes")
    finally:
        small.close()


async def test_shared_memory_through_the_jupyter_server(jp_triton, jp_http_port, jp_base_url, regions):
    """The extension's routes serve the same regions, behind the Jupyter server's credentials."""
    import asyncio
    base = f"127.0.0.1:{jp_http_port}{jp_base_url.rstrip('/')}"
    x = np.array([[7, -8, 9]], dtype=np.int32)
    in_name, in_key, in_handle = regions(x.nbytes)
    out_name, out_key, out_handle = regions(x.nbytes)
    shm.set_shared_memory_region(in_handle, [x])

    def story() -> None:
        c = httpclient.InferenceServerClient(base, network_timeout=60)
        auth = {"Authorization": f"token {TOKEN}"}
        try:
            err = error_of(lambda: c.register_system_shared_memory(in_name, in_key, x.nbytes))
            assert err.status() in ("401", "403")
            c.register_system_shared_memory(in_name, in_key, x.nbytes, headers=dict(auth))
            c.register_system_shared_memory(out_name, out_key, x.nbytes, headers=dict(auth))
            inp = httpclient.InferInput("INPUT0", [1, 3], "INT32")
            inp.set_shared_memory(in_name, x.nbytes)
            out = httpclient.InferRequestedOutput("OUTPUT0")
            out.set_shared_memory(out_name, x.nbytes)
            c.infer("identity_int32", [inp], outputs=[out], headers=dict(auth))
            np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.int32, [1, 3]), x)
            assert status_names(c.get_system_shared_memory_status(headers=dict(auth))) == {in_name, out_name}
        finally:
            c.unregister_system_shared_memory(headers=dict(auth))
            c.close()

    await asyncio.to_thread(story)


# -- what must be a 400, never a crash -----------------------------------------------------

@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_regions_offsets_and_sizes_are_client_errors(server, regions, protocol):
    lib, c = client(server, protocol)
    in_name, in_key, in_handle = regions(2 * NBYTES)
    out_name, out_key, _ = regions(2 * NBYTES)
    shm.set_shared_memory_region(in_handle, [IN0, IN1])
    c.register_system_shared_memory(in_name, in_key, 2 * NBYTES)
    c.register_system_shared_memory(out_name, out_key, 2 * NBYTES)

    def infer(**change):
        inputs, outputs = shm_request(lib, in_name, out_name)
        if "input1" in change:
            inputs[1].set_shared_memory(*change["input1"])
        if "output1" in change:
            outputs[1].set_shared_memory(*change["output1"])
        return lambda: c.infer("simple", inputs, outputs=outputs)

    try:
        cases = [
            (dict(input1=("no_such_region", NBYTES)), "Unable to find shared memory region: 'no_such_region'"),
            (dict(input1=(in_name, NBYTES, 2 * NBYTES)), f"Invalid offset for shared memory region: '{in_name}'"),
            (dict(input1=(in_name, NBYTES, NBYTES + 4)), f"Invalid offset + byte size for shared memory region: '{in_name}'"),
            (dict(input1=(in_name, NBYTES // 2)), "input byte size mismatch for input 'INPUT1'"),
            (dict(output1=(out_name, NBYTES // 2, NBYTES)),
             f"shared memory size specified with the request for output 'OUTPUT1' ({NBYTES // 2} bytes) "
             f"should be at least {NBYTES} bytes"),
            (dict(output1=("no_such_region", NBYTES)), "Unable to find shared memory region: 'no_such_region'"),
        ]
        for change, text in cases:
            assert_client_error(error_of(infer(**change)), protocol, text)
        assert_serving(server)
    finally:
        c.unregister_system_shared_memory()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_region_shrunk_after_registration_is_a_client_error(server, regions, protocol):
    """Reading past the end of a shrunk object through a mapping is a SIGBUS; here it is a 400."""
    lib, c = client(server, protocol)
    in_name, in_key, in_handle = regions(2 * NBYTES)
    out_name, out_key, _ = regions(2 * NBYTES)
    shm.set_shared_memory_region(in_handle, [IN0, IN1])
    c.register_system_shared_memory(in_name, in_key, 2 * NBYTES)
    c.register_system_shared_memory(out_name, out_key, 2 * NBYTES)
    try:
        os.truncate(f"/dev/shm/{out_key[1:]}", 0)
        inputs, outputs = shm_request(lib, in_name, out_name)
        err = error_of(lambda: c.infer("simple", inputs, outputs=outputs))
        assert_client_error(err, protocol, "truncated after it was registered")
        os.truncate(f"/dev/shm/{out_key[1:]}", 2 * NBYTES)
        os.truncate(f"/dev/shm/{in_key[1:]}", NBYTES)
        err = error_of(lambda: c.infer("simple", inputs, outputs=outputs))
        assert_client_error(err, protocol, f"shared memory region '{in_name}' (key '{in_key}') is now")
        assert_serving(server)
    finally:
        c.unregister_system_shared_memory()


def test_the_python_backends_own_segments_cannot_be_registered(server):
    _, c = client(server, "http")
    segments = [p.name for p in Path("/dev/shm").glob("jt_*")]
    key = "/" + (segments[0] if segments else "jt_anything")
    err = error_of(lambda: c.register_system_shared_memory("theirs", key, 8))
    assert_client_error(err, "http", "reserved for the server's python backend")


# -- perf_analyzer ---------------------------------------------------------------------------

@pytest.mark.skipif(PERF_ANALYZER is None, reason="perf_analyzer not found (tools/install-perf-analyzer.sh)")
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_with_system_shared_memory(server, protocol, tmp_path):
    port = server.http_port if protocol == "http" else server.grpc_port
    report = tmp_path / "report.csv"
    cmd = [PERF_ANALYZER, "-m", "simple", "-u", f"127.0.0.1:{port}", "-i", protocol,
           "--shared-memory", "system", "--output-shared-memory-size", str(NBYTES),
           "--concurrency-range", "1", "--measurement-interval", "1000", "--max-trials", "10",
           # eight agents share two cores here: any steady rate will do, this checks the protocol
           "--stability-percentage", "10000", "-f", str(report)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    rows = report.read_text().splitlines()
    assert len(rows) == 2 and float(rows[1].split(",")[1]) > 0, rows
    _, c = client(server, "http")
    assert c.get_system_shared_memory_status() == []      # perf_analyzer cleaned up after itself
