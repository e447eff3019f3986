"""jupyter_triton: NVIDIA Triton's serving model, native to Jupyter."""
from __future__ import annotations

from ._version import __version__  # noqa: F401  (the public name)


def _jupyter_server_extension_points() -> list[dict]:
    from .serverext import JupyterTriton
    return [{"module": "jupyter_triton", "app": JupyterTriton}]


# The notebook API, imported on first use so that the server extension never loads it.

def load_ipython_extension(ip) -> None:
    """``%load_ext jupyter_triton``: registers ``%%serve``, ``%%ensemble`` and ``%triton``."""
    from .kernel.magics import load_ipython_extension as load
    load(ip)


def serve(obj, name: str, *, max_batch_size: int | None = None,
          preferred_batch_sizes: list[int] | None = None, max_queue_delay_us: int | None = None,
          instances: int = 1, kind: str = "auto", gpus: list[int] | None = None,
          priority_levels: int | None = None, warmup: int | None = None, example=None,
          inputs=None, outputs=None, config: str = "", decoupled: bool | None = None,
          sequence: bool = False, golden=None, atol: float = 1e-8, rtol: float = 1e-5,
          canary: float | None = None, stage: bool = False):
    """Serve a model, module or function as ``name``; see ``jupyter_triton.kernel.api.serve``."""
    from .kernel.api import serve as _serve
    return _serve(obj, name, max_batch_size=max_batch_size,
                  preferred_batch_sizes=preferred_batch_sizes, max_queue_delay_us=max_queue_delay_us,
                  instances=instances, kind=kind, gpus=gpus, priority_levels=priority_levels,
                  warmup=warmup, example=example, inputs=inputs, outputs=outputs, config=config,
                  decoupled=decoupled, sequence=sequence, golden=golden, atol=atol, rtol=rtol,
                  canary=canary, stage=stage)


def ensemble(name: str, steps, *, max_batch_size: int | None = None, config: str = ""):
    """Serve a Triton ensemble of served models; see ``jupyter_triton.kernel.api.ensemble``."""
    from .kernel.api import ensemble as _ensemble
    return _ensemble(name, steps, max_batch_size=max_batch_size, config=config)


def rollback(name: str):
    """Serve again the version and config that served ``name`` before; see
    ``jupyter_triton.kernel.api.rollback``."""
    from .kernel.api import rollback as _rollback
    return _rollback(name)


def history(name: str) -> list[dict]:
    from .kernel.api import history as _history
    return _history(name)


def simulate(model: str, qps=None, max_batch_size=None, max_queue_delay_us=None, instances=None,
             **options):
    """Capacity planning before deploying: the served model's execution times, measured once,
    drive the engine's own dynamic batcher on a virtual clock for every config and load
    (``jupyter_triton.planning.capacity``)."""
    from .kernel import simulate as _simulate
    return _simulate(model, qps, max_batch_size, max_queue_delay_us, instances, **options)


def models() -> list[dict]:
    from .kernel.api import models as _models
    return _models()


def model(name: str):
    from .kernel.api import model as _model
    return _model(name)


def unload(name: str) -> None:
    from .kernel.api import unload as _unload
    _unload(name)


def capture(name: str, fraction: float = 1.0, max_rows: int = 10_000, *, max_bytes=None,
            capture: bool = True, clear: bool = False) -> dict:
    """Capture a bounded sample of ``name``'s requests on the server (``capture=False``
    stops); see ``ServedModel.capture``."""
    from .kernel.api import capture as _capture
    return _capture(name, fraction, max_rows, max_bytes=max_bytes, capture=capture, clear=clear)


def traffic(name: str, n: int | None = None):
    """``name``'s captured requests as a pandas DataFrame; see ``ServedModel.traffic``."""
    from .kernel.api import traffic as _traffic
    return _traffic(name, n)


def dashboard(name: str | None = None, interval: float = 1.0):
    from .kernel.api import dashboard as _dashboard
    return _dashboard(name, interval)


def tune(model, max_batch_size=None, max_queue_delay_us=None, concurrency=(1, 8),
         seconds: float = 3.0, slo_p99_ms: float | None = None, **options):
    """Measure batching configs under load and recommend one; see ``jupyter_triton.kernel.tune``."""
    from .kernel.tune import tune as _tune
    return _tune(model, max_batch_size, max_queue_delay_us, concurrency, seconds, slo_p99_ms,
                 **options)


def connection():
    from .kernel.api import connection as _connection
    return _connection()
