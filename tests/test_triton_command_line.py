"""tritonserver 2.51's whole command line, accepted by `jupyter-triton serve` with Triton's
syntax (--flag=value, --flag value, repeated flags); the flags that mean something here take
effect, the others are named in the log, one line each, with the reason."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from jupyter_triton.cli import build_parser, options_from
from jupyter_triton.triton_flags import AS_HERE, IGNORED, log_ignored
from test_cli_options import serve, stop

pytestmark = pytest.mark.timeout(120)

# Every flag of `tritonserver --help` (2.51, nvidia-pytriton's build), as it lists them,
# generated once from that output; test_the_list_is_tritonservers_own checks it where the
# binary is installed.
TRITONSERVER_FLAGS = [
    ("--id", "<string>"),
    ("--exit-timeout-secs", "<integer>"),
    ("--log-verbose", "<integer>"),
    ("--log-info", "<boolean>"),
    ("--log-warning", "<boolean>"),
    ("--log-error", "<boolean>"),
    ("--log-format", "<string>"),
    ("--log-file", "<string>"),
    ("--model-store", "<string>"),
    ("--model-repository", "<string>"),
    ("--exit-on-error", "<boolean>"),
    ("--disable-auto-complete-config", ""),
    ("--strict-readiness", "<boolean>"),
    ("--model-control-mode", "<string>"),
    ("--repository-poll-secs", "<integer>"),
    ("--load-model", "<string>"),
    ("--model-config-name", "<string>"),
    ("--model-load-thread-count", "<integer>"),
    ("--model-load-retry-count", "<integer>"),
    ("--model-namespacing", "<boolean>"),
    ("--enable-peer-access", "<boolean>"),
    ("--allow-http", "<boolean>"),
    ("--http-address", "<string>"),
    ("--http-port", "<integer>"),
    ("--reuse-http-port", "<boolean>"),
    ("--http-header-forward-pattern", "<string>"),
    ("--http-thread-count", "<integer>"),
    ("--http-restricted-api", "<<string>:<string>=<string>>"),
    ("--allow-grpc", "<boolean>"),
    ("--grpc-address", "<string>"),
    ("--grpc-port", "<integer>"),
    ("--reuse-grpc-port", "<boolean>"),
    ("--grpc-header-forward-pattern", "<string>"),
    ("--grpc-infer-allocation-pool-size", "<integer>"),
    ("--grpc-use-ssl", "<boolean>"),
    ("--grpc-use-ssl-mutual", "<boolean>"),
    ("--grpc-server-cert", "<string>"),
    ("--grpc-server-key", "<string>"),
    ("--grpc-root-cert", "<string>"),
    ("--grpc-infer-response-compression-level", "<string>"),
    ("--grpc-keepalive-time", "<integer>"),
    ("--grpc-keepalive-timeout", "<integer>"),
    ("--grpc-keepalive-permit-without-calls", "<boolean>"),
    ("--grpc-http2-max-pings-without-data", "<integer>"),
    ("--grpc-http2-min-recv-ping-interval-without-data", "<integer>"),
    ("--grpc-http2-max-ping-strikes", "<integer>"),
    ("--grpc-max-connection-age", "<integer>"),
    ("--grpc-max-connection-age-grace", "<integer>"),
    ("--grpc-restricted-protocol", "<<string>:<string>=<string>>"),
    ("--allow-sagemaker", "<boolean>"),
    ("--sagemaker-port", "<integer>"),
    ("--sagemaker-safe-port-range", "<<integer>-<integer>>"),
    ("--sagemaker-thread-count", "<integer>"),
    ("--allow-vertex-ai", "<boolean>"),
    ("--vertex-ai-port", "<integer>"),
    ("--vertex-ai-thread-count", "<integer>"),
    ("--vertex-ai-default-model", "<string>"),
    ("--allow-metrics", "<boolean>"),
    ("--allow-gpu-metrics", "<boolean>"),
    ("--allow-cpu-metrics", "<boolean>"),
    ("--metrics-address", "<string>"),
    ("--metrics-port", "<integer>"),
    ("--metrics-interval-ms", "<float>"),
    ("--metrics-config", "<<string>=<string>>"),
    ("--trace-config", "<<string>,<string>=<string>>"),
    ("--backend-directory", "<string>"),
    ("--backend-config", "<<string>,<string>=<string>>"),
    ("--repoagent-directory", "<string>"),
    ("--cache-config", "<<string>,<string>=<string>>"),
    ("--cache-directory", "<string>"),
    ("--rate-limit", "<string>"),
    ("--rate-limit-resource", "<<string>:<integer>:<integer>>"),
    ("--pinned-memory-pool-byte-size", "<integer>"),
    ("--cuda-memory-pool-byte-size", "<<integer>:<integer>>"),
    ("--cuda-virtual-address-size", "<<integer>:<integer>>"),
    ("--min-supported-compute-capability", "<float>"),
    ("--buffer-manager-thread-count", "<integer>"),
    ("--host-policy", "<<string>,<string>=<string>>"),
    ("--model-load-gpu-limit", "<<device_id>:<fraction>>"),
    ("--strict-model-config", "<boolean>"),
    ("--response-cache-byte-size", "<integer>"),
    ("--trace-file", "<string>"),
    ("--trace-level", "<string>"),
    ("--trace-rate", "<integer>"),
    ("--trace-count", "<integer>"),
    ("--trace-log-frequency", "<integer>"),
]

# A value tritonserver would take, where the metavar alone does not say it
VALUES = {
    "--log-format": "ISO8601", "--model-control-mode": "explicit", "--rate-limit": "execution_count",
    "--trace-level": "TIMESTAMPS", "--grpc-infer-response-compression-level": "low",
    "--http-restricted-api": "model-repository:admin-key=secret",
    "--grpc-restricted-protocol": "model-repository:admin-key=secret",
    "--metrics-config": "summary_latencies=true", "--trace-config": "rate=100",
    "--backend-config": "python,shm-default-byte-size=1048576",
    "--cache-config": "local,size=1048576", "--rate-limit-resource": "R1:4:0",
    "--cuda-memory-pool-byte-size": "0:67108864", "--cuda-virtual-address-size": "0:1073741824",
    "--sagemaker-safe-port-range": "8080-8085", "--model-load-gpu-limit": "0:0.5",
    "--host-policy": "gpu_0,numa-node=0", "--load-model": "simple",
    "--vertex-ai-default-model": "simple", "--model-config-name": "h100",
    "--response-cache-byte-size": "1048576",
}
BY_METAVAR = {"<integer>": "2", "<boolean>": "false", "<float>": "1.5", "<string>": "x"}


def value(flag: str, metavar: str) -> str | None:
    """None: the flag takes no value."""
    if not metavar:
        return None
    return VALUES.get(flag) or BY_METAVAR[metavar]


def parse(repo: Path, *argv: str):
    return build_parser().parse_args(["serve", f"--model-repository={repo}", *argv])


@pytest.mark.parametrize("flag, metavar", TRITONSERVER_FLAGS, ids=[f for f, _ in TRITONSERVER_FLAGS])
def test_every_tritonserver_flag_is_accepted_in_both_spellings(tmp_path: Path, flag: str,
                                                               metavar: str):
    given = value(flag, metavar)
    if given is None:
        forms = [[flag]]
    else:
        forms = [[f"{flag}={given}"], [flag, given], [f"{flag}={given}", f"{flag}={given}"]]
    for argv in forms:
        args = parse(tmp_path, *argv)
        if flag not in ("--model-repository", "--model-store"):    # one repository here
            options_from(args)          # and the options build from it


def test_a_whole_tritonserver_command_line_serves(tmp_path: Path):
    # the repository of test_cli_options' servers: an empty one is enough to start
    argv = []
    for flag, metavar in TRITONSERVER_FLAGS:
        if flag in ("--model-repository", "--model-store", "--help"):
            continue
        given = value(flag, metavar)
        argv += [flag] if given is None else [f"{flag}={given}"]
    args = parse(tmp_path, *argv)
    options = options_from(args)
    assert options.rate_limit == "execution_count" and options.rate_limit_resources == ["R1:4:0"]
    assert options.server_id == "x" and options.response_cache_size == 1048576
    assert options.auto_complete_config is False            # --disable-auto-complete-config
    lines = log_ignored(args)
    named = [line.split(" ", 1)[0] for line in lines]
    # every boolean above is "false": those that ask for what happens here anyway are applied
    quiet = {flag for flag, same in AS_HERE.items() if same is False}
    assert quiet and quiet < set(IGNORED)
    assert sorted(named) == sorted(set(IGNORED) - quiet | {
        "--backend-config=python,shm-default-byte-size=1048576"}), lines
    loud = parse(tmp_path, "--model-namespacing", "1",
                 "--allow-cpu-metrics=true", "--allow-cpu-metrics=false")
    assert sorted(line.split(" ", 1)[0] for line in log_ignored(loud)) == [
        "--allow-cpu-metrics", "--model-namespacing"]


def test_refusals_name_the_flag(tmp_path: Path, capsys):
    for argv in (["--rate-limit=sometimes"], ["--rate-limit-resource=R1"],
                 ["--rate-limit-resource=R1:-2"], ["--backend-config=python"],
                 ["--model-residency-bytes=-1"]):
        with pytest.raises(SystemExit):
            parse(tmp_path, *argv)
        assert argv[0].split("=")[0] in capsys.readouterr().err, argv


def test_flags_take_effect_in_a_served_process(tmp_path: Path):
    repo = tmp_path / "models"
    repo.mkdir()
    proc, url = serve(repo, "--id=team-a", "--http-thread-count", "16",
                      "--backend-config=python,shm-default-byte-size=1048576",
                      "--backend-config", "default-max-batch-size=8",
                      "--allow-gpu-metrics=false",
                      "--rate-limit=execution_count", "--rate-limit-resource=R1:2",
                      "--response-cache-byte-size", "1048576")
    client = httpclient.InferenceServerClient(url, network_timeout=30)
    try:
        assert client.get_server_metadata()["name"] == "team-a"
    finally:
        client.close()
        out = stop(proc)
    for flag in ("--http-thread-count", "--allow-gpu-metrics",
                 "--backend-config=python,shm-default-byte-size=1048576",
                 "--backend-config=default-max-batch-size=8"):
        said = [line for line in out.splitlines() if f"{flag} is accepted and ignored: " in line]
        assert len(said) == 1, (flag, out)
    assert "--rate-limit" not in out and "--id" not in out, out   # those are applied


def test_the_list_is_tritonservers_own(tmp_path: Path):
    from tritonserver_peer import tritonserver_dist
    import os
    dist, _version, libdir = tritonserver_dist()      # skips where it is not installed
    env = {**os.environ, "LD_LIBRARY_PATH": f"{dist.parent.parent / 'nvidia_pytriton.libs'}:{libdir}"}
    done = subprocess.run([str(dist / "bin" / "tritonserver"), "--help"], capture_output=True,
                          text=True, timeout=60, env=env)
    listed = []
    for line in (done.stdout + done.stderr).splitlines():
        if line.startswith("  --") and line.split()[0] != "--help":
            flag, _, metavar = line.strip().partition(" ")
            listed.append((flag, metavar))
    assert listed == TRITONSERVER_FLAGS


@pytest.mark.parametrize("flags", [["--disable-auto-complete-config"],
                                   ["--strict-model-config", "true"]])
def test_without_auto_complete_a_config_is_served_as_written(tmp_path: Path, flags: list[str]):
    from onnx import TensorProto
    from onnx_models import add_sub
    from conftest import LINEAR_CONFIG, W
    from onnx_models import linear
    repo = tmp_path / "models"
    add_sub(repo / "partial" / "1" / "model.onnx", elem=TensorProto.FLOAT)
    (repo / "partial" / "config.pbtxt").write_text('name: "partial"\nbackend: "onnxruntime"\n')
    linear(W, repo / "linear" / "1" / "model.onnx")
    (repo / "linear" / "config.pbtxt").write_text(LINEAR_CONFIG)
    for strict in (True, False):
        proc, url = serve(repo, *(flags if strict else ["--strict-model-config=false"]))
        client = httpclient.InferenceServerClient(url, network_timeout=30)
        try:
            client.load_model("linear")                     # complete: served either way
            if strict:
                with pytest.raises(InferenceServerException) as err:
                    client.load_model("partial")
                assert err.value.status() == "400" and "partial" in err.value.message()
            else:
                client.load_model("partial")
                assert [i["name"] for i in client.get_model_metadata("partial")["inputs"]] == \
                    ["INPUT0", "INPUT1"]
        finally:
            client.close()
            stop(proc)
