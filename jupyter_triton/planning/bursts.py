"""The two short bursts ``measure`` runs after its sweep (one row a request, back to back:
``BURST_CLIENTS`` clients, saturating, then one client): what the c=1 sweep cannot see.

* the hand-off: how long an instance is occupied per batch beyond the execution the
  statistics record (the hand-off to the instance's worker and back): at saturation the
  instance runs batch after batch, so the saturating burst's wall time less the recorded
  executions and the stalls (below: the instance waited them out, and the simulation
  stalls apart), per execution, is that cycle's remainder;
* the server's event loop's CPU (read, decode, submit; encode, write; dispatching a batch,
  taking its results), work that requests take in turn on its one thread. Per request it
  falls with the batch, so it is two parts, one a request and one a batch shared by its
  requests: the bursts see it at one request a batch and at the saturating burst's mean
  batch, which gives both (``fitting``). It needs the server's process on this host
  (``server_thread``: the in-kernel server's thread, or the pid in a Jupyter server's runtime
  file); 0 when it cannot be read, and then the simulation treats the whole overhead as a
  delay requests spend in parallel;
* the stalls: the moments the machine gave the server no core (other processes, the clients
  themselves). A request whose latency exceeds the burst's median by more than one instance
  cycle was stalled (its place in the queue varies by a cycle at most), and the requests
  answered within a cycle of each other were held by one stall (every client at once: nothing
  completes during one; ``_stalls``).

The burst's clients run in a process of their own (in the kernel's they would take the GIL
from an in-kernel server). What it measures is this machine at that moment: on a shared
machine a later load finds other neighbours; measure again (``refresh=True``) to follow.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ..protocol.errors import Unavailable
from ..kernel.client import TritonHTTP
from ..kernel.discovery import IN_KERNEL, Connection, runtime_files

REQUEST_TIMEOUT_S = 30.0
#: clients of the saturating burst: enough that the queue is never empty when a batch ends
BURST_CLIENTS = 8
#: the burst's clients (standard library only: it starts fast): argv host, port, clients;
#: stdin a JSON line {path, headers, body}, then "measure" and "stop"; stdout "go" once all
#: send, then {requests: [sent, latency] (ns) of those sent between measure and stop, errors}
BURST_CLIENT = """
import http.client, json, sys, threading, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
job = json.loads(sys.stdin.readline())
body = job["body"].encode("latin-1")
measuring, stop = threading.Event(), threading.Event()
started, requests, errors = threading.Barrier(n + 1), [], []
def send():
    conn = http.client.HTTPConnection(host, port, timeout=30)
    started.wait()
    while not stop.is_set():
        counted = measuring.is_set()
        sent = time.perf_counter_ns()
        try:
            conn.request("POST", job["path"], body, job["headers"])
            resp = conn.getresponse()
            data = resp.read()
        except Exception as err:
            errors.append(repr(err))
            return
        if resp.status != 200:
            errors.append(data[:300].decode("utf-8", "replace"))
            return
        if counted and not stop.is_set():
            requests.append((sent, time.perf_counter_ns() - sent))
threads = [threading.Thread(target=send, daemon=True) for _ in range(n)]
for t in threads:
    t.start()
started.wait()
time.sleep(0.2)
print("go", flush=True)
sys.stdin.readline()
measuring.set()
sys.stdin.readline()
stop.set()
for t in threads:
    t.join(30)
print(json.dumps({"requests": requests, "errors": errors}), flush=True)
"""


def model_stats(client: TritonHTTP, model: str, version: str) -> dict:
    """The version's statistics, as the server reports them."""
    [s] = client.stats(model, version)["model_stats"]
    return s


def executions(s: dict) -> tuple[int, dict[int, int]]:
    """(executions, the compute ns recorded per batch size) of a statistics entry."""
    per = {}
    for b in s.get("batch_stats") or []:
        per[int(b["batch_size"])] = sum(int(b[k]["ns"]) for k in
                                        ("compute_input", "compute_infer", "compute_output"))
    return int(s["execution_count"]), per


def server_thread(connection: Connection, pid: int | None = None) -> tuple[int, int] | None:
    """(pid, thread id) of the server's event loop on this host: the in-kernel server's thread,
    a Jupyter server's main thread (the pid its runtime file gives for this URL), or ``pid``'s
    main thread; None when not found or /proc is not there."""
    found: tuple[int, int] | None = None
    thread = getattr(connection.server, "thread", None)
    if pid is not None:
        found = (pid, pid)
    elif connection.mode == IN_KERNEL and getattr(thread, "native_id", None):
        found = (os.getpid(), thread.native_id)
    else:
        try:
            infos = runtime_files()
        except Exception:          # no Jupyter runtime directory here
            infos = []
        for info in infos:
            if str(info.get("url", "")).rstrip("/") == connection.url.rstrip("/"):
                found = (int(info["pid"]), int(info["pid"]))
                break
    if found is None or _thread_cpu_ns(*found) is None:
        return None
    return found


def _thread_cpu_ns(pid: int, tid: int) -> int | None:
    """User + system CPU of one thread (Linux /proc), ns."""
    try:
        stat = open(f"/proc/{pid}/task/{tid}/stat").read()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def burst(connection: Connection, model: str, version: str, path: str, body: bytes, seconds: float,
          thread: tuple[int, int] | None, clients: int = BURST_CLIENTS,
          content: dict[str, str] | None = None) -> "Burst | None":
    """``clients`` clients sending one-row requests back to back for ``seconds``; None
    when nothing was executed.

    At saturation an instance runs batch after batch: the wall time over the executions is
    its cycle (with n instances, n times the wall time), and the cycle less the execution
    the statistics recorded and the stalls is the hand-off. A request's latency beyond the median by more
    than one cycle is not its place in the queue (that varies by a cycle at most) but a stall:
    the server's threads or processes waiting for a core while something else runs; one
    stall holds up the requests in flight with it (``_stalls``)."""
    client = TritonHTTP(connection)
    parts = urlsplit(connection.url)
    headers = {**(content or {"Content-Type": "application/json"}), **connection.headers}
    instances = sum(int(g.get("count", 1) or 1)
                    for g in client.config(model, version).get("instance_group") or [{}])
    # The clients run in a process of their own: in this one they would take the GIL from an
    # in-kernel server's loop (and from the measurement), which no real client does.
    proc = subprocess.Popen([sys.executable, "-c", BURST_CLIENT, parts.hostname or "127.0.0.1",
                             str(parts.port), str(clients)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        proc.stdin.write(json.dumps({"path": path, "headers": headers,
                                     "body": body.decode("latin-1")}) + "\n")
        proc.stdin.flush()
        if proc.stdout.readline().strip() != "go":      # every client sending, past the start
            raise Unavailable(f"simulate '{model}': the burst's clients did not start: "
                              f"{proc.stderr.read()[-500:]}")
        before, cpu0, t0 = model_stats(client, model, version), thread and _thread_cpu_ns(*thread), time.monotonic_ns()
        proc.stdin.write("measure\n")
        proc.stdin.flush()
        time.sleep(seconds)
        after, cpu1, t1 = model_stats(client, model, version), thread and _thread_cpu_ns(*thread), time.monotonic_ns()
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=REQUEST_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    try:
        report = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise Unavailable(f"simulate '{model}': the burst's clients failed: {err[-500:]}") from None
    if report["errors"]:
        raise Unavailable(f"simulate '{model}': a request of the burst failed: {report['errors'][0]}")
    sent = report["requests"]
    execs0, per0 = executions(before)
    execs1, per1 = executions(after)
    execs = execs1 - execs0
    served = (int(after["inference_stats"]["success"]["count"])
              - int(before["inference_stats"]["success"]["count"]))
    if execs < 1 or served < 1 or not sent:
        return None
    rows = int(after["inference_count"]) - int(before["inference_count"])
    compute = sum(per1.values()) - sum(per0.values())
    cycle = (t1 - t0) * instances // execs
    loop = max(0, (cpu1 - cpu0) // served) if thread and cpu0 is not None and cpu1 is not None else 0
    stalls = _stalls(sent, cycle)
    # the instance waited out the stalls too: its cycle is the wall time without them
    cycle = max(0, (t1 - t0 - sum(stalls)) * instances // execs)
    latencies = sorted(lat for _, lat in sent)
    return Burst(cycle, rows / execs, compute // execs, int(loop), stalls, len(stalls) / seconds,
                 len(stalls) / served, served / seconds, latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
                 len(latencies), latencies)


def _stalls(sent: list[tuple[int, int]], cycle_ns: int) -> list[int]:
    """Each stall's length, from the burst's (sent, latency) pairs: the
    requests held beyond the median latency by more than one cycle, those answered within a
    cycle of each other one stall (it held all of them), as long as the least it held. The
    others waited longer behind the backlog it left (answers and batches queued), which the
    simulation forms itself from the stall: taking the longest would count that twice."""
    median = statistics.median(lat for _, lat in sent)
    held = sorted((t + lat, lat - median) for t, lat in sent if lat - median > cycle_ns)
    stalls: list[int] = []
    last_end = None
    for end, excess in held:
        if last_end is not None and end - last_end <= cycle_ns:
            stalls[-1] = min(stalls[-1], int(excess))
        else:
            stalls.append(int(excess))
        last_end = end
    return sorted(stalls)


@dataclass
class Burst:
    """What a saturating burst saw (``burst``)."""
    cycle_ns: int          # an instance's cycle, one batch to the next
    rows: float            # the mean batch
    compute_ns: int        # the mean execution the statistics recorded
    loop_ns: int           # the event loop's CPU per request (0: unread)
    stall_ns: list[int]
    stall_rate: float      # stalls a second
    stall_chance: float    # stalls a request served
    qps: float             # requests served a second
    p99_ns: int = 0        # the burst's p99 latency (its own client's)
    requests: int = 0      # requests measured
    latencies_ns: list[int] = field(default_factory=list)   # each one's, sorted
