"""Ours against ours: this checkout's standalone server beside another checkout's (``--baseline
DIR``, e.g. a ``git worktree`` of the commit before a change), the benchmark's own rows
(run.py's model, perf_analyzer, CPU from /proc, server statistics), rounds alternating
(new, baseline, new, baseline, ...), each server started fresh per round.

What a change costs the data path, in one run on one machine: the ratio new / baseline per row
(throughput: higher is better; p50 and CPU per inference: lower is better).

usage: .venv/bin/python benchmarks/ab.py --baseline /tmp/base [--protocols grpc] [--rounds 3]
       [--concurrency 1 32] [--interval-ms 3000] [--out benchmarks/results/ab.md]
       [--new /tmp/change]        (the new side from another checkout too; default: this one)
       [--tensor json] [--batch 64]   (JSON tensors, [64,256] requests: the JSON path)
       [--busy-poll-us 200]       (both servers' polling window)
       [--queue-delay-us 2000]    (the models' queue delay)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.models import ONNX_MODEL, PYTHON_MODEL, QUEUE_DELAY_US, build_repository  # noqa: E402
from benchmarks.run import (HOST, Measurement, Ours, Row, find_perf_analyzer, log,  # noqa: E402
                            measure, perf_analyzer, summarize)

HERE = Path(__file__).resolve().parent


class Baseline(Ours):
    """The same server from another checkout: its package first on the path, its cwd."""

    name = "baseline"

    def __init__(self, workdir: Path, repository: Path, model: str, source: Path,
                 name: str = "baseline") -> None:
        self.name = name
        super().__init__(workdir, repository, model)
        self.source = source
        self.label = f"{name} ({source}), {self.label.rsplit(', ', 1)[-1]}"
        self.log_name = f"{name}-{model}"
        self.flags: list[str] = []              # more `serve` flags, the same on both sides

    def command(self) -> tuple[list[str], dict[str, str]]:
        cmd, env = super().command()
        env = dict(env, PYTHONPATH=str(self.source))
        return [sys.executable, "-m", "jupyter_triton.cli", *cmd[cmd.index("serve"):], *self.flags], env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, required=True, help="another checkout's root")
    ap.add_argument("--new", type=Path, help="the new side's checkout (default: this one)")
    ap.add_argument("--tensor", choices=("binary", "json"), default="binary")
    ap.add_argument("--batch", type=int, default=1, help="rows per request")
    ap.add_argument("--protocols", nargs="+", choices=("http", "grpc"), default=["grpc"])
    ap.add_argument("--models", nargs="+", default=[ONNX_MODEL, PYTHON_MODEL])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--interval-ms", type=int, default=3000)
    ap.add_argument("--busy-poll-us", type=int, help="both servers' polling window (default: serve's)")
    ap.add_argument("--queue-delay-us", type=int,
                    help=f"the models' max_queue_delay_microseconds (default {QUEUE_DELAY_US})")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "ab.md")
    args = ap.parse_args()
    pa = find_perf_analyzer()
    if pa is None:
        print("perf_analyzer not found: tools/install-perf-analyzer.sh", file=sys.stderr)
        return 2
    base = args.baseline.resolve()
    commit = subprocess.run(["git", "-C", str(base), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "?"
    ours_commit = subprocess.run(["git", "-C", str(args.new or HERE.parent), "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True).stdout.strip() or "?"
    rows: dict[tuple[str, str], list[Row]] = {}
    with tempfile.TemporaryDirectory(prefix="jt-ab-") as tmp:
        workdir = Path(tmp)
        targets = []
        for model in args.models:
            repository = workdir / f"repository-{model}"
            build_repository(repository, (model,))
            if args.queue_delay_us is not None:
                config = repository / model / "config.pbtxt"
                config.write_text(config.read_text().replace(
                    f"max_queue_delay_microseconds: {QUEUE_DELAY_US}",
                    f"max_queue_delay_microseconds: {args.queue_delay_us}"))
            # the new side from its own checkout too: the installed package may be another's
            new = Baseline(workdir, repository, model, (args.new or HERE.parent).resolve(), name="ours")
            for target in (new, Baseline(workdir, repository, model, base)):
                if args.busy_poll_us is not None:
                    target.flags = ["--busy-poll-us", str(args.busy_poll_us)]
                targets.append(target)
                rows[(target.name, model)] = [Row(target.name, model, p, c, tensor=args.tensor, batch=args.batch)
                                              for c in args.concurrency for p in args.protocols]
        for rnd in range(1, args.rounds + 1):
            for target in targets:
                mine = rows[(target.name, target.model)]
                log(f"round {rnd}: {target.label}")
                try:
                    target.start()
                    perf_analyzer(pa, target, target.model, "http", 1, False, 1000,
                                  workdir / "warmup.csv", warmup=True)
                    for row in mine:
                        try:
                            m = measure(pa, target, row, rnd, args.interval_ms)
                        except (RuntimeError, OSError, KeyError, ValueError,
                                subprocess.TimeoutExpired) as e:
                            m = Measurement(round=rnd, error=str(e)[:300])
                            log(f"  {row.key}: FAILED {m.error}")
                        else:
                            log(f"  {row.key:36s} {m.throughput:7.0f} infer/s  p50 "
                                f"{m.p50_us / 1e3:5.2f} ms  CPU {m.cpu_us_per_inference:5.0f} us/inf")
                        row.rounds.append(m)
                finally:
                    target.stop()
    lines = [f"# ours ({args.new or 'this checkout'}, {ours_commit}) / baseline ({base}, {commit}): "
             f"{args.rounds} alternating rounds, medians, {args.interval_ms} ms windows, "
             f"{args.tensor} tensors [{args.batch},256], queue delay "
             f"{QUEUE_DELAY_US if args.queue_delay_us is None else args.queue_delay_us} us, busy poll "
             f"{'serve default' if args.busy_poll_us is None else f'{args.busy_poll_us} us'}, "
             f"load avg at end {os.getloadavg()[0]:.1f}", "",
             "| model | protocol | c | new infer/s | base infer/s | ratio | new p50 ms | base p50 ms "
             "| new CPU us/inf | base CPU us/inf | CPU ratio |", "|" + "---|" * 11]
    for model in args.models:
        for new, old in zip(rows[("ours", model)], rows[("baseline", model)]):
            summarize(new)
            summarize(old)
            if not new.median or not old.median:
                lines.append(f"| {model} | {new.protocol} | {new.concurrency} | failed |")
                continue
            a, b = new.median, old.median
            lines.append(
                f"| {model} | {new.protocol} | {new.concurrency} | {a['throughput']:.0f} | "
                f"{b['throughput']:.0f} | {a['throughput'] / b['throughput']:.2f} | "
                f"{a['p50_us'] / 1e3:.2f} | {b['p50_us'] / 1e3:.2f} | "
                f"{a['cpu_us_per_inference']:.0f} | {b['cpu_us_per_inference']:.0f} | "
                f"{a['cpu_us_per_inference'] / b['cpu_us_per_inference']:.2f} |")
    table = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
