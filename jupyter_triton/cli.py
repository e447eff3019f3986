"""``jupyter-triton serve`` (also ``jupyter triton serve``): the standalone server, with
flags spelled like tritonserver's."""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import sys
from dataclasses import replace
from typing import Any, Coroutine

from .engine import CONTROL_MODES, EngineOptions
from .engine.observation.server_log import ServerLog
from .frontends.admission import MODEL_REPOSITORY, AccessPolicy, Restriction
from .frontends.grpc_options import KEEPALIVE_FLAGS, GrpcTLS, http2_limits
from .frontends.limits import HTTP2Limits
from .protocol.errors import InvalidArgument, TritonError
from .triton_flags import add_ignored, log_ignored

# An instance thread whose runtime has released the GIL waits up to the switch interval
# (5 ms by default) to take it back from the event loop: for millisecond-scale models that
# wait is most of the latency (benchmarks/README.md has the figures).
SWITCH_INTERVAL_S = 0.0005
# engine/batching/busy_poll.py: a standalone server polls this long after each request (the event loop
# and its GIL are its own; a Jupyter server's and a kernel's are not, so they don't poll). A
# millisecond covers the 500 us queue delay and a fast model's execution at one client, so
# the loop does not sleep between a client's requests.
BUSY_POLL_US = 1000
# `serve` runs on uvloop where it is installed: it spends less of the event loop's CPU per
# inference than asyncio's, over HTTP and gRPC (benchmarks/loop_cpu.py; see
# benchmarks/results/notes-frontends.md). JUPYTER_TRITON_LOOP=asyncio keeps asyncio's loop (the
# one the Jupyter server and the kernel's fallback server run on).
LOOP_ENV = "JUPYTER_TRITON_LOOP"
_DEFAULTS = EngineOptions(model_repository=".")     # the engine's defaults are the flags' defaults


def _non_negative(kind: type):
    def parse(text: str):
        value = kind(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
        return value
    parse.__name__ = kind.__name__      # argparse names the type in its error message
    return parse


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):       # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a number of seconds, 0 or more, got {text}")
    return value


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{text}'")


def _rate_limit_resource(text: str) -> str:
    """tritonserver's <name>:<count>[:<device>]."""
    parts = text.split(":")
    try:
        ok = len(parts) in (2, 3) and parts[0] != "" and int(parts[1]) >= 0 and \
            (len(parts) == 2 or int(parts[2]) >= 0)
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(
            f"expected <resource_name>:<count>[:<device>] with a count and a device of 0 or "
            f"more, got '{text}'")
    return text


def _restriction(text: str) -> Restriction:
    try:
        return Restriction.parse(text)
    except InvalidArgument as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_open_repository(args: argparse.Namespace) -> list[str]:
    """Loudly (log and stderr) say where the model-repository API, which loads code in
    explicit mode, is open to anyone who reaches a non-loopback address. Returns the lines."""
    if args.model_control_mode != "explicit":
        return []            # other modes refuse load/unload: the repository API runs no code
    listeners = []
    if args.allow_http:
        listeners.append(("HTTP", args.http_address, args.http_restricted_api, "--http-restricted-api"))
    if args.allow_grpc:
        listeners.append(("gRPC", args.grpc_address, args.grpc_restricted_protocol,
                          "--grpc-restricted-protocol"))
    lines = []
    for name, address, restrictions, flag in listeners:
        if not _loopback(address) and not any(MODEL_REPOSITORY in r.groups for r in restrictions):
            lines.append(
                f"WARNING: the model-repository API (load/unload: it runs the model's code) is open "
                f"to anyone who can reach {name} {address or '0.0.0.0'}; restrict it with "
                f"{flag} model-repository:<header>=<secret>, or bind 127.0.0.1")
    for line in lines:
        logging.warning(line)
        print(line, file=sys.stderr, flush=True)
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jupyter-triton")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve", help="serve a Triton model repository without Jupyter",
        epilog="Every other flag of tritonserver 2.51 is accepted as tritonserver spells it "
               "(GPU memory pools, C++ thread counts, SageMaker/Vertex AI, backend settings, "
               "...); one that cannot apply here is named in the log with the reason.")
    serve.add_argument("--model-repository", "--model-store", required=True, action="append")
    serve.add_argument("--http-port", type=int, default=8000)
    serve.add_argument("--http-address", default="0.0.0.0")
    serve.add_argument("--grpc-port", type=int, default=8001)
    serve.add_argument("--grpc-address", default="0.0.0.0")
    serve.add_argument("--metrics-port", type=int, default=8002)
    serve.add_argument("--metrics-address", default=None)
    serve.add_argument("--allow-http", type=_bool, default=True)
    serve.add_argument("--allow-grpc", type=_bool, default=True)
    serve.add_argument("--allow-metrics", type=_bool, default=True)
    serve.add_argument("--model-control-mode", choices=CONTROL_MODES, default="none")
    serve.add_argument("--load-model", action="append", default=[])
    serve.add_argument("--repository-poll-secs", type=float, default=15.0)
    serve.add_argument("--http-max-input-size", type=int, default=64 * 1024 * 1024)
    serve.add_argument("--exit-on-error", type=_bool, default=False)
    serve.add_argument("--metrics-config", action="append", default=[],
                       help="e.g. summary_latencies=true")
    serve.add_argument("--log-verbose", type=int, default=0)
    serve.add_argument("--log-info", type=_bool, default=True)
    serve.add_argument("--log-warning", type=_bool, default=True)
    serve.add_argument("--log-error", type=_bool, default=True)
    serve.add_argument("--log-format", choices=("default", "ISO8601"), default="default")
    serve.add_argument("--log-file", default="")
    serve.add_argument("--trace-config", action="append", default=[],
                       help="[<mode>,]<setting>=<value>, as tritonserver: level=TIMESTAMPS, "
                            "rate=100, count=-1, mode=triton|opentelemetry, triton,file=PATH, "
                            "triton,log-frequency=N, opentelemetry,url=...")
    # tritonserver's deprecated spellings, still accepted by 2.51
    serve.add_argument("--trace-file", default=None, help=argparse.SUPPRESS)
    serve.add_argument("--trace-level", action="append", default=[], help=argparse.SUPPRESS)
    serve.add_argument("--trace-rate", default=None, help=argparse.SUPPRESS)
    serve.add_argument("--trace-count", default=None, help=argparse.SUPPRESS)
    serve.add_argument("--trace-log-frequency", default=None, help=argparse.SUPPRESS)
    serve.add_argument("--strict-readiness", type=_bool, default=_DEFAULTS.strict_readiness,
                       help="v2/health/ready is false while a model asked to load is not ready")
    serve.add_argument("--exit-timeout-secs", type=_non_negative(float), default=_DEFAULTS.exit_timeout_secs,
                       help="at stop, how long models may finish what they run")
    serve.add_argument("--shutdown-drain-secs", type=_seconds, default=0.0,
                       metavar="<seconds>",
                       help="on SIGTERM, answer readiness 503 (HTTP) and NOT_SERVING (gRPC) "
                            "while still serving this long, so a load balancer stops sending; "
                            "then close the listeners and let requests in flight finish within "
                            "--exit-timeout-secs (a second signal ends the wait; 0: stop at once)")
    serve.add_argument("--unload-timeout-secs", type=_non_negative(float), default=_DEFAULTS.unload_timeout_secs,
                       help="at unload or reload, how long requests in flight may finish")
    serve.add_argument("--max-output-size", type=_non_negative(int), default=_DEFAULTS.max_output_size,
                       help="bytes of outputs one response may carry (past it: 503; 0: no bound)")
    serve.add_argument("--cache-config", action="append", default=[],
                       help="local,size=<bytes>: the response cache of models whose config says "
                            "response_cache { enable: true } (as tritonserver)")
    serve.add_argument("--keep-versions", type=_non_negative(int), default=_DEFAULTS.keep_versions,
                       help="after an upload, keep the newest N versions on disk (0: delete nothing)")
    restricted = "<api>[,<api>...]:<key>=<value>: those API groups need that request header " \
                 "(as tritonserver; groups: health, metadata, inference, shared-memory, " \
                 "model-config, model-repository, statistics, trace, logging)"
    serve.add_argument("--http-restricted-api", action="append", default=[], type=_restriction,
                       metavar="<api>[,<api>...]:<key>=<value>", help=restricted)
    serve.add_argument("--grpc-restricted-protocol", action="append", default=[], type=_restriction,
                       metavar="<api>[,<api>...]:<key>=<value>", help=restricted + " (gRPC metadata)")
    _grpc_connection_flags(serve)
    serve.add_argument("--id", default="triton", metavar="<string>",
                       help="the server's name in server metadata (as tritonserver: 'triton')")
    serve.add_argument("--rate-limit", choices=("off", "execution_count"),
                       default=_DEFAULTS.rate_limit,
                       help="execution_count: instances run as the rate_limiter of their "
                            "instance_group and the resources allow (as tritonserver)")
    serve.add_argument("--rate-limit-resource", action="append", default=[],
                       type=_rate_limit_resource, metavar="<resource_name>:<count>[:<device>]",
                       help="how many of a resource the server has (repeat per resource)")
    serve.add_argument("--response-cache-byte-size", type=_non_negative(int), default=None,
                       metavar="<integer>", help=argparse.SUPPRESS)  # = --cache-config local,size=
    serve.add_argument("--model-residency-bytes", type=_non_negative(int),
                       default=_DEFAULTS.model_residency_bytes, metavar="<bytes>",
                       help="memory budget of loaded models: the least recently used idle ones "
                            "are evicted to make room for a load (0: none)")
    serve.add_argument("--max-loaded-models", type=_non_negative(int),
                       default=_DEFAULTS.max_loaded_models, metavar="<n>",
                       help="at most this many models loaded at once, as above (0: no bound)")
    serve.add_argument("--load-on-demand", type=_bool, nargs="?", const=True,
                       default=_DEFAULTS.load_on_demand, metavar="<boolean>",
                       help="a request for a repository model that is not loaded loads it "
                            "(default false: Triton's 404; a model's config parameter "
                            "load_on_demand says it for that model)")
    serve.add_argument("--busy-poll-us", type=_non_negative(int), default=BUSY_POLL_US,
                       metavar="<microseconds>",
                       help="after a request arrives the event loop, and a python model's worker "
                            "after a batch of one, poll this long before sleeping: lower latency "
                            "at light load for up to a core while requests come (0: off)")
    add_ignored(serve)
    export = sub.add_parser(
        "export", help="copy a repository into the form NVIDIA Triton and KServe serve as is")
    export.add_argument("--model-repository", required=True)
    export.add_argument("--output", required=True, help="a new folder (never overwritten)")
    export.add_argument("--model", action="append", default=[], help="only these models")
    export.add_argument("--all-versions", action="store_true",
                        help="every version on disk, not only those the version policy serves")
    export.add_argument("--kserve-name", default="",
                        help="also write <output>-kserve.yaml, an InferenceService of that name")
    export.add_argument("--storage-uri", default="",
                        help="where KServe will find the repository (e.g. s3://bucket/models)")
    export.add_argument("--torch-format", choices=("torchscript", "onnx"), default="torchscript",
                        help="what torch.export programs and torch modules become for Triton: "
                             "TorchScript (its pytorch backend) or ONNX (its onnxruntime backend)")
    export.add_argument("--pack-env", action="store_true",
                        help="pack the Python environment each python-backend model needs "
                             "(copied from this one) beside it and set EXECUTION_ENV_PATH")
    export.add_argument("--pack-env-pin", action="append", default=[], metavar="<requirement>",
                        help="with --pack-env: install this version instead of this environment's "
                             "(e.g. 'numpy<2' for Triton 2.51's python backend); repeatable")
    return parser


def _grpc_connection_flags(serve: argparse.ArgumentParser) -> None:
    """tritonserver's gRPC keep-alive, connection-age and TLS flags (times in milliseconds)."""
    defaults = HTTP2Limits()
    for flag, (field, unit) in KEEPALIVE_FLAGS.items():
        default = getattr(defaults, field)
        if unit == "bool":
            serve.add_argument(f"--grpc-{flag}", type=_bool, default=None, metavar="<bool>",
                               help=f"as tritonserver (default: {str(default).lower()})")
        elif unit == "ms":
            serve.add_argument(f"--grpc-{flag}", type=_non_negative(int), default=None,
                               metavar="<ms>", help="milliseconds, as tritonserver (default: " +
                               (f"{round(default * 1000)})" if default is not None else "none)"))
        else:
            serve.add_argument(f"--grpc-{flag}", type=_non_negative(int), default=None,
                               metavar="<n>", help=f"as tritonserver (default: {default})")
    serve.add_argument("--grpc-use-ssl", type=_bool, default=False, metavar="<bool>",
                       help="serve TLS on the gRPC port (needs --grpc-server-cert and --grpc-server-key)")
    serve.add_argument("--grpc-use-ssl-mutual", type=_bool, default=False, metavar="<bool>",
                       help="TLS, and every client presents a certificate --grpc-root-cert signed")
    serve.add_argument("--grpc-server-cert", default="", metavar="<file>",
                       help="PEM certificate (chain) of the gRPC port")
    serve.add_argument("--grpc-server-key", default="", metavar="<file>",
                       help="PEM private key of the gRPC port")
    serve.add_argument("--grpc-root-cert", default="", metavar="<file>",
                       help="PEM CA certificate(s) that client certificates must chain to (mutual TLS)")


def grpc_connection_options(args: argparse.Namespace) -> tuple[HTTP2Limits, GrpcTLS | None]:
    """The gRPC port's limits and TLS from the flags; a file that does not load stops here,
    with the flag's name, before anything is served."""
    limits = http2_limits({flag: getattr(args, "grpc_" + flag.replace("-", "_"))
                           for flag in KEEPALIVE_FLAGS})
    if not (args.grpc_use_ssl or args.grpc_use_ssl_mutual):
        if args.grpc_server_cert or args.grpc_server_key or args.grpc_root_cert:
            logging.warning("--grpc-server-cert/--grpc-server-key/--grpc-root-cert are ignored "
                            "without --grpc-use-ssl true")
        return limits, None
    tls = GrpcTLS(args.grpc_server_cert, args.grpc_server_key, args.grpc_root_cert,
                  mutual=args.grpc_use_ssl_mutual)
    try:
        tls.check()
    except ValueError as err:
        raise SystemExit(f"jupyter-triton serve: {err}") from None
    return limits, tls


def _export(args: argparse.Namespace) -> int:
    from .protocol.errors import TritonError
    from .repository.export import export_repository
    try:
        report = export_repository(args.model_repository, args.output, args.model or None,
                                   args.all_versions, args.kserve_name, args.storage_uri,
                                   torch_format=args.torch_format, pack_env=args.pack_env,
                                   pack_env_pins=args.pack_env_pin)
    except TritonError as err:
        print(f"jupyter-triton export: {err}", file=sys.stderr)
        return 2
    print(report.summary())
    return 0


def options_from(args: argparse.Namespace) -> EngineOptions:
    if len(args.model_repository) > 1:
        raise SystemExit("jupyter-triton serves one --model-repository")
    metrics = dict(item.split("=", 1) for item in args.metrics_config if "=" in item)
    cache_config = list(args.cache_config)
    if args.response_cache_byte_size is not None:       # tritonserver's deprecated spelling
        cache_config.append(f"local,size={args.response_cache_byte_size}")
    return EngineOptions(
        model_repository=args.model_repository[0], model_control_mode=args.model_control_mode,
        load_models=args.load_model, repository_poll_secs=args.repository_poll_secs,
        summary_latencies=_bool(metrics.get("summary_latencies", "false")),
        histogram_latencies=_bool(metrics.get("histogram_latencies", "false")),
        histogram_buckets_ms=tuple(float(b) for b in metrics.get("histogram_buckets_ms", "").split(",") if b),
        max_input_size=args.http_max_input_size, exit_on_error=args.exit_on_error,
        strict_readiness=args.strict_readiness, exit_timeout_secs=args.exit_timeout_secs,
        unload_timeout_secs=args.unload_timeout_secs, max_output_size=args.max_output_size,
        keep_versions=args.keep_versions, trace_config=_trace_config(args),
        response_cache_size=_cache_size(cache_config),
        model_residency_bytes=args.model_residency_bytes,
        max_loaded_models=args.max_loaded_models, load_on_demand=args.load_on_demand,
        rate_limit=args.rate_limit,
        rate_limit_resources=list(args.rate_limit_resource), server_id=args.id,
        busy_poll_us=args.busy_poll_us,
        auto_complete_config=not (args.disable_auto_complete_config or
                                  _bool((args.strict_model_config or ["false"])[-1])))


def _cache_size(values: list[str]) -> int:
    from .engine.cache import parse_cache_config
    try:
        return parse_cache_config(values)
    except TritonError as err:
        raise SystemExit(f"jupyter-triton: {err}") from None


def _trace_config(args: argparse.Namespace) -> list[str]:
    """--trace-config values, after those the deprecated --trace-* flags stand for."""
    old = [f"level={level}" for level in args.trace_level]
    for flag, setting in ((args.trace_file, "triton,file"), (args.trace_rate, "rate"),
                          (args.trace_count, "count"), (args.trace_log_frequency, "triton,log-frequency")):
        if flag is not None:
            old.append(f"{setting}={flag}")
    config = old + list(args.trace_config)
    from .engine.observation.trace import Tracing, parse_trace_config
    from .protocol.errors import TritonError
    try:
        Tracing(parse_trace_config(config)).close()     # refused here, not as a traceback later
    except TritonError as err:
        raise SystemExit(f"jupyter-triton serve: {err}") from None
    return config


async def _serve(args: argparse.Namespace, server_log: ServerLog) -> None:
    if args.metrics_address not in (None, args.http_address):
        logging.warning("--metrics-address is served on --http-address here")
    warn_open_repository(args)
    log_ignored(args)
    grpc_limits, grpc_ssl = grpc_connection_options(args)
    options = options_from(args)
    from .repository.remote import open_repository
    try:        # s3://...: served from a local mirror kept in sync (None: a directory)
        mirror = await asyncio.to_thread(open_repository, options.model_repository,
                                         options.repository_poll_secs)
    except TritonError as err:
        raise SystemExit(f"jupyter-triton serve: {err}") from None
    if mirror is not None:
        options = replace(options, model_repository=mirror.path)
    try:
        await _serve_until_stopped(args, options, grpc_limits, grpc_ssl, server_log)
    finally:
        if mirror is not None:      # its last push: an upload just made is not lost
            await asyncio.to_thread(mirror.close)


async def _serve_until_stopped(args: argparse.Namespace, options: EngineOptions,
                               grpc_limits: HTTP2Limits, grpc_ssl: GrpcTLS | None,
                               server_log: ServerLog) -> None:
    from .standalone import start_standalone
    server = await start_standalone(
        options, host=args.http_address, http_port=args.http_port,
        metrics_port=args.metrics_port if args.allow_metrics else None,
        grpc_port=args.grpc_port if args.allow_grpc else None,
        access=AccessPolicy.open(args.http_restricted_api),
        grpc_access=AccessPolicy.open(args.grpc_restricted_protocol), grpc_host=args.grpc_address,
        grpc_limits=grpc_limits, grpc_ssl=grpc_ssl, server_log=server_log)
    print(f"jupyter-triton: HTTP {server.url}  gRPC {server.grpc_port}  metrics {server.metrics_port}",
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    stop.clear()            # a second signal cuts the drain short
    await server.shutdown(args.shutdown_drain_secs, cut_short=stop)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "export":
        return _export(args)
    logging.basicConfig(level=logging.DEBUG if args.log_verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.log_verbose:
        # Like tritonserver: no line per request unless asked (each line costs the event loop;
        # see benchmarks/results/notes-frontends.md).
        logging.getLogger("tornado.access").setLevel(logging.WARNING)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    if args.command == "serve":
        # the logging extension's settings, the engine's from its start: installed first, so
        # that the lines of the start are in the flags' file and format
        server_log = ServerLog()
        server_log.install(log_file=args.log_file, info=args.log_info, warning=args.log_warning,
                           error=args.log_error, verbose_level=args.log_verbose,
                           log_format=args.log_format)
        _run(_serve(args, server_log))
    return 0


def _run(main: Coroutine[Any, Any, None]) -> None:
    """``main`` on uvloop where it is installed and not refused (``LOOP_ENV``), else asyncio."""
    if os.environ.get(LOOP_ENV, "").lower() != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(main)
    asyncio.run(main)


if __name__ == "__main__":
    sys.exit(main())
