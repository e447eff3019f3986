"""Progress of long work (``tune``, ``simulate``'s measurement, ``export``): an ipywidgets bar
and a label where a front end shows widgets (a notebook kernel), text lines on stderr where
none does (plain IPython, a script, the command line, nbval). Nothing here knows what the work
is: callers say how many steps and what each one is."""
from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def has_widget_frontend() -> bool:
    """Whether widgets can show: this runs in a Jupyter kernel (an IPython shell with a kernel
    and its comms), as ipywidgets needs."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class Progress:
    """``Progress(total, what)``; ``update(done, text)`` after each step (``text``: what runs
    now), ``close(text)`` at the end (a ``with`` block closes it, saying whether it failed).

    With a widget front end (``widgets`` None: detected) an IntProgress and a label; else a
    text line on ``stream`` each time a tenth more is done, and at a step whose ``phase``
    (the text before ":") changed, so a long step list stays a few lines."""

    def __init__(self, total: int, what: str, *, widgets: bool | None = None,
                 stream: TextIO | None = None) -> None:
        self.total, self.what = max(1, int(total)), what
        self.done = 0
        self._started = time.monotonic()
        self._stream = stream
        self._printed: tuple[int, str] | None = None
        self._bar = self._label = None
        if has_widget_frontend() if widgets is None else widgets:
            try:
                self._show_widgets()
            except Exception:   # noqa: BLE001 - no widgets (none installed, no display): text
                self._bar = None

    def _show_widgets(self) -> None:
        import ipywidgets as w
        from IPython.display import display
        self._bar = w.IntProgress(value=0, min=0, max=self.total, description="",
                                  layout=w.Layout(width="240px"))
        self._label = w.Label(value=f"{self.what}: starting")
        display(w.HBox([self._bar, self._label]))

    @property
    def widgets(self) -> tuple[Any, Any] | None:
        """(the IntProgress, the Label) when shown as widgets."""
        return (self._bar, self._label) if self._bar is not None else None

    def update(self, done: int, text: str = "") -> None:
        self.done = min(int(done), self.total)
        line = f"{self.what}: {self.done}/{self.total}" + (f" {text}" if text else "")
        if self._bar is not None:
            self._bar.value = self.done
            self._label.value = line
            return
        tenth, phase = self.done * 10 // self.total, text.split(":", 1)[0]
        if self._printed is None or tenth > self._printed[0] or phase != self._printed[1]:
            self._printed = (tenth, phase)
            self._write(f"[{100 * self.done // self.total:3d}%] {line}")

    def close(self, text: str = "done") -> None:
        line = f"{self.what}: {text} ({time.monotonic() - self._started:.1f} s)"
        if self._bar is not None:
            self._bar.value = self.done if text != "done" else self.total
            self._bar.bar_style = "success" if text == "done" else "danger"
            self._label.value = line
        else:
            self._write(line)

    def _write(self, line: str) -> None:
        stream = self._stream or sys.stderr
        print(line, file=stream, flush=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, kind, err, tb) -> None:
        if kind is None:
            self.close()
        else:
            self.close("interrupted" if issubclass(kind, KeyboardInterrupt) else f"failed: {err}")


class Quiet(Progress):
    """A Progress that shows nothing (``progress=False``)."""

    def __init__(self, total: int = 1, what: str = "") -> None:
        self.total, self.what, self.done = max(1, int(total)), what, 0

    def update(self, done: int, text: str = "") -> None:
        self.done = done

    def close(self, text: str = "done") -> None:
        pass


def progress(total: int, what: str, show: bool = True) -> Progress:
    """``Progress(total, what)``, or a quiet one when not ``show``."""
    return Progress(total, what) if show else Quiet(total, what)
