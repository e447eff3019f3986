"""Planning by length (issue 36 item 5) against the text-lengths benchmark, once.

The plan: the benchmark's padding model (``text_lengths.py``: the encoder, ``encoder_pad``)
served alone by a fresh standalone server, measured at c=1 (``measure``: overhead, event loop,
hand-off, stalls; then ``measure_lengths`` on the default (batch, length) grid of the
benchmark's length distribution), then every candidate simulated at 16 closed-loop clients,
the benchmark's own settings among them (buckets 24,48,96,192, max_batch_tokens 2048, delay
2000 us) and the model without padding. The measurement: ``text_lengths.py --no-peer`` (a fresh
server per row). The figures of the two rows the benchmark measures, predicted beside measured,
go to ``results/planning-lengths.md``.

    .venv/bin/python benchmarks/planning_lengths.py --seconds 15
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import text_lengths as tl  # noqa: E402
from run import HERE, ROOT, log  # noqa: E402

from jupyter_triton.kernel.client import TritonHTTP  # noqa: E402
from jupyter_triton.kernel.discovery import Connection  # noqa: E402
from jupyter_triton.planning.capacity import Load  # noqa: E402
from jupyter_triton.planning.length_service import measure_lengths  # noqa: E402
from jupyter_triton.planning.lengths import bucket_candidates, describe_lengths, measure_grid, plan_by_length  # noqa: E402
from jupyter_triton.planning.sweep import measure  # noqa: E402

BENCH_BUCKETS = (24, 48, 96, 192)
BENCH_BUDGET = 2048
BENCH_DELAY = 2000


def plan(workdir: Path, counts: list[int], burst_s: float, slo_ms: float):
    repository = workdir / "repository-text"
    # measured without queue delay (as simulate's copy is): the bursts read a batch's cycle as
    # execution and hand-off; the candidates set their own delays
    tl.SETTINGS["delay_us"] = 0
    tl.build_repository(repository, tl.encoder_onnx())
    target = tl.OursText(workdir, repository, tl.PAD_MODEL, "plan")
    target.start()
    try:
        conn = Connection(url=f"http://{tl.HOST}:{target.http_port}/")
        config = TritonHTTP(conn).config(tl.PAD_MODEL)
        started = time.perf_counter()
        base = measure(conn, tl.PAD_MODEL, sizes=[1], repeats=15, burst_s=burst_s,
                       server_pid=target.proc.pid, progress=False)
        batches, grid = measure_grid(counts, tl.MAX_BATCH)
        service = measure_lengths(conn, tl.PAD_MODEL, batches, grid, base, repeats=5, progress=False)
        measured_s = time.perf_counter() - started
    finally:
        target.stop()
    buckets = [BENCH_BUCKETS] + [b for b in bucket_candidates(counts) if b != BENCH_BUCKETS]
    result = plan_by_length(tl.PAD_MODEL, config, service, counts, [Load("concurrency", float(tl.CLIENTS))],
                            buckets=buckets, budgets=[0, BENCH_BUDGET, 1024], delays=[0, 1000, BENCH_DELAY],
                            slo_p99_ms=slo_ms)
    return result, measured_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="text_lengths.py's measured seconds per row")
    parser.add_argument("--burst-s", type=float, default=2.0, help="measure's bursts (0: none)")
    parser.add_argument("--slo-ms", type=float, default=100.0, help="the p99 target of the plan")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "planning-lengths.md")
    args = parser.parse_args()
    counts = [int(n) for n in tl.lengths(tl.POOL)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    started_utc = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    with tempfile.TemporaryDirectory(prefix="jt-plan-lengths-") as tmp:
        workdir = Path(tmp)
        log("planning: measuring encoder_pad by length")
        result, measured_s = plan(workdir, counts, args.burst_s, args.slo_ms)
        log(repr(result))
        bench_out = workdir / "text_lengths.md"
        log("measuring: text_lengths.py --no-peer")
        subprocess.run([sys.executable, str(HERE / "text_lengths.py"), "--no-peer", "--rounds", "1",
                        "--seconds", str(args.seconds), "--out", str(bench_out)], check=True, cwd=ROOT)
        measured = json.loads(bench_out.with_suffix(".json").read_text())
    rows = {r["model"]: r for r in measured["results"]}

    def predicted(padded: bool) -> dict:
        for r in result.results:
            c = r["candidate"]
            if c.padded == padded and c.delay_us == BENCH_DELAY and \
                    (not padded or (c.buckets == BENCH_BUCKETS and c.budget == BENCH_BUDGET)):
                return r
        raise LookupError("the benchmark's settings were not simulated")

    lines = [f"# Planning by length against the text-lengths benchmark (issue 36 item 5)", "",
             f"`.venv/bin/python benchmarks/planning_lengths.py --seconds {args.seconds:g} --burst-s "
             f"{args.burst_s:g} --slo-ms {args.slo_ms:g}` at {commit}, {started_utc}, {os.cpu_count()} CPUs, "
             f"load average at end {os.getloadavg()[0]:.1f}. Lengths: {describe_lengths(counts)}. "
             f"Measurement for the plan: {measured_s:.0f} s; {len(result.results)} simulations "
             f"{result.seconds:.1f} s. Measured: one round of `text_lengths.py --no-peer` "
             f"({args.seconds:g} s a row).", "",
             "| row (16 clients, delay 2000 us) | | infer/s | p50 ms | p99 ms | mean batch | padding waste |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for model, padded, label in ((tl.PAD_MODEL, True, "padding, buckets 24,48,96,192, max_batch_tokens 2048"),
                                 (tl.PLAIN_MODEL, False, "no padding (Triton's semantics)")):
        p, m = predicted(padded), rows.get(model, {})
        lines.append(f"| {label} | predicted | {p['throughput']:.0f} | {p['p50_ms']:.1f} | {p['p99_ms']:.1f} | "
                     f"{p['mean_batch']:.2f} | {p['waste']:.2f} |")
        if m.get("requests"):
            waste = m.get("waste")
            lines.append(f"| | measured | {m['throughput']:.0f} | {m['p50_ms']:.1f} | {m['p99_ms']:.1f} | "
                         f"{m['mean_batch']:.2f} | {'' if waste is None else f'{waste:.2f}'} |")
            err = {k: (p[k] - m[k]) / m[k] if m[k] else float("nan")
                   for k in ("throughput", "p50_ms", "p99_ms", "mean_batch")}
            lines.append(f"| | error | {err['throughput']:+.0%} | {err['p50_ms']:+.0%} | {err['p99_ms']:+.0%} | "
                         f"{err['mean_batch']:+.0%} | |")
        else:
            lines.append(f"| | measured | failed: {m.get('error', 'no row')[:200]} | | | | |")
    lines += ["", f"Recommendation for p99 <= {args.slo_ms:g} ms: {result.why}", "", "```",
              result.config_text().rstrip(), "```", "", f"Service model: {result.service.describe()}; "
              f"{result.service.base.describe_overhead()}.", "",
              "| batch | length | samples | p50 ms | fitted ms | fit error |", "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['batch_size']} | {r['length']} | {r['n']} | {r['p50_ms']:.2f} | {r['fitted_ms']:.2f} | "
              f"{r['fit_error']:+.0%} |" for r in result.service.table()]
    lines += ["", "Every candidate simulated:", "", "```", repr(result), "```"]
    args.out.write_text("\n".join(lines) + "\n")
    log("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
