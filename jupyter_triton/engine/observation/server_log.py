"""Triton's logging extension over Python logging: the server's log settings (``log_info``,
``log_warning``, ``log_error``, ``log_verbose_level``, ``log_format``, ``log_file``) applied
to the ``jupyter_triton`` loggers.

Each engine owns its settings (``Engine.server_log``): what ``v2/logging`` reports and
changes on one server is that server's. The standalone server ``install``s them
(tritonserver's ``--log-*`` flags): a handler of its own on the ``jupyter_triton`` logger, in
Triton's line format, that lets through exactly the kinds that are on. Inside Jupyter the
server's logging belongs to Jupyter: there the settings move the ``jupyter_triton`` logger's
level only. Python logging is per process, so where two servers share one (tests, a Jupyter
server beside a kernel's own), the logger's level is the most verbose kind any of them has
on, and each installed handler drops the kinds its own server has off.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from typing import Any, Mapping

from ...protocol.errors import InvalidArgument, Unsupported

FORMATS = ("default", "ISO8601")
_LETTER = {logging.DEBUG: "V", logging.INFO: "I", logging.WARNING: "W", logging.ERROR: "E",
           logging.CRITICAL: "E"}

# Every server's settings in this process. A logger is the process's: once any server's
# settings act on it (installed, or updated by a client), it lets through what any server
# asks for, so that one server's switch does not silence another's; while none does, its
# level is Python logging's (or Jupyter's). Weak: a server that is gone stops counting.
_ALL: "weakref.WeakSet[ServerLog]" = weakref.WeakSet()
_ALL_LOCK = threading.Lock()


def _set_level(logger: logging.Logger) -> None:
    logs = [s for s in _ALL if s.logger is logger]
    logger.setLevel(min((s._threshold() for s in logs), default=logging.NOTSET)
                    if any(s.acting for s in logs) else logging.NOTSET)


class _Kinds(logging.Filter):
    def __init__(self, log: "ServerLog") -> None:
        super().__init__()
        self.log = log

    def filter(self, record: logging.LogRecord) -> bool:
        log = self.log
        if record.levelno >= logging.ERROR:
            return log.error
        if record.levelno >= logging.WARNING:
            return log.warning
        if record.levelno >= logging.INFO:
            return log.info
        return log.verbose_level > 0


class TritonFormatter(logging.Formatter):
    """tritonserver's log lines: ``I1201 11:31:13.123456 4242 model.py:87] text`` (default)
    or ``2026-12-01T11:31:13Z I 4242 model.py:87] text`` (ISO8601)."""

    def __init__(self, log_format: str = "default") -> None:
        super().__init__()
        self.log_format = log_format

    def format(self, record: logging.LogRecord) -> str:
        letter = _LETTER.get(record.levelno, "I")
        where = f"{record.process} {os.path.basename(record.pathname)}:{record.lineno}]"
        if self.log_format == "ISO8601":
            head = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.created)) + f" {letter}"
        else:
            local = time.localtime(record.created)
            micros = int((record.created % 1) * 1e6)
            head = f"{letter}{time.strftime('%m%d %H:%M:%S', local)}.{micros:06d}"
        text = f"{head} {where} {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class ServerLog:
    """The server's log settings; ``settings()`` is Triton's ``v2/logging`` JSON."""

    def __init__(self, logger: str = "jupyter_triton") -> None:
        self.logger = logging.getLogger(logger)
        self.log_file = ""
        self.info = self.warning = self.error = True
        self.verbose_level = 0
        self.log_format = "default"
        self.handler: logging.Handler | None = None
        self._lock = threading.Lock()
        self.acting = False         # installed, or updated by a client
        with _ALL_LOCK:
            _ALL.add(self)

    def install(self, *, log_file: str = "", info: bool = True, warning: bool = True,
                error: bool = True, verbose_level: int = 0, log_format: str = "default") -> None:
        """Own the server's log output (the standalone server; tritonserver's --log-* flags)."""
        if log_format not in FORMATS:
            raise InvalidArgument(f"log format must be one of {', '.join(FORMATS)}, got '{log_format}'")
        with self._lock:
            if self.handler is not None:
                self.logger.removeHandler(self.handler)
                self.handler.close()
            handler: logging.Handler = (logging.FileHandler(log_file, encoding="utf-8") if log_file
                                        else logging.StreamHandler(sys.stderr))
            handler.addFilter(_Kinds(self))
            self.handler = handler
            self.log_file = log_file
            self.info, self.warning, self.error = info, warning, error
            self.verbose_level, self.log_format = verbose_level, log_format
            handler.setFormatter(TritonFormatter(log_format))
            self.logger.addHandler(handler)
            self.logger.propagate = False
            self._apply()

    def uninstall(self) -> None:
        """Give the log output back (Python logging's own, or another server's settings that
        still act on it; Triton's defaults reported)."""
        with self._lock:
            if self.handler is not None:
                self.logger.removeHandler(self.handler)
                self.handler.close()
                self.handler = None
            self.log_file, self.log_format = "", "default"
            self.info = self.warning = self.error = True
            self.verbose_level = 0
            self.acting = False
            with _ALL_LOCK:
                self.logger.propagate = not any(s.handler is not None for s in _ALL
                                                if s.logger is self.logger)
                _set_level(self.logger)

    def settings(self) -> dict[str, Any]:
        return {"log_file": self.log_file, "log_info": self.info, "log_warning": self.warning,
                "log_error": self.error, "log_verbose_level": self.verbose_level,
                "log_format": self.log_format}

    def update(self, updates: Mapping[str, Any]) -> dict[str, Any]:
        """Apply a client's settings; the whole update is checked before any of it applies
        (Triton's names and refusals)."""
        checked: dict[str, Any] = {}
        for name, value in updates.items():
            if name == "log_file":
                raise Unsupported("log file location can not be updated through network protocol")
            if name in ("log_info", "log_warning", "log_error"):
                if not isinstance(value, bool):
                    raise InvalidArgument(f"expect boolean for '{name}'")
            elif name == "log_verbose_level":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise InvalidArgument(f"expect unsigned integer for '{name}'")
            elif name == "log_format":
                if not isinstance(value, str):
                    raise InvalidArgument(f"expect string for '{name}'")
                if value not in FORMATS:
                    raise InvalidArgument(f"invalid argument for log_format, got '{value}'")
            else:
                raise InvalidArgument(f"unknown log setting '{name}'")
            checked[name] = value
        with self._lock:
            for name, value in checked.items():
                if name == "log_verbose_level":
                    self.verbose_level = value
                elif name == "log_format":
                    self.log_format = value
                    if self.handler is not None:
                        self.handler.setFormatter(TritonFormatter(value))
                else:
                    setattr(self, name[len("log_"):], value)
            self._apply()
        return self.settings()

    def _threshold(self) -> int:
        # the most verbose kind that is on; the handler's filter (when installed) drops the
        # kinds that are off above it
        if self.verbose_level > 0:
            return logging.DEBUG
        if self.info:
            return logging.INFO
        if self.warning:
            return logging.WARNING
        if self.error:
            return logging.ERROR
        return logging.CRITICAL + 1

    def _apply(self) -> None:
        self.acting = True
        with _ALL_LOCK:
            _set_level(self.logger)
