"""What the dynamic batcher leaves on a request's future: its queue callback only while the
request is queued (a request that ran ends without a loop callback of the batcher's), and
the shape key batches requests together exactly when their inputs agree."""
from __future__ import annotations

import asyncio

import numpy as np

from jupyter_triton.engine.batching.batcher import DynamicBatcher
from jupyter_triton.engine.batching.pending import Pending
from jupyter_triton.protocol.types import InferRequest

from test_batcher import batcher, occupy, pending, run


def test_a_request_that_ran_ends_without_the_batchers_queue_callback(monkeypatch):
    calls = []
    forget = DynamicBatcher._forget
    monkeypatch.setattr(DynamicBatcher, "_forget",
                        lambda self, p, f: (calls.append(p), forget(self, p, f)))

    async def main():
        b, log, _ = batcher("max_batch_size: 4 dynamic_batching { max_queue_delay_microseconds: 200000 }")
        first = await occupy(b, log)
        ran, gone = pending(1), pending(2)
        await b.submit(ran)
        await b.submit(gone)
        gone.future.cancel()                  # the client went away while it was queued
        await asyncio.sleep(0)
        assert b.queued_count() == 1
        assert await asyncio.gather(first.future, ran.future)
        await asyncio.sleep(0.01)
        return log, gone

    log, gone = run(main())
    assert log == [[0], [1]]
    assert calls == [gone]


def _pending(**inputs: np.ndarray) -> Pending:
    return Pending(InferRequest("m"), inputs, 1, None)  # type: ignore[arg-type]


def test_shape_keys_agree_exactly_when_every_input_agrees_beyond_the_batch_dim():
    one = _pending(A=np.zeros((1, 3), np.float32))
    assert one.shape_key() == _pending(A=np.zeros((5, 3), np.float32)).shape_key()
    assert one.shape_key() != _pending(A=np.zeros((1, 4), np.float32)).shape_key()
    assert one.shape_key() != _pending(A=np.zeros((1, 3), np.float64)).shape_key()
    two = _pending(A=np.zeros((1, 3), np.float32), B=np.zeros((1, 2), np.int32))
    assert two.shape_key() == _pending(B=np.zeros((2, 2), np.int32),
                                       A=np.zeros((2, 3), np.float32)).shape_key()
    assert two.shape_key() != one.shape_key()
