"""A ``[batch, length]`` model's execution time per (batch size, padded length), measured
through the protocol (``measure_lengths``) and kept as a ``LengthService``: what the simulation
draws for a padded batch (``engine.simulation``: ``service(rows, rng, length)``).

The grid is small (a few batch sizes times a few lengths): each cell is sent at c=1, one
request of ``batch`` rows each ``length`` tokens long (every variable dimension that long, the
values 1), and its execution is the delta of the server's ``compute_input + compute_infer +
compute_output``, as ``sweep`` reads it. Between and beyond the cells the execution is fitted
as ``a + b * batch * length + c * batch * length**2`` (an encoder's work per token, and its
attention's per pair of tokens), by least squares on the cells' medians weighted by their
inverse (so a short cell's error counts as much as a long one's), with no negative term; each
draw is that times a ratio drawn from every sample's ratio to its cell's median. What lies
outside the model (the client's and the server's overhead, the event loop, the hand-off,
stalls) comes from ``measure``'s c=1 sweep and bursts on the same model (``base``).
"""
from __future__ import annotations

import http.client
import itertools
import random
import statistics
import time
from dataclasses import dataclass, field
from urllib.parse import quote, urlsplit

import numpy as np

from ..protocol.errors import InvalidArgument, Unavailable
from ..kernel.client import TritonHTTP
from ..kernel.discovery import Connection
from .bursts import REQUEST_TIMEOUT_S, executions, model_stats
from .service import ServiceModel
from .sweep import binary_request

#: cells a grid may have: a measurement stays minutes at most
MAX_CELLS = 64
TERMS = ("a", "b_token", "c_pair")


@dataclass
class LengthService:
    """Execution ns per (batch size, padded length): ``samples[(batch, length)]`` single
    executions; ``base`` the model's c=1 sweep and bursts (the figures outside the model)."""

    model: str
    version: str
    samples: dict[tuple[int, int], list[int]]
    base: ServiceModel
    coefficients: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.samples = {(int(b), int(n)): sorted(int(v) for v in vs)
                        for (b, n), vs in self.samples.items() if vs}
        if not self.samples:
            raise InvalidArgument(f"length service of '{self.model}': no sample")
        medians = {k: float(statistics.median(v)) for k, v in self.samples.items()}
        self._medians = medians
        self._ratios = sorted(v / medians[k] for k, vs in self.samples.items() for v in vs)
        if not self.coefficients:
            self.coefficients = _fit(medians)

    def median_ns(self, rows: int, length: int) -> float:
        """The fitted execution of ``rows`` rows padded to ``length`` tokens."""
        c = self.coefficients
        tokens = rows * length
        return max(1.0, c["a"] + c["b_token"] * tokens + c["c_pair"] * tokens * length)

    def __call__(self, rows: int, rng: random.Random, length: int = 1) -> int:
        """How long an instance is occupied by ``rows`` rows padded to ``length``: a drawn
        execution and the measured hand-off around it."""
        return max(1, int(self.median_ns(rows, max(1, length)) * rng.choice(self._ratios))) \
            + self.base.handoff_ns

    def table(self) -> list[dict]:
        """Each measured cell: its median, what the fit says, the fit's error."""
        out = []
        for (b, n), v in sorted(self.samples.items()):
            fitted = self.median_ns(b, n)
            out.append({"batch_size": b, "length": n, "n": len(v), "p50_ms": self._medians[(b, n)] / 1e6,
                        "fitted_ms": fitted / 1e6, "fit_error": fitted / self._medians[(b, n)] - 1})
        return out

    def describe(self) -> str:
        c = self.coefficients
        return (f"execution {c['a'] / 1e3:.0f} us + {c['b_token']:.0f} ns a token + "
                f"{c['c_pair'] * 1e3:.2f} ps a token x length, fitted on {len(self.samples)} "
                f"(batch, length) cells")

    def __repr__(self) -> str:
        return f"LengthService({self.model} v{self.version}: {self.describe()})"

    def to_json(self) -> dict:
        return {"model": self.model, "version": self.version, "base": self.base.to_json(),
                "coefficients": dict(self.coefficients),
                "samples": [[b, n, v] for (b, n), v in sorted(self.samples.items())]}

    @classmethod
    def from_json(cls, obj: dict) -> "LengthService":
        return cls(obj["model"], str(obj["version"]), {(int(b), int(n)): v for b, n, v in obj["samples"]},
                   ServiceModel.from_json(obj["base"]), {k: float(v) for k, v in obj["coefficients"].items()})


def _fit(medians: dict[tuple[int, int], float]) -> dict[str, float]:
    """``a + b * tokens + c * tokens * length`` by least squares relative to each cell, with
    every term >= 0: the best fit among the subsets of terms whose coefficients all are."""
    keys = sorted(medians)
    y = np.array([medians[k] for k in keys])
    columns = np.array([[1.0, b * n, b * n * n] for b, n in keys])
    weights = 1.0 / y
    best: tuple[float, dict[str, float]] | None = None
    for size in (3, 2, 1):
        for used in itertools.combinations(range(3), size):
            if len(keys) < size:
                continue
            a = columns[:, used] * weights[:, None]
            coef, *_ = np.linalg.lstsq(a, y * weights, rcond=None)
            if (coef < 0).any():
                continue
            error = float(np.sum((a @ coef - y * weights) ** 2))
            if best is None or error < best[0] - 1e-12:
                full = dict.fromkeys(TERMS, 0.0)
                full.update({TERMS[i]: float(v) for i, v in zip(used, coef)})
                best = (error, full)
    assert best is not None         # the constant alone always fits
    return best[1]


def length_request(metadata: dict, rows: int, length: int) -> tuple[bytes, dict[str, str]]:
    """A binary infer request of ``rows`` rows, every variable dimension ``length`` long,
    every value 1 (a token id and an attention mask alike), with its headers."""
    for inp in metadata["inputs"]:
        if inp["datatype"] == "BYTES":
            raise InvalidArgument(f"simulate: input '{inp['name']}' is BYTES: lengths are measured "
                                  f"on numeric [batch, length] inputs")
    return binary_request(metadata, rows, length, fill=1)


def measure_lengths(connection: Connection, model: str, batches: list[int], lengths: list[int],
                    base: ServiceModel, repeats: int = 5, warmup: int = 1, version: str = "",
                    time_limit_s: float = 120.0, progress: bool = True) -> LengthService:
    """Each (batch, length) of the grid ``repeats`` times at c=1 (cells interleaved round after
    round, as ``sweep`` does; a cell's first sends are warm-up), within ``time_limit_s``."""
    from ..progress import progress as show_progress

    client = TritonHTTP(connection)
    meta = client.metadata(model, version)
    version = version or str(max(int(v) for v in meta["versions"]))
    batches, lengths = sorted({int(b) for b in batches}), sorted({int(n) for n in lengths})
    if not batches or not lengths or batches[0] < 1 or lengths[0] < 1:
        raise InvalidArgument("simulate: the measured grid needs batch sizes and lengths >= 1")
    if len(batches) * len(lengths) > MAX_CELLS:
        raise InvalidArgument(f"simulate: the measured grid has {len(batches) * len(lengths)} cells "
                              f"(batch sizes x lengths), at most {MAX_CELLS}")
    if not 1 <= repeats <= 100:
        raise InvalidArgument("simulate: repeats must be in [1, 100]")
    cells = [(b, n) for b in batches for n in lengths]
    bodies = {c: length_request(meta, *c) for c in cells}
    parts = urlsplit(connection.url)
    path = parts.path.rstrip("/") + f"/v2/models/{quote(model, safe='')}/versions/{version}/infer"
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=REQUEST_TIMEOUT_S)
    samples: dict[tuple[int, int], list[int]] = {c: [] for c in cells}
    rounds = [(c, True) for _ in range(warmup) for c in cells] + [(c, False) for _ in range(repeats) for c in cells]
    deadline = time.monotonic() + time_limit_s
    before = model_stats(client, model, version)
    with show_progress(len(rounds), f"measure {model} v{version} by length", progress) as bar:
        try:
            for i, ((b, n), warming) in enumerate(rounds):
                if time.monotonic() > deadline:
                    break
                bar.update(i, f"{'warm-up' if warming else 'sweep'}: {b} x {n} tokens")
                body, headers = bodies[(b, n)]
                conn.request("POST", path, body, {**headers, **connection.headers})
                resp = conn.getresponse()
                data = resp.read()
                if resp.status != 200:
                    raise Unavailable(f"simulate '{model}': a batch of {b} x {n} tokens failed: "
                                      f"{data[:300].decode('utf-8', 'replace')}")
                after = model_stats(client, model, version)
                (e0, per0), (e1, per1) = executions(before), executions(after)
                before = after
                compute = per1.get(b, 0) - per0.get(b, 0)
                if not warming and e1 - e0 == 1 and compute > 0:
                    samples[(b, n)].append(compute)
        finally:
            conn.close()
    if not any(samples.values()):
        raise Unavailable(f"simulate '{model}': no clean sample by length (is another client using it?)")
    return LengthService(model, version, samples, base)
