"""Serving counts as activity: Jupyter's idle shutdown (``shutdown_no_activity_timeout``) and
JupyterHub's culler (fed by the single-user server's activity reports) read the server's
``last_activity``, which Jupyter takes as the latest of its settings named ``*_last_activity``.
Inference reaches this server on routes Jupyter does not count (the fast routes, the gRPC and
data ports), so the latest request any model answered is copied into such a setting every few
seconds, from the statistics the engine keeps anyway: nothing is added to the data path."""
from __future__ import annotations

from datetime import datetime, timezone

from tornado.ioloop import PeriodicCallback

from .engine import Engine

SETTING = "jupyter_triton_last_activity"


class InferenceActivity:
    def __init__(self, engine: Engine, settings: dict, interval_s: float) -> None:
        self.engine = engine
        self.settings = settings
        self.latest_ms = 0
        self._timer = PeriodicCallback(self.note, interval_s * 1000)

    def start(self) -> None:
        self._timer.start()

    def stop(self) -> None:
        self._timer.stop()

    def note(self) -> None:
        latest = max((mv.stats.last_inference for mv in self.engine.models()), default=0)
        if latest > self.latest_ms:
            self.latest_ms = latest
            self.settings[SETTING] = datetime.fromtimestamp(latest / 1000, timezone.utc)
