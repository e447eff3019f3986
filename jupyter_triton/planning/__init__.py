"""Capacity planning: a model's measured execution times (``service``), traffic
(``traffic``) and the engine's own batcher on a virtual clock answer what a config does under
load before it is deployed (``capacity.simulate``)."""
from __future__ import annotations

from .capacity import Answer, BulkEffect, CapacityPlan, Load, simulate
from .service import ServiceModel, measure
from .traffic import TrafficClass, bursty, closed, from_trace, mix, poisson

__all__ = ["Answer", "BulkEffect", "CapacityPlan", "Load", "ServiceModel", "TrafficClass", "bursty",
           "closed", "from_trace", "measure", "mix", "poisson", "simulate"]
