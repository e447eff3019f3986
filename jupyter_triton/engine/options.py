"""What an operator chooses for one engine (tritonserver's command-line flags, in Python)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

CONTROL_MODES = ("none", "explicit", "poll")


@dataclass
class EngineOptions:
    model_repository: Path
    model_control_mode: str = "none"
    load_models: list[str] = field(default_factory=list)   # explicit mode: names, or "*"
    repository_poll_secs: float = 15.0
    summary_latencies: bool = False
    # --metrics-config histogram_latencies=true: nv_inference_first_response_histogram_ms and
    # the request/queue/compute histograms per version (engine/observation/histograms.py);
    # histogram_buckets_ms: the latter's bucket bounds (empty: the defaults)
    histogram_latencies: bool = False
    histogram_buckets_ms: tuple[float, ...] = ()
    max_input_size: int = 64 * 1024 * 1024
    exit_on_error: bool = False
    # Triton's --strict-readiness: v2/health/ready is false while a model that was asked
    # to load has no ready version.
    strict_readiness: bool = True
    # tritonserver's --trace-config values, as given ("level=TIMESTAMPS", "triton,file=...")
    trace_config: list[str] = field(default_factory=list)
    # Server stop: every version drains and closes in parallel within this bound; requests
    # still in flight after it (a hung model) fail with Unavailable. Triton's
    # --exit-timeout-secs (its default is 30 s; a Jupyter server should stop sooner).
    exit_timeout_secs: float = 5.0
    # Unload / reload: how long requests in flight may finish before they fail.
    unload_timeout_secs: float = 30.0
    # A response whose outputs together exceed this fails with Unavailable instead of
    # being encoded (a model that returns far more than anyone asked for).
    max_output_size: int = 1 << 30
    # Retention: after a successful upload keep the newest N versions on disk and delete
    # older ones that are not served. 0 (default): nothing is ever deleted.
    keep_versions: int = 0
    # Triton's response cache, its --cache-config local,size=<bytes>: one LRU of that many
    # bytes for every model whose config says response_cache { enable: true }. 0: no cache.
    response_cache_size: int = 0
    # Lifecycle as a control (engine/lifecycle/residency.py): within these bounds idle models are
    # evicted, least recently used first, to make room for a load; what loads at start stops
    # where the bounds are reached. 0: no bound (Triton's semantics: nothing unloads by itself).
    # --model-residency-bytes, --max-loaded-models; c.JupyterTriton traits of the same names.
    model_residency_bytes: int = 0
    max_loaded_models: int = 0
    # A request for a model that is in the repository but not loaded (never, or evicted) loads
    # it: off by default (Triton's 404), since loading runs the model's code. A model's config
    # may say ``parameters { key: "load_on_demand" value: { string_value: "true" } }`` (or
    # "false") instead. --load-on-demand; c.JupyterTriton.load_on_demand.
    load_on_demand: bool = False
    # tritonserver's --rate-limit: "off" (its default) or "execution_count"; with
    # --rate-limit-resource=<name>:<count>[:<device>] values as given.
    rate_limit: str = "off"
    rate_limit_resources: list[str] = field(default_factory=list)
    # tritonserver's --disable-auto-complete-config (and --strict-model-config=true): a
    # config is served as written; one that leaves out what a backend would fill is refused.
    auto_complete_config: bool = True
    # tritonserver's --id: the name server metadata answers
    server_id: str = "triton"
    # engine/batching/busy_poll.py: after a request arrives, the event loop (and a python model's
    # worker, after a batch of one) polls this long before sleeping. 0: off (a Jupyter
    # server's and a kernel's default); `jupyter-triton serve` polls by default.
    busy_poll_us: int = 0
