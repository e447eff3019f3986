"""What traffic capture (engine/observation/capture.py) costs per request, against the issue's bound of 5 %
of throughput, in CPU time per request (less swayed by other processes than the wall clock),
capture off / on (fraction 1, max_rows 10,000, max_bytes 16 MiB: the sample full and evicting,
the steady state), rounds alternating so that a loaded machine's drift hits both:

1. an engine's ``infer`` of an ONNX identity model (4 floats, and 4,096 floats), 16 requests in
   flight at a time in one loop (the process's CPU);
2. ``jupyter-triton serve`` answering HTTP requests (tritonclient, 8 in flight) for the 4-float
   model (busy polling off): the server process's CPU per request (/proc), what bounds its
   throughput.

    .venv/bin/python benchmarks/capture_cost.py
"""
from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from jupyter_triton.engine import Engine, EngineOptions  # noqa: E402
from jupyter_triton.protocol.types import InferRequest, InferTensor  # noqa: E402

ROUNDS = 7
REQUESTS = 4_000
IN_FLIGHT = 16


def write_model(root: Path, name: str, width: int) -> None:
    from onnx import TensorProto
    from onnx_models import identity
    identity(TensorProto.FLOAT, root / name / "1" / "model.onnx", dims=width)
    (root / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "onnxruntime"\nmax_batch_size: 8\n'
        f'input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ {width} ] }} ]\n'
        f'output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ {width} ] }} ]\n')


async def cpu_us(repo: Path, name: str, width: int, capture: bool) -> float:
    engine = Engine(EngineOptions(model_repository=repo, model_control_mode="explicit",
                                  load_models=[name], busy_poll_us=0))
    await engine.start()
    x = np.ones((1, width), np.float32)

    async def client(n: int) -> None:
        for _ in range(n):
            await engine.infer(InferRequest(name, inputs=[InferTensor("INPUT0", "FP32", (1, width), x)]))
    try:
        if capture:
            engine.traffic.control(name, {"fraction": 1.0, "max_rows": 10_000})
        await asyncio.gather(*(client(12_000 // IN_FLIGHT) for _ in range(IN_FLIGHT)))  # warm; fills
        start = time.process_time_ns()
        await asyncio.gather(*(client(REQUESTS // IN_FLIGHT) for _ in range(IN_FLIGHT)))
        return (time.process_time_ns() - start) / REQUESTS / 1e3
    finally:
        await engine.stop()


def server_cpu_us(repo: Path, capture: bool) -> float:
    """The serve process's CPU (user + system) per HTTP request of ident4."""
    import tritonclient.http as httpclient
    from ports import free_port
    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "jupyter-triton"), "serve",
                             "--model-repository", str(repo), "--http-address", "127.0.0.1",
                             "--http-port", str(port), "--allow-grpc", "false",
                             "--allow-metrics", "false", "--model-control-mode", "explicit",
                             "--load-model", "ident4", "--busy-poll-us", "0"],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", concurrency=8)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if client.is_model_ready("ident4"):
                    break
            except Exception:
                pass
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        if capture:
            import json
            import urllib.request
            urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{port}/v2/models/ident4/traffic", method="POST",
                data=json.dumps({"fraction": 1.0, "max_rows": 10_000}).encode()), timeout=30).read()
        inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(np.ones((1, 4), np.float32))

        def burst(n: int) -> None:
            for result in [client.async_infer("ident4", [inp]) for _ in range(n)]:
                result.get_result()

        burst(2_000)
        ticks = os.sysconf("SC_CLK_TCK")

        def cpu() -> float:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / ticks
        before = cpu()
        burst(REQUESTS)
        return (cpu() - before) / REQUESTS * 1e6
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        write_model(repo, "ident4", 4)
        off, on = [], []
        for _ in range(ROUNDS):
            off.append(server_cpu_us(repo, False))
            on.append(server_cpu_us(repo, True))
        m_off, m_on = statistics.median(off), statistics.median(on)
        print(f"| serve, HTTP, ident4, 8 in flight (server CPU) | {m_off:.1f} | {m_on:.1f} | "
              f"{(m_on - m_off) / m_off * 100:+.1f} % | off {[round(v, 1) for v in off]}, "
              f"on {[round(v, 1) for v in on]} |", flush=True)
        for name, width in (("ident4", 4), ("ident4096", 4096)):
            if width != 4:
                write_model(repo, name, width)
            off, on = [], []
            for _ in range(ROUNDS):
                off.append(asyncio.run(cpu_us(repo, name, width, False)))
                on.append(asyncio.run(cpu_us(repo, name, width, True)))
            m_off, m_on = statistics.median(off), statistics.median(on)
            print(f"| {name} (1 x {width} FP32), {IN_FLIGHT} in flight | {m_off:.1f} | {m_on:.1f} | "
                  f"{(m_on - m_off) / m_off * 100:+.1f} % | off {[round(v, 1) for v in off]}, "
                  f"on {[round(v, 1) for v in on]} |", flush=True)


if __name__ == "__main__":
    main()
