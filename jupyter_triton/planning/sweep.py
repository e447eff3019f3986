"""``measure``: a model's execution time per batch size, through the protocol.

The sweep sends, from one client (c=1), ``repeats`` requests of each batch size and reads the
model's statistics after each one: the request's execution is the delta of the server's
``compute_input + compute_infer + compute_output`` for that batch size. The server's own
figures, not a client's stopwatch, because the simulator needs what occupies an instance;
what a client sees on top of it (front end, network, its own Python) is measured in the same
round trip as ``overhead_ns`` (client latency minus the server's queue and compute). A sample
whose delta is not exactly one execution (someone else used the model) is dropped.

After the sweep, two short bursts (``bursts``) measure what the c=1 sweep cannot see, and
``fitting`` turns them into the service model's hand-off, event-loop and stall figures.
"""
from __future__ import annotations

import http.client
import json
import statistics
import time
from typing import Any
from urllib.parse import quote, urlsplit

import numpy as np

from ..progress import progress as show_progress
from ..protocol.datatypes import element_size, triton_to_numpy
from ..protocol.errors import InvalidArgument, Unavailable
from ..kernel.client import TritonHTTP
from ..kernel.discovery import Connection
from .bursts import BURST_CLIENTS, REQUEST_TIMEOUT_S, burst, executions, model_stats, server_thread
from .fitting import _fit_stalls, _split_by_load
from .service import _CACHE, ServiceModel, fingerprint


def sweep_sizes(largest: int) -> list[int]:
    """1, 2, 4, ... and ``largest`` itself."""
    sizes, b = [], 1
    while b < largest:
        sizes.append(b)
        b *= 2
    return sizes + [largest]


def request_body(metadata: dict, rows: int) -> bytes:
    """A JSON infer request of ``rows`` rows of zeros (variable dims 1), as tune's load has."""
    inputs = []
    for inp in metadata["inputs"]:
        shape = [rows] + [1 if int(d) < 0 else int(d) for d in inp["shape"][1:]]
        n = 1
        for d in shape:
            n *= d
        value: Any = "0" if inp["datatype"] == "BYTES" else False if inp["datatype"] == "BOOL" else 0
        inputs.append({"name": inp["name"], "shape": shape, "datatype": inp["datatype"],
                       "data": [value] * n})
    return json.dumps({"inputs": inputs}).encode()


def binary_request(metadata: dict, rows: int, length: int = 1, fill: int = 0) -> tuple[bytes, dict[str, str]]:
    """``request_body``'s request in the binary tensor extension (what perf_analyzer and
    tritonclient send; answers asked binary too), with its headers: the server's loop does
    less a request than for JSON, and the bursts measure its CPU with the clients' encoding.
    ``length``: each variable dimension's; ``fill``: every numeric value (1: a token id and an
    attention mask alike, ``length_service``)."""
    inputs, data = [], []
    for inp in metadata["inputs"]:
        shape = [rows] + [length if int(d) < 0 else int(d) for d in inp["shape"][1:]]
        n = 1
        for d in shape:
            n *= d
        if inp["datatype"] == "BYTES":
            raw = b"\x01\x00\x00\x000" * n
        elif fill:
            raw = np.full(shape, fill, triton_to_numpy(inp["datatype"])).tobytes()
        else:
            raw = bytes(n * (element_size(inp["datatype"]) or 1))
        inputs.append({"name": inp["name"], "shape": shape, "datatype": inp["datatype"],
                       "parameters": {"binary_data_size": len(raw)}})
        data.append(raw)
    head = json.dumps({"inputs": inputs, "parameters": {"binary_data_output": True}}).encode()
    return head + b"".join(data), {"Content-Type": "application/octet-stream",
                                   "Inference-Header-Content-Length": str(len(head))}


def measure(connection: Connection, model: str, sizes: list[int] | None = None, repeats: int = 15,
            warmup: int = 3, version: str = "", refresh: bool = False,
            time_limit_s: float = 60.0, burst_s: float = 3.0,
            server_pid: int | None = None, binary: bool = False, progress: bool = True) -> ServiceModel:
    """Sweep ``sizes`` (default 1, 2, 4, ... up to the model's max_batch_size) ``repeats``
    times each at c=1, then a saturating burst of ``burst_s`` (0: none); see the module
    docstring. ``server_pid``: the server's process when ``server_thread`` cannot find it
    (a standalone server started elsewhere on this host). ``binary``: the bursts send the
    binary tensor extension, as perf_analyzer and tritonclient do (default JSON, as tune's
    load does): the loop's CPU a request is the clients' encoding's. Cached unless ``refresh``.
    ``progress``: a bar (a notebook) or text lines (elsewhere) through the sweep and bursts."""
    client = TritonHTTP(connection)
    meta = client.metadata(model, version)
    version = version or str(max(int(v) for v in meta["versions"]))
    config = client.config(model, version)
    # the bursts' encoding is part of what was measured (the loop's CPU a request)
    key = (connection.url, model, version, fingerprint(config) + (" binary" if binary else ""))
    if not refresh and sizes is None and key in _CACHE:
        return _CACHE[key]
    mbs = int(config.get("max_batch_size", 0) or 0)
    if mbs < 1:
        raise InvalidArgument(f"simulate '{model}': the model does not batch (max_batch_size 0)")
    sizes = sorted({int(b) for b in (sizes or sweep_sizes(mbs))})
    if sizes[0] < 1 or sizes[-1] > mbs:
        raise InvalidArgument(f"simulate '{model}': batch sizes must be in [1, {mbs}] "
                              f"(its max_batch_size)")
    if repeats < 1 or repeats > 1000:
        raise InvalidArgument("simulate: repeats must be in [1, 1000]")
    parts = urlsplit(connection.url)
    path = parts.path.rstrip("/") + f"/v2/models/{quote(model, safe='')}/versions/{version}/infer"
    headers = {"Content-Type": "application/json", **connection.headers}
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=REQUEST_TIMEOUT_S)
    samples: dict[int, list[int]] = {b: [] for b in sizes}
    overheads: list[int] = []
    bodies = {b: request_body(meta, b) for b in sizes}
    deadline = time.monotonic() + time_limit_s
    before = model_stats(client, model, version)
    # sizes interleaved, round after round: a machine whose load drifts during the sweep
    # shifts every size alike instead of bending the curve
    rounds = [(b, True) for _ in range(warmup) for b in sizes] + \
        [(b, False) for _ in range(repeats) for b in sizes]
    steps = len(rounds) + (2 if burst_s > 0 else 0)
    with show_progress(steps, f"measure {model} v{version}", progress) as bar:
        try:
            for i, (b, warming) in enumerate(rounds):
                if time.monotonic() > deadline:
                    break
                bar.update(i, f"{'warm-up' if warming else 'sweep'}: batch of {b}")
                sent = time.perf_counter_ns()
                conn.request("POST", path, bodies[b], headers)
                resp = conn.getresponse()
                data = resp.read()
                latency = time.perf_counter_ns() - sent
                if resp.status != 200:
                    raise Unavailable(f"simulate '{model}': a batch of {b} failed: "
                                      f"{data[:300].decode('utf-8', 'replace')}")
                after = model_stats(client, model, version)
                execs0, per0 = executions(before)
                execs1, per1 = executions(after)
                queue = (int(after["inference_stats"]["queue"]["ns"])
                         - int(before["inference_stats"]["queue"]["ns"]))
                before = after
                compute = per1.get(b, 0) - per0.get(b, 0)
                if warming or execs1 - execs0 != 1 or compute <= 0:
                    continue
                samples[b].append(compute)
                overheads.append(max(0, latency - queue - compute))
        finally:
            conn.close()
        if not any(samples.values()):
            raise Unavailable(f"simulate '{model}': no clean sample (is another client using it?)")
        result = ServiceModel(model, version, samples, int(statistics.median(overheads)), overheads,
                              fingerprint=fingerprint(config))
        if burst_s > 0:
            thread = server_thread(connection, server_pid)
            body, kind = binary_request(meta, 1) if binary else (request_body(meta, 1), None)
            bar.update(len(rounds), f"burst: {BURST_CLIENTS} clients for {burst_s:g} s")
            seen = burst(connection, model, version, path, body, burst_s, thread, content=kind)
            bar.update(len(rounds) + 1, f"burst: 1 client for {burst_s:g} s")
            alone = burst(connection, model, version, path, body, burst_s, thread, clients=1, content=kind) \
                if seen is not None else None
            if seen is not None:
                # the cycle at saturation less the executions the statistics recorded in it
                result.handoff_ns = max(0, seen.cycle_ns - seen.compute_ns)
                result.loop_ns = seen.loop_ns
                result.stall_ns, result.stall_rate = seen.stall_ns, seen.stall_rate
                result.stall_chance, result.burst_qps = seen.stall_chance, seen.qps
                result.burst_batch = seen.rows
                result.method += f"; hand-off, event loop and stalls from {burst_s:g} s bursts at c={BURST_CLIENTS} and 1"
                if alone is not None:
                    _split_by_load(result, seen, alone)
                    result.round_trip_ns = alone.latencies_ns
                result.burst_p99_ns = seen.p99_ns
                _fit_stalls(result, config, seen)
    _CACHE[key] = result
    return result


def calibrate_overhead(connection: Connection, model: str, service: ServiceModel,
                       seconds: float = 2.0, load_generator: str = "auto") -> dict:
    """What one client of ``load_generator`` (perf_analyzer when installed, else tune's
    loadgen) sees beyond one execution at c=1: its p50 latency minus the service model's
    median for one row (medians both: a few slow outliers move neither). Use it as
    ``simulate(..., overhead_us=...)`` when comparing with that generator. Run it on a model
    with max_queue_delay 0, as the sweep's figures are."""
    from ..kernel import tune as tu
    client = TritonHTTP(connection)
    meta = client.metadata(model)
    perf = tu.find_perf_analyzer() if load_generator in ("auto", "perf_analyzer") else None
    if perf:
        run = tu._run_perf_analyzer(perf, connection, model, tu._shapes(meta), 1, seconds)
    else:
        run = tu._run_loadgen(connection, model, tu._shapes(meta), 1, seconds)
    server_ms = service.median_ns(1) / 1e6
    return {"overhead_us": max(0.0, (run["p50_ms"] - server_ms) * 1000), "client_p50_ms": run["p50_ms"],
            "server_ms": server_ms, "load_generator": "perf_analyzer" if perf else "loadgen"}
