"""What traffic capture costs under batched load (issue 37's bound: 5 % of throughput): one
``jupyter-triton serve`` per round with the benchmark's ONNX model, perf_analyzer at 32 in flight
over HTTP then gRPC, capture off / on (fraction 1, ``max_rows`` as given), rounds alternating;
throughput, the server process tree's CPU per inference and the mean batch, medians.

    .venv/bin/python benchmarks/capture_load.py [rounds] [max_rows]
"""
import json
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.models import ONNX_MODEL, build_repository
from benchmarks.run import Ours, find_perf_analyzer, perf_analyzer, tree_cpu_seconds

MAX_ROWS = int(sys.argv[2]) if len(sys.argv) > 2 else 10_000


def count(t, model):
    s = t.stats(model)
    return s["inference_count"], s["execution_count"]


def one(workdir, repo, capture, pa, protocol):
    t = Ours(workdir, repo, ONNX_MODEL)
    t.start()
    try:
        if capture:
            urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{t.http_port}/v2/models/{ONNX_MODEL}/traffic", method="POST",
                data=json.dumps({"fraction": 1.0, "max_rows": MAX_ROWS}).encode()), timeout=30).read()
        perf_analyzer(pa, t, ONNX_MODEL, protocol, 32, False, 2000, workdir / "w.csv", warmup=True)
        c0, (i0, e0) = tree_cpu_seconds(t.proc.pid), count(t, ONNX_MODEL)
        view = perf_analyzer(pa, t, ONNX_MODEL, protocol, 32, False, 3000, workdir / "r.csv")
        c1, (i1, e1) = tree_cpu_seconds(t.proc.pid), count(t, ONNX_MODEL)
        return view.throughput, (c1 - c0) / (i1 - i0) * 1e6, (i1 - i0) / (e1 - e0)
    finally:
        t.stop()


pa = find_perf_analyzer()
with tempfile.TemporaryDirectory() as tmp:
    repo = Path(tmp) / "repo"; build_repository(repo, (ONNX_MODEL,))
    for protocol in ("http", "grpc"):
        res = {False: [], True: []}
        for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
            for cap in (False, True):
                w = Path(tmp) / f"w{protocol}{r}{cap}"; w.mkdir()
                res[cap].append(one(w, repo, cap, pa, protocol))
                print(protocol, "capture" if cap else "off", [round(v, 1) for v in res[cap][-1]], flush=True)
        med = {k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in res.items()}
        print(f"| {protocol} c=32 | off {med[False][0]:.0f} infer/s, {med[False][1]:.1f} us CPU/inf, batch {med[False][2]:.2f} "
              f"| on {med[True][0]:.0f} infer/s, {med[True][1]:.1f} us CPU/inf, batch {med[True][2]:.2f} "
              f"| throughput {med[True][0]/med[False][0]:.3f} | CPU {med[True][1]/med[False][1]:.3f} |", flush=True)
