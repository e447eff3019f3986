"""tritonserver 2.51's flags that ``jupyter-triton serve`` accepts without acting on them,
each with the reason, so a team's existing launch command or manifest starts as it is and
the log says, one line a flag, what was not applied and why."""
from __future__ import annotations

import argparse
import logging

log = logging.getLogger("jupyter_triton.cli")

_CPU_ONLY = "this engine places no model on a GPU through tritonserver's allocator"
_NO_CPP = "tritonserver's C++ front threads; here each front is one asyncio loop"

# flag -> (metavar as tritonserver's --help writes it, why it has no effect here)
IGNORED: dict[str, tuple[str, str]] = {
    "--backend-directory": ("<string>", "the backends are built into jupyter_triton"),
    "--repoagent-directory": ("<string>", "repository agents are not supported"),
    "--cache-directory": ("<string>", "the response cache is built in (--cache-config local,...)"),
    "--enable-peer-access": ("<boolean>", _CPU_ONLY + " (no CUDA peer access)"),
    "--pinned-memory-pool-byte-size": ("<integer>", "tensors are not staged through pinned "
                                       "host memory here"),
    "--cuda-memory-pool-byte-size": ("<<integer>:<integer>>", _CPU_ONLY),
    "--cuda-virtual-address-size": ("<<integer>:<integer>>", _CPU_ONLY),
    "--min-supported-compute-capability": ("<float>", _CPU_ONLY),
    "--model-load-gpu-limit": ("<<device_id>:<fraction>>", _CPU_ONLY),
    "--host-policy": ("<<string>,<string>=<string>>", "no NUMA placement of instances here"),
    "--buffer-manager-thread-count": ("<integer>", _NO_CPP),
    "--http-thread-count": ("<integer>", _NO_CPP),
    "--grpc-infer-allocation-pool-size": ("<integer>", _NO_CPP + " (no response object pool)"),
    "--grpc-infer-response-compression-level": ("<string>", "responses leave uncompressed "
                                                "(compressed requests are read)"),
    "--reuse-http-port": ("<boolean>", "the port is bound without SO_REUSEPORT"),
    "--reuse-grpc-port": ("<boolean>", "the port is bound without SO_REUSEPORT"),
    "--http-header-forward-pattern": ("<string>", "headers are not forwarded as request "
                                      "parameters yet"),
    "--grpc-header-forward-pattern": ("<string>", "metadata is not forwarded as request "
                                      "parameters yet"),
    "--allow-sagemaker": ("<boolean>", "no SageMaker front"),
    "--sagemaker-port": ("<integer>", "no SageMaker front"),
    "--sagemaker-safe-port-range": ("<<integer>-<integer>>", "no SageMaker front"),
    "--sagemaker-thread-count": ("<integer>", "no SageMaker front"),
    "--allow-vertex-ai": ("<boolean>", "no Vertex AI front"),
    "--vertex-ai-port": ("<integer>", "no Vertex AI front"),
    "--vertex-ai-thread-count": ("<integer>", "no Vertex AI front"),
    "--vertex-ai-default-model": ("<string>", "no Vertex AI front"),
    "--allow-gpu-metrics": ("<boolean>", "nv_gpu_* are exported where NVML finds a GPU"),
    "--allow-cpu-metrics": ("<boolean>", "nv_cpu_* are always exported"),
    "--metrics-interval-ms": ("<float>", "gauges are read when /metrics is scraped"),
    "--model-load-thread-count": ("<integer>", "models load one after another at startup, "
                                  "their disk and runtime work off the event loop"),
    "--model-load-retry-count": ("<integer>", "a failed load is not retried at startup; "
                                 "poll mode retries it with backoff"),
    "--model-namespacing": ("<boolean>", "one model repository here: no two models can "
                            "share a name"),
    "--model-config-name": ("<string>", "custom configs (configs/<name>.pbtxt) are not "
                            "supported; config.pbtxt is read"),
}

# Values that ask for what this engine does anyway: given so, the flag is simply applied
# (`--strict-model-config=false` is in most Triton manifests).
AS_HERE: dict[str, bool] = {
    "--allow-cpu-metrics": True, "--model-namespacing": False,
    "--reuse-http-port": False, "--reuse-grpc-port": False, "--allow-sagemaker": False,
    "--allow-vertex-ai": False, "--enable-peer-access": False,
}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

# --backend-config=<backend>,<setting>=<value> (or <setting>=<value> for every backend)
BACKEND_SETTINGS: dict[tuple[str, str], str] = {
    ("python", "shm-default-byte-size"): "a python worker's shared memory is sized per batch",
    ("python", "shm-growth-byte-size"): "a python worker's shared memory grows per batch",
    ("python", "shm-region-prefix-name"): "segments are named jt_<server pid>_...",
    ("python", "stub-timeout-seconds"): "a worker's start is bounded by the engine",
    ("", "default-max-batch-size"): "auto-complete sets max_batch_size 4, as Triton's default",
}


def add_ignored(parser: argparse.ArgumentParser) -> None:
    """Register every flag of IGNORED (and --backend-config) with tritonserver's syntax."""
    parser.add_argument("--disable-auto-complete-config", action="store_true",
                        help="serve configs as written (a backend fills nothing in)")
    parser.add_argument("--strict-model-config", action="append", default=None,
                        metavar="<boolean>", help="true: as --disable-auto-complete-config")
    for flag, (metavar, _why) in IGNORED.items():
        if metavar:
            parser.add_argument(flag, default=None, metavar=metavar, action="append",
                                help=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, default=None, action="append_const", const="",
                                help=argparse.SUPPRESS)
    parser.add_argument("--backend-config", action="append", default=[],
                        type=check_backend_config, metavar="<backend>,<setting>=<value>",
                        help="accepted as tritonserver; python backend settings are logged "
                             "with why they do not apply")


def log_ignored(args: argparse.Namespace) -> list[str]:
    """One line for each ignored flag that was given (and each --backend-config); returns them."""
    lines = []
    for flag, (_metavar, why) in IGNORED.items():
        given = getattr(args, flag[2:].replace("-", "_"))
        if given is None:
            continue
        if flag in AS_HERE and given[-1].lower() in (_TRUE if AS_HERE[flag] else _FALSE):
            continue
        lines.append(f"{flag} is accepted and ignored: {why}")
    for item in args.backend_config:
        head = item.split("=", 1)[0]            # [<backend>,]<setting>
        backend, _, name = head.rpartition(",")
        why = BACKEND_SETTINGS.get((backend, name)) or \
            f"the {backend or 'global'} backend setting '{name}' has no counterpart here"
        lines.append(f"--backend-config={item} is accepted and ignored: {why}")
    for line in lines:
        log.warning(line)
    return lines


def check_backend_config(item: str) -> str:
    """Triton's syntax: [<backend>,]<setting>=<value>."""
    head, eq, _value = item.partition("=")
    if not eq or not head.split(",")[-1]:
        raise argparse.ArgumentTypeError(
            f"expected [<backend>,]<setting>=<value>, got '{item}'")
    return item
