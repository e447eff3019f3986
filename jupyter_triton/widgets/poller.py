"""The kernel-side statistics poller: a daemon thread that reads ``v2/models/stats`` (and
the pending-request gauge from ``/metrics`` where it can) every ``interval`` seconds.

It is the fallback for front ends that cannot fetch the statistics themselves (no Jupyter
page, or a server on another origin such as the in-kernel server on a loopback port).
Widget traits set from this thread reach the front end over IOPub, which keeps flowing
while the kernel runs a cell.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable

from .figures import Snapshot, ensemble_graph, parse_pending

#: log lines a dashboard shows (the newest)
LOG_TAIL = 200


def stats_url(server_url: str, model: str | None) -> str:
    """``{server_url}v2/models/stats`` or the per-model route; ``server_url`` ends in "/"."""
    if model:
        return f"{server_url}v2/models/{urllib.parse.quote(model, safe='')}/stats"
    return f"{server_url}v2/models/stats"


def logs_url(server_url: str, model: str) -> str:
    """``{server_url}v2/models/{model}/logs``: every version's lines, oldest first."""
    return f"{server_url}v2/models/{urllib.parse.quote(model, safe='')}/logs"


def shadow_url(server_url: str, model: str) -> str:
    """``{server_url}v2/models/{model}/shadow``: its shadow report (None when none ran)."""
    return f"{server_url}v2/models/{urllib.parse.quote(model, safe='')}/shadow"


class StatsPoller:
    """Polls until ``stop()``, ``duration`` seconds, or ``max_polls`` readings, whichever
    comes first. ``paused`` (an Event) skips readings while set: the browser is polling.
    With ``logs_url``, a reading also takes the model's last log lines while ``logs_wanted()``
    (a view shows its logs tab). With ``shadow_url``, a reading also takes the model's shadow
    report."""

    def __init__(self, url: str, headers: dict[str, str], on_snapshot: Callable[[Snapshot], None],
                 *, interval: float = 1.0, metrics_url: str | None = None,
                 on_error: Callable[[str], None] | None = None, duration: float = 3600.0,
                 timeout: float = 5.0, logs_url: str | None = None,
                 logs_wanted: Callable[[], bool] = lambda: False,
                 shadow_url: str | None = None) -> None:
        self.url, self.headers, self.metrics_url = url, dict(headers), metrics_url
        self.shadow_url = shadow_url
        self.logs_url, self.logs_wanted = logs_url, logs_wanted
        self.on_snapshot, self.on_error = on_snapshot, on_error
        self.interval, self.duration, self.timeout = max(0.1, interval), duration, timeout
        self.max_polls = int(duration / self.interval) + 1
        self.paused = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._graphs: dict[str, dict | None] = {}     # "model/version" -> its graph, None: no ensemble
        self._root = url.split("v2/models/", 1)[0]

    def _get(self, url: str) -> bytes:
        req = urllib.request.Request(url, headers=self.headers)
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            return resp.read()

    def poll_once(self, with_logs: bool = False) -> Snapshot:
        """One reading (with the log lines when ``with_logs`` or wanted). Raises on an
        unreachable server or an error answer of the statistics."""
        t = time.time()
        body = json.loads(self._get(self.url))
        pending = None
        if self.metrics_url:
            try:
                pending = parse_pending(self._get(self.metrics_url).decode())
            except (OSError, ValueError):
                # /metrics needs Jupyter's own credentials on the Jupyter server: the
                # kernel's token does not reach it, so pending counts are left out.
                self.metrics_url = None
        logs = None
        if self.logs_url and (with_logs or self.logs_wanted()):
            try:
                logs = json.loads(self._get(self.logs_url)).get("lines", [])[-LOG_TAIL:]
            except (OSError, ValueError) as err:
                # the statistics were read: show them, and say why the lines are missing
                logs = [{"time": "", "version": "", "level": "ERROR", "source": "dashboard",
                         "message": describe_error(err).replace("statistics", "logs", 1)}]
        shadow = None
        if self.shadow_url:
            try:
                shadow = json.loads(self._get(self.shadow_url)).get("shadow")
            except (OSError, ValueError):
                self.shadow_url = None      # a server without the route: not asked again
        stats = body.get("model_stats", [])
        graphs, composing = self._ensembles(stats)
        return Snapshot(t=t, model_stats=stats, pending=pending, logs=logs, graphs=graphs,
                        composing=composing, shadow=shadow)

    def _ensembles(self, stats: list[dict]) -> tuple[dict[str, dict], list[dict]]:
        """The graph of each ensemble among ``stats`` (its config, read once a version) and
        the statistics of its steps' models that ``stats`` lacks."""
        graphs: dict[str, dict] = {}
        composing: list[dict] = []
        have = {m.get("name") for m in stats}
        for m in stats:
            name, version = m.get("name", ""), str(m.get("version", ""))
            key = f"{name}/{version}"
            if key not in self._graphs:     # is it an ensemble? its config says, once a version
                quoted = urllib.parse.quote(name, safe="")
                try:
                    config = json.loads(self._get(
                        f"{self._root}v2/models/{quoted}/versions/{version}/config"))
                except (OSError, ValueError):
                    continue        # drawn as a list of steps until its config can be read
                self._graphs[key] = ensemble_graph(config) if config.get("platform") == "ensemble" else None
            graph = self._graphs[key]
            if graph is None:
                continue
            graphs[name] = graph
            for step in graph["steps"]:
                model = step["model"]
                if model in have:
                    continue
                have.add(model)
                try:
                    composing += json.loads(self._get(stats_url(self._root, model))).get("model_stats", [])
                except (OSError, ValueError):
                    pass            # no percentiles for this step this time
        return graphs, composing

    def _run(self) -> None:
        deadline = time.monotonic() + self.duration
        for _ in range(self.max_polls):
            if self._stop.is_set() or time.monotonic() > deadline:
                break
            if not self.paused.is_set():
                try:
                    self.on_snapshot(self.poll_once())
                except Exception as err:  # reported in the widget, polling goes on
                    if self.on_error is not None:
                        self.on_error(describe_error(err))
            if self._stop.wait(self.interval):
                break

    def start(self) -> "StatsPoller":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="jupyter-triton-dashboard", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


def describe_error(err: Exception) -> str:
    if isinstance(err, urllib.error.HTTPError):
        try:
            detail = json.loads(err.read()).get("error", "")
        except (ValueError, OSError):
            detail = ""
        return f"statistics request failed: HTTP {err.code} {detail}".strip()
    if isinstance(err, urllib.error.URLError):
        return f"statistics server unreachable: {err.reason}"
    return f"statistics request failed: {err}"
