"""Work over text a client sized (a prompt, an embedding input, a model's answer to either)
that must not hold the server's event loop: the OpenAI routes' word counts, taken in bounded
slices, and any such work run off the loop once the text is large.

A slice of text is split on its own (a list as long as its words, never the whole text's),
and between two slices the GIL is offered to the other threads: off the loop, the loop's
thread waits for at most one slice's work (a millisecond), not for the interpreter's switch
interval.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable, TypeVar

SLICE_CHARS = 1 << 16
# Past this many characters the work runs in a thread (the data plane offloads bodies past
# the same size, frontends.dataplane.OFFLOAD_BYTES).
OFF_LOOP_CHARS = 1 << 20

T = TypeVar("T")


def word_count(text: str, slice_chars: int = SLICE_CHARS) -> int:
    """``len(text.split())`` (whitespace-separated words), with memory bounded by one slice."""
    if len(text) <= slice_chars:
        return len(text.split())
    count = 0
    for start in range(0, len(text), slice_chars):
        count += len(text[start:start + slice_chars].split())
        if start and not text[start - 1].isspace() and not text[start].isspace():
            count -= 1              # a word across the cut was counted in both slices
        time.sleep(0)               # the GIL, offered to the loop between slices
    return count


async def off_loop(chars: int, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)``: here for a small text of ``chars`` characters, in a thread for a large
    one (the caller awaits it, so the work stays in order)."""
    if chars <= OFF_LOOP_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)

