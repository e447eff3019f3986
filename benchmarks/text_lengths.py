"""Texts of different lengths (issue 36): a small transformer encoder, 16 clients, natural lengths.

The model: token and position embeddings, 2 encoder layers (hidden 64, 4 heads, masked
attention), the masked mean of the last layer: ``input_ids``, ``attention_mask`` ``[batch,
length]`` in, ``embedding`` ``[batch, 64]`` out. Built here with torch (random weights, seed 0)
and exported to ONNX with dynamic batch and length. The clients send each text at its own
length (no client-side padding), lengths drawn from a log-normal with median 40 tokens
(sigma 0.8), clipped to 4-512; 16 closed-loop clients (each sends its next request as the last
answers), binary tensors over HTTP, the same request sequence for every server.

Servers, one at a time, each started fresh, in alternating rounds (medians reported):

* ours, padding: the ONNX model with ``ragged_batching: "pad"``, ``length_buckets`` and
  ``max_batch_tokens`` (config/padding.py): requests of different lengths batch, each batch padded
  to its longest member.
* ours, no padding: the same model and batcher without those parameters, Triton's semantics: only
  requests of the same length batch together.
* tritonserver 2.51, python backend, ragged batching: inputs ``allow_ragged_batch: true``, a
  ``model.py`` that pads the batch it is handed itself and runs the same ONNX file in onnxruntime
  (installed into the peer's venv when missing). The same ``model.py`` in ours is a fourth row.

Per server: throughput, p50/p99 (client view), mean batch (inferences / executions, server
statistics), padding waste (padded tokens / real tokens from our statistics; the python rows pad
inside model.py, where no server counts it), model compute per execution and per inference,
server CPU per inference (the process tree); then the encoder alone in onnxruntime at a few
(batch, length), what batching can save in the model itself on the machine.

    .venv/bin/python benchmarks/text_lengths.py --seconds 20     # alone: results/text_lengths.md
    .venv/bin/python benchmarks/run.py                           # as a row of ./dev bench
"""
from __future__ import annotations

import argparse
import http.client
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import (DEFAULT_PYTRITON_VENV, HOST, HERE, ROOT, Ours, Target, Tritonserver,  # noqa: E402
                 ensure_pytriton, log, tree_cpu_seconds, tritonserver_dist)

VOCAB, HIDDEN, LAYERS, HEADS, MAX_LENGTH = 1000, 64, 2, 4, 512
MEDIAN, SIGMA, SHORTEST = 40, 0.8, 4
CLIENTS = 16
MAX_BATCH = 16
#: the batching settings every row shares (delay) and the padding row's own; main() sets them
SETTINGS = {"delay_us": 2000, "buckets": "24,48,96,192", "budget": 2048, "threads": 0}
POOL = 2048                       # distinct requests, cycled by every client from its own offset


def description() -> str:
    return (f"transformer encoder ({LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, random weights, "
            f"ONNX), lengths log-normal median {MEDIAN} sigma {SIGMA} clipped to {SHORTEST}-{MAX_LENGTH}, "
            f"{CLIENTS} clients, binary HTTP, max_batch_size {MAX_BATCH}, "
            f"max_queue_delay {SETTINGS['delay_us']} us, onnxruntime intra-op threads "
            f"{SETTINGS['threads'] or 'default'}")


# -- the model ---------------------------------------------------------------------------------

def encoder_onnx() -> bytes:
    """The encoder's ONNX bytes. Its attention is written out (not nn.MultiheadAttention, whose
    traced export fixes the batch and length in its reshapes)."""
    import torch

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
            self.out = torch.nn.Linear(HIDDEN, HIDDEN)
            self.ff = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.GELU(),
                                          torch.nn.Linear(2 * HIDDEN, HIDDEN))
            self.norm1, self.norm2 = torch.nn.LayerNorm(HIDDEN), torch.nn.LayerNorm(HIDDEN)

        def forward(self, h, bias):
            q, k, v = (t.unflatten(-1, (HEADS, -1)).transpose(1, 2) for t in self.qkv(h).chunk(3, dim=-1))
            attention = torch.softmax(q @ k.transpose(-1, -2) / (HIDDEN // HEADS) ** 0.5 + bias, dim=-1)
            h = self.norm1(h + self.out((attention @ v).transpose(1, 2).flatten(2)))
            return self.norm2(h + self.ff(h))

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = torch.nn.Embedding(VOCAB, HIDDEN)
            self.positions = torch.nn.Embedding(MAX_LENGTH, HIDDEN)
            self.layers = torch.nn.ModuleList(Layer() for _ in range(LAYERS))

        def forward(self, input_ids, attention_mask):
            h = self.tokens(input_ids) + self.positions.weight[: input_ids.shape[1]]
            mask = attention_mask.to(h.dtype)
            bias = ((1.0 - mask) * -1e9)[:, None, None, :]      # padded keys get no attention
            for layer in self.layers:
                h = layer(h, bias)
            mask = mask.unsqueeze(-1)
            return (h * mask).sum(1) / mask.sum(1)

    torch.manual_seed(0)
    model = Encoder().eval()
    example = (torch.ones(2, 7, dtype=torch.int64), torch.ones(2, 7, dtype=torch.int64))
    axes = {0: "batch", 1: "length"}
    buf = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(model, example, buf, dynamo=False, opset_version=17,
                          input_names=["input_ids", "attention_mask"], output_names=["embedding"],
                          dynamic_axes={"input_ids": axes, "attention_mask": axes,
                                        "embedding": {0: "batch"}})
    return buf.getvalue()


def _config(name: str, backend: str, ragged: bool, parameters: dict[str, str]) -> str:
    flag = " allow_ragged_batch: true" if ragged else ""
    listed = ", ".join(f'{{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in parameters.items())
    return (f'name: "{name}"\nbackend: "{backend}"\nmax_batch_size: {MAX_BATCH}\n'
            f"dynamic_batching {{ max_queue_delay_microseconds: {SETTINGS['delay_us']} }}\n"
            f'input [ {{ name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ]{flag} }},\n'
            f'        {{ name: "attention_mask" data_type: TYPE_INT64 dims: [ -1 ]{flag} }} ]\n'
            f'output [ {{ name: "embedding" data_type: TYPE_FP32 dims: [ {HIDDEN} ] }} ]\n'
            f"instance_group [ {{ count: 1 kind: KIND_CPU }} ]\n"
            + (f"parameters [ {listed} ]\n" if parameters else ""))


MODEL_PY = '''\
import json
import os

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Ragged batching done by the model: the batch of requests of different lengths is padded
    to its longest member here, run once, and split back per request."""

    def initialize(self, args):
        options = ort.SessionOptions()
        # as our onnxruntime backend sets them: pool threads sleep between operators
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        params = json.loads(args["model_config"]).get("parameters", {})
        if "intra_op_thread_count" in params:
            options.intra_op_num_threads = int(params["intra_op_thread_count"]["string_value"])
        path = os.path.join(args["model_repository"], args["model_version"], "encoder.onnx")
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])

    def execute(self, requests):
        ids = [pb_utils.get_input_tensor_by_name(r, "input_ids").as_numpy() for r in requests]
        masks = [pb_utils.get_input_tensor_by_name(r, "attention_mask").as_numpy() for r in requests]
        longest = max(a.shape[1] for a in ids)
        rows = [a.shape[0] for a in ids]
        batch_ids = np.zeros((sum(rows), longest), np.int64)
        batch_mask = np.zeros((sum(rows), longest), np.int64)
        at = 0
        for a, m in zip(ids, masks):
            batch_ids[at:at + a.shape[0], :a.shape[1]] = a
            batch_mask[at:at + a.shape[0], :m.shape[1]] = m
            at += a.shape[0]
        out = self.session.run(["embedding"], {"input_ids": batch_ids, "attention_mask": batch_mask})[0]
        responses, at = [], 0
        for n in rows:
            tensor = pb_utils.Tensor("embedding", out[at:at + n])
            responses.append(pb_utils.InferenceResponse(output_tensors=[tensor]))
            at += n
        return responses
'''

PAD_MODEL, PLAIN_MODEL, PYTHON_MODEL = "encoder_pad", "encoder", "encoder_python"


def build_repository(root: Path, onnx: bytes) -> None:
    threads = {"intra_op_thread_count": str(SETTINGS["threads"])} if SETTINGS["threads"] else {}
    pad = {**threads, "ragged_batching": "pad", "max_batch_tokens": str(SETTINGS["budget"]),
           "max_length": str(MAX_LENGTH)}
    if SETTINGS["buckets"]:
        pad["length_buckets"] = SETTINGS["buckets"]
    for name, backend, ragged, params, file in (
            (PAD_MODEL, "onnxruntime", False, pad, "model.onnx"),
            (PLAIN_MODEL, "onnxruntime", False, threads, "model.onnx"),
            (PYTHON_MODEL, "python", True, threads, "encoder.onnx")):
        version = root / name / "1"
        version.mkdir(parents=True, exist_ok=True)
        (version / file).write_bytes(onnx)
        if backend == "python":
            (version / "model.py").write_text(MODEL_PY)
        (root / name / "config.pbtxt").write_text(_config(name, backend, ragged, params))


def alone_us_per_row(onnx: bytes, shapes: tuple[tuple[int, int], ...] = (
        (1, 40), (4, 40), (16, 40), (1, 80), (4, 80)), runs: int = 40) -> dict[str, float]:
    """The encoder in onnxruntime in this process, no server: microseconds per row at
    (batch, length), the best of ``runs`` (the machine's other load only ever adds): what
    batching can save in the model itself on this machine."""
    import onnxruntime as ort

    session = ort.InferenceSession(onnx, providers=["CPUExecutionProvider"])
    out = {}
    for batch, length in shapes:
        feed = {"input_ids": np.ones((batch, length), np.int64),
                "attention_mask": np.ones((batch, length), np.int64)}
        best = float("inf")
        for _ in range(runs):
            start = time.perf_counter()
            session.run(None, feed)
            best = min(best, time.perf_counter() - start)
        out[f"{batch}x{length}"] = best / batch * 1e6
    return out


# -- the load ----------------------------------------------------------------------------------

def lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    drawn = np.rint(rng.lognormal(np.log(MEDIAN), SIGMA, size=n))
    return np.clip(drawn, SHORTEST, MAX_LENGTH).astype(np.int64)


def request_bodies(seed: int = 0) -> list[tuple[int, bytes, int]]:
    """(length, body, JSON header length) per request: binary tensors, built once."""
    rng = np.random.default_rng(seed + 1)
    out = []
    for length in lengths(POOL, seed):
        ids = rng.integers(1, VOCAB, size=(1, int(length)), dtype=np.int64)
        mask = np.ones_like(ids)
        header = json.dumps({
            "inputs": [{"name": n, "shape": [1, int(length)], "datatype": "INT64",
                        "parameters": {"binary_data_size": a.nbytes}}
                       for n, a in (("input_ids", ids), ("attention_mask", mask))],
            "outputs": [{"name": "embedding", "parameters": {"binary_data": True}}]}).encode()
        out.append((int(length), header + ids.tobytes() + mask.tobytes(), len(header)))
    return out


def drive(port: int, model: str, bodies: list[tuple[int, bytes, int]], seconds: float,
          clients: int = CLIENTS) -> dict:
    """``clients`` threads, one keep-alive connection each, each sending its next request as
    the last answered, until ``seconds`` have passed. Latencies of the requests that finished in
    the window."""
    path = f"/v2/models/{model}/infer"
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    start = time.perf_counter()
    deadline = start + seconds

    def client(k: int) -> None:
        conn = http.client.HTTPConnection(HOST, port, timeout=60)
        mine: list[float] = []
        i = k * (len(bodies) // clients)
        try:
            while True:
                _, body, header = bodies[i % len(bodies)]
                i += 1
                t0 = time.perf_counter()
                if t0 >= deadline:
                    break
                conn.request("POST", path, body, {"Inference-Header-Content-Length": str(header),
                                                  "Content-Type": "application/octet-stream"})
                resp = conn.getresponse()
                data = resp.read()
                t1 = time.perf_counter()
                if resp.status != 200:
                    with lock:
                        errors.append(f"{resp.status}: {data[:200]!r}")
                    if len(errors) > 20:
                        break
                elif t1 <= deadline:
                    mine.append(t1 - t0)
        except OSError as e:
            with lock:
                errors.append(repr(e))
        finally:
            conn.close()
            with lock:
                latencies.extend(mine)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ms = sorted(x * 1e3 for x in latencies)
    return {"requests": len(ms), "errors": errors[:5], "failures": len(errors),
            "throughput": len(ms) / seconds,
            "p50_ms": ms[len(ms) // 2] if ms else 0.0,
            "p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))] if ms else 0.0}


# -- the servers -------------------------------------------------------------------------------

class OursText(Ours):
    def __init__(self, workdir: Path, repository: Path, model: str, label: str) -> None:
        Target.__init__(self, workdir)
        self.repository, self.model, self.served = repository, model, (model,)
        self.label, self.log_name = label, f"text-ours-{model}"


class TritonserverText(Tritonserver):
    def __init__(self, workdir: Path, repository: Path, model: str, python: Path,
                 dist: tuple[Path, str, str], label: str) -> None:
        Target.__init__(self, workdir)
        self.repository, self.served, self.python = repository, (model,), python
        self.dist, self.version, self.libdir = dist
        self.label, self.log_name = label, f"text-tritonserver-{model}"


def peer_onnxruntime(python: Path) -> str | None:
    """onnxruntime in the peer's venv (numpy<2 stays): None when it imports, else why not."""
    probe = [str(python), "-c", "import onnxruntime"]
    if subprocess.run(probe, capture_output=True).returncode == 0:
        return None
    log(f"installing onnxruntime into {python.parent.parent} (tritonserver's python model.py runs it)")
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "onnxruntime", "numpy<2"],
                          capture_output=True, text=True)
    if done.returncode != 0 or subprocess.run(probe, capture_output=True).returncode != 0:
        return f"onnxruntime does not install in {python}: {done.stderr.strip()[-300:]}"
    return None


@dataclass
class Result:
    label: str
    model: str
    throughput: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    mean_batch: float = 0.0
    waste: float | None = None
    cpu_us_per_inference: float = 0.0
    queue_us: float = 0.0
    compute_us_per_execution: float = 0.0
    requests: int = 0
    failures: int = 0
    error: str = ""
    round_throughputs: list[float] = field(default_factory=list)


def batch_compute_ns(stats: dict) -> float:
    """Model compute over every execution (batch_stats: per batch size, one count per execution)."""
    return sum(float(b.get("compute_infer", {}).get("ns", 0)) for b in stats.get("batch_stats", []))


def measure(target: Target, model: str, bodies: list, seconds: float, warmup_s: float) -> Result:
    result = Result(target.label, model)
    try:
        target.start()
        # lengths across the range once, alone: a first run at a new shape costs onnxruntime more
        for length in sorted({b[0] for b in bodies})[::8]:
            drive(target.http_port, model, [b for b in bodies if b[0] == length][:1], 0.05, clients=1)
        drive(target.http_port, model, bodies, warmup_s)
        before, cpu0 = target.stats(model), tree_cpu_seconds(target.proc.pid)
        load = drive(target.http_port, model, bodies, seconds)
        after, cpu1 = target.stats(model), tree_cpu_seconds(target.proc.pid)
    except (RuntimeError, OSError, TimeoutError) as e:
        result.error = " / ".join(str(e).splitlines()[:1] + str(e).splitlines()[-2:])[:600]
        return result
    finally:
        target.stop()

    def delta(*keys: str) -> float:
        a, b = after, before
        for k in keys:
            a, b = a.get(k, {}), b.get(k, {})
        return float(a or 0) - float(b or 0)

    inferences, executions = delta("inference_count"), delta("execution_count")
    result.throughput, result.p50_ms, result.p99_ms = load["throughput"], load["p50_ms"], load["p99_ms"]
    result.requests, result.failures = load["requests"], load["failures"]
    result.error = "; ".join(load["errors"])
    result.mean_batch = inferences / executions if executions else 0.0
    result.cpu_us_per_inference = (cpu1 - cpu0) * 1e6 / inferences if inferences else 0.0
    queue = delta("inference_stats", "queue", "count")
    result.queue_us = delta("inference_stats", "queue", "ns") / queue / 1e3 if queue else 0.0
    compute = batch_compute_ns(after) - batch_compute_ns(before)
    result.compute_us_per_execution = compute / executions / 1e3 if executions else 0.0
    padded, real = delta("padding", "batch_tokens"), delta("padding", "request_tokens")
    if "padding" in after:
        result.waste = padded / real if real else None
    elif model == PLAIN_MODEL:
        result.waste = 1.0
    return result


def median_result(rounds: list[Result]) -> Result:
    """Each figure's median over the rounds that answered; the throughput of every round kept."""
    ok = [r for r in rounds if r.requests] or rounds[:1]
    out = Result(ok[0].label, ok[0].model, requests=sum(r.requests for r in ok),
                 failures=sum(r.failures for r in rounds),
                 error="; ".join(r.error for r in rounds if r.error)[:600],
                 round_throughputs=[round(r.throughput, 1) for r in rounds])
    for name in ("throughput", "p50_ms", "p99_ms", "mean_batch", "cpu_us_per_inference", "queue_us",
                 "compute_us_per_execution"):
        setattr(out, name, statistics.median(getattr(r, name) for r in ok))
    wastes = [r.waste for r in ok if r.waste is not None]
    out.waste = statistics.median(wastes) if wastes else None
    return out


def run(workdir: Path, seconds: float, warmup_s: float, peer_python: Path | None,
        dist: tuple[Path, str, str] | None, notes: list[str], rounds: int = 1) -> list[Result]:
    repository = workdir / "repository-text"
    onnx = encoder_onnx()
    build_repository(repository, onnx)
    bodies = request_bodies()
    targets: list[tuple[Target, str]] = [
        (OursText(workdir, repository, PAD_MODEL,
                  f"ours, padding (buckets {SETTINGS['buckets'] or 'none'}, "
                  f"max_batch_tokens {SETTINGS['budget']})"), PAD_MODEL),
        (OursText(workdir, repository, PLAIN_MODEL, "ours, no padding (Triton's semantics)"), PLAIN_MODEL),
        (OursText(workdir, repository, PYTHON_MODEL, "ours, python model.py, ragged batching"), PYTHON_MODEL)]
    if peer_python is not None and dist is not None:
        why = peer_onnxruntime(peer_python)
        if why:
            notes.append(f"tritonserver text row skipped: {why}")
        else:
            targets.append((TritonserverText(workdir, repository, PYTHON_MODEL, peer_python, dist,
                                             "tritonserver 2.51, python model.py, ragged batching"),
                            PYTHON_MODEL))
    # Rounds alternate (every server in turn, then again): on a shared machine the load moves
    # between minutes, and a server measured only at a quiet or a busy one says little.
    measured: list[list[Result]] = [[] for _ in targets]
    for rnd in range(1, rounds + 1):
        for (target, model), mine in zip(targets, measured):
            log(f"text lengths, round {rnd}: {target.label}")
            r = measure(target, model, bodies, seconds, warmup_s)
            log(f"  {r.throughput:7.1f} infer/s  p50 {r.p50_ms:6.1f} ms  p99 {r.p99_ms:6.1f} ms  "
                f"batch {r.mean_batch:5.2f}  waste {r.waste if r.waste is not None else '-'}  "
                f"CPU {r.cpu_us_per_inference:6.0f} us/inf  {r.error[:200]}")
            mine.append(r)
    results = [median_result(mine) for mine in measured]
    alone = alone_us_per_row(onnx)
    notes.append("onnxruntime alone (this process, no server, best of 40 runs), us per row at "
                 "batch x length: "
                 + ", ".join(f"{k} {v:.0f}" for k, v in alone.items()))
    return results


def markdown(results: list[Result], notes: list[str]) -> str:
    lengths_drawn = lengths(POOL)
    lines = [
        f"Model: {description()}. Request lengths (the {POOL} requests cycled): median "
        f"{int(np.median(lengths_drawn))}, mean {lengths_drawn.mean():.0f}, p99 "
        f"{int(np.percentile(lengths_drawn, 99))}, max {lengths_drawn.max()} tokens.",
        "",
        "| server | infer/s (each round) | p50 ms | p99 ms | mean batch | padding waste | queue us | compute us/batch (/inf) | CPU us/inf | requests |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r.error and not r.requests:
            lines.append(f"| {r.label} | failed: {r.error[:200]} | | | | | | | | |")
            continue
        waste = f"{r.waste:.2f}" if r.waste is not None else "in model.py"
        each = ", ".join(f"{t:.0f}" for t in r.round_throughputs)
        lines.append(f"| {r.label} | {r.throughput:.1f} ({each}) | {r.p50_ms:.1f} | {r.p99_ms:.1f} | "
                     f"{r.mean_batch:.2f} | {waste} | {r.queue_us:.0f} | {r.compute_us_per_execution:.0f} "
                     f"({r.compute_us_per_execution / r.mean_batch if r.mean_batch else 0:.0f}) | "
                     f"{r.cpu_us_per_inference:.0f} | "
                     f"{r.requests}{f' ({r.failures} failed)' if r.failures else ''} |")
    by = {r.model + ("@peer" if r.label.startswith("tritonserver") else ""): r for r in results if r.requests}
    pad = by.get(PAD_MODEL)
    lines.append("")
    for key, aim, what in ((PLAIN_MODEL, 3.0, "ours without padding"),
                           (PYTHON_MODEL + "@peer", 1.5, "tritonserver's python-backend ragged batching")):
        other = by.get(key)
        if pad and other and other.throughput:
            ratio = pad.throughput / other.throughput
            ok = ratio >= aim and pad.p99_ms <= other.p99_ms
            lines.append(f"- padding / {what}: throughput {ratio:.2f}x (aim >= {aim}x), p99 "
                         f"{pad.p99_ms:.1f} vs {other.p99_ms:.1f} ms: {'PASS' if ok else 'MISS'}")
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="measured seconds per server")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds; medians reported")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of load before measuring")
    parser.add_argument("--pytriton-venv", type=Path,
                        default=Path(os.environ.get("PYTRITON_VENV") or os.environ.get("JUPYTER_TRITON_PYTRITON_VENV")
                                     or DEFAULT_PYTRITON_VENV))
    parser.add_argument("--buckets", default=SETTINGS["buckets"], help="length_buckets of the padding row ('': none)")
    parser.add_argument("--budget", type=int, default=SETTINGS["budget"], help="max_batch_tokens of the padding row")
    parser.add_argument("--delay-us", type=int, default=SETTINGS["delay_us"], help="max_queue_delay of every row")
    parser.add_argument("--intra-op-threads", type=int, default=SETTINGS["threads"],
                        help="onnxruntime's intra-op threads in every server (intra_op_thread_count; "
                             "0: onnxruntime's default)")
    parser.add_argument("--no-peer", action="store_true", help="leave tritonserver out")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "text_lengths.md")
    args = parser.parse_args(argv)
    SETTINGS.update(buckets=args.buckets, budget=args.budget, delay_us=args.delay_us,
                    threads=args.intra_op_threads)
    started_utc = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="jt-text-") as tmp:
        workdir = Path(tmp)
        peer_python = dist = None
        if not args.no_peer:
            peer_python, detail = ensure_pytriton(args.pytriton_venv, workdir)
            if peer_python is None:
                notes.append(f"tritonserver skipped: {detail}")
            else:
                dist, why = tritonserver_dist(peer_python)
                if dist is None:
                    notes.append(f"tritonserver skipped: {why}")
        results = run(workdir, args.seconds, args.warmup, peer_python, dist, notes, args.rounds)
    command = " ".join([os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT))
                        else sys.executable, *sys.argv] if argv is None else argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    text = (f"# Texts of different lengths (issue 36)\n\n`{command}` at {commit}, {started_utc}, "
            f"{os.cpu_count()} CPUs, load average at end {os.getloadavg()[0]:.1f}; "
            f"{args.rounds} alternating round(s), {args.seconds:g} s measured per server and round after "
            f"{args.warmup:g} s of load; medians over the rounds.\n\n"
            + markdown(results, notes))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"command": command, "commit": commit, "started_utc": started_utc, "model": description(),
         "seconds": args.seconds, "results": [asdict(r) for r in results], "notes": notes}, indent=1) + "\n")
    log(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
