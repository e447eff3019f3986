"""CPU per request of the server's event loop, two checkouts side by side: what a change to the
per-request Python (parse, decode, validate, deliver, encode) costs, on a machine too busy for
throughput figures to mean anything.

Both servers (`python -m jupyter_triton.cli serve`, each checkout first on PYTHONPATH) run at
once on the benchmark's model; short bursts of perf_analyzer requests go to one, then the other,
alternating, many times. Per burst, the on-CPU nanoseconds of the server's main thread (the
event loop) and of its whole process tree come from /proc/<pid>/task/<tid>/schedstat
(nanosecond resolution, unlike the 10 ms ticks of /proc/<pid>/stat), over the inferences the
server's statistics counted. The medians over bursts are compared: CPU time is what a change
moves; other load on the machine stretches wall time far more than it moves CPU time.

    .venv/bin/python benchmarks/loop_cpu.py --a /tmp/change --b /tmp/base [--protocol http]
        [--concurrency 1] [--tensor json] [--batch 64] [--bursts 8] [--requests 400]
        [--busy-poll-us 1000]      (the polling's CPU too, as `serve` runs by default)
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.models import PYTHON_MODEL, build_repository  # noqa: E402
from benchmarks.run import Ours, find_perf_analyzer, log, perf_analyzer_command, process_tree  # noqa: E402


def on_cpu_ns(pid: int, tid: int | None = None) -> int:
    """On-CPU ns of one thread (``tid``), or of every thread of ``pid``'s live tree."""
    if tid is not None:
        return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    total = 0
    for p in process_tree(pid):
        try:
            for task in os.scandir(f"/proc/{p}/task"):
                total += int(Path(task.path, "schedstat").read_text().split()[0])
        except OSError:
            pass
    return total


class Checkout(Ours):
    """The standalone server of one checkout (its package first on the path)."""

    def __init__(self, workdir: Path, repository: Path, model: str, source: Path, name: str) -> None:
        self.name = name
        super().__init__(workdir, repository, model)
        self.source = source
        self.label = f"{name} ({source})"
        self.log_name = name
        self.busy_poll_us = 0

    def command(self) -> tuple[list[str], dict[str, str]]:
        cmd, env = super().command()
        # CPU spent on work, not on busy polling (engine/batching/busy_poll.py), which fills what
        # the cores leave idle and would hide a change's cost at low concurrency; unless
        # what is measured is the polling itself (--busy-poll-us)
        polls = "--busy-poll-us" in (self.source / "jupyter_triton" / "cli.py").read_text()
        return ([sys.executable, "-m", "jupyter_triton.cli", *cmd[cmd.index("serve"):],
                 *(["--busy-poll-us", str(self.busy_poll_us)] if polls else [])],
                dict(env, PYTHONPATH=str(self.source)))


def burst(pa: str, server: Checkout, args: argparse.Namespace) -> dict[str, float]:
    report = server.workdir / f"{server.name}.csv"
    cmd = perf_analyzer_command(pa, server, server.model, args.protocol, args.concurrency, False, 0,
                                report, warmup=False, tensor=args.tensor, batch=args.batch)
    # A fixed count of requests per window instead of a time window: both servers do the same work.
    at = cmd.index("--measurement-interval")
    cmd[at:at + 2] = ["--measurement-mode", "count_windows", "--measurement-request-count",
                      str(args.requests)]
    pid = server.proc.pid
    before = server.stats(server.model)["inference_count"]
    loop0, tree0 = on_cpu_ns(pid, pid), on_cpu_ns(pid)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    loop1, tree1 = on_cpu_ns(pid, pid), on_cpu_ns(pid)
    if proc.returncode != 0:
        raise RuntimeError(f"perf_analyzer: {(proc.stdout + proc.stderr)[-500:]}")
    n = max(1, server.stats(server.model)["inference_count"] - before)
    return {"loop_us": (loop1 - loop0) / n / 1e3, "tree_us": (tree1 - tree0) / n / 1e3, "inferences": n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", type=Path, required=True, help="the changed checkout")
    ap.add_argument("--b", type=Path, required=True, help="the baseline checkout")
    ap.add_argument("--model", default=PYTHON_MODEL)
    ap.add_argument("--protocol", choices=("http", "grpc"), default="http")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--tensor", choices=("binary", "json"), default="binary")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--bursts", type=int, default=8)
    ap.add_argument("--requests", type=int, default=400, help="requests per perf_analyzer window")
    ap.add_argument("--busy-poll-us", type=int, default=0,
                    help="the servers' polling window (default 0: CPU on work only)")
    args = ap.parse_args()
    pa = find_perf_analyzer()
    if pa is None:
        print("perf_analyzer not found: tools/install-perf-analyzer.sh", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="jt-loop-cpu-") as tmp:
        workdir = Path(tmp)
        repository = workdir / "repository"
        build_repository(repository, (args.model,))
        servers = [Checkout(workdir, repository, args.model, args.a.resolve(), "a"),
                   Checkout(workdir, repository, args.model, args.b.resolve(), "b")]
        for server in servers:
            server.busy_poll_us = args.busy_poll_us
        results: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
        try:
            for server in servers:
                server.start()
                burst(pa, server, argparse.Namespace(**{**vars(args), "requests": 50}))
            for i in range(args.bursts):
                for server in servers if i % 2 == 0 else servers[::-1]:
                    r = burst(pa, server, args)
                    results[server.name].append(r)
                    log(f"  {server.name} burst {i}: loop {r['loop_us']:7.1f} us/inf  tree {r['tree_us']:7.1f} us/inf")
        finally:
            for server in servers:
                server.stop()
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("loop_us", "tree_us")} for k, v in results.items()}
    log(f"{args.model} {args.protocol} {args.tensor} [{args.batch},256] c={args.concurrency}, "
        f"{args.bursts} bursts x 3 x {args.requests} requests, medians, load avg {os.getloadavg()[0]:.1f}")
    log(f"  a ({args.a}): loop {med['a']['loop_us']:.1f} us/inf, tree {med['a']['tree_us']:.1f} us/inf")
    log(f"  b ({args.b}): loop {med['b']['loop_us']:.1f} us/inf, tree {med['b']['tree_us']:.1f} us/inf")
    log(f"  a/b: loop {med['a']['loop_us'] / med['b']['loop_us']:.2f}, tree {med['a']['tree_us'] / med['b']['tree_us']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
