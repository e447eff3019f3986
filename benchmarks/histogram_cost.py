"""What the latency histograms (``histogram_latencies``) cost per request, to decide whether the
Jupyter extension keeps them on by default (the dashboard's p50/p95/p99 need them).

Two measurements in CPU time (the process's: less swayed by other processes than the wall
clock), each alternating off/on rounds so that a loaded machine's drift hits both:

1. the statistics' bookkeeping of one request of batch one (queue, one execution, success) with
   and without ``LatencyHistograms`` attached: what the histograms add to the request path;
2. an engine's ``infer`` of a 4-float ONNX identity model, sequential requests in one loop,
   with the option off and on: the same cost seen against a whole request.

    .venv/bin/python benchmarks/histogram_cost.py
"""
from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from tritonclient.grpc import model_config_pb2 as mc  # noqa: E402

from jupyter_triton.engine import Engine, EngineOptions  # noqa: E402
from jupyter_triton.engine.observation.histograms import latency_histograms  # noqa: E402
from jupyter_triton.engine.observation.statistics import ModelStatistics  # noqa: E402
from jupyter_triton.protocol.types import InferRequest, InferTensor  # noqa: E402

ROUNDS = 7
BOOKKEEPING_N = 50_000
INFER_N = 3_000


def bookkeeping_ns(histograms: bool) -> float:
    stats = ModelStatistics("m", "1")
    stats.histograms = latency_histograms(mc.ModelConfig(), histograms)
    start = time.process_time_ns()
    for i in range(BOOKKEEPING_N):
        stats.record_queue(20_000 + i % 7)
        stats.record_execution(1, 1, 3_000, 90_000, 2_000)
        stats.record_success(130_000 + i % 11)
    return (time.process_time_ns() - start) / BOOKKEEPING_N


def write_model(root: Path) -> None:
    from onnx import TensorProto
    from onnx_models import identity
    identity(TensorProto.FLOAT, root / "ident" / "1" / "model.onnx", dims=4)
    (root / "ident" / "config.pbtxt").write_text(
        'name: "ident"\nbackend: "onnxruntime"\nmax_batch_size: 8\n'
        'input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]\n'
        'output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]\n')


async def infer_us(repo: Path, histograms: bool) -> float:
    engine = Engine(EngineOptions(model_repository=repo, model_control_mode="explicit",
                                  load_models=["ident"], histogram_latencies=histograms))
    await engine.start()
    x = np.ones((1, 4), np.float32)
    try:
        for _ in range(200):        # warm
            await engine.infer(InferRequest("ident", inputs=[InferTensor("INPUT0", "FP32", (1, 4), x)]))
        start = time.process_time_ns()
        for _ in range(INFER_N):
            await engine.infer(InferRequest("ident", inputs=[InferTensor("INPUT0", "FP32", (1, 4), x)]))
        return (time.process_time_ns() - start) / INFER_N / 1e3
    finally:
        await engine.stop()


def main() -> None:
    off, on = [], []
    for _ in range(ROUNDS):
        off.append(bookkeeping_ns(False))
        on.append(bookkeeping_ns(True))
    b_off, b_on = statistics.median(off), statistics.median(on)
    print(f"statistics bookkeeping per request: off {b_off:.0f} ns, on {b_on:.0f} ns, "
          f"histograms add {b_on - b_off:.0f} ns CPU (median of {ROUNDS} rounds of {BOOKKEEPING_N}; "
          f"off {[round(v) for v in off]}, on {[round(v) for v in on]})")
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        write_model(repo)
        i_off, i_on = [], []
        for _ in range(ROUNDS):
            i_off.append(asyncio.run(infer_us(repo, False)))
            i_on.append(asyncio.run(infer_us(repo, True)))
    e_off, e_on = statistics.median(i_off), statistics.median(i_on)
    print(f"engine.infer CPU per request (ONNX identity, batch 1, sequential): off {e_off:.1f} us, "
          f"on {e_on:.1f} us (median of {ROUNDS} rounds of {INFER_N}; off "
          f"{[round(v, 1) for v in i_off]}, on {[round(v, 1) for v in i_on]}); the bookkeeping "
          f"difference is {(b_on - b_off) / 1e3 / e_off * 100:.1f}% of a request's CPU")


if __name__ == "__main__":
    main()
