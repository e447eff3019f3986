"""What the dashboard shows, computed from two snapshots of Triton's statistics JSON.

Triton's statistics are cumulative counters, so rates and averages over the last interval
are deltas of two snapshots. ``dashboard.js`` computes the same figures in the browser
(when it fetches the statistics itself); keep the two in step.
"""
from __future__ import annotations

import html
import math
import threading
from dataclasses import dataclass, field

COMPUTE_PHASES = ("compute_input", "compute_infer", "compute_output")
#: the latency histograms (the statistics' ``latency_histograms``) the dashboard shows
LATENCY_SHOWN = ("request", "queue", "compute_infer")
#: what it says where the server keeps none
HISTOGRAMS_OFF = "enable histogram_latencies for percentiles"


@dataclass
class Snapshot:
    """One reading of ``GET v2/models/stats``: ``t`` in seconds, ``pending`` from /metrics
    (``nv_inference_pending_request_count`` per "name/version"; None when unreachable);
    ``logs``: the model's last log lines when read (None: not read this time)."""
    t: float
    model_stats: list[dict]
    pending: dict[str, int] | None = None
    logs: list[dict] | None = None
    # an ensemble's graph by name (``ensemble_graph`` of its config), and the statistics of
    # the models its steps run on that ``model_stats`` lacks (a one-model dashboard)
    graphs: dict[str, dict] = field(default_factory=dict)
    composing: list[dict] = field(default_factory=list)
    # a one-model dashboard: its shadow report (``GET v2/models/{m}/shadow``), None: none ran
    shadow: dict | None = None

    def to_json(self) -> dict:
        return {"t": self.t, "model_stats": self.model_stats, "pending": self.pending,
                "graphs": self.graphs, "composing": self.composing, "shadow": self.shadow}


def ensemble_graph(config: dict) -> dict:
    """What the dashboard draws of an ensemble's config (``GET v2/models/{m}/config``): its
    inputs and outputs, and each step's model with its input and output maps (dashboard.js's
    ensembleGraph)."""
    steps = (config.get("ensemble_scheduling") or {}).get("step") or []
    return {"inputs": [t["name"] for t in config.get("input") or []],
            "outputs": [t["name"] for t in config.get("output") or []],
            "steps": [{"step": i + 1, "model": s.get("model_name", ""),
                       "inputs": s.get("input_map") or {}, "outputs": s.get("output_map") or {}}
                      for i, s in enumerate(steps)]}


@dataclass
class StepFigures:
    """One step of an ensemble (its ``ensemble_steps`` statistics)."""
    step: int
    model: str
    version: str
    mean_us: float | None            # mean time of the step's runs (over ``mean_window``)
    runs: int                        # cumulative successful runs
    failures: int                    # cumulative failed runs
    # what ``mean_us`` is over: "interval" (the runs since the last reading) or "since load"
    # (no run since the last reading: every run so far, so an idle step still shows its time)
    mean_window: str = "interval"

    @property
    def label(self) -> str:
        return f"step {self.step} {self.model} v{self.version}"

    def mean_text(self, unit: str = " us") -> str:
        """Its mean time, and over what when the step is idle."""
        if self.mean_window == "interval" or self.mean_us is None:
            return _fmt(self.mean_us, unit)
        return f"{_fmt(self.mean_us, unit)} (mean of {self.runs} runs since load)"


@dataclass
class ModelFigures:
    name: str
    version: str
    inferences_per_s: float          # inference_count delta / dt (batch elements)
    requests_per_s: float            # successful requests delta / dt
    queue_us: float | None           # mean queue time per request over the interval
    compute_us: float | None         # mean compute_input + infer + output per request
    failures: int                    # cumulative failed requests
    inference_count: int
    execution_count: int
    batch_sizes: dict[int, int] = field(default_factory=dict)   # batch size -> executions
    pending: int | None = None
    # decoupled models (their statistics have response_stats), over the interval:
    decoupled: bool = False
    responses_per_request: float | None = None   # responses sent (success + fail) per request
    first_response_us: float | None = None       # mean queue + time to response 0 per request
    steps: list[StepFigures] = field(default_factory=list)   # an ensemble's steps
    # p50/p95/p99 (ms, None: nothing finished), count and window (what they are over, in
    # words: LatencyWindows) per kind of LATENCY_SHOWN; None where the server keeps no histograms
    latency: dict[str, dict] | None = None
    # seconds from the last request's end to this reading (the statistics' last_inference);
    # None before the first request
    last_request_s: float | None = None
    # ragged_batching "pad": tokens the padded batches held / tokens the requests sent, over
    # the interval (since load where nothing ran in it); None where the model does not pad
    padding_waste: float | None = None

    @property
    def key(self) -> str:
        return f"{self.name}/{self.version}"


def _count(stats: dict, phase: str) -> tuple[int, int]:
    d = stats.get("inference_stats", {}).get(phase, {})
    return int(d.get("count", 0)), int(d.get("ns", 0))


def batch_histogram(stats: dict) -> dict[int, int]:
    """Executions per batch size, from ``batch_stats`` (``compute_infer.count`` per size)."""
    hist = {}
    for row in stats.get("batch_stats", []):
        n = int(row.get("compute_infer", {}).get("count", 0))
        if n:
            hist[int(row["batch_size"])] = n
    return dict(sorted(hist.items()))


def padding_waste(prev: dict | None, cur: dict) -> float | None:
    """Padded tokens over request tokens (the statistics' ``padding``): over the interval
    where both readings have them and the model ran, else since the model was loaded."""
    now = cur.get("padding")
    if not now:
        return None
    before = (prev or {}).get("padding") or {}
    padded = int(now.get("batch_tokens", 0)) - int(before.get("batch_tokens", 0))
    sent = int(now.get("request_tokens", 0)) - int(before.get("request_tokens", 0))
    if sent > 0:
        return padded / sent
    total = int(now.get("request_tokens", 0))
    return int(now.get("batch_tokens", 0)) / total if total > 0 else None


def response_counts(stats: dict) -> tuple[int, int, int]:
    """(responses sent, first responses, their ns) from Triton's ``response_stats``: per
    response index, ``success`` and ``fail`` count the responses that carried something
    (``empty_response`` is the final flag alone, ``cancel`` a response nobody read)."""
    sent = first = first_ns = 0
    for index, row in (stats.get("response_stats") or {}).items():
        for kind in ("success", "fail"):
            d = row.get(kind, {})
            sent += int(d.get("count", 0))
            if str(index) == "0":
                first += int(d.get("count", 0))
                first_ns += int(d.get("ns", 0))
    return sent, first, first_ns


def step_figures(prev: dict | None, cur: dict, usable: bool) -> list[StepFigures]:
    """An ensemble's steps: each one's mean time over the interval (every run's since load
    where none ran in it), its runs and failures."""
    earlier = {int(s.get("step", 0)): s for s in ((prev or {}).get("ensemble_steps") or [])}
    out = []
    for s in cur.get("ensemble_steps") or []:
        index = int(s.get("step", 0))
        ok, p = s.get("success", {}), earlier.get(index, {}).get("success", {})
        runs, ns = int(ok.get("count", 0)), int(ok.get("ns", 0))
        d_runs = runs - int(p.get("count", 0)) if usable else 0
        d_ns = ns - int(p.get("ns", 0)) if usable else 0
        if d_runs > 0:
            mean, window = d_ns / d_runs / 1e3, "interval"
        else:
            mean, window = (ns / runs / 1e3 if runs > 0 else None), "since load"
        out.append(StepFigures(index, str(s.get("model", "")), str(s.get("version", "")), mean, runs,
                               int(s.get("fail", {}).get("count", 0)), window))
    return out


class LatencyWindows:
    """The recent past of each model version's latency histograms, as a dashboard polls: one
    protocol/quantiles.py ``RecentQuantiles`` per version and kind, fed the cumulative buckets
    of every reading (the window is the dashboard's readings, so it needs no state on the
    server). A dashboard opened after traffic stopped still shows the last requests: until
    its first reading is ``seconds`` old the window runs from the version's load (every
    request it served), then over the last ``seconds``; a window that emptied (no request in
    the last ``seconds``) keeps the figures of the last requests it had. Each result says in
    words what it is over (``window``). A reload (counts going down) starts again from zero."""

    def __init__(self, seconds: float = 60.0) -> None:
        self.seconds = seconds
        # (version, kind) -> (its RecentQuantiles, the last total, when its window started,
        # the last figures that counted a request)
        self._windows: dict[tuple[str, str], tuple[object, int, float, dict | None]] = {}
        self._lock = threading.Lock()     # the poller's thread and refresh() both read

    def quantiles(self, key: str, stats: dict, now: float) -> dict[str, dict] | None:
        """{kind: {"p50", "p95", "p99": ms or None, "count": n, "window": words}}; None
        without histograms."""
        kept = stats.get("latency_histograms")
        if not kept:
            return None
        with self._lock:
            return self._quantiles(key, kept, now)

    def _quantiles(self, key: str, kept: dict, now: float) -> dict[str, dict]:
        from ..protocol.quantiles import RecentQuantiles
        out = {}
        for kind in LATENCY_SHOWN:
            h = kept.get(kind)
            if not h:
                continue
            cumulative = list(zip([*map(float, h["bounds_ms"]), math.inf], map(int, h["cumulative"])))
            total = cumulative[-1][1] if cumulative else 0
            window, last_total, started, last = self._windows.get((key, kind), (None, 0, now, None))
            if window is None or total < last_total:
                # from the load on: zero counts first (kept as the window's base until the
                # first reading is ``seconds`` old)
                window, started, last = RecentQuantiles(self.seconds), now, None
                window.add([(b, 0) for b, _ in cumulative], now)
            q = window.add(cumulative, now)
            q = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in q.items()}
            minute = _span(self.seconds)
            if q["count"]:
                q["window"] = (f"{q['count']} since load" if now - started < self.seconds
                               else f"{q['count']} in the last {minute}")
                last = q
            elif last is not None:      # traffic stopped: the last requests' figures, said so
                q = {**last, "window": f"the last {last['count']}, none in the last {minute}"}
            else:
                q["window"] = "no requests yet"
            self._windows[(key, kind)] = (window, total, started, last)
            out[kind] = q
        return out


def _span(seconds: float) -> str:
    return "minute" if seconds == 60 else f"{seconds:g} s"


def model_figures(prev: dict | None, cur: dict, dt: float, pending: int | None = None) -> ModelFigures:
    """Figures of one model: rates and means over ``dt`` seconds since ``prev`` (the same
    model's earlier statistics; None, or counters that went down after a reload, give no
    rates)."""
    usable = prev is not None and dt > 0 and int(cur.get("inference_count", 0)) >= int(prev.get("inference_count", 0))

    def delta(phase: str) -> tuple[int, int]:
        if not usable:
            return 0, 0
        (c1, ns1), (c0, ns0) = _count(cur, phase), _count(prev, phase)
        return c1 - c0, ns1 - ns0

    d_success, _ = delta("success")
    d_queue, d_queue_ns = delta("queue")
    d_compute, _ = delta("compute_infer")
    d_compute_ns = sum(delta(p)[1] for p in COMPUTE_PHASES)
    d_inferences = int(cur.get("inference_count", 0)) - int(prev.get("inference_count", 0)) if usable else 0
    decoupled = bool(cur.get("response_stats"))
    per_request = first_us = None
    if decoupled and usable:
        (sent1, first1, ns1), (sent0, first0, ns0) = response_counts(cur), response_counts(prev)
        d_requests = d_success + delta("fail")[0]
        if d_requests > 0:
            per_request = (sent1 - sent0) / d_requests
        if first1 > first0:
            first_us = (ns1 - ns0) / (first1 - first0) / 1e3 + (d_queue_ns / d_queue / 1e3 if d_queue > 0 else 0.0)
    return ModelFigures(
        name=str(cur.get("name", "")), version=str(cur.get("version", "")),
        inferences_per_s=d_inferences / dt if usable else 0.0,
        requests_per_s=d_success / dt if usable else 0.0,
        queue_us=d_queue_ns / d_queue / 1e3 if d_queue > 0 else None,
        compute_us=d_compute_ns / d_compute / 1e3 if d_compute > 0 else None,
        failures=_count(cur, "fail")[0],
        inference_count=int(cur.get("inference_count", 0)),
        execution_count=int(cur.get("execution_count", 0)),
        batch_sizes=batch_histogram(cur), pending=pending, decoupled=decoupled,
        responses_per_request=per_request, first_response_us=first_us,
        steps=step_figures(prev, cur, usable),
        padding_waste=padding_waste(prev if usable else None, cur))


def last_request_s(stats: dict, now: float) -> float | None:
    """Seconds from the last request's end (the statistics' ``last_inference``, ms since the
    epoch) to ``now``; None before the first one."""
    last = int(stats.get("last_inference", 0) or 0)
    return max(0.0, now - last / 1e3) if last > 0 else None


def figures(prev: Snapshot | None, cur: Snapshot, windows: LatencyWindows | None = None) -> list[ModelFigures]:
    """Figures of every model in ``cur``, matched with ``prev`` by name and version;
    percentiles over ``windows`` (the dashboard's; without it, since the first reading)."""
    windows = windows or LatencyWindows()
    earlier = {f"{m.get('name')}/{m.get('version')}": m for m in (prev.model_stats if prev else [])}
    dt = cur.t - prev.t if prev else 0.0
    out = []
    for m in cur.model_stats:
        key = f"{m.get('name')}/{m.get('version')}"
        pending = cur.pending.get(key) if cur.pending is not None else None
        f = model_figures(earlier.get(key), m, dt, pending)
        f.latency = windows.quantiles(key, m, cur.t)
        f.last_request_s = last_request_s(m, cur.t)
        out.append(f)
    return out


def parse_pending(metrics_text: str) -> dict[str, int]:
    """``nv_inference_pending_request_count`` per "model/version" from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families
    pending = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "nv_inference_pending_request_count":
            continue
        for sample in family.samples:
            labels = sample.labels
            pending[f"{labels.get('model')}/{labels.get('version')}"] = int(sample.value)
    return pending


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "–"
    return f"{value:,.1f}{unit}" if value < 100 else f"{value:,.0f}{unit}"


def latency_text(f: ModelFigures, unit: str = " ms") -> list[str]:
    """One line per kind: its percentiles and what they are over (or why there are none)."""
    if f.latency is None:
        return [HISTOGRAMS_OFF]
    return [f"{kind} p50 {_fmt(q['p50'], unit)} · p95 {_fmt(q['p95'], unit)} · p99 {_fmt(q['p99'], unit)}"
            f" ({q['window']})" for kind, q in f.latency.items()]


def padding_text(f: ModelFigures) -> str:
    """The padding line ("" where the model does not pad)."""
    if f.padding_waste is None:
        return ""
    return f"padding waste {f.padding_waste:.2f} (padded tokens / request tokens)"


def last_request_text(f: ModelFigures) -> str:
    """When the last request ended, as the dashboard says it ("" before the first)."""
    if f.last_request_s is None:
        return ""
    return f"last request {_ago(f.last_request_s)}"


def _ago(seconds: float) -> str:
    if seconds < 1:
        return "just now"
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    return f"{seconds / 60:.0f} min ago" if seconds < 7200 else f"{seconds / 3600:.0f} h ago"


def log_line(e: dict) -> str:
    """One line of the logs tab, as ``handle.logs()`` prints it."""
    version = f"v{e.get('version')} " if e.get("version") else ""
    return f"{e.get('time', '')} {version}{e.get('level', ''):<7} [{e.get('source', '')}] {e.get('message', '')}"


def text_table(rows: list[ModelFigures]) -> str:
    """A plain-text overview (what front ends without widgets show)."""
    streams = any(f.decoupled for f in rows)
    head = f"{'model':<24}{'ver':>4}{'inf/s':>9}{'req/s':>9}{'queue us':>10}{'compute us':>12}" \
           f"{'pending':>9}{'failed':>8}" + (f"{'resp/req':>10}{'1st resp us':>13}" if streams else "") \
           + "  batch sizes"
    lines = [head]
    for f in rows:
        hist = " ".join(f"{b}:{n}" for b, n in f.batch_sizes.items()) or "-"
        pending = "-" if f.pending is None else str(f.pending)
        stream = f"{_fmt(f.responses_per_request):>10}{_fmt(f.first_response_us):>13}" if streams else ""
        lines.append(f"{f.name:<24}{f.version:>4}{_fmt(f.inferences_per_s):>9}{_fmt(f.requests_per_s):>9}"
                     f"{_fmt(f.queue_us):>10}{_fmt(f.compute_us):>12}{pending:>9}{f.failures:>8}{stream}  {hist}")
        lines += [f"  {s.label:<26} {s.mean_text():>10}  {s.runs} runs, {s.failures} failed"
                  for s in f.steps]
        lines += [f"  {padding_text(f)}"] if f.padding_waste is not None else []
        lines += [f"  {last_request_text(f)}"] if f.last_request_s is not None else []
        lines += [f"  {line}" for line in latency_text(f)] if f.latency is not None else []
    if rows and all(f.latency is None for f in rows):
        lines.append(HISTOGRAMS_OFF)
    return "\n".join(lines)


def html_table(rows: list[ModelFigures], title: str = "Triton models") -> str:
    """The same overview as an HTML table (static: nbviewer, GitHub, nbval outputs)."""
    streams = any(f.decoupled for f in rows)
    cols = ("model", "version", "inf/s", "req/s", "queue µs", "compute µs", "pending", "failed") \
        + (("responses/req", "1st response µs") if streams else ()) + ("batch sizes",)
    body = []
    for f in rows:
        hist = " ".join(f"{b}×{n}" for b, n in f.batch_sizes.items()) or "–"
        stream = (_fmt(f.responses_per_request), _fmt(f.first_response_us)) if streams else ()
        cells = (f.name, f.version, _fmt(f.inferences_per_s), _fmt(f.requests_per_s), _fmt(f.queue_us),
                 _fmt(f.compute_us), "–" if f.pending is None else str(f.pending), str(f.failures),
                 *stream, hist)
        body.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
        for step in f.steps:
            text = f"{step.label}: {step.mean_text(' µs')}, {step.runs} runs, {step.failures} failed"
            body.append(f"<tr class='jt-step'><td></td><td colspan='{len(cols) - 1}'>"
                        f"{html.escape(text)}</td></tr>")
        if f.latency is not None or f.last_request_s is not None or f.padding_waste is not None:
            lines = (latency_text(f) if f.latency is not None else []) + \
                ([padding_text(f)] if f.padding_waste is not None else []) + \
                ([last_request_text(f)] if f.last_request_s is not None else [])
            body.append(f"<tr class='jt-latency'><td></td><td colspan='{len(cols) - 1}'>"
                        + "<br>".join(html.escape(line) for line in lines) + "</td></tr>")
    if rows and all(f.latency is None for f in rows):
        body.append(f"<tr class='jt-latency'><td colspan='{len(cols)}'>{HISTOGRAMS_OFF}</td></tr>")
    return (f"<table class='jt-static'><caption>{html.escape(title)}</caption><thead><tr>"
            + "".join(f"<th>{c}</th>" for c in cols) + "</tr></thead><tbody>" + "".join(body)
            + "</tbody></table>")

