"""Triton's python backend: ``model.py`` / ``TritonPythonModel`` in isolated worker processes."""
from .backend import PythonBackend
from .model_config import execution_mode, triton_config_json

__all__ = ["PythonBackend", "execution_mode", "triton_config_json"]
