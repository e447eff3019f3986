"""Server CPU per request of the two standalone HTTP skins (httptools front vs tornado), for
an infer call and for v2/health/live (the front alone, no engine work).

Each front serves the same tiny ONNX model (y = x @ W, one [1, 16] row) from its own
subprocess; a tritonclient in this process sends N sequential requests; the server's CPU is
read from /proc/<pid>/stat (utime + stime, every thread) before and after. Fronts alternate
over rounds so that load from the rest of the machine affects both alike.

    .venv/bin/python tools/http_front_cpu.py [--requests 2000] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SERVER = """
import asyncio, sys
from jupyter_triton.engine import EngineOptions
from jupyter_triton.standalone import start_standalone
async def main():
    s = await start_standalone(EngineOptions(model_repository=sys.argv[1], model_control_mode="none"),
                               host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=None,
                               access_log=False, http_front=sys.argv[2])
    print(s.http_port, flush=True)
    await asyncio.Event().wait()
sys.setswitchinterval(0.0005)
asyncio.run(main())
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    import tritonclient.http as httpclient
    from conftest import build_repository

    repo = build_repository(Path(tempfile.mkdtemp()) / "models")
    servers = {}
    for front in ("fast", "tornado"):
        proc = subprocess.Popen([sys.executable, "-c", SERVER, str(repo), front],
                                stdout=subprocess.PIPE, text=True, cwd=ROOT)
        servers[front] = (proc, int(proc.stdout.readline()))
    x = np.ones((1, 16), np.float32)
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        for _ in range(args.rounds):
            for front, (proc, port) in servers.items():
                client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
                inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
                inp.set_data_from_numpy(x)
                for _ in range(50):                    # warm: connection, first-call paths
                    client.infer("linear", [inp])
                calls = {"infer": lambda: client.infer("linear", [inp]),
                         "health/live": client.is_server_live}
                for what, call in calls.items():
                    cpu0, t0 = cpu_seconds(proc.pid), time.perf_counter()
                    for _ in range(args.requests):
                        call()
                    wall, cpu = time.perf_counter() - t0, cpu_seconds(proc.pid) - cpu0
                    results.setdefault((front, what), []).append(
                        (cpu / args.requests * 1e6, wall / args.requests * 1e6))
                client.close()
    finally:
        for proc, _ in servers.values():
            proc.terminate()
    for (front, what), rows in results.items():
        cpu = sorted(r[0] for r in rows)
        wall = sorted(r[1] for r in rows)
        print(f"{front:8s} {what:12s} server CPU/request: median {cpu[len(cpu) // 2]:6.0f} us "
              f"(rounds {', '.join(f'{c:.0f}' for c in cpu)}); wall/request median "
              f"{wall[len(wall) // 2]:6.0f} us")

if __name__ == "__main__":
    main()
