"""A misbehaving python model hurts only its own requests: a hung execute or initialize is
bounded, unload finishes, workers die with their server, segments of a killed server are
swept, and a full /dev/shm is a 503, never a signal. Real servers, real worker processes."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from conftest import serve
from server_waits import started, wait_for_start, wait_until
from jupyter_triton.backends.base import InstanceSpec, ModelFiles
from jupyter_triton.backends.python import PythonBackend
from jupyter_triton.protocol.errors import Unavailable
from ports import free_port

pytestmark = pytest.mark.timeout(180)

# X[0] picks what execute does: 0 echo, 1 hang, 2 return X[1] zeros. Marker files in the
# version directory make initialize / finalize hang.
FAULTY_MODEL_PY = '''
import os, time
import numpy as np
import triton_python_backend_utils as pb_utils

HERE = os.path.dirname(__file__)

class TritonPythonModel:
    def initialize(self, args):
        if os.path.exists(os.path.join(HERE, "hang_initialize")):
            time.sleep(3600)

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            mode = int(x[0]) if x.size else 0
            if mode == 1:
                open(os.path.join(HERE, "hung"), "w").close()     # the test waits for it
                time.sleep(3600)
            y = np.zeros(int(x[1]), np.float32) if mode == 2 else x
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("Y", y), pb_utils.Tensor("PID", np.array([os.getpid()], np.int64))]))
        return responses

    def finalize(self):
        if os.path.exists(os.path.join(HERE, "hang_finalize")):
            time.sleep(3600)
'''


def faulty_config(**parameters: str) -> str:
    params = "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n'
                     for k, v in parameters.items())
    return textwrap.dedent('''
        name: "faulty"
        backend: "python"
        input [{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }]
        output [{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] },
                { name: "PID" data_type: TYPE_INT64 dims: [ 1 ] }]
        instance_group [{ kind: KIND_CPU count: 1 }]
        ''') + params


def write_faulty(root: Path, **parameters: str) -> Path:
    version = root / "faulty" / "1"
    version.mkdir(parents=True, exist_ok=True)
    (version / "model.py").write_text(textwrap.dedent(FAULTY_MODEL_PY))
    (root / "faulty" / "config.pbtxt").write_text(faulty_config(**parameters))
    return version


def x_input(values: np.ndarray) -> list[httpclient.InferInput]:
    inp = httpclient.InferInput("X", list(values.shape), "FP32")
    inp.set_data_from_numpy(values.astype(np.float32), binary_data=True)
    return [inp]


def infer_pid(client: httpclient.InferenceServerClient) -> int:
    x = np.array([0, 7, 8], np.float32)
    result = client.infer("faulty", x_input(x))
    np.testing.assert_array_equal(result.as_numpy("Y"), x)
    return int(result.as_numpy("PID")[0])


def gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaped (it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, command line with NULs between arguments)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        found[int(entry)] = (int(fields[1]), fields[0], cmdline)
    return found


def children_running(pid: int) -> list[int]:
    """Live python backend workers of server ``pid``: forked by its template process (a child
    of the server running boot.py), or started by the server itself (a packed environment's)."""
    procs = _processes()
    templates = {p for p, (ppid, _, cmd) in procs.items() if ppid == pid and "boot.py\0template\0" in cmd}
    return [p for p, (ppid, state, cmd) in procs.items()
            if state != "Z" and "boot.py\0" in cmd
            and (ppid in templates or (ppid == pid and "boot.py\0worker\0" in cmd))]


def segments_of(pid: int) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"jt_{pid}_")}


# --------------------------------------------------------------- timeouts (in-thread server)

def test_a_hung_execute_fails_with_504_and_a_restarted_worker_serves_the_next(tmp_path):
    write_faulty(tmp_path, execute_timeout_seconds="2")
    server, client = serve(tmp_path, model_control_mode="explicit", load_models=["faulty"])
    try:
        first = infer_pid(client)
        start = time.monotonic()
        with pytest.raises(InferenceServerException) as err:
            client.infer("faulty", x_input(np.array([1], np.float32)))
        elapsed = time.monotonic() - start
        assert err.value.status() == "504", err.value
        message = str(err.value)
        assert "faulty" in message and "execute_timeout_seconds" in message and "2 s" in message, message
        assert 1.5 < elapsed < 15, elapsed
        assert gone(first)
        second = infer_pid(client)
        assert second != first
        assert client.is_model_ready("faulty")
    finally:
        server.close()


def test_a_hung_initialize_fails_the_load_with_504_and_leaves_no_worker(tmp_path):
    version = write_faulty(tmp_path, initialize_timeout_seconds="2")
    (version / "hang_initialize").touch()
    before = set(children_running(os.getpid()))
    server, client = serve(tmp_path, model_control_mode="explicit")
    try:
        start = time.monotonic()
        with pytest.raises(InferenceServerException) as err:
            client.load_model("faulty")
        assert time.monotonic() - start < 20
        message = str(err.value)
        assert "initialize" in message and "initialize_timeout_seconds" in message, message
        assert not client.is_model_ready("faulty")
        wait_until(lambda: set(children_running(os.getpid())) <= before, "the hung worker is gone",
                   seconds=5)
        (version / "hang_initialize").unlink()
        client.load_model("faulty")
        infer_pid(client)
    finally:
        server.close()


def test_a_bad_timeout_parameter_fails_the_load(tmp_path):
    write_faulty(tmp_path, execute_timeout_seconds="soon")
    server, client = serve(tmp_path, model_control_mode="explicit")
    try:
        with pytest.raises(InferenceServerException) as err:
            client.load_model("faulty")
        assert "execute_timeout_seconds" in str(err.value) and "soon" in str(err.value)
    finally:
        server.close()


# ------------------------------------------------------------------------------- unload

def test_unload_with_a_hung_finalize_is_bounded(tmp_path):
    version = write_faulty(tmp_path, finalize_timeout_seconds="1")
    server, client = serve(tmp_path, model_control_mode="explicit", load_models=["faulty"])
    try:
        pid = infer_pid(client)
        (version / "hang_finalize").touch()
        start = time.monotonic()
        client.unload_model("faulty")
        wait_until(lambda: gone(pid), "the worker stuck in finalize is killed", seconds=10)
        wait_until(lambda: not client.is_model_ready("faulty"), "the model is unloaded", seconds=5)
        assert time.monotonic() - start < 15            # the waits' bound: not the 3600 s hang
    finally:
        server.close()


def test_unload_and_stop_with_a_request_stuck_in_execute_are_bounded(tmp_path):
    write_faulty(tmp_path)    # the default execute bound (600 s) is far away
    server, client = serve(tmp_path, model_control_mode="explicit", load_models=["faulty"],
                           unload_timeout_secs=1.0)
    outcome: list = []

    def stuck() -> None:
        hung = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", network_timeout=60)
        try:
            hung.infer("faulty", x_input(np.array([1], np.float32)))
            outcome.append("answered")
        except InferenceServerException as err:
            outcome.append(err)

    try:
        pid = infer_pid(client)
        before = started(client, "faulty")
        thread = threading.Thread(target=stuck, daemon=True)
        thread.start()
        wait_for_start(client, "faulty", before)
        start = time.monotonic()
        client.unload_model("faulty")
        wait_until(lambda: gone(pid), "the worker stuck in execute is killed at unload", seconds=15)
        thread.join(15)
        assert time.monotonic() - start < 15
        assert outcome and isinstance(outcome[0], InferenceServerException), outcome
        assert outcome[0].status() == "503", outcome[0]
        # and the server itself stops in bounded time with a model loaded again and stuck
        client.load_model("faulty")
        pid = infer_pid(client)
        before = started(client, "faulty")
        threading.Thread(target=stuck, daemon=True).start()
        wait_for_start(client, "faulty", before)
    finally:
        start = time.monotonic()
        server.close()
    assert time.monotonic() - start < 20
    wait_until(lambda: gone(pid), "no worker outlives the server's stop", seconds=5)


def test_backend_unload_kills_a_worker_stuck_in_execute(tmp_path):
    version = write_faulty(tmp_path)
    config = text_format.Parse(faulty_config(), mc.ModelConfig())
    backend = PythonBackend(config, ModelFiles("faulty", 1, tmp_path / "faulty", version, "model.py"),
                            InstanceSpec("faulty_0_0"))
    backend.load()
    pid = backend._worker.pid
    results: list = []
    thread = threading.Thread(target=lambda: results.append(
        backend.execute([{"X": np.array([1], np.float32)}])), daemon=True)
    thread.start()
    wait_until(backend._lock.locked, "the batch is executing", seconds=10)
    start = time.monotonic()
    backend.unload()
    assert time.monotonic() - start < 8
    thread.join(5)
    assert gone(pid)
    assert len(results) == 1 and isinstance(results[0][0], Unavailable), results
    assert "unloaded while executing" in str(results[0][0])


# --------------------------------------------------- killed servers (jupyter-triton serve)


class ServeProcess:
    """`jupyter-triton serve` in its own session (so the test can kill its whole group)."""

    def __init__(self, repo: Path, log: Path, prefix: list[str] | None = None) -> None:
        self.port = free_port()
        exe = Path(sys.executable).with_name("jupyter-triton")
        argv = [str(exe), "serve", "--model-repository", str(repo), "--http-address", "127.0.0.1",
                "--http-port", str(self.port), "--allow-grpc", "false", "--allow-metrics", "false",
                "--model-control-mode", "explicit", "--load-model", "faulty"]
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen((prefix or []) + argv, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.client = httpclient.InferenceServerClient(f"127.0.0.1:{self.port}", network_timeout=60)
        deadline = time.monotonic() + 90
        while True:
            try:
                if self.client.is_model_ready("faulty"):
                    break
            except Exception:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill_group()
                raise AssertionError(f"server did not become ready:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        self.kill_group()


def test_workers_die_with_a_killed_server(tmp_path):
    write_faulty(tmp_path)
    server = ServeProcess(tmp_path, tmp_path / "server.log")
    try:
        pid = infer_pid(server.client)
        assert pid in children_running(server.pid)
        # Stuck in execute, the worker never reads its socket: only the kernel's parent-death
        # signal can end it.
        hung = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}", network_timeout=60)
        threading.Thread(target=lambda: _ignore(hung.infer, "faulty", x_input(np.array([1], np.float32))),
                         daemon=True).start()
        wait_until((tmp_path / "faulty" / "1" / "hung").exists, "the worker hangs in execute", seconds=60)
        os.kill(server.pid, signal.SIGKILL)
        server.proc.wait(10)
        wait_until(lambda: gone(pid), "the worker dies with its server", seconds=5)
    finally:
        server.kill_group()


def _ignore(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:
        pass


def test_segments_of_a_killed_server_are_swept_at_the_next_start(tmp_path):
    write_faulty(tmp_path)
    first = ServeProcess(tmp_path, tmp_path / "first.log")
    try:
        infer_pid(first.client)        # regions are made by the first batch
        leaked = segments_of(first.pid)
        assert leaked, "the first batch made no shared-memory segment"
    finally:
        first.kill_group()             # server, workers and resource tracker: nobody unlinks
    assert segments_of(first.pid) == leaked
    second = ServeProcess(tmp_path, tmp_path / "second.log")
    try:
        assert not segments_of(first.pid) & leaked
        infer_pid(second.client)
    finally:
        second.stop()
    assert not segments_of(second.pid), "a stopped server left its segments"


def _unshare_works() -> str | None:
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return "needs Linux and unshare(1)"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"cannot mount a small /dev/shm in a mount namespace here: {probe.stderr.strip()}"
    return None


def test_a_batch_larger_than_dev_shm_is_a_503_and_the_server_lives(tmp_path):
    reason = _unshare_works()
    if reason:
        pytest.skip(reason)
    write_faulty(tmp_path)
    small_shm = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=8m tmpfs /dev/shm && exec "$@"', "sh"]
    server = ServeProcess(tmp_path, tmp_path / "server.log", prefix=small_shm)
    try:
        client = server.client
        pid = infer_pid(client)
        big = np.zeros(3 << 20, np.float32)     # 12 MiB of inputs: more than /dev/shm holds
        with pytest.raises(InferenceServerException) as err:
            client.infer("faulty", x_input(big))
        assert err.value.status() == "503", err.value
        message = str(err.value)
        assert "faulty" in message and "shared memory" in message and "No space left" in message, message
        assert client.is_server_live() and client.is_model_ready("faulty")
        assert infer_pid(client) == pid      # same worker: nothing died
        # outputs larger than /dev/shm, asked for by a small request
        with pytest.raises(InferenceServerException) as err:
            client.infer("faulty", x_input(np.array([2, 3 << 20], np.float32)))
        assert err.value.status() == "503" and "shared memory" in str(err.value), err.value
        assert infer_pid(client) == pid
        # what fits still fits, after the failures: 2.5 MiB in, 2.5 MiB out
        mid = np.full(5 << 17, 3, np.float32)
        np.testing.assert_array_equal(client.infer("faulty", x_input(mid)).as_numpy("Y"), mid)
        assert server.proc.poll() is None
    finally:
        server.stop()


def test_the_sweep_spares_live_servers_and_other_pid_namespaces(tmp_path):
    from jupyter_triton.backends.python.shm import segment_prefix, sweep_stale_segments
    dead = subprocess.Popen(["true"])
    dead.wait()
    ours_dead = segment_prefix(dead.pid) + "0123456789ab"
    ours_live = segment_prefix(os.getpid()) + "0123456789ab"
    other_ns = f"jt_{dead.pid}_1_0123456789ab"      # a container sharing /dev/shm
    for name in (ours_dead, ours_live, other_ns, "unrelated_file"):
        (tmp_path / name).write_bytes(b"x")
    assert sweep_stale_segments(str(tmp_path)) == [ours_dead]
    assert sorted(os.listdir(tmp_path)) == sorted([ours_live, other_ns, "unrelated_file"])
