"""A served notebook function's prints reach the notebook: ``handle.logs()`` reads the lines
the server keeps per model (the worker's stdout), through the authenticated logs route."""
from __future__ import annotations

import pytest

from test_kernel import in_thread, server_kernel  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(240)

CHATTY_CELL = """%%serve chatty
def chatty(prompt: str) -> str:
    print(f"chatty saw {len(prompt.split())} words", flush=True)
    return prompt.upper()
chatty"""


async def test_a_served_functions_prints_are_read_back_by_the_handle(server_kernel):
    _, kernel = await server_kernel()
    await in_thread(kernel.ok, "%load_ext jupyter_triton")
    await in_thread(kernel.ok, CHATTY_CELL)
    await in_thread(kernel.ok, "chatty = _\nprint(chatty.infer('a b c'))")
    shown = await in_thread(kernel.ok, """
import time
for _ in range(50):                 # the worker's stdout is read by a server thread
    text = chatty.logs()
    if "chatty saw" in text:
        break
    time.sleep(0.1)
print(text)""")
    line = next(l for l in shown.stdout.splitlines() if "chatty saw" in l)
    assert "chatty saw 3 words" in line and "[stdout]" in line and " v1 " in line
