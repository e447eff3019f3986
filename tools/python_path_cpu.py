"""Server CPU per inference of the benchmark's python model at a concurrency (issue 8's c=32 row).

Serves benchmarks/models.py's model (matmul_python, or --model matmul_onnx for the same
product without a worker) with `jupyter-triton serve`, runs perf_analyzer
(`-i http|grpc -b 1 --concurrency-range C -p MS`, three windows), and divides the CPU ticks
(utime+stime, /proc) of the server's process tree, per process and per thread, by the
inferences the server's own statistics counted. The cores are shared: CPU per inference is
the figure to compare, in alternating runs.

usage: .venv/bin/python tools/python_path_cpu.py [http|grpc] [--concurrency 32] [--interval 3000]
       [--model matmul_python] [--source DIR]   (DIR: another checkout's root, for A/B runs)
       [--spy PREFIX]   (py-spy raw profiles of the server and the worker: PREFIX.0, PREFIX.1)
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.models import PYTHON_MODEL, build_repository  # noqa: E402
from tools.python_backend_cpu import free_port, tree  # noqa: E402

HZ = os.sysconf("SC_CLK_TCK")


def ticks(path: str) -> tuple[float, float]:
    try:
        fields = open(path).read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    return int(fields[11]) / HZ, int(fields[12]) / HZ


def threads(pids: list[int]) -> dict[tuple[int, int], tuple[float, float]]:
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            out[(pid, int(tid))] = ticks(f"/proc/{pid}/task/{tid}/stat")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("protocol", nargs="?", default="http", choices=("http", "grpc"))
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--interval", type=int, default=3000)
    ap.add_argument("--model", default=PYTHON_MODEL)
    ap.add_argument("--source", default=str(ROOT))
    ap.add_argument("--spy")
    args = ap.parse_args()
    pa = os.environ.get("PERF_ANALYZER") or str(Path.home() / ".cache" / "perf_analyzer" / "perf_analyzer")
    work = Path(tempfile.mkdtemp(prefix="pypath_"))
    build_repository(work / "repo", (args.model,))
    http_port, grpc_port = free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=args.source)
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter_triton.cli", "serve", "--model-repository", str(work / "repo"),
         "--http-address", "127.0.0.1", "--http-port", str(http_port), "--grpc-address", "127.0.0.1",
         "--grpc-port", str(grpc_port), "--allow-metrics", "false"],
        # cwd: `python -m` puts it first on sys.path, before --source
        env=env, cwd=str(work), stdout=open(work / "server.log", "w"), stderr=subprocess.STDOUT,
        start_new_session=True)
    base = f"http://127.0.0.1:{http_port}/v2/models/{args.model}"

    def stats() -> tuple[int, int]:
        s = json.load(urllib.request.urlopen(f"{base}/stats"))["model_stats"][0]
        return s["inference_count"], s["execution_count"]

    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if urllib.request.urlopen(f"{base}/ready").status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("server did not start:\n" + (work / "server.log").read_text()[-2000:])
            time.sleep(0.3)
        url = f"127.0.0.1:{http_port if args.protocol == 'http' else grpc_port}"
        cmd = [pa, "-m", args.model, "-u", url, "-i", args.protocol, "-b", "1",
               "--concurrency-range", str(args.concurrency)]
        subprocess.run(cmd + ["--measurement-mode", "count_windows", "--measurement-request-count", "200"],
                       capture_output=True, timeout=120)   # warm-up: first batches, worker start
        pids = tree(server.pid)
        cpu0, threads0, (n0, e0) = {p: ticks(f"/proc/{p}/stat") for p in pids}, threads(pids), stats()
        spies = []
        if args.spy:
            seconds = str(int(args.interval * 3 / 1000) + 4)
            spies = [subprocess.Popen(["py-spy", "record", "-r", "500", "-f", "raw", "-o", f"{args.spy}.{i}",
                                       "-p", str(p), "-d", seconds],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for i, p in enumerate(pids[:2])]
        run = subprocess.run(cmd + ["-p", str(args.interval), "--stability-percentage", "10000",
                                    "--max-trials", "3", "-f", str(work / "pa.csv")],
                             capture_output=True, text=True, timeout=120 + args.interval * 9 / 1000)
        cpu1, threads1, (n1, e1) = {p: ticks(f"/proc/{p}/stat") for p in pids}, threads(pids), stats()
        for spy in spies:
            spy.wait()
        if run.returncode != 0:
            raise SystemExit("perf_analyzer failed:\n" + (run.stdout + run.stderr)[-2000:])
        n = n1 - n0
        row = next(csv.DictReader(open(work / "pa.csv")))

        def us(seconds: float) -> int:
            return round(seconds / n * 1e6)

        total = sum(sum(cpu1[p]) - sum(cpu0[p]) for p in pids)
        print(f"{args.model} {args.protocol} c={args.concurrency}: {float(row['Inferences/Second']):.0f} infer/s, "
              f"p50 {float(row['p50 latency']) / 1000:.1f} ms, {n} inferences in {e1 - e0} batches "
              f"({n / max(1, e1 - e0):.1f} a batch), server tree {us(total)} us CPU/inference")
        for p in pids:
            user, system = (a - b for a, b in zip(cpu1[p], cpu0[p]))
            if user + system:
                print(f"  {'server' if p == server.pid else f'child {p}'}: {us(user + system)} us "
                      f"(user {us(user)}, system {us(system)})")
        busy = sorted(((us(sum(v) - sum(threads0.get(k, (0, 0)))), k) for k, v in threads1.items()), reverse=True)
        print("  threads (us/inference, pid, tid):", [(c, pid, tid) for c, (pid, tid) in busy if c >= 3])
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
