"""Large JSON requests decoded in slices, so that no one parse holds the GIL for long.

json.loads holds the GIL for the whole document: 60 MiB of numbers is a second or more
during which no other thread (the server's event loop included) runs, even when the
decode was handed to a worker thread. So a large document is decoded in slices of a few
milliseconds each: the long runs of numbers inside arrays (what makes a request large) are
cut out and replaced by a marker, the small remaining skeleton is parsed in one go, and
each run is parsed and converted slice by slice, the GIL free for others in between.
"""
from __future__ import annotations

import re
import secrets
from typing import Any

import numpy as np

from .datatypes import element_count, triton_to_numpy
from .errors import InvalidArgument
from .json_tensors import count_message, parse_json, values_to_array

SLICED_MIN = 1 << 20          # documents below this are parsed in one go
_RUN_MIN = 64 * 1024          # a run of numbers must fill a whole window of this size
_SLICE = 64 * 1024            # bytes of numbers parsed per slice (a few ms)
_NUMERIC = b"0123456789+-.eE,\t\n\r "
_NOT_SPACE = re.compile(rb"[^ \t\n\r]")
_MASK = bytes(48 if i in _NUMERIC else 49 for i in range(256))    # b"0" numeric, b"1" not


class Hole:
    """The text of one long run of numbers (an array's inside), decoded on demand."""

    def __init__(self, text: bytes, start: int, end: int) -> None:
        self.text, self.start, self.end = text, start, end

    def slices(self):
        """The run's values, one list per slice (each a short json.loads)."""
        text, pos, end = self.text, self.start, self.end
        if _NOT_SPACE.search(text, pos, end) is None:        # "[ ]": an empty array
            return
        while pos < end:
            cut = end if end - pos <= _SLICE else text.rfind(b",", pos, pos + _SLICE)
            if cut <= pos:                      # no comma in a whole slice: not a number list
                cut = end
            piece = text[pos:cut]
            if not piece.strip():
                raise InvalidArgument("failed to parse the request JSON buffer: an array "
                                      "element is missing")
            yield parse_json(b"[" + piece + b"]")
            pos = cut + 1
        if text[end - 1:end] == b",":
            raise InvalidArgument("failed to parse the request JSON buffer: trailing comma "
                                  "in an array")

    def to_list(self) -> list:
        out: list = []
        for values in self.slices():
            out.extend(values)
        return out

    def to_array(self, dt: str, shape: tuple[int, ...], name: str) -> np.ndarray:
        count = element_count(shape)
        parts, seen = [], 0
        for values in self.slices():
            if seen + len(values) <= count:
                parts.append(values_to_array(values, dt, name, seen))
            seen += len(values)
        if seen != count:
            raise InvalidArgument(count_message(name, shape, count, seen))
        if not parts:
            return np.zeros(shape, dtype=triton_to_numpy(dt))
        return (parts[0] if len(parts) == 1 else np.concatenate(parts)).reshape(shape)


def _number_runs(text: bytes) -> list[tuple[int, int]]:
    """(start, end) of each long run of number text directly inside ``[`` ... ``]``."""
    runs = []
    n, w = len(text), _RUN_MIN
    k = 0
    while k * w < n:
        if b"1" in text[k * w:(k + 1) * w].translate(_MASK):
            k += 1
            continue
        j = k + 1
        while j * w < n and b"1" not in text[j * w:(j + 1) * w].translate(_MASK):
            j += 1
        left = text[max(0, (k - 1) * w):k * w].translate(_MASK).rfind(b"1")
        left = -1 if left < 0 else left + max(0, (k - 1) * w)
        right = text[j * w:(j + 1) * w].translate(_MASK).find(b"1")
        right = -1 if right < 0 else right + j * w
        if left >= 0 and right >= 0 and text[left] == 0x5B and text[right] == 0x5D:
            runs.append((left + 1, right))
        k = j + 1
    return runs


def parse_large_json(text: bytes) -> Any:
    """json.loads(text), except that a long number run which is an input's ``data`` stays
    a Hole (decoded later, slice by slice, straight into its array)."""
    runs = _number_runs(text)
    if not runs:
        return parse_json(text)
    # A marker cannot stand for a run that was really inside a string: its quote would end
    # that string and the backslash after it is invalid JSON outside one.
    key = "\\u0001hole-" + secrets.token_hex(8)
    parts, pos = [], 0
    for i, (start, end) in enumerate(runs):
        parts += [text[pos:start], b'{"%s":%d}' % (key.encode(), i)]
        pos = end
    parts.append(text[pos:])
    try:
        doc = parse_json(b"".join(parts))
    except InvalidArgument:
        return parse_json(text)    # the whole parse names the error exactly
    marker = "\x01hole-" + key[len("\\u0001hole-"):]
    holes = [Hole(text, s, e) for s, e in runs]
    found: list[int] = []

    def fill(node: Any, as_data: bool = False) -> Any:
        if isinstance(node, list):
            if len(node) == 1 and isinstance(node[0], dict) and marker in node[0]:
                i = node[0][marker]
                found.append(i)
                if type(i) is not int or not 0 <= i < len(holes):
                    return node
                return holes[i] if as_data else holes[i].to_list()
            return [fill(x) for x in node]
        if isinstance(node, dict):
            return {k: fill(v) for k, v in node.items()}
        return node

    if isinstance(doc, dict) and isinstance(doc.get("inputs"), list):
        doc = {k: ([{kk: fill(vv, kk == "data") for kk, vv in item.items()}
                    if isinstance(item, dict) else fill(item) for item in v]
                   if k == "inputs" else fill(v))
               for k, v in doc.items()}
    else:
        doc = fill(doc)
    if sorted(found) != list(range(len(holes))):
        return parse_json(text)
    return doc

