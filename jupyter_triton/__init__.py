"""jupyter_triton: NVIDIA Triton's serving model, native to Jupyter."""
from __future__ import annotations

__version__ = "0.1.0"


def _jupyter_server_extension_points() -> list[dict]:
    from .serverext import JupyterTriton
    return [{"module": "jupyter_triton", "app": JupyterTriton}]
