"""Cold start: a served plain function (the artifact ``%%serve`` uploads) answers its first
call from another process, in a worker process of its own forked from the template; a crash
in it costs only its own requests. No test here asserts a time (the figure is in the note)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import serve
from jupyter_triton.backends.python import launch
from jupyter_triton.kernel.artifacts import build_artifact

REMOTE_CALL = r'''
import json, sys
import numpy as np
import tritonclient.http as httpclient
client = httpclient.InferenceServerClient(sys.argv[1])
x = httpclient.InferInput("x", [1, 1], "INT64")
x.set_data_from_numpy(np.array([[int(sys.argv[3])]], np.int64))
result = client.infer(sys.argv[2], [x])
print(json.dumps(result.as_numpy(result.get_response()["outputs"][0]["name"]).ravel().tolist()))
'''


def pid_or_crash(x):
    """The worker's pid, or a crash for a negative input."""
    import os
    import numpy as np
    if int(x.ravel()[0]) < 0:
        os._exit(7)
    return np.full_like(x, os.getpid())


def tripled(x):
    return x * 3


def upload(client: httpclient.InferenceServerClient, fn, name: str) -> None:
    artifact = build_artifact(fn, name, example=np.ones((1, 1), np.int64))
    client.load_model(name, config=artifact.config_json(),
                      files={f"file:{path}": data for path, data in artifact.files.items()})


def call(client: httpclient.InferenceServerClient, name: str, value: int) -> int:
    x = httpclient.InferInput("x", [1, 1], "INT64")
    x.set_data_from_numpy(np.array([[value]], np.int64))
    result = client.infer(name, [x])
    return int(result.as_numpy(result.get_response()["outputs"][0]["name"]).ravel()[0])


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode().split("\0")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def server(tmp_path):
    server, client = serve(tmp_path / "models", model_control_mode="explicit")
    try:
        yield server, client
    finally:
        server.close()


def test_a_served_function_answers_its_first_remote_call_from_a_worker_of_its_own(server):
    srv, client = server
    upload(client, tripled, "tripled")
    out = subprocess.run([sys.executable, "-c", REMOTE_CALL, f"127.0.0.1:{srv.http_port}", "tripled", "14"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [42]

    upload(client, pid_or_crash, "pids")
    pid = call(client, "pids", 1)
    assert pid != os.getpid()                               # not the server's process
    template = parent_of(pid)                               # forked from the template...
    assert "template" in cmdline(template) and parent_of(template) == os.getpid()   # ...the server's child
    assert call(client, "pids", 2) == pid                   # one worker serves on


def test_a_crash_costs_only_its_own_requests(server):
    _, client = server
    upload(client, pid_or_crash, "crashy")
    upload(client, pid_or_crash, "bystander")
    first, other = call(client, "crashy", 1), call(client, "bystander", 1)
    with pytest.raises(InferenceServerException) as err:
        call(client, "crashy", -1)
    assert err.value.status() == "503" and "died (exit code 7)" in str(err.value), err.value
    deadline = time.monotonic() + 10
    while alive(first) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(first)
    second = call(client, "crashy", 1)                       # a new worker, from the template
    assert second != first and "template" in cmdline(parent_of(second))
    assert call(client, "bystander", 1) == other             # the other model never noticed
    assert client.is_server_live()


def test_a_worker_sees_the_servers_environment_of_now_not_of_the_templates_start(server, monkeypatch, tmp_path):
    _, client = server
    upload(client, tripled, "warm")                          # the template runs from here on
    monkeypatch.setenv("JT_COLD_START_PROBE", "set after the template started")
    monkeypatch.chdir(tmp_path)

    def probe(x):
        import os
        import numpy as np
        ok = (os.environ.get("JT_COLD_START_PROBE") == "set after the template started"
              and os.getcwd() == os.environ.get("JT_EXPECTED_CWD"))
        return np.full_like(x, 1 if ok else 0)

    monkeypatch.setenv("JT_EXPECTED_CWD", str(tmp_path))
    upload(client, probe, "probe")
    assert call(client, "probe", 1) == 1


def test_a_dead_template_is_started_again(server):
    _, client = server
    upload(client, tripled, "before")
    old = launch.TEMPLATE._process.pid
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(old) and time.monotonic() < deadline:
        time.sleep(0.05)
    upload(client, pid_or_crash, "after")                    # a new template forks this one
    pid = call(client, "after", 1)
    assert parent_of(pid) != old and "template" in cmdline(parent_of(pid))
    # the old template's workers died with it (PR_SET_PDEATHSIG); "before" gets a new one
    try:
        call(client, "before", 1)
    except InferenceServerException as err:
        assert "died" in str(err)
    assert call(client, "before", 5) == 15


@pytest.mark.parametrize("pidfd", [True, False])
def test_without_the_template_every_worker_is_a_fresh_interpreter(server, monkeypatch, pidfd):
    """Where pidfds are missing (not Linux, a kernel before 5.3) workers are started as a
    packed environment's are: slower, the same behaviour."""
    _, client = server
    monkeypatch.setattr(launch, "USE_TEMPLATE", False)
    monkeypatch.setattr(launch, "USE_PIDFD", pidfd and launch.USE_PIDFD)
    upload(client, pid_or_crash, "fresh")
    pid = call(client, "fresh", 1)
    assert parent_of(pid) == os.getpid() and "worker" in cmdline(pid)
    with pytest.raises(InferenceServerException) as err:
        call(client, "fresh", -1)
    assert "died (exit code 7)" in str(err.value), err.value
    assert call(client, "fresh", 1) not in (pid, os.getpid())


def test_a_server_that_may_get_python_models_starts_the_template_at_once(tmp_path):
    """``jupyter-triton serve`` in explicit mode (uploads may bring python models) has the
    template running before the first python model arrives: that model pays no start."""
    import psutil

    exe = os.path.join(os.path.dirname(sys.executable), "jupyter-triton")
    (tmp_path / "models").mkdir()
    proc = subprocess.Popen([exe, "serve", "--model-repository", str(tmp_path / "models"),
                             "--model-control-mode", "explicit", "--http-address", "127.0.0.1",
                             "--http-port", "0", "--allow-grpc", "false", "--allow-metrics", "false"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        templates: list = []
        while not templates and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            try:
                templates = [c for c in psutil.Process(proc.pid).children()
                             if "template" in c.cmdline()]
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                pass
        assert templates, "no template process under the server"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_worker_handles_past_fd_setsize_work(server):
    """A server holding over 1,024 descriptors (connections, workers) still watches its
    workers: their pidfds land past select()'s FD_SETSIZE, which once failed every unload."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1300:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} leaves no room past 1,024 descriptors")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1300), hard))
    filler = []
    try:
        while not filler or filler[-1] < 1100:
            filler.append(os.open(os.devnull, os.O_RDONLY))
        srv, client = server
        upload(client, pid_or_crash, "pids")
        pid = call(client, "pids", 1)                    # its pidfd is past 1,024
        assert alive(pid)
        client.unload_model("pids")                      # joins the worker through that pidfd
        deadline = time.monotonic() + 30
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(pid)
        upload(client, pid_or_crash, "pids")             # and a crash is still seen as one
        with pytest.raises(InferenceServerException) as died:
            call(client, "pids", -1)
        assert died.value.status() == "503"
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
