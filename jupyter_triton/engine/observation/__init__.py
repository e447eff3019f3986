"""Observation: what the server tells about the requests it ran.

``statistics`` keeps Triton's per-model statistics (and ``histograms`` their latency
buckets for Prometheus), ``trace`` Triton's trace API (``otel`` its OpenTelemetry
export), ``server_log`` the logging API's settings and lines, and ``capture`` the opt-in
sample of a model's traffic (``shadow`` its copy to a staged version). Nothing here changes
what a request answers.

It imports only ``protocol`` (types, errors, the JSON tensor form); the engine it reports on
is named for type checks only (``TYPE_CHECKING``) and handed in by the caller: a capture or a
trace asks the engine it is given, never a module above it.
"""
