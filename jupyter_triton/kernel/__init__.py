"""The notebook side: a Python API (``serve``, ``models``, ``unload``, ...) and the
``%%serve`` / ``%triton`` magics over it. It speaks only the v2 protocol to a server: the
Jupyter server's extension, or one it starts inside the kernel when there is none.

Layer note: this layer owns the notebook's side (artifacts built from notebook objects, the
client, handles, tuning) and talks to a server only through the protocol. It may import
``protocol``, ``config``, ``repository``'s file formats, ``widgets`` and (on call)
``planning``; it must not import the engine or a frontend, except that ``discovery`` starts
the standalone wiring (with its admission policy) for an in-kernel server and then speaks to
it over HTTP like any other client.
"""
from __future__ import annotations

from .api import connection, dashboard, ensemble, load, model, models, serve, unload
from .artifacts import Artifact, ArtifactError, build_artifact
from .discovery import Connection
from .handle import ServedModel
from .magics import load_ipython_extension

__all__ = ["Artifact", "ArtifactError", "Connection", "ServedModel", "build_artifact", "connection",
           "dashboard", "ensemble", "load", "load_ipython_extension", "model", "models", "serve",
           "simulate", "unload"]


def simulate(model, qps=None, max_batch_size=None, max_queue_delay_us=None, instances=None, **options):
    """Simulate batching configs under traffic before deploying them; see
    ``jupyter_triton.planning.capacity``. (Imported on call: planning imports this package.)"""
    from ..planning import simulate as _simulate
    return _simulate(model, qps, max_batch_size, max_queue_delay_us, instances, **options)
