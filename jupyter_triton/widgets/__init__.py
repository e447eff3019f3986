"""Notebook widgets: the live statistics dashboard."""
from __future__ import annotations

from .dashboard import Dashboard
from .figures import ModelFigures, Snapshot, figures

__all__ = ["Dashboard", "ModelFigures", "Snapshot", "figures"]
