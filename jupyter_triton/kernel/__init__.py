"""The notebook side: a Python API (``serve``, ``models``, ``unload``, ...) and the
``%%serve`` / ``%triton`` magics over it. It speaks only the v2 protocol to a server: the
Jupyter server's extension, or one it starts inside the kernel when there is none."""
from __future__ import annotations

from .api import connection, dashboard, ensemble, load, model, models, serve, unload
from .artifacts import Artifact, ArtifactError, build_artifact
from .discovery import Connection
from .handle import ServedModel
from .magics import load_ipython_extension

__all__ = ["Artifact", "ArtifactError", "Connection", "ServedModel", "build_artifact", "connection",
           "dashboard", "ensemble", "load", "load_ipython_extension", "model", "models", "serve", "unload"]
