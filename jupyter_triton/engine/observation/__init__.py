"""Observation: what the server tells about the requests it ran.

``statistics`` keeps Triton's per-model statistics (and ``histograms`` their latency
buckets for Prometheus), ``trace`` Triton's trace API (``otel`` its OpenTelemetry
export), ``server_log`` the logging API's settings and lines, and ``capture`` the opt-in
sample of a model's traffic. Nothing here changes what a request answers.
"""
