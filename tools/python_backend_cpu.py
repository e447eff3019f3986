"""Server CPU per inference for a python model (y = x @ W, W 256x256 fp32, [1,256] requests).

Starts `jupyter-triton serve` as a subprocess, sends N sequential requests (c=1) with
tritonclient HTTP from this process, sums utime+stime over the server's process tree (server,
workers, resource tracker) from /proc, divides by the inference count of v2/models/stats.

usage: .venv/bin/python tools/python_backend_cpu.py [N] [--thread] [--profile-worker]
(--thread: the same model in EXECUTION_MODE thread, the floor without a worker process)
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

MODEL_PY = '''
import numpy as np, os
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.W = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
        if os.environ.get("PROFILE_WORKER"):
            import cProfile, atexit
            self.prof = cProfile.Profile()
            self.prof.enable()

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "x").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", x @ self.W)]))
        return out

    def finalize(self):
        if os.environ.get("PROFILE_WORKER"):
            self.prof.disable()
            self.prof.dump_stats(os.environ["PROFILE_WORKER"])
'''

CONFIG = '''
name: "mm"
backend: "python"
max_batch_size: 64
dynamic_batching { max_queue_delay_microseconds: 500 }
input [{ name: "x" data_type: TYPE_FP32 dims: [ 256 ] }]
output [{ name: "y" data_type: TYPE_FP32 dims: [ 256 ] }]
instance_group [{ kind: KIND_CPU count: 1 }]
'''

HZ = os.sysconf("SC_CLK_TCK")


def tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_s(pids: list[int]) -> float:
    total = 0
    for p in pids:
        try:
            f = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(f[11]) + int(f[12])
    return total / HZ


def task_cpu(pid: int) -> dict[int, float]:
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            f = open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(t)] = (int(f[11]) + int(f[12])) / HZ
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 2000
    repo = Path(tempfile.mkdtemp()) / "models"
    (repo / "mm" / "1").mkdir(parents=True)
    (repo / "mm" / "1" / "model.py").write_text(textwrap.dedent(MODEL_PY))
    config = CONFIG
    if "--thread" in sys.argv:
        config += 'parameters { key: "EXECUTION_MODE" value: { string_value: "thread" } }\n'
    (repo / "mm" / "config.pbtxt").write_text(config)
    port = free_port()
    env = dict(os.environ)
    prof = None
    if "--profile-worker" in sys.argv:
        prof = str(repo.parent / "worker.prof")
        env["PROFILE_WORKER"] = prof
    exe = Path(sys.executable).with_name("jupyter-triton")
    server = subprocess.Popen([str(exe), "serve", "--model-repository", str(repo), "--http-port", str(port),
                               "--allow-grpc", "false", "--allow-metrics", "false",
                               "--model-control-mode", "explicit", "--load-model", "mm"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        deadline = time.monotonic() + 60
        while True:
            try:
                if client.is_model_ready("mm"):
                    break
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("server did not start")
            time.sleep(0.2)
        x = np.random.default_rng(1).standard_normal((1, 256)).astype(np.float32)
        inp = httpclient.InferInput("x", [1, 256], "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        outs = [httpclient.InferRequestedOutput("y", binary_data=True)]
        for _ in range(200):
            client.infer("mm", [inp], outputs=outs)
        count0 = client.get_inference_statistics("mm")["model_stats"][0]["inference_count"]
        pids = tree(server.pid)
        before = {p: cpu_s([p]) for p in pids}
        tasks0 = task_cpu(server.pid)
        c0, t0 = cpu_s(pids), time.perf_counter()
        for _ in range(n):
            client.infer("mm", [inp], outputs=outs)
        c1, t1 = cpu_s(tree(server.pid)), time.perf_counter()
        per = {p: cpu_s([p]) - before[p] for p in pids}
        tasks1 = task_cpu(server.pid)
        count = client.get_inference_statistics("mm")["model_stats"][0]["inference_count"] - count0
        print(f"processes {len(pids)} inferences {count} wall {t1 - t0:.2f}s "
              f"({count / (t1 - t0):.0f}/s) server CPU {c1 - c0:.2f}s "
              f"= {(c1 - c0) / count * 1e6:.0f} us/inference")
        print("  us/inference by process:",
              {("server" if p == server.pid else "worker" if "spawn_main" in open(f"/proc/{p}/cmdline").read()
                else "other"): round(v / count * 1e6) for p, v in per.items()})
        threads = sorted(((tasks1[t] - tasks0.get(t, 0)) / count * 1e6 for t in tasks1), reverse=True)
        print("  server threads us/inference:", [round(v) for v in threads if v >= 5])
        if prof:
            client.unload_model("mm")
            time.sleep(2)
    finally:
        server.terminate()
        server.wait(10)
    if prof and os.path.exists(prof):
        import pstats
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
