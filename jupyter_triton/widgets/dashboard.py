"""The live dashboard widget: throughput, queue and compute time per request, batch sizes
formed, pending requests and failures, per model and for all models; request, queue and
compute p50/p95/p99 over the last minute where the server keeps latency histograms; and for
one model, a logs tab with its last log lines (``v2/models/{m}/logs``).

Two sources of statistics, so that it keeps moving while the kernel is busy running a cell:
the browser fetches ``v2/models/stats`` itself when the notebook page is served by the same
Jupyter server as the models (same base URL: the page's cookie authenticates it), and a
kernel-side poller thread pushes snapshots into the ``snapshot`` trait otherwise (the
in-kernel server on a loopback port, VS Code, or no front end at all). The poller pauses
while a browser view reports that it polls.
"""
from __future__ import annotations

import pathlib
import time
import urllib.parse
from typing import Any, Protocol

import anywidget
import traitlets

from .figures import LatencyWindows, ModelFigures, Snapshot, figures, html_table, log_line, text_table
from .poller import StatsPoller, describe_error, logs_url, shadow_url, stats_url

HERE = pathlib.Path(__file__).parent


class _Connection(Protocol):
    url: str
    mode: str

    @property
    def headers(self) -> dict[str, str]: ...


class Dashboard(anywidget.AnyWidget):
    """``Dashboard(connection, model=None, interval=1.0)``: ``model`` None shows every model."""

    _esm = HERE / "dashboard.js"
    _css = HERE / "dashboard.css"

    model = traitlets.Unicode("").tag(sync=True)              # "" = all models
    interval = traitlets.Float(1.0).tag(sync=True)
    # URL path of the server root as the kernel sees it ("/user/alice/"); the browser
    # fetches the statistics itself only when its page's base URL is this path.
    server_path = traitlets.Unicode("").tag(sync=True)
    snapshot = traitlets.Dict().tag(sync=True)                 # the kernel poller's latest reading
    error = traitlets.Unicode("").tag(sync=True)
    browser_polling = traitlets.Bool(False).tag(sync=True)     # set by a browser view
    # "stats" or "logs": the tab a view shows (set by the view; the kernel poller reads the
    # model's log lines only while one shows its logs)
    tab = traitlets.Unicode("stats").tag(sync=True)
    logs = traitlets.List().tag(sync=True)                      # the model's last log lines

    def __init__(self, connection: _Connection, model: str | None = None, interval: float = 1.0,
                 *, duration: float = 3600.0, poll_kernel: bool = True, **kwargs: Any) -> None:
        mode = getattr(connection, "mode", "")
        server_path = "" if mode == "in-kernel" else urllib.parse.urlparse(connection.url).path or "/"
        super().__init__(model=model or "", interval=float(interval), server_path=server_path, **kwargs)
        self.connection = connection
        self._prev: Snapshot | None = None
        self._last: Snapshot | None = None
        self.figures: list[ModelFigures] = []
        self._windows = LatencyWindows()
        # Where the pending-request gauge can be read with the kernel's credentials ("" or
        # absent: nowhere; the Jupyter server's own /metrics wants Jupyter's login).
        metrics_url = getattr(connection, "metrics_url", None) or None
        self.poller = StatsPoller(stats_url(connection.url, model), connection.headers, self._on_snapshot,
                                  interval=interval, metrics_url=metrics_url, on_error=self._on_error,
                                  duration=duration, logs_url=logs_url(connection.url, model) if model else None,
                                  logs_wanted=lambda: self.tab == "logs",
                                  shadow_url=shadow_url(connection.url, model) if model else None)
        try:
            self._on_snapshot(self.poller.poll_once(with_logs=True))   # something to show at once
        except Exception as err:
            self._on_error(describe_error(err))
        if poll_kernel:
            self.poller.start()

    def _on_snapshot(self, snap: Snapshot) -> None:
        self._prev, self._last = self._last, snap
        self.figures = figures(self._prev, snap, self._windows)
        self.error = ""
        if snap.logs is not None and snap.logs != self.logs:
            self.logs = snap.logs
        self.snapshot = snap.to_json()

    def _on_error(self, message: str) -> None:
        self.error = message

    @traitlets.observe("browser_polling")
    def _browser_polls(self, change: dict) -> None:
        if change["new"]:
            self.poller.paused.set()
        else:
            self.poller.paused.clear()

    def figures_for(self, name: str) -> ModelFigures | None:
        """The latest figures of model ``name`` (its newest version)."""
        rows = [f for f in self.figures if f.name == name]
        return max(rows, key=lambda f: int(f.version) if f.version.isdigit() else -1) if rows else None

    def refresh(self) -> list[ModelFigures]:
        """Take one reading now (also while the poller is paused; with the log lines) and
        return the figures."""
        self._on_snapshot(self.poller.poll_once(with_logs=True))
        return self.figures

    def logs_text(self, tail: int = 50) -> str:
        """The logs tab as text: the model's last ``tail`` lines of the latest reading."""
        return "\n".join(log_line(e) for e in self.logs[-tail:]) if tail else ""

    def stop(self) -> None:
        """Stop the kernel-side poller (the browser views keep polling while shown)."""
        self.poller.stop()

    def close(self) -> None:
        self.poller.stop()
        super().close()

    def _title(self) -> str:
        shown = getattr(self.connection, "shown_url", "") or self.connection.url   # a hub's public one
        return f"Triton dashboard: {self.model or 'all models'} @ {shown}"

    def _repr_mimebundle_(self, **kwargs: Any):
        bundle = super()._repr_mimebundle_(**kwargs)
        if bundle is None:
            return None
        data, metadata = bundle
        stamp = time.strftime("%H:%M:%S", time.localtime(self._last.t)) if self._last else "no data"
        data["text/plain"] = f"{self._title()} ({stamp})\n{text_table(self.figures)}"
        data["text/html"] = html_table(self.figures, f"{self._title()} ({stamp})")
        return data, metadata
