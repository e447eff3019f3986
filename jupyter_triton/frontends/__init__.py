"""Transports over the engine: tornado v2 HTTP handlers, the gRPC servicer, Prometheus metrics."""
