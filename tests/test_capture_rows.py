"""What a traffic capture's row holds (engine/observation/capture.py): a copy of the request's
tensors in one object of its own, whatever memory they came in (a body off the wire, a batch
output, a region someone rewrites), read back as they were; its size is what max_bytes
counts; and a full sample adds nothing the garbage collector goes through."""
import gc
import mmap
import sys

import numpy as np
import pytest

from jupyter_triton.engine.observation.capture import _ROW_OVERHEAD, Capture, CaptureSettings
from jupyter_triton.protocol.types import InferRequest, InferResponse, InferTensor


def _capture(*inputs: InferTensor, outputs=(), settings=CaptureSettings()) -> Capture:
    capture = Capture(settings)
    request = InferRequest("m", "", "r", list(inputs))
    response = InferResponse("m", "1", "r", list(outputs)) if outputs else None
    capture.add(request, response, 0, 200, "")
    return capture


def _kept(data: np.ndarray) -> np.ndarray:
    """The array a capture's row gives back for an input ``data``."""
    return _capture(InferTensor("IN", "FP32", data.shape, data)).snapshot()[0].inputs[0][3]


def test_a_row_is_a_copy_whatever_memory_the_tensors_came_in():
    body = bytearray(64) + np.arange(8, dtype=np.float32).tobytes()
    wire = np.ndarray((2, 4), np.float32, body, 64)       # a view of a buffer off the wire
    kept = _kept(wire)
    body[64:68] = np.float32(99).tobytes()
    assert kept.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]

    batch = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.float32)   # a batch output: a request's
    batch.flags.writeable = False                                # answer is a row of it
    before = sys.getrefcount(batch)
    kept = _kept(batch[1:])
    assert sys.getrefcount(batch) == before                      # the batch is not held
    assert kept.tolist() == [[4, 5, 6, 7]]

    region = mmap.mmap(-1, 32)                            # a shared-memory region, rewritten
    view = np.frombuffer(region, np.float32)              # by its owner
    kept = _kept(view)
    region[:4] = np.float32(7).tobytes()
    assert kept[0] == 0 and view[0] == 7
    del view
    region.close()

    strided = np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]     # not contiguous
    capture = _capture(InferTensor("IN", "INT64", strided.shape, strided))
    got = capture.snapshot()[0].inputs[0]
    assert got[:3] == ("IN", "INT64", (3, 2)) and got[3].tolist() == strided.tolist()
    assert got[3].dtype == np.int64


def test_every_datatype_and_a_tensor_not_kept_read_back_as_they_were():
    arrays = {"BOOL": np.array([[True, False]]), "FP16": np.array([[1.5, -2]], np.float16),
              "UINT8": np.array([[0, 255]], np.uint8), "FP64": np.array([[np.nan, np.inf]]),
              "EMPTY": np.zeros((0, 3), np.float32)}
    tensors = [InferTensor(name, str(a.dtype).upper(), a.shape, a) for name, a in arrays.items()]
    words = np.array([["héllo".encode(), b"w\x00rld"]], dtype=object)
    tensors.append(InferTensor("TEXT", "BYTES", words.shape, words))
    tensors.append(InferTensor("SHM", "FP32", (4, 4), None))      # named, in a region
    row = _capture(*tensors).snapshot()[0]
    got = {name: (shape, data) for name, _, shape, data in row.inputs}
    for name, a in arrays.items():
        assert got[name][0] == a.shape and got[name][1].dtype == a.dtype
        np.testing.assert_array_equal(got[name][1], a)
    assert got["TEXT"][1].tolist() == words.tolist()
    assert got["SHM"] == ((4, 4), None)


def test_a_row_past_max_bytes_keeps_its_figures_not_its_tensors():
    big = np.zeros(4096, np.float32)
    capture = _capture(InferTensor("IN", "FP32", big.shape, big),
                       settings=CaptureSettings(1.0, 10, 4096))
    (row,) = capture.snapshot()
    assert row.status == 200 and row.inputs == () and "past max_bytes" in row.error


def test_what_max_bytes_counts_is_what_the_rows_hold():
    settings = CaptureSettings(1.0, 100_000, 256 << 10)
    capture = Capture(settings)
    for i in range(2000):
        x = np.full((1, 64 + i % 7), i, np.float32)
        capture.add(InferRequest("m", "", f"r{i}", [InferTensor("IN", "FP32", x.shape, x)]),
                    None, 0, 200, "")
    held = sum(sys.getsizeof(row) for row in capture.rows)
    assert capture.bytes <= settings.max_bytes
    assert held <= capture.bytes <= held + 16 * len(capture.rows)
    assert all(not gc.get_referents(row) for row in capture.rows)      # nothing else held
    assert capture.dropped == 2000 - len(capture.rows) > 0
    assert capture.snapshot()[-1].inputs[0][3][0, 0] == 1999


def test_a_full_sample_is_not_tracked_by_the_collector():
    capture = Capture(CaptureSettings(1.0, 1000, 16 << 20))
    out = np.ones((4, 3), np.float32)
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
    assert last.model_version == "1"


@pytest.mark.parametrize("count", [5000])
def test_thousands_of_distinct_names_keep_the_descriptions_bounded(count):
    from jupyter_triton.engine.observation import capture as module
    capture = Capture(CaptureSettings(1.0, 10, 16 << 20))
    for i in range(count):
        x = np.zeros((1, 1), np.float32)
        capture.add(InferRequest("m", "", "", [InferTensor(f"IN{i}", "FP32", x.shape, x)]),
                    None, 0, 200, "")
    assert len(module._DESCRIBED) <= module._DESCRIBED_MOST
    assert capture.snapshot()[-1].inputs[0][0] == f"IN{count - 1}"


def test_a_sampled_row_does_not_hold_its_batch_output():
    """A request's answer is a row of its batch's output; a sample keeping one request a batch
    holds what max_bytes counts, not every batch's whole output (before: 31 times the bound)."""
    import tracemalloc
    settings = CaptureSettings(1.0, 10_000, 1 << 20)
    capture = Capture(settings)
    x = np.zeros((1, 4), np.float32)
    tracemalloc.start()
    try:
        for b in range(300):        # one request of each batch of 32 sampled
            out = np.ones((32, 4096), np.float32)
            out.flags.writeable = False
            capture.add(InferRequest("m", "", "", [InferTensor("X", "FP32", (1, 4), x)]),
                        InferResponse("m", "1", "", [InferTensor("Y", "FP32", (1, 4096),
                                                                 out[b % 32:b % 32 + 1])]),
                        0, 200, "")
            del out
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert capture.bytes <= settings.max_bytes and len(capture.rows) > 50
    assert held < 2 * settings.max_bytes, f"{held} bytes held for a sample of {capture.bytes}"


def test_the_bounds_and_the_order_hold_as_rows_change_size():
    """A model's rows are one size request after request (the deque's own bound keeps them),
    until a refusal, an id or another shape makes one of another size: through every change
    the sample keeps exactly the newest rows that fit both bounds, oldest first, as a sample
    counting every row's bytes would."""
    settings = CaptureSettings(1.0, 40, 6000)
    capture = Capture(settings)
    kept: list[tuple[int, int]] = []            # (request, its row's size): the reference
    for i in range(600):
        run = (i // 23) % 4                     # runs of one kind of row
        width = 8 if run != 3 else 8 + i % 5    # the last kind: a size each request
        x = np.full((1, width), i, np.float32)
        request = InferRequest("m", "", f"id{i:05d}" if run == 1 else "",
                               [InferTensor("IN", "FP32", x.shape, x)])
        response = InferResponse("m", "1", "", [InferTensor("OUT", "FP32", x.shape, x)])
        if run == 2:
            capture.add(request, None, i, 400, "refused")
        else:
            capture.add(request, response, i, 200, "")
        kept.append((i, len(capture.rows[-1])))
        while len(kept) > settings.max_rows or \
                sum(size + _ROW_OVERHEAD for _, size in kept) > settings.max_bytes:
            kept.pop(0)
        assert [int(r.inputs[0][3][0, 0]) for r in capture.snapshot()] == [k for k, _ in kept]
        assert capture.bytes == sum(size + _ROW_OVERHEAD for _, size in kept) <= settings.max_bytes
        assert capture.dropped == i + 1 - len(kept)
    assert 0 < len(kept) <= settings.max_rows
