"""A worker process's stdout and stderr, read in the server: passed on to the server's own
streams as the worker wrote them, and kept per model version in the engine's ``ModelLogs``
(a ``pb_utils.Logger`` line, marked with ``LOGGER_MARK``, keeps its level)."""
from __future__ import annotations

import json
import logging
import os
import re
import select

from ...model_logs import ModelLogs
from .messages import LOGGER_MARK, READ_CHUNK

log = logging.getLogger(__name__)

_WORKER_LOG_LINE = re.compile(r"^\S+ \S+ \[python backend worker \d+\] (INFO|WARNING|ERROR|DEBUG|CRITICAL) ")
_LOG_LEVEL_NAMES = {"DEBUG": "VERBOSE", "CRITICAL": "ERROR"}


def read_output(logs: ModelLogs, label: str, model: str, version: str, out_r: int,
                err_r: int) -> None:
    """A worker's stdout and stderr, line by line: to the server's own streams as before, and
    into the model's log lines (``logs``)."""
    streams = {out_r: ("stdout", bytearray()), err_r: ("stderr", bytearray())}
    poll = select.poll()
    for fd in streams:
        poll.register(fd, select.POLLIN)
    try:
        while streams:
            for fd, _ in poll.poll():
                source, pending = streams[fd]
                try:
                    chunk = os.read(fd, READ_CHUNK)
                except OSError:
                    chunk = b""
                if chunk:
                    pending += chunk
                    if b"\n" not in chunk:
                        continue
                    done, _, rest = bytes(pending).rpartition(b"\n")
                    pending[:] = rest
                    _emit(logs, label, model, version, source,
                          done.decode("utf-8", "replace") + "\n")
                    continue
                if pending:
                    _emit(logs, label, model, version, source,
                          pending.decode("utf-8", "replace") + "\n")
                poll.unregister(fd)
                os.close(fd)
                del streams[fd]
    except Exception:
        log.exception("python worker %s: reading its output failed", label)


def _emit(logs: ModelLogs, label: str, model: str, version: str, source: str, text: str) -> None:
    raw = []
    for line in text.rstrip("\n").split("\n"):   # not splitlines(): it splits at \x1c-\x1e too
        if source == "stderr" and line.startswith(LOGGER_MARK):   # a pb_utils.Logger line
            level, _, message = line[len(LOGGER_MARK):].partition("\t")
            try:
                message = json.loads(message)
            except ValueError:
                pass
            logs.record(model, version, level, str(message), "logger", label)
            continue
        raw.append(line)
        match = _WORKER_LOG_LINE.match(line) if source == "stderr" else None
        level = (_LOG_LEVEL_NAMES.get(match.group(1), match.group(1)) if match
                 else "INFO" if source == "stdout" else "WARNING")
        logs.record(model, version, level, line, source, label, to_server_log=False)
    if not raw:
        return
    # The server's own fd, as the worker wrote to it before its output was read here: a
    # terminal, a log file, or whatever captures the server's output sees the same bytes.
    data = memoryview(("\n".join(raw) + "\n").encode("utf-8", "replace"))
    try:
        while data:
            data = data[os.write(1 if source == "stdout" else 2, data):]
    except OSError:
        pass
