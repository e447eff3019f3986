"""Where traffic capture's cost comes from (issue 37's bound: 5 % of throughput), one variant at a
time through the public control route: a standalone server in this process (its CPU per
inference is this process's CPU time, perf_analyzer's is not in it), the benchmark's ONNX model,
perf_analyzer at 32 in flight, variants alternating per round:

- ``off``: no capture;
- ``tap``: capture on at ``fraction`` 0.0001 (the engine asks the tap of every request, almost
  none is kept): what the tap itself costs;
- ``rows1``: every request kept, ``max_rows`` 1 (each row evicted by the next): keeping a row,
  without holding a sample;
- ``rows100``, ``rows10k``: every request kept, a sample of 100 / 10,000 rows (10,000: the
  default; the default 16 MiB ``max_bytes`` holds about 6,500 rows of these 2 KiB requests);
- ``frac0.1``: a tenth of the requests kept, 10,000 rows.

    .venv/bin/python benchmarks/capture_parts.py [rounds] [http|grpc]
"""
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.models import ONNX_MODEL, build_repository  # noqa: E402
from benchmarks.run import find_perf_analyzer, perf_analyzer  # noqa: E402
from jupyter_triton.engine.options import EngineOptions  # noqa: E402
from jupyter_triton.standalone import start_in_thread  # noqa: E402

VARIANTS = {"off": None, "tap": (0.0001, 10_000), "rows1": (1.0, 1), "rows100": (1.0, 100),
            "rows10k": (1.0, 10_000), "frac0.1": (0.1, 10_000)}


class Target:
    headers: dict = {}

    def __init__(self, server) -> None:
        self.http_port, self.grpc_port = server.http_port, server.grpc_port


def counts(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{ONNX_MODEL}/stats") as r:
        return json.load(r)["model_stats"][0]["inference_count"]


def one(repo: Path, workdir: Path, capture, protocol: str, pa: str) -> tuple[float, float]:
    server = start_in_thread(EngineOptions(model_repository=repo, model_control_mode="explicit",
                                           load_models=["*"]),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0,
                             access_log=False)
    try:
        target = Target(server)
        if capture is not None:
            fraction, rows = capture
            urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{server.http_port}/v2/models/{ONNX_MODEL}/traffic",
                method="POST", data=json.dumps({"fraction": fraction, "max_rows": rows}).encode()),
                timeout=30).read()
        perf_analyzer(pa, target, ONNX_MODEL, protocol, 32, False, 2000, workdir / "w.csv",
                      warmup=True)
        n0, c0 = counts(server.http_port), time.process_time()
        view = perf_analyzer(pa, target, ONNX_MODEL, protocol, 32, False, 3000, workdir / "r.csv")
        c1, n1 = time.process_time(), counts(server.http_port)
        return (c1 - c0) / (n1 - n0) * 1e6, view.throughput
    finally:
        server.close()


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    protocol = sys.argv[2] if len(sys.argv) > 2 else "http"
    pa = find_perf_analyzer()
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        build_repository(repo, (ONNX_MODEL,))
        seen: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
        for r in range(rounds):
            for name, capture in VARIANTS.items():
                seen[name].append(one(repo, Path(tmp), capture, protocol, pa))
                print(name, [round(x, 1) for x in seen[name][-1]], flush=True)
        off_cpu = statistics.median(c for c, _ in seen["off"])
        off_thr = statistics.median(t for _, t in seen["off"])
        print(f"| variant ({protocol}, c=32, {rounds} rounds, medians) | server CPU us/inference "
              f"| vs off | infer/s | vs off |\n|---|---:|---:|---:|---:|")
        for name, rows in seen.items():
            cpu = statistics.median(c for c, _ in rows)
            thr = statistics.median(t for _, t in rows)
            print(f"| {name} | {cpu:.1f} | {cpu / off_cpu:.3f} | {thr:.0f} | {thr / off_thr:.3f} |")


if __name__ == "__main__":
    main()
