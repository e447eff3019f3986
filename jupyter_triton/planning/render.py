"""How planning's objects look in a notebook: the service model's plot and table, the plan's
plot, tables and text, the bulk effect's table, ``compare``'s rows. The objects' own
``_repr_html_`` and ``plot_png`` hand over to these; nothing here computes a figure.

The objects (``service.ServiceModel``, ``capacity.CapacityPlan``, ``capacity.BulkEffect``)
import this module; it knows of them only what it reads, as the protocols below.
"""
from __future__ import annotations

import base64
import html
from typing import Any, Protocol, Sequence

from ..kernel.tune import legend_outside, png_bytes, series_style
from .rows import describe_range, replica_range


class ShownService(Protocol):
    """What the service model's views read of a ``service.ServiceModel``."""
    model: str
    version: str
    samples: dict[int, list[int]]
    overhead_ns: int
    method: str

    def median_ns(self, rows: int) -> float: ...

    def table(self) -> list[dict]: ...

    def plot_png(self) -> bytes: ...

    def describe_overhead(self) -> str: ...


class ShownLoad(Protocol):
    kind: str                   # "qps" (open loop), else closed loop or named traffic


class ShownAnswer(Protocol):
    row: dict | None

    def _repr_html_(self) -> str: ...


class ShownPlan(Protocol):
    """What the plan's views read of a ``capacity.CapacityPlan``."""
    model: str
    service: Any                # shown by its repr
    loads: Sequence[ShownLoad]
    grid: Sequence[tuple[int, int, int]]
    results: list[dict]
    slo_p99_ms: float | None
    seconds: float
    bulk: Any                   # a traffic class, or None: no bulk effect to show
    measured: Any               # tune()'s results, or None: nothing measured to compare

    def run(self, max_batch_size: int, max_queue_delay_us: int, instances: int,
            load: Any) -> dict: ...

    def best(self) -> ShownAnswer: ...

    def plot_png(self) -> bytes: ...

    def table_html(self) -> str: ...

    def bulk_effect(self) -> Any: ...       # shown by its _repr_html_

    def compare(self, measured: Any) -> Comparison: ...


class ShownBulkEffect(Protocol):
    """What the bulk effect's views read of a ``capacity.BulkEffect``."""
    bulk: str
    config: dict
    qps: float

    @property
    def rows(self) -> list[dict]: ...

COLUMNS = ("max_batch_size", "max_queue_delay_us", "instances", "load", "throughput", "p50_ms",
           "p95_ms", "p99_ms", "mean_batch", "rejected", "timeouts", "metastable")
COMPARE_COLUMNS = ("max_batch_size", "max_queue_delay_us", "concurrency", "measured_throughput",
                   "simulated_throughput", "measured_p50_ms", "simulated_p50_ms", "measured_p99_ms",
                   "simulated_p99_ms", "measured_mean_batch", "simulated_mean_batch", "simulated_range")


# ---- the service model ---------------------------------------------------------------------

def service_png(service: ShownService) -> bytes:
    """Execution time against batch size: every sample, the mean, the model's line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    sizes = sorted(service.samples)
    for b in sizes:
        ax.scatter([b] * len(service.samples[b]), [v / 1e6 for v in service.samples[b]], s=8,
                   alpha=0.35, color="tab:blue")
    ax.plot(sizes, [service.median_ns(b) / 1e6 for b in sizes], "o-", color="tab:red",
            label="median (the model's)")
    ax.plot(sizes, [r["mean_ms"] for r in service.table()], "x", color="k", label="mean")
    top = sizes[-1] * 2
    ax.plot([sizes[-1], top], [service.median_ns(sizes[-1]) / 1e6, service.median_ns(top) / 1e6],
            ":", color="tab:red", label="extrapolated")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (rows)")
    ax.set_ylabel("execution (ms)")
    ax.set_title(f"{service.model} v{service.version}: overhead {service.overhead_ns / 1e6:.2f} ms a request")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return png_bytes(fig)


def service_html(service: ShownService) -> str:
    png = base64.b64encode(service.plot_png()).decode("ascii")
    cols = ("batch_size", "n", "mean_ms", "p50_ms", "p95_ms", "max_ms", "per_row_ms")
    rows = "".join("<tr>" + "".join(f"<td>{_fmt(r[c])}</td>" for c in cols) + "</tr>"
                   for r in service.table())
    head = "".join(f"<th>{c}</th>" for c in cols)
    return (f'<div><img alt="service time" src="data:image/png;base64,{png}"/>'
            f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"
            f"<p><small>{service.method}; {html.escape(service.describe_overhead())}</small></p></div>")


# ---- the plan ------------------------------------------------------------------------------

def plan_figure(plan: ShownPlan):
    """Left: p99 (solid) and p50 (dotted) against load, one colour and marker per config
    (the legend beside the plot), a metastable row's replicas' range as a cross
    (throughput across, closed loop; p99 up). Right: the batch sizes formed at the highest
    load, one step histogram per config. A matplotlib Figure on an Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    ax, hx = fig.subplots(1, 2, gridspec_kw={"width_ratios": (3, 2)})
    top = plan.loads[-1] if plan.loads else None
    for i, (mbs, delay, inst) in enumerate(plan.grid):
        style = series_style(i)
        colour = style["color"]
        rows = [plan.run(mbs, delay, inst, load) for load in plan.loads]
        x = [r["offered"] if r["kind"] == "qps" else r["throughput"] for r in rows]
        label = f"b{mbs} d{delay}us x{inst}"
        ax.plot(x, [r["p99_ms"] for r in rows], "-", label=label, **style)
        ax.plot(x, [r["p50_ms"] for r in rows], ":", color=colour, marker=style["marker"],
                fillstyle="none")
        for xi, r in zip(x, rows):
            if r["metastable"]:
                t0, t1 = replica_range(r, "throughput") if r["kind"] != "qps" else (xi, xi)
                p0, p1 = replica_range(r, "p99_ms")
                ax.errorbar([xi], [r["p99_ms"]], xerr=[[xi - t0], [t1 - xi]],
                            yerr=[[r["p99_ms"] - p0], [p1 - r["p99_ms"]]], color=colour, capsize=3)
        if top is not None:
            hist = plan.run(mbs, delay, inst, top)["batch_histogram"]
            sizes = sorted(hist)
            hx.step(sizes, [hist[s] for s in sizes], where="mid", label=label, **style)
    if plan.slo_p99_ms is not None:
        ax.axhline(plan.slo_p99_ms, color="tab:red", linestyle="--", label=f"SLO {plan.slo_p99_ms:g} ms")
    ax.set_yscale("log")
    kinds = {l.kind for l in plan.loads}
    ax.set_xlabel("offered load (qps)" if kinds == {"qps"} else "load (qps offered / infer/s served)")
    ax.set_ylabel("latency (ms): p99 solid, p50 dotted")
    ax.set_title(f"{plan.model}: simulated latency against load"
                 + (" (crosses: metastable, the replicas' range)"
                    if any(r["metastable"] for r in plan.results) else ""))
    ax.grid(alpha=0.3)
    legend_outside(ax, fontsize=6)
    hx.set_xlabel("batch size (rows)")
    hx.set_ylabel("batches")
    hx.set_title(f"batch sizes at {top}")
    hx.grid(alpha=0.3)
    return fig


def plan_table_html(plan: ShownPlan, rows: Sequence[dict] | None = None,
                    columns: Sequence[str] = COLUMNS) -> str:
    rows = plan.results if rows is None else rows
    return table_html(rows, columns, plan.best().row if plan.results else None)


def plan_html(plan: ShownPlan) -> str:
    png = base64.b64encode(plan.plot_png()).decode("ascii")
    parts = [f"<div><h4>simulate: {html.escape(plan.model)} ({len(plan.results)} runs, "
             f"{plan.seconds:.1f} s)</h4>", plan.best()._repr_html_()]
    parts.append(f'<img alt="latency against load" src="data:image/png;base64,{png}"/>')
    parts.append(plan.table_html())
    if plan.bulk is not None:
        parts.append(plan.bulk_effect()._repr_html_())
    if plan.measured is not None:
        parts.append("<h5>measured by tune() beside simulated (closed loop)</h5>")
        parts.append(plan.compare(plan.measured)._repr_html_())
    parts.append(f"<p><small>service: {html.escape(repr(plan.service))}</small></p></div>")
    return "".join(parts)


def plan_text(plan: ShownPlan) -> str:
    lines = [f"CapacityPlan({plan.model}: {len(plan.results)} simulations in {plan.seconds:.2f} s)",
             "  ".join(f"{c:>18}" for c in COLUMNS)]
    lines += ["  ".join(f"{_show(r, c):>18}" for c in COLUMNS).rstrip() for r in plan.results]
    lines.append(f"best: {plan.best()!r}")
    return "\n".join(lines)


# ---- the bulk effect, compared rows, tables ------------------------------------------------

def bulk_effect_html(effect: ShownBulkEffect) -> str:
    cols = ("scenario", "interactive_p50_ms", "interactive_p95_ms", "interactive_p99_ms",
            "bulk_throughput", "bulk_p95_ms", "mean_batch")
    head = "".join(f"<th>{c}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(r[c]))}</td>" for c in cols) + "</tr>"
                   for r in effect.rows)
    return (f"<h5>interactive {effect.qps:g} qps with and without '{html.escape(effect.bulk)}' "
            f"({html.escape(knobs_text(effect.config))})</h5>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def bulk_effect_text(effect: ShownBulkEffect) -> str:
    return "\n".join(f"{r['scenario']:>45}: interactive p95 {r['interactive_p95_ms']:.2f} ms, "
                     f"bulk {r['bulk_throughput']:.0f} infer/s" for r in effect.rows)


class Comparison(list):
    """``compare``'s rows (dicts, measured beside simulated) shown as a table, with ``notes``:
    the compared configs whose simulations are within noise of each other."""

    def __init__(self, rows: list[dict], notes: list[str]) -> None:
        super().__init__(rows)
        self.notes = notes

    def _repr_html_(self) -> str:
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in self.notes)
        return (table_html(self, COMPARE_COLUMNS)
                + (f"<p><small>within noise:</small></p><ul>{notes}</ul>" if notes else ""))

    def __repr__(self) -> str:
        if not self:
            return "Comparison(no measured row without failures)"
        width = [max(len(c), *(len(_show(r, c)) for r in self)) for c in COMPARE_COLUMNS]
        lines = ["  ".join(c.rjust(w) for c, w in zip(COMPARE_COLUMNS, width))]
        lines += ["  ".join(_show(r, c).rjust(w) for c, w in zip(COMPARE_COLUMNS, width)).rstrip()
                  for r in self]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

    def to_dataframe(self):
        """The rows as a pandas DataFrame (pandas is not a dependency: install it for this)."""
        import pandas as pd
        return pd.DataFrame([{c: r.get(c) for c in COMPARE_COLUMNS} for r in self])


def table_html(rows: Sequence[dict], columns: Sequence[str], bold: dict | None = None) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for r in rows:
        style = ' style="font-weight:bold"' if r is bold else ""
        body.append(f"<tr{style}>" + "".join(f"<td>{html.escape(_show(r, c))}</td>" for c in columns)
                    + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _show(row: dict, column: str) -> str:
    """A table's cell: a metastable row's replica ranges in words under ``metastable``."""
    if column == "metastable":
        return describe_range(row)
    return _cell(row.get(column))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return "" if value is None else str(value)


def knobs_text(config: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in config.items())


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)
