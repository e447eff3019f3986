"""Triton's ``--trace-config mode=opentelemetry``: each traced request becomes a span (its
model's name, attributes ``triton.model``, ``triton.version``, ``triton.request_id``,
``triton.batch_size`` and Triton's own ``model_name``/``model_version``/``request_id``), with
a ``compute`` child span and its timestamps as events; an ensemble's steps are child spans
of the ensemble's. A client's W3C ``traceparent`` (HTTP header or gRPC metadata) continues
the client's trace, and such a request is always traced (as Triton does).

Spans go to the OTLP/HTTP exporter at ``opentelemetry,url=...`` when
``opentelemetry-exporter-otlp-proto-http`` is installed (``bsp_*`` settings as Triton's);
``add_span_processor`` adds others (an in-memory exporter in tests, a console one).
The provider is this server's own, never the process's global one.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Mapping, Protocol

from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from ...protocol.types import InferRequest

log = logging.getLogger(__name__)

DEFAULT_URL = "http://localhost:4318/v1/traces"
_PROPAGATOR = TraceContextTextMapPropagator()


class Finished(Protocol):
    """What ``end`` reads of a finished trace (``trace.Trace``, which starts this exporter:
    the exporter knows only these fields, not the tracer above it)."""
    span: Any
    model_version: str
    parent_id: int
    batch_size: int
    stamps: list[tuple[str, int]]


class OpenTelemetry:
    def __init__(self, config: Mapping[str, str]) -> None:
        attributes = {"service.name": "triton-inference-server"}
        for item in [v for k, v in config.items() if k == "resource"]:
            key, _, value = item.partition("=")
            attributes[key] = value
        self.provider = TracerProvider(resource=Resource.create(attributes))
        self.tracer = self.provider.get_tracer("jupyter_triton")
        # monotonic (the trace stamps) to wall clock (what OpenTelemetry records)
        self._offset = time.time_ns() - time.monotonic_ns()
        url = config.get("url", DEFAULT_URL)
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.info("OpenTelemetry tracing without an OTLP exporter (install "
                     "opentelemetry-exporter-otlp-proto-http to send spans to %s)", url)
        else:
            self.provider.add_span_processor(BatchSpanProcessor(
                OTLPSpanExporter(endpoint=url),
                max_queue_size=int(config.get("bsp_max_queue_size", 2048)),
                schedule_delay_millis=float(config.get("bsp_schedule_delay", 5000)),
                max_export_batch_size=int(config.get("bsp_max_export_batch_size", 512))))

    def add_span_processor(self, processor: SpanProcessor) -> None:
        self.provider.add_span_processor(processor)

    def has_remote_parent(self, request: "InferRequest") -> bool:
        return getattr(request, "trace_context", None) is not None

    def _wall(self, monotonic_ns: int) -> int:
        return monotonic_ns + self._offset

    def start(self, request: "InferRequest", parent_span: Any) -> Any:
        if parent_span is not None:
            context = otel_trace.set_span_in_context(parent_span)
        else:
            carrier = getattr(request, "trace_context", None)
            context = _PROPAGATOR.extract(carrier) if carrier else None
        span = self.tracer.start_span(request.model_name or "InferRequest", context=context,
                                      kind=otel_trace.SpanKind.SERVER if parent_span is None
                                      else otel_trace.SpanKind.INTERNAL)
        span.set_attribute("triton.model", request.model_name)
        span.set_attribute("model_name", request.model_name)
        if request.id:
            span.set_attribute("triton.request_id", request.id)
            span.set_attribute("request_id", request.id)
        return span

    def end(self, trace: Finished, error: BaseException | None) -> None:
        span = trace.span
        version = trace.model_version or "-1"
        span.set_attribute("triton.version", version)
        span.set_attribute("model_version", version)
        if trace.parent_id:
            span.set_attribute("parent_id", trace.parent_id)
        if trace.batch_size:
            span.set_attribute("triton.batch_size", trace.batch_size)
        stamps = dict(trace.stamps)
        for name, ns in trace.stamps:
            span.add_event(name, timestamp=self._wall(ns))
        if "COMPUTE_START" in stamps and "COMPUTE_END" in stamps:
            compute = self.tracer.start_span("compute", context=otel_trace.set_span_in_context(span),
                                             start_time=self._wall(stamps["COMPUTE_START"]))
            for name in ("COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END"):
                if name in stamps:
                    compute.add_event(name, timestamp=self._wall(stamps[name]))
            compute.end(end_time=self._wall(stamps["COMPUTE_END"]))
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, str(error)))
            span.record_exception(error)
        span.end(end_time=self._wall(stamps.get("REQUEST_END", time.monotonic_ns())))

    def shutdown(self) -> None:
        self.provider.shutdown()
