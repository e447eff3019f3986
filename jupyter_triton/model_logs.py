"""What models say: ``pb_utils.Logger`` lines and a python worker's stdout/stderr, kept per
model version in a bounded ring buffer, so that a notebook user can read them
(``v2/models/<name>/logs``) instead of searching the server's terminal.

Each line is also written to the server's own log, as before: the buffer is a copy, not a
detour. It depends on nothing of the server. The engine owns one (``Engine.model_logs``) and
hands it to the backends it loads (``ServerCalls.model_logs``), so that two servers in one
process keep their models' lines apart; the python backend writes to it and the frontends
(a logs route, which the kernel's ``handle.logs()`` reads) read it through the engine.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from datetime import datetime, timezone
from typing import Any

#: lines kept per model version; older ones are dropped first
MAX_LINES = 2000
#: longest message kept (a model printing a whole tensor must not fill the server's memory)
MAX_MESSAGE_CHARS = 8192

LEVELS = ("VERBOSE", "INFO", "WARNING", "ERROR")
_LOGGING_LEVEL = {"VERBOSE": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING,
                  "ERROR": logging.ERROR}

log = logging.getLogger("jupyter_triton.model")


class ModelLogs:
    """The ring buffers of every model version of one server."""

    def __init__(self, max_lines: int = MAX_LINES) -> None:
        self.max_lines = max_lines
        self._buffers: dict[tuple[str, str], collections.deque] = {}
        self._lock = threading.Lock()

    def record(self, model: str, version: str, level: str, message: str, source: str,
               instance: str = "", to_server_log: bool = True) -> None:
        """One line. ``source`` is "logger", "stdout" or "stderr"; ``to_server_log`` False
        where the caller has written it to the server's log (or stream) itself."""
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[:MAX_MESSAGE_CHARS] + f"... ({len(message) - MAX_MESSAGE_CHARS} characters cut)"
        now = time.time()
        entry = {"time": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="microseconds"),
                 "timestamp": now, "model": model, "version": str(version), "instance": instance,
                 "level": level if level in LEVELS else "INFO", "source": source, "message": message}
        key = (model, str(version))
        with self._lock:
            buffer = self._buffers.get(key)
            if buffer is None:
                buffer = self._buffers[key] = collections.deque(maxlen=self.max_lines)
            buffer.append(entry)
        if to_server_log:
            log.log(_LOGGING_LEVEL.get(entry["level"], logging.INFO), "model '%s' v%s%s: %s", model,
                    version, f" ({instance})" if instance else "", message)

    def lines(self, model: str, version: str = "") -> list[dict[str, Any]]:
        """Every kept line of ``model`` (one version, or all of them in time order), oldest
        first: ``{"time", "timestamp", "model", "version", "instance", "level", "source",
        "message"}``; ``level`` is VERBOSE, INFO, WARNING or ERROR, ``source`` logger, stdout or
        stderr. Lines outlive an unload (that is when they are wanted most)."""
        with self._lock:
            if version:
                return list(self._buffers.get((model, str(version)), ()))
            found = [e for (name, _), buffer in self._buffers.items() if name == model for e in buffer]
        return sorted(found, key=lambda e: e["timestamp"])

    def clear(self, model: str, version: str = "") -> None:
        with self._lock:
            for key in [k for k in self._buffers if k[0] == model and (not version or k[1] == str(version))]:
                del self._buffers[key]


__all__ = ["MAX_LINES", "ModelLogs"]
