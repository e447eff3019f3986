"""Planning by input length (issue 36): which ``length_buckets``, ``max_batch_tokens`` and
``max_queue_delay_microseconds`` (config/padding.py) serve a corpus's lengths within a p99
target, answered by the engine's own padding batcher on a virtual clock.

``simulate(model, concurrency=... or qps=..., lengths=<texts or token counts>,
slo_p99_ms=...)`` turns ``lengths`` into token counts (``token_counts``: texts through the
``tokenizer`` given, else split on whitespace), measures the served model's execution per
(batch size, padded length) on a small grid (``length_service``), and simulates every candidate:
buckets from the distribution's quantiles and doublings (or those given), budgets from its
quantiles times max_batch_size, a few delays, and the model without padding (Triton's
semantics: only equal lengths batch). Each simulated request draws its length from the
distribution; a batch mixes only lengths of one bucket, padded to its longest member, within
the budget (a longer request alone), and runs for the (batch, padded length) service model's
time. The ``LengthPlan`` shows every candidate's throughput, p50/p99, mean batch and padding
waste (padded tokens / real tokens), the one chosen for the target, and its config as text.
"""
from __future__ import annotations

import copy
import html
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, Sequence

from ..config.formats import config_from_json
from ..config.padding import BUCKETS, BUDGET, MAX_LENGTH, MODE, PAD, padding
from ..engine.batching import simulation as sim
from ..progress import progress as show_progress
from ..protocol.errors import InvalidArgument
from . import traffic as tr
from .capacity import CapacityPlan, Load
from .length_service import LengthService
from .render import table_html
from .rows import summarize

#: texts or counts a distribution may hold (a corpus larger than this: pass a sample)
MAX_LENGTHS = 1_000_000
#: delays tried unless given (with the model's own)
DELAYS_US = (0, 1000, 4000)
COLUMNS = ("padding", "length_buckets", "max_batch_tokens", "max_queue_delay_us", "load", "throughput",
           "p50_ms", "p99_ms", "mean_batch", "waste", "meets")


def token_counts(lengths: Any, tokenizer: Any = None) -> list[int]:
    """Token counts from ``lengths``: a list of texts (``str``: counted by ``tokenizer`` when
    given, a ``transformers`` tokenizer, anything with ``encode`` or a callable returning ids
    or a count; else split on whitespace; an empty text counts 1, as a request of it would
    carry at least one token) or of token counts (whole numbers >= 1), mixed or not."""
    if isinstance(lengths, (str, bytes, dict)) or not hasattr(lengths, "__len__"):
        raise InvalidArgument(f"simulate: lengths must be a list of texts or token counts, not "
                              f"{type(lengths).__name__}")
    if not len(lengths):
        raise InvalidArgument("simulate: lengths is empty: give the texts (or their token counts) "
                              "the model will see")
    if len(lengths) > MAX_LENGTHS:
        raise InvalidArgument(f"simulate: lengths holds {len(lengths)} items, at most {MAX_LENGTHS}: "
                              f"pass a random sample of the corpus")
    out = []
    for i, item in enumerate(lengths):
        if isinstance(item, str):
            out.append(max(1, _count(item, tokenizer)))
            continue
        if isinstance(item, bool) or not hasattr(item, "__index__") and not isinstance(item, float):
            raise InvalidArgument(f"simulate: lengths[{i}] is {type(item).__name__}: give texts (str) "
                                  f"or token counts (whole numbers)")
        value = float(item)
        if value != value or value != int(value) or value < 1:
            raise InvalidArgument(f"simulate: lengths[{i}] is {item!r}: a token count is a whole "
                                  f"number >= 1")
        out.append(int(value))
    return out


def _count(text: str, tokenizer: Any) -> int:
    if tokenizer is None:
        return len(text.split())
    ids = tokenizer.encode(text) if hasattr(tokenizer, "encode") else tokenizer(text)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return int(ids) if isinstance(ids, int) else len(ids)


def quantile(sorted_lengths: Sequence[int], q: float) -> int:
    return sorted_lengths[min(len(sorted_lengths) - 1, int(q * len(sorted_lengths)))]


def bucket_candidates(lengths: Sequence[int]) -> list[tuple[int, ...]]:
    """One bucket; the median and p90 as bounds; the quartiles and p95; doublings from 16
    (each without bounds at or past the longest length: the last bucket holds those)."""
    s = sorted(lengths)
    top = s[-1]

    def clean(bounds: Sequence[int]) -> tuple[int, ...]:
        return tuple(sorted({int(b) for b in bounds if 1 <= b < top}))
    doubling, b = [], 16
    while b < top:
        doubling.append(b)
        b *= 2
    out: list[tuple[int, ...]] = [()]
    for bounds in (clean([quantile(s, 0.5), quantile(s, 0.9)]),
                   clean([quantile(s, q) for q in (0.25, 0.5, 0.75, 0.95)]), clean(doubling)):
        if bounds and bounds not in out:
            out.append(bounds)
    return out


def budget_candidates(lengths: Sequence[int], max_batch_size: int) -> list[int]:
    """None (0), and max_batch_size rows of the median and of the p90 length, in 64s."""
    s = sorted(lengths)
    out = [0]
    for q in (0.5, 0.9):
        budget = -(-max_batch_size * quantile(s, q) // 64) * 64
        if budget not in out:
            out.append(budget)
    return out


@dataclass(frozen=True)
class Candidate:
    padded: bool
    buckets: tuple[int, ...]
    budget: int
    delay_us: int

    def parameters(self) -> dict[str, str]:
        if not self.padded:
            return {}
        out = {MODE: PAD}
        if self.buckets:
            out[BUCKETS] = ",".join(map(str, self.buckets))
        if self.budget:
            out[BUDGET] = str(self.budget)
        return out


class LengthPlan:
    """Every candidate simulated at every load (``results``), the one ``chosen`` for the p99
    target and why, shown as a table (``_repr_html_``) and as config text (``config_text``)."""

    def __init__(self, model: str, base_config: dict, service: LengthService, lengths: list[int],
                 loads: list[Load], candidates: list[Candidate], *, slo_p99_ms: float | None = None,
                 requests: int = tr.DEFAULT_REQUESTS, seed: int = 0, stalls: bool = True,
                 progress: bool = False) -> None:
        self.model, self.service, self.lengths, self.loads = model, service, lengths, loads
        self.candidates, self.slo_p99_ms = candidates, slo_p99_ms
        self.requests, self.seed, self.stalls = requests, seed, stalls
        self._base = base_config
        started = time.perf_counter()
        runs = [(c, load) for c in candidates for load in loads]
        self.results: list[dict] = []
        with show_progress(len(runs), f"simulate {model} by length", progress) as bar:
            for c, load in runs:
                bar.update(len(self.results), f"{_label(c)}: {load}")
                self.results.append(self.run(c, load))
        self.seconds = time.perf_counter() - started
        self.chosen, self.why = self._choose()

    def config(self, candidate: Candidate) -> dict:
        """The model's config (JSON, as the server returned it) with this candidate's knobs."""
        config = copy.deepcopy(self._base)
        params = {k: v for k, v in (config.get("parameters") or {}).items() if k not in (MODE, BUCKETS, BUDGET)}
        params.update({k: {"string_value": v} for k, v in candidate.parameters().items()})
        config["parameters"] = params
        batching = dict(config.get("dynamic_batching") or {})
        batching["max_queue_delay_microseconds"] = candidate.delay_us
        config["dynamic_batching"] = batching
        return config

    def _traffic(self, load: Load, seed: int) -> list:
        rng = random.Random(f"lengths/{seed}")
        drawn = [rng.choice(self.lengths) for _ in range(self.requests)]
        if load.kind == "qps":
            return [sim.Arrival(a.t_ns, length=n) for a, n in
                    zip(tr.poisson(load.value, self.requests, seed=seed), drawn)]
        return [sim.ClosedLoop(int(load.value), self.requests, lengths=tuple(drawn))]

    def run(self, candidate: Candidate, load: Load) -> dict:
        """One candidate at one load: the simulation's figures and its padding waste."""
        config = config_from_json(self.config(candidate), self._base.get("name", self.model))
        base = self.service.base
        stalled = self.stalls and bool(base.stall_ns)
        hold_ns, hold_rate = base.holds()
        loop = {"loop_ns": base.loop_ns, "loop_batch_ns": base.loop_batch_ns} if base.loop_ns else {}
        result = sim.simulate(config, self.service, self._traffic(load, self.seed), seed=self.seed,
                              overhead_ns=base.parallel_ns, jitter_ns=base.jitter_ns(),
                              stagger_ns=base.parallel_ns + base.loop_ns + int(self.service.median_ns(1, 1)),
                              stall_ns=base.stall_ns if stalled else (), stall_rate=base.stall_rate,
                              stall_chance=base.stall_chance if stalled else 0.0,
                              hold_ns=hold_ns, hold_rate=hold_rate, **loop)
        row = summarize(result)
        padded = sum(p for p, _ in result.tokens)
        real = sum(r for _, r in result.tokens)
        row.update(padding="pad" if candidate.padded else "none",
                   length_buckets=",".join(map(str, candidate.buckets)) if candidate.buckets else "-",
                   max_batch_tokens=candidate.budget, max_queue_delay_us=candidate.delay_us,
                   load=str(load), kind=load.kind, offered=load.value,
                   waste=padded / real if real else float("nan"), candidate=candidate)
        row["meets"] = self.kept_up(row) and (self.slo_p99_ms is None or row["p99_ms"] <= self.slo_p99_ms)
        return row

    kept_up = staticmethod(CapacityPlan.kept_up)

    def _choose(self) -> tuple[dict | None, str]:
        """At the highest load some candidate meets the target at, the one serving the most
        (closed loop: throughput; open loop: every one that keeps up serves the same), then
        the lowest p99, then the least waste."""
        ok = [r for r in self.results if r["meets"]]
        target = "" if self.slo_p99_ms is None else f" within p99 {self.slo_p99_ms:g} ms"
        if not ok:
            low = min(self.results, key=lambda r: r["p99_ms"])
            return None, (f"no candidate serves {low['load']}{target}: the lowest p99 is "
                          f"{low['p99_ms']:.2f} ms ({_label(low['candidate'])})")
        top = max(r["offered"] for r in ok)
        at_top = [r for r in ok if r["offered"] == top]
        served = (lambda r: round(r["throughput"], -1)) if at_top[0]["kind"] == "concurrency" else (lambda r: 0)
        row = max(at_top, key=lambda r: (served(r), -r["p99_ms"], -(r["waste"] if r["waste"] == r["waste"] else 9)))
        return row, (f"{_label(row['candidate'])} serves {row['load']}{target}: {row['throughput']:.0f} "
                     f"infer/s, p99 {row['p99_ms']:.2f} ms, mean batch {row['mean_batch']:.1f}, "
                     f"padding waste {row['waste']:.2f}")

    def config_text(self, row: dict | None = None) -> str:
        """The chosen (or ``row``'s) settings as config.pbtxt lines to put in the model's config."""
        row = row or self.chosen
        if row is None:
            return f"# {self.why}\n"
        c: Candidate = row["candidate"]
        lines = [f"dynamic_batching {{ max_queue_delay_microseconds: {c.delay_us} }}"]
        lines += [f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}'
                  for k, v in c.parameters().items()]
        return "\n".join(lines) + "\n"

    def _repr_html_(self) -> str:
        parts = [f"<div><h4>simulate {html.escape(self.model)} by length ({len(self.results)} runs, "
                 f"{self.seconds:.1f} s)</h4>", f"<p><b>{html.escape(self.why)}</b></p>",
                 f"<p>lengths: {html.escape(describe_lengths(self.lengths))}</p>",
                 table_html(self.results, COLUMNS, self.chosen),
                 f"<pre>{html.escape(self.config_text())}</pre>",
                 f"<p><small>{html.escape(self.service.describe())}; "
                 f"{html.escape(self.service.base.describe_overhead())}</small></p></div>"]
        return "".join(parts)

    def __repr__(self) -> str:
        lines = [f"LengthPlan({self.model}: {len(self.results)} simulations in {self.seconds:.2f} s; "
                 f"{describe_lengths(self.lengths)})", "  ".join(f"{c:>18}" for c in COLUMNS)]
        lines += ["  ".join(f"{_cell(r.get(c)):>18}" for c in COLUMNS).rstrip() for r in self.results]
        lines += [f"chosen: {self.why}", self.config_text().rstrip()]
        return "\n".join(lines)


def _cell(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _label(c: Candidate) -> str:
    if not c.padded:
        return f"no padding, delay {c.delay_us} us"
    return (f"buckets {','.join(map(str, c.buckets)) or 'one'}, max_batch_tokens {c.budget or 'none'}, "
            f"delay {c.delay_us} us")


def describe_lengths(lengths: Sequence[int]) -> str:
    s = sorted(lengths)
    return (f"{len(s)} requests, median {quantile(s, 0.5)}, p90 {quantile(s, 0.9)}, p99 {quantile(s, 0.99)}, "
            f"max {s[-1]} tokens, mean {statistics.fmean(s):.1f}")


def candidates_for(lengths: list[int], base_config: dict, buckets: Sequence[Sequence[int]] | None,
                   budgets: Sequence[int] | None, delays: Sequence[int] | None) -> list[Candidate]:
    """Every combination of the buckets, budgets and delays (given, or from the distribution),
    and the model without padding at each delay."""
    mbs = int(base_config.get("max_batch_size", 0) or 0)
    own = int((base_config.get("dynamic_batching") or {}).get("max_queue_delay_microseconds", 0) or 0)
    bucket_sets = [tuple(int(b) for b in bs) for bs in buckets] if buckets is not None else bucket_candidates(lengths)
    budget_set = [int(b) for b in budgets] if budgets is not None else budget_candidates(lengths, mbs)
    delay_set = sorted({int(d) for d in delays} if delays is not None else {own, *DELAYS_US})
    if not bucket_sets or not budget_set or not delay_set:
        raise InvalidArgument("simulate: length_buckets, max_batch_tokens and max_queue_delay_us need "
                              "a value each")
    if min(budget_set) < 0 or min(delay_set) < 0:
        raise InvalidArgument("simulate: max_batch_tokens and max_queue_delay_us must be >= 0")
    for bs in bucket_sets:
        if any(b < 1 for b in bs) or list(bs) != sorted(set(bs)):
            raise InvalidArgument(f"simulate: length_buckets {list(bs)} must be increasing lengths >= 1")
    out = [Candidate(True, bs, budget, d) for d in delay_set for bs in bucket_sets for budget in budget_set]
    return out + [Candidate(False, (), 0, d) for d in delay_set]


def plan_by_length(name: str, base: dict, service: LengthService, lengths: list[int], loads: list[Load],
                   *, buckets: Sequence[Sequence[int]] | None = None, budgets: Sequence[int] | None = None,
                   delays: Sequence[int] | None = None, **options: Any) -> LengthPlan:
    """Check that the model can pad and the lengths fit it, then simulate every candidate."""
    candidates = candidates_for(lengths, base, buckets, budgets, delays)
    if len(candidates) * len(loads) > 400:
        raise InvalidArgument(f"simulate: {len(candidates) * len(loads)} simulations; at most 400 "
                              f"(fewer buckets, budgets, delays or loads)")
    probe = copy.deepcopy(base)
    probe.setdefault("parameters", {})[MODE] = {"string_value": PAD}
    rules = padding(config_from_json(probe, name))       # InvalidArgument where it cannot pad
    limit = rules.max_length if rules is not None else 0
    if limit and max(lengths) > limit:
        over = sum(n > limit for n in lengths)
        raise InvalidArgument(f"simulate '{name}': {over} of the lengths exceed the model's "
                              f"{MAX_LENGTH} {limit}: the server refuses them (400); truncate them first")
    return LengthPlan(name, base, service, lengths, loads, candidates, **options)


def measure_grid(lengths: Sequence[int], max_batch_size: int) -> tuple[list[int], list[int]]:
    """The (batch sizes, lengths) measured by default: 1, a quarter and all of max_batch_size;
    the shortest, median, p90 and longest lengths."""
    s = sorted(lengths)
    batches = sorted({1, max(1, max_batch_size // 4), max_batch_size})
    grid = sorted({s[0], quantile(s, 0.5), quantile(s, 0.9), s[-1]})
    return batches, grid

