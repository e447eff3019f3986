"""Notebook widgets: the live statistics dashboard.

Layer note: this layer owns what a notebook shows of a running server (figures computed from
statistics snapshots, the poller that reads them over HTTP, the anywidget view). It imports
only ``protocol`` (quantiles); it must not import the engine, a frontend or the kernel's
client: the kernel hands it a connection (a URL and a credential), and it reads what any
client can.
"""
from __future__ import annotations

from .dashboard import Dashboard
from .figures import ModelFigures, Snapshot, figures

__all__ = ["Dashboard", "ModelFigures", "Snapshot", "figures"]
