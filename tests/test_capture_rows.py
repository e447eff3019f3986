"""What a traffic capture's row holds (engine/observation/capture.py): an array whose memory
can change later is copied, one whose memory cannot is kept as it is, and a full sample adds
nothing the garbage collector goes through."""
import gc
import mmap

import numpy as np

from jupyter_triton.engine.observation.capture import Capture, CaptureSettings
from jupyter_triton.protocol.types import InferRequest, InferResponse, InferTensor


def _kept(data: np.ndarray) -> np.ndarray:
    """The array a capture's row holds for an input ``data``."""
    capture = Capture(CaptureSettings())
    capture.add(InferRequest("m", "", "r", [InferTensor("IN", "FP32", data.shape, data)]),
                None, 0, 200, "")
    return capture.snapshot()[0].inputs[0][3]


def test_memory_that_can_change_is_copied_and_memory_that_cannot_is_kept():
    body = bytes(64) + np.arange(8, dtype=np.float32).tobytes()
    wire = np.ndarray((2, 4), np.float32, body, 64)       # a view of the body off the wire
    assert _kept(wire) is wire

    fresh = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.float32)  # a backend's output, handed
    fresh.flags.writeable = False                         # over read-only (onnxruntime's)
    row = fresh[1:]
    assert _kept(row) is row

    writable = np.arange(8, dtype=np.float32)             # someone may write it again
    kept = _kept(writable[2:4])
    writable[2] = 99
    assert kept.tolist() == [2, 3]

    region = mmap.mmap(-1, 32)                            # a shared-memory region, read-only
    view = np.frombuffer(region, np.float32)              # to us, rewritten by its owner
    view.flags.writeable = False
    kept = _kept(view)
    region[:4] = np.float32(7).tobytes()
    assert kept[0] == 0 and view[0] == 7
    del view, kept
    region.close()


def test_a_full_sample_is_not_tracked_by_the_collector():
    capture = Capture(CaptureSettings(1.0, 1000, 16 << 20))
    out = np.ones((4, 3), np.float32)
    out.flags.writeable = False
    for i in range(1000):
        request = InferRequest("m", "", f"r{i}", [InferTensor("IN", "FP32", (1, 3),
                                                              np.zeros((1, 3), np.float32))])
        response = InferResponse("m", "1", f"r{i}", [InferTensor("OUT", "FP32", (1, 3),
                                                                 out[i % 4:i % 4 + 1])])
        capture.add(request, response, 0, 200, "")
    gc.collect()
    assert not any(gc.is_tracked(row) for row in capture.rows)
    rows = capture.snapshot()
    assert [r.id for r in rows[-2:]] == ["r998", "r999"]
    last = rows[-1]
    assert [(t[0], t[1], t[2]) for t in last.inputs] == [("IN", "FP32", (1, 3))]
    assert [(t[0], t[1], t[2]) for t in last.outputs] == [("OUT", "FP32", (1, 3))]
    assert last.outputs[0][3].tolist() == [[1, 1, 1]] and last.status == 200
