"""Transports over the engine: admission (the one door every listener asks), the v2 operations
once for HTTP and gRPC, and thin skins over them (the fast HTTP/1.1 front, tornado's handlers,
HTTP/2 gRPC, the OpenAI routes, Prometheus metrics).

Layer note: this layer owns what comes off the wire before the engine sees it (credentials,
Host, slots, limits, the bytes-in-flight budget, deadlines) and how answers are written back.
It may import ``protocol`` (codecs, errors), the engine's public interface and ``repository``'s
lineage; it must not import ``backends`` (a model is reached only through the engine) nor the
notebook side (``kernel``, ``planning``, ``widgets``). Measured costs behind its choices:
benchmarks/results/notes-frontends.md.
"""
