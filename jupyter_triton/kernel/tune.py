"""``jupyter_triton.tune``: measure a grid of batching configs under load and recommend one.

For every ``(max_batch_size, max_queue_delay_us)`` of the grid the tuner loads the model's
files under a temporary name (``<model>__tune``, one new version per config, through the
repository API like ``%%serve``), drives it at every ``concurrency`` from outside this
kernel's Python (perf_analyzer when installed, otherwise ``loadgen.py`` in a subprocess),
reads the server's statistics for the mean batch size, and unloads the temporary model at
the end. The kernel talks protocol only.

``best`` is the row with the most throughput whose p99 latency is within the SLO (and that
had no failed request); ``apply()`` loads its config as a new version of the model, which
the server makes READY before the old version retires.

The temporary model's config says it is one (``TEMPORARY_PARAMETER``): when the tuner unloads
it, however the work ended (an error, an interrupt), the server removes it from the repository
(a model without that parameter, a user's, is never removed).
"""
from __future__ import annotations

import base64
import copy
import csv
import html
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..config import TEMPORARY_PARAMETER
from ..progress import progress as show_progress
from ..protocol.errors import InvalidArgument, TritonError, Unavailable
from .client import TritonHTTP
from .discovery import Connection

#: columns of ``results`` and of ``to_csv``
COLUMNS = ("max_batch_size", "max_queue_delay_us", "concurrency", "throughput", "p50_ms",
           "p95_ms", "p99_ms", "mean_batch", "failures")

TEMP_SUFFIX = "__tune"
LOADGEN = Path(__file__).with_name("loadgen.py")


def find_perf_analyzer() -> str | None:
    """perf_analyzer from $PERF_ANALYZER, ~/.cache/perf_analyzer/ or PATH; None if absent."""
    for path in (os.environ.get("PERF_ANALYZER"),
                 str(Path.home() / ".cache" / "perf_analyzer" / "perf_analyzer"),
                 shutil.which("perf_analyzer")):
        if path and os.access(path, os.X_OK):
            return path
    return None


# ---- the result ---------------------------------------------------------------------------


def png_bytes(fig) -> bytes:
    """A matplotlib figure (Agg canvas) as PNG bytes, laid out: the tuner's and the
    planner's plots end the same way."""
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


#: markers cycled against matplotlib's ten colours: 10 x 6 = 30 series before a pair repeats
MARKERS = ("o", "s", "^", "D", "v", "P")


def series_style(i: int) -> dict:
    """The ``i``-th series' colour and marker: no two of the first 30 share both."""
    return {"color": f"C{i % 10}", "marker": MARKERS[i % len(MARKERS)]}


def legend_outside(ax, fontsize: float = 7) -> None:
    """The legend right of the axes, never over the lines."""
    ax.legend(fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)

@dataclass
class Recommendation:
    """The config ``tune`` recommends, the measurement it rests on, and why."""

    config: dict              # {"max_batch_size": .., "max_queue_delay_us": ..}
    concurrency: int
    throughput: float
    p99_ms: float
    within_slo: bool
    why: str

    def __repr__(self) -> str:
        return f"Recommendation({self.config}, concurrency={self.concurrency}): {self.why}"

    def _repr_html_(self) -> str:
        return f"<p><b>{html.escape(_knobs(self.config))}</b>: {html.escape(self.why)}</p>"


def _knobs(config: dict) -> str:
    return f"max_batch_size={config['max_batch_size']}, max_queue_delay_us={config['max_queue_delay_us']}"


def pareto_front(rows: Sequence[dict]) -> list[dict]:
    """Rows no other row beats on both throughput (higher) and p99 (lower), by p99."""
    front: list[dict] = []
    for row in sorted(rows, key=lambda r: (r["p99_ms"], -r["throughput"])):
        if row["failures"] == 0 and (not front or row["throughput"] > front[-1]["throughput"]):
            front.append(row)
    return front


class TuneResult:
    """What ``tune`` measured: ``results`` (one dict per config and concurrency), ``best``,
    a table and a throughput-vs-p99 plot (``_repr_html_``), ``to_csv`` and ``apply``."""

    def __init__(self, model: str, results: list[dict], slo_p99_ms: float | None,
                 base_config: dict, files: dict[str, bytes], connection: Connection,
                 load_generator: str) -> None:
        self.model = model
        self.results = results
        self.slo_p99_ms = slo_p99_ms
        self.load_generator = load_generator
        self._base = base_config
        self._files = files
        self._connection = connection
        self.best = self.recommend(slo_p99_ms)

    def recommend(self, slo_p99_ms: float | None) -> Recommendation | None:
        """The row with the most throughput within ``slo_p99_ms`` (no SLO: the most
        throughput); when no row meets the SLO, the one with the lowest p99, saying so."""
        clean = [r for r in self.results if r["failures"] == 0 and r["throughput"] > 0]
        if not clean:
            return None         # every run failed: each row's "error" says why
        slo = float("inf") if slo_p99_ms is None else float(slo_p99_ms)
        within = [r for r in clean if r["p99_ms"] <= slo]
        if within:
            row = max(within, key=lambda r: (r["throughput"], -r["p99_ms"]))
            others = sorted((r for r in within if r is not row), key=lambda r: -r["throughput"])
            why = (f"{row['throughput']:.0f} infer/s at concurrency {row['concurrency']} with p99 "
                   f"{row['p99_ms']:.1f} ms" + (f" (SLO {slo:g} ms)" if slo_p99_ms is not None else "")
                   + f", mean batch {row['mean_batch']:.1f}")
            if others:
                why += (f"; the next best within the SLO: {_knobs(others[0])} at concurrency "
                        f"{others[0]['concurrency']}, {others[0]['throughput']:.0f} infer/s")
            over = [r for r in clean if r["p99_ms"] > slo and r["throughput"] > row["throughput"]]
            if over:
                top = max(over, key=lambda r: r["throughput"])
                why += (f"; {_knobs(top)} at concurrency {top['concurrency']} reaches "
                        f"{top['throughput']:.0f} infer/s but its p99 is {top['p99_ms']:.1f} ms")
            return Recommendation(_config_of(row), row["concurrency"], row["throughput"],
                                  row["p99_ms"], True, why)
        row = min(clean, key=lambda r: r["p99_ms"])
        return Recommendation(_config_of(row), row["concurrency"], row["throughput"], row["p99_ms"],
                              False, f"no config met the {slo:g} ms p99 SLO; the lowest p99 was "
                              f"{row['p99_ms']:.1f} ms at concurrency {row['concurrency']} "
                              f"({row['throughput']:.0f} infer/s)")

    # ---- showing and saving ------------------------------------------------------------
    def plot_png(self) -> bytes:
        """Throughput against p99 latency, one series per config, the Pareto front and the
        SLO marked; a PNG (matplotlib's Agg backend, no display needed)."""
        return png_bytes(self.plot_figure())

    def plot_figure(self):
        """The figure ``plot_png`` draws (a matplotlib Figure on an Agg canvas)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(8.4, 4.0), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        configs = sorted({(r["max_batch_size"], r["max_queue_delay_us"]) for r in self.results})
        for i, (mbs, delay) in enumerate(configs):
            rows = sorted((r for r in self.results if (r["max_batch_size"], r["max_queue_delay_us"])
                           == (mbs, delay)), key=lambda r: r["concurrency"])
            ax.plot([r["p99_ms"] for r in rows], [r["throughput"] for r in rows], "-", alpha=0.7,
                    label=f"batch {mbs}, delay {delay} us", **series_style(i))
            for r in rows:
                ax.annotate(f"c={r['concurrency']}", (r["p99_ms"], r["throughput"]), fontsize=7,
                            xytext=(3, 3), textcoords="offset points")
        front = pareto_front(self.results)
        if front:
            ax.step([r["p99_ms"] for r in front], [r["throughput"] for r in front], "k--",
                    where="post", linewidth=1, label="Pareto front")
            ax.scatter([r["p99_ms"] for r in front], [r["throughput"] for r in front],
                       s=90, facecolors="none", edgecolors="k")
        if self.slo_p99_ms is not None:
            ax.axvline(self.slo_p99_ms, color="tab:red", linestyle=":", label=f"SLO {self.slo_p99_ms:g} ms")
        if self.best is not None and self.best.within_slo:
            ax.scatter([self.best.p99_ms], [self.best.throughput], marker="*", s=250,
                       color="tab:red", zorder=5, label="best")
        ax.set_xlabel("p99 latency (ms)")
        ax.set_ylabel("throughput (infer/s)")
        ax.set_title(f"{self.model}: {len(configs)} configs ({self.load_generator})")
        ax.grid(alpha=0.3)
        legend_outside(ax)
        return fig

    def table_html(self) -> str:
        front = {id(r) for r in pareto_front(self.results)}
        head = "".join(f"<th>{c}</th>" for c in COLUMNS)
        body = []
        for r in self.results:
            style = ' style="font-weight:bold"' if id(r) in front else ""
            cells = "".join(f"<td>{_cell(r[c])}</td>" for c in COLUMNS)
            body.append(f"<tr{style}>{cells}</tr>")
        return (f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
                "<p><small>bold: on the Pareto front (no other row has more throughput at a "
                "lower p99)</small></p>")

    def _repr_html_(self) -> str:
        png = base64.b64encode(self.plot_png()).decode("ascii")
        errors = sorted({r["error"] for r in self.results if r.get("error")})
        best = (self.best._repr_html_() if self.best is not None else
                f"<p>no run without failed requests: {html.escape('; '.join(errors) or 'no requests')}</p>")
        return (f"<div><h4>tune: {html.escape(self.model)}</h4>{best}"
                f'<img alt="throughput vs p99" src="data:image/png;base64,{png}"/>'
                f"{self.table_html()}</div>")

    def __repr__(self) -> str:
        lines = [f"TuneResult({self.model}: {len(self.results)} runs, {self.load_generator})",
                 "  ".join(f"{c:>18}" for c in COLUMNS)]
        lines += ["  ".join(f"{_cell(r[c]):>18}" for c in COLUMNS) for r in self.results]
        lines.append(f"best: {self.best!r}")
        return "\n".join(lines)

    def to_csv(self, path: str | Path) -> Path:
        path = Path(path)
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(COLUMNS), extrasaction="ignore")
            writer.writeheader()
            writer.writerows(self.results)
        return path

    # ---- acting --------------------------------------------------------------------------
    def apply(self, recommendation: Recommendation | None = None) -> Any:
        """Serve the recommended config (``best`` unless given) as a new version of the
        model; the server loads it before the old version stops serving."""
        from .handle import ServedModel
        chosen = recommendation or self.best
        if chosen is None:
            raise Unavailable(f"tune '{self.model}': no run succeeded, nothing to apply")
        config = with_batching(self._base, self.model, **chosen.config)
        client = TritonHTTP(self._connection)
        client.load(self.model, json.dumps(config), self._files)
        versions = client.metadata(self.model)["versions"]
        return ServedModel(self.model, max(int(v) for v in versions), self._connection,
                           notes=[f"tuned: {_knobs(chosen.config)}"])


def _cell(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _config_of(row: dict) -> dict:
    return {"max_batch_size": row["max_batch_size"], "max_queue_delay_us": row["max_queue_delay_us"]}


# ---- configs ------------------------------------------------------------------------------

def with_batching(base: dict, name: str, max_batch_size: int, max_queue_delay_us: int) -> dict:
    """The model's config (as ``GET .../config`` returned it) with these batching knobs."""
    config = copy.deepcopy(base)
    config["name"] = name
    config["max_batch_size"] = int(max_batch_size)
    batching = dict(config.get("dynamic_batching") or {})
    batching["max_queue_delay_microseconds"] = int(max_queue_delay_us)
    preferred = [int(p) for p in batching.get("preferred_batch_size", []) if int(p) <= max_batch_size]
    if preferred == [int(base.get("max_batch_size", 0))]:
        # what Triton fills in for a config that names none (config/defaults.py): written back,
        # it would cap every batch of a larger max_batch_size at the old one
        preferred = []
    if preferred:
        batching["preferred_batch_size"] = preferred
    else:
        batching.pop("preferred_batch_size", None)
    config["dynamic_batching"] = batching
    return config


def temporary(config: dict, name: str) -> dict:
    """``config`` as the temporary copy ``name``: the server removes it from its repository
    when it is unloaded. The mark names the copy itself, so a config read from a copy and
    loaded under another name (a user's model) never carries a mark that holds."""
    parameters = dict(config.get("parameters") or {})
    parameters[TEMPORARY_PARAMETER] = {"string_value": name}
    return {**config, "name": name, "parameters": parameters}


def _grid(values: Iterable[int] | int | None, default: int) -> list[int]:
    if values is None:
        return [default]
    if isinstance(values, int):
        return [values]
    out = [int(v) for v in values]
    if not out:
        raise InvalidArgument("tune: every grid needs at least one value")
    return out


# ---- load ---------------------------------------------------------------------------------

def _shapes(metadata: dict) -> list[tuple[str, str, list[int], bool]]:
    """Each input of a batching model: name, datatype, the shape of a one-row request
    (variable dims 1), and whether it has variable dims besides the batch dim."""
    out = []
    for inp in metadata["inputs"]:
        dims = [int(d) for d in inp["shape"]]
        out.append((inp["name"], inp["datatype"], [1] + [1 if d < 0 else d for d in dims[1:]],
                    any(d < 0 for d in dims[1:])))
    return out


def _json_body(shapes: list[tuple[str, str, list[int], bool]]) -> str:
    inputs = []
    for name, datatype, shape, _ in shapes:
        n = 1
        for d in shape:
            n *= d
        value: Any = "0" if datatype == "BYTES" else False if datatype == "BOOL" else 0
        inputs.append({"name": name, "shape": shape, "datatype": datatype, "data": [value] * n})
    return json.dumps({"inputs": inputs})


def _percentile(sorted_ms: list[float], q: float) -> float:
    if not sorted_ms:
        return float("nan")
    return sorted_ms[min(len(sorted_ms) - 1, int(q * len(sorted_ms)))]


def _run_loadgen(conn: Connection, model: str, shapes: list, concurrency: int,
                 seconds: float) -> dict:
    job = {"url": conn.url, "headers": conn.headers, "model": model, "body": _json_body(shapes),
           "concurrency": concurrency, "seconds": seconds}
    proc = subprocess.run([sys.executable, str(LOADGEN)], input=json.dumps(job), text=True,
                          capture_output=True, timeout=seconds + 60)
    if proc.returncode != 0:
        raise Unavailable(f"tune: the load generator failed: {proc.stderr.strip()[-500:]}")
    out = json.loads(proc.stdout)
    lat = sorted(out["latencies_ms"])
    return {"throughput": len(lat) / max(out["elapsed_s"], 1e-9), "p50_ms": _percentile(lat, 0.50),
            "p95_ms": _percentile(lat, 0.95), "p99_ms": _percentile(lat, 0.99),
            "failures": int(out["failures"]), "errors": out["errors"]}


def _run_perf_analyzer(path: str, conn: Connection, model: str, shapes: list, concurrency: int,
                       seconds: float) -> dict:
    url = conn.url.split("://", 1)[-1].rstrip("/")
    # three windows are perf_analyzer's least; any windows count as stable: the tuner
    # compares configs measured the same way, it does not certify a benchmark
    window_ms = max(200, int(seconds * 1000 / 3))
    with tempfile.TemporaryDirectory(prefix="jupyter_triton-tune-") as tmp:
        report = Path(tmp) / "report.csv"
        cmd = [path, "-m", model, "-u", url, "-i", "http", "--concurrency-range", str(concurrency),
               "--measurement-interval", str(window_ms), "--max-trials", "4",
               "--stability-percentage", "10000", "-f", str(report)]
        for name, value in conn.headers.items():
            cmd += ["-H", f"{name}: {value}"]
        for name, _, shape, free in shapes:
            if free:        # perf_analyzer needs the variable dims; the batch dim is its -b
                cmd += ["--shape", f"{name}:{','.join(map(str, shape[1:]))}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds * 4 + 90)
        if proc.returncode != 0 or not report.exists():
            raise Unavailable(f"tune: perf_analyzer failed (exit {proc.returncode}): "
                              f"{(proc.stderr or proc.stdout).strip()[-500:]}")
        with report.open() as f:
            [row] = list(csv.DictReader(f))
    return {"throughput": float(row["Inferences/Second"]),
            "p50_ms": float(row["p50 latency"]) / 1000, "p95_ms": float(row["p95 latency"]) / 1000,
            "p99_ms": float(row["p99 latency"]) / 1000, "failures": 0, "errors": []}


def _counts(client: TritonHTTP, model: str, version: str) -> tuple[int, int, int]:
    [stats] = client.stats(model, version)["model_stats"]
    fail = int(stats["inference_stats"]["fail"]["count"])
    return int(stats["inference_count"]), int(stats["execution_count"]), fail


def _measure_config(client: TritonHTTP, conn: Connection, temp: str, version: str, shapes: list,
                    mbs: int, delay: int, level: int, seconds: float, perf: str | None) -> dict:
    """One row of ``results``: the temporary model, served with this config, driven at
    ``level`` clients for ``seconds``."""
    rows0, execs0, _ = _counts(client, temp, version)
    if perf:
        run = _run_perf_analyzer(perf, conn, temp, shapes, level, seconds)
    else:
        run = _run_loadgen(conn, temp, shapes, level, seconds)
    rows1, execs1, _ = _counts(client, temp, version)
    execs = execs1 - execs0
    return {"max_batch_size": mbs, "max_queue_delay_us": delay, "concurrency": level,
            "throughput": run["throughput"], "p50_ms": run["p50_ms"], "p95_ms": run["p95_ms"],
            "p99_ms": run["p99_ms"], "mean_batch": (rows1 - rows0) / execs if execs else 0.0,
            "failures": run["failures"], "error": run["errors"][0] if run["errors"] else ""}


# ---- the entry point ----------------------------------------------------------------------

def tune(model: Any, max_batch_size: Sequence[int] | int | None = None,
         max_queue_delay_us: Sequence[int] | int | None = None,
         concurrency: Sequence[int] | int = (1, 8), seconds: float = 3.0,
         slo_p99_ms: float | None = None, *, files: dict[str, bytes] | None = None,
         load_generator: str = "auto", connection: Connection | None = None,
         progress: bool = True) -> TuneResult:
    """Measure every ``max_batch_size`` x ``max_queue_delay_us`` config at every
    ``concurrency`` for ``seconds`` each; see the module docstring.

    ``model``: a served model's name (or its handle). Its files are those this kernel last
    served under that name (``serve``), or ``files`` (``{"1/model.onnx": bytes}``).
    ``load_generator``: "auto" (perf_analyzer when installed), "perf_analyzer" or "loadgen".
    ``progress``: a bar (a notebook) or text lines (elsewhere) as each run starts.
    """
    from . import api
    name = model if isinstance(model, str) else model.name
    conn = connection or api.connection()
    client = TritonHTTP(conn)
    if files is None:
        uploaded = api.uploaded.get(name)
        if uploaded is None:
            raise InvalidArgument(
                f"tune '{name}': this kernel did not serve '{name}', so it has no files to load "
                f"under a temporary name; serve it from this notebook first or pass files=")
        files = dict(uploaded.files)
    if seconds <= 0 or seconds > 600:
        raise InvalidArgument("tune: seconds must be in (0, 600]")
    base = client.config(name)
    base_mbs = int(base.get("max_batch_size", 0) or 0)
    delays = _grid(max_queue_delay_us, int((base.get("dynamic_batching") or {})
                                           .get("max_queue_delay_microseconds", 0) or 0))
    sizes = _grid(max_batch_size, base_mbs)
    if base_mbs == 0 or min(sizes) < 1:
        raise InvalidArgument(f"tune '{name}': batching configs need a model that batches "
                              f"(max_batch_size >= 1 in its config and in the grid)")
    levels = _grid(concurrency, 1)
    if min(levels) < 1 or max(levels) > 1024:
        raise InvalidArgument("tune: concurrency must be between 1 and 1024")
    perf = find_perf_analyzer() if load_generator in ("auto", "perf_analyzer") else None
    if load_generator == "perf_analyzer" and perf is None:
        raise Unavailable("tune: perf_analyzer not found (~/.cache/perf_analyzer/perf_analyzer or PATH)")
    if load_generator not in ("auto", "perf_analyzer", "loadgen"):
        raise InvalidArgument("tune: load_generator must be auto, perf_analyzer or loadgen")
    generator = "perf_analyzer" if perf else "loadgen"

    temp = name + TEMP_SUFFIX
    results: list[dict] = []
    with show_progress(len(sizes) * len(delays) * len(levels), f"tune {name}", progress) as bar:
        try:
            for mbs in sizes:
                for delay in delays:
                    client.load(temp, json.dumps(temporary(with_batching(base, temp, mbs, delay), temp)),
                                files)
                    meta = client.metadata(temp)
                    version = str(max(int(v) for v in meta["versions"]))
                    shapes = _shapes(meta)
                    for level in levels:
                        bar.update(len(results), f"max_batch_size={mbs}, max_queue_delay_us={delay}: "
                                                 f"concurrency {level} for {seconds:g} s")
                        results.append(_measure_config(client, conn, temp, version, shapes, mbs, delay,
                                                       level, seconds, perf))
        finally:
            try:
                client.unload(temp)
            except TritonError:
                pass            # the failure that brought us here is the one to report
    return TuneResult(name, results, slo_p99_ms, base, files, conn, generator)


def tune_line(line: str) -> TuneResult:
    """``%triton tune NAME [--max-batch-size 8,32] [--max-queue-delay-us 0,500]
    [--concurrency 1,8] [--seconds 3] [--slo-p99-ms 20] [--load-generator loadgen]``"""
    import argparse
    import shlex

    def ints(text: str) -> list[int]:
        try:
            return [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None

    parser = argparse.ArgumentParser(prog="%triton tune", add_help=False, exit_on_error=False)
    parser.add_argument("name")
    parser.add_argument("--max-batch-size", type=ints)
    parser.add_argument("--max-queue-delay-us", type=ints)
    parser.add_argument("--concurrency", type=ints, default=[1, 8])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--slo-p99-ms", type=float)
    parser.add_argument("--load-generator", default="auto", choices=["auto", "perf_analyzer", "loadgen"])
    try:
        args = parser.parse_args(shlex.split(line))
    except (argparse.ArgumentError, SystemExit) as err:
        raise InvalidArgument(f"{tune_line.__doc__.split(chr(10))[0].strip('`')}: {err}") from None
    return tune(args.name, args.max_batch_size, args.max_queue_delay_us, args.concurrency,
                args.seconds, args.slo_p99_ms, load_generator=args.load_generator)
