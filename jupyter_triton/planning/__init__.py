"""Capacity planning: a model's measured execution times (``sweep`` measures, with its
``bursts`` and their ``fitting``, into a ``service`` model), traffic (``traffic``) and the
engine's own batcher on a virtual clock answer what a config does under load before it is
deployed (``api.simulate``: a ``capacity`` plan, its ``rows``, shown by ``render``). By input
length (``lengths``): execution per (batch, padded length) (``length_service``) and a plan of
padding buckets, token budget and delay (``LengthPlan``).

Layer: the notebook side's. It may import the engine's simulator (``engine.batching.simulation``),
the config and protocol layers and the kernel's client; it talks to a server only over its v2
routes, never through a running engine's objects, and nothing in the server imports it."""
from __future__ import annotations

from .api import simulate
from .capacity import Answer, BulkEffect, CapacityPlan, Load
from .length_service import LengthService, measure_lengths
from .lengths import LengthPlan, token_counts
from .service import ServiceModel
from .sweep import measure
from .traffic import TrafficClass, bursty, closed, from_trace, mix, poisson

__all__ = ["Answer", "BulkEffect", "CapacityPlan", "LengthPlan", "LengthService", "Load", "ServiceModel",
           "TrafficClass", "bursty", "closed", "from_trace", "measure", "measure_lengths", "mix", "poisson",
           "simulate", "token_counts"]
