"""What traffic capture costs under batched load (issue 37's bound: 5 % of throughput), measured
so that a busy machine's other work falls on both sides alike: one ``jupyter-triton serve`` with
the benchmark's ONNX model, one perf_analyzer at 32 in flight for the whole run, and the capture
switched on and off through its public route every few seconds, in the order off, on, on, off
(a drift of the machine over the run falls on both kinds alike). Each phase is measured after
its first second (a new sample has filled by then: 10,000 rows at 9,000 requests a second):
requests served (the server's statistics) and the server process tree's CPU. Throughput and CPU
per inference are sums over the phases of each kind; the spread is the phases' own; each
block of four phases also gives a ratio of its own (their mean and standard error), and the
server's CPU is split into its event loop thread's and the rest's.

    .venv/bin/python benchmarks/capture_alternating.py [phases] [http|grpc] [fraction] [max_rows]
        [pin] [settle_s measure_s]

``pin``: the server's threads on CPU 0 and perf_analyzer on CPU 1 (of a 2-core machine), so
that neither takes the other's core: the server's own cost is then what moves its throughput.
``settle_s`` and ``measure_s`` (1 and 2 unless given): shorter phases, more of them, follow a
machine whose speed drifts from second to second (a shared host) more closely; the median of
the blocks' ratios is then the figure to read.

A phase "on" starts a new sample (``{"fraction": f, "max_rows": n}``, the default 16 MiB
``max_bytes``); "off" stops it and drops its rows, as a server that never captured holds none.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.models import ONNX_MODEL, build_repository  # noqa: E402
from benchmarks.run import (Ours, find_perf_analyzer, perf_analyzer,  # noqa: E402
                            perf_analyzer_command, tree_cpu_seconds)

SETTLE_S = 1.0              # a phase's first second: the sample fills, the switch settles
MEASURE_S = 2.0


def post(port: int, body: dict) -> None:
    urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{port}/v2/models/{ONNX_MODEL}/traffic", method="POST",
        data=json.dumps(body).encode()), timeout=30).read()


def loop_cpu_seconds(pid: int) -> float:
    """The server's main thread's CPU: its event loop (the instance threads are the rest)."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def served(target: Ours) -> int:
    return target.stats(ONNX_MODEL)["inference_count"]


def main() -> None:
    phases = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    protocol = sys.argv[2] if len(sys.argv) > 2 else "http"
    fraction = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
    max_rows = int(sys.argv[4]) if len(sys.argv) > 4 else 10_000
    pin = len(sys.argv) > 5 and sys.argv[5] == "pin"
    settle_s = float(sys.argv[6]) if len(sys.argv) > 6 else SETTLE_S
    measure_s = float(sys.argv[7]) if len(sys.argv) > 7 else MEASURE_S
    pa = find_perf_analyzer()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        repo = workdir / "repo"
        build_repository(repo, (ONNX_MODEL,))
        target = Ours(workdir, repo, ONNX_MODEL)
        target.start()
        load = None
        if pin:     # every thread the server has now (its instance threads are started)
            subprocess.run(["taskset", "-a", "-p", "-c", "0", str(target.proc.pid)],
                           check=True, capture_output=True)
        try:
            perf_analyzer(pa, target, ONNX_MODEL, protocol, 32, False, 2000, workdir / "w.csv",
                          warmup=True)
            # one long measurement window: the load runs until it is stopped
            cmd = perf_analyzer_command(pa, target, ONNX_MODEL, protocol, 32, False, 3_600_000,
                                        workdir / "load.csv")
            load = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    preexec_fn=(lambda: os.sched_setaffinity(0, {1})) if pin
                                    else None)
            seen: dict[bool, list[tuple[float, int, float, float]]] = {False: [], True: []}
            for i in range(2 * phases):
                on = i % 4 in (1, 2)     # off on on off: a drift falls on both alike
                post(target.http_port, {"fraction": fraction, "max_rows": max_rows} if on
                     else {"capture": False, "clear": True})
                time.sleep(settle_s)
                pid = target.proc.pid
                t0, n0, c0, l0 = (time.monotonic(), served(target), tree_cpu_seconds(pid),
                                  loop_cpu_seconds(pid))
                time.sleep(measure_s)
                t1, n1, c1, l1 = (time.monotonic(), served(target), tree_cpu_seconds(pid),
                                  loop_cpu_seconds(pid))
                seen[on].append((t1 - t0, n1 - n0, c1 - c0, l1 - l0))
                print("on " if on else "off", f"{(n1 - n0) / (t1 - t0):8.0f} infer/s "
                      f"{(c1 - c0) / max(n1 - n0, 1) * 1e6:6.1f} us CPU/inf", flush=True)
        finally:
            if load is not None:
                load.kill()
                load.wait()
            target.stop()
    figures, loop = {}, {}
    for on, rows in seen.items():
        seconds, count, cpu, loop_cpu = (sum(r[k] for r in rows) for k in range(4))
        spread = statistics.pstdev(r[1] / r[0] for r in rows) / (count / seconds)
        figures[on] = (count / seconds, cpu / count * 1e6, spread)
        loop[on] = (loop_cpu / count * 1e6, (cpu - loop_cpu) / count * 1e6)
    print(f"CPU us per inference, event loop thread: off {loop[False][0]:.1f}, on "
          f"{loop[True][0]:.1f}; the rest of the server's tree: off {loop[False][1]:.1f}, "
          f"on {loop[True][1]:.1f}")
    (off_t, off_c, off_s), (on_t, on_c, on_s) = figures[False], figures[True]
    # each block of four phases (off, on, on, off) gives a ratio of its own, the machine's
    # drift over the block falling on both kinds: their mean and its standard error
    blocks = [(sum(r[1] / r[0] for r in seen[True][2 * b:2 * b + 2])
               / sum(r[1] / r[0] for r in seen[False][2 * b:2 * b + 2]))
              for b in range(min(len(seen[True]), len(seen[False])) // 2)]
    if len(blocks) > 1:
        mean = statistics.fmean(blocks)
        error = statistics.stdev(blocks) / len(blocks) ** 0.5
        print(f"blocks of off, on, on, off: throughput on/off {mean:.3f} +- {error:.3f} "
              f"(standard error), median {statistics.median(blocks):.3f} ({len(blocks)} blocks: "
              + " ".join(f"{b:.3f}" for b in blocks) + ")")
    print(f"| {protocol}, c=32, fraction {fraction:g}, max_rows {max_rows}, {phases} phases each"
          f"{', pinned' if pin else ''} "
          f"| off {off_t:.0f} infer/s, {off_c:.1f} us CPU/inf (phase spread {off_s:.1%}) "
          f"| on {on_t:.0f} infer/s, {on_c:.1f} us CPU/inf (spread {on_s:.1%}) "
          f"| throughput {on_t / off_t:.3f} | CPU {on_c / off_c:.3f} |")


if __name__ == "__main__":
    main()
