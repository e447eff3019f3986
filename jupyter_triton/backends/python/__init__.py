"""Triton's python backend: ``model.py`` / ``TritonPythonModel`` in isolated worker processes.

``backend`` is the instance as the engine sees it; ``worker`` (and ``decoupled``) the server's
handle on one worker process; ``messages`` the wire format between them (the server unpickles
only what the protocol carries); ``shm`` and ``loans`` the tensor memory they share;
``worker_main``, ``stub`` and ``triton_python_backend_utils`` run inside the worker, with the
user's code; ``envs`` and ``launch`` start it (a packed environment, or forked from a template).
Layer: a backend. It may import ``protocol`` and ``config``, never the engine or a frontend;
what it needs of the server (BLS calls, model logs, custom metrics) it is handed at load."""
from .backend import PythonBackend
from .model_config import execution_mode, triton_config_json

__all__ = ["PythonBackend", "execution_mode", "triton_config_json"]
