"""A closed-loop load generator the tuner runs as a subprocess when perf_analyzer is not
installed: ``python loadgen.py`` reads one JSON job on stdin and writes one JSON result on
stdout. Standard library only, run by path (not ``-m``), so it starts in a fraction of a
second and nothing of the kernel's process (its GIL, its event loop) shapes the load.

Job: ``{"url": "http://host:port/prefix/", "headers": {...}, "model": "m", "body": "<JSON
infer request>", "concurrency": 8, "seconds": 3.0}``. Each of ``concurrency`` threads keeps
one keep-alive connection and sends the next request as soon as the last answered
(perf_analyzer's concurrency mode). Result: ``{"latencies_ms": [...], "failures": n,
"errors": [first few], "elapsed_s": t}``, latencies of the requests that succeeded.
"""
from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from urllib.parse import quote, urlsplit

#: per-request socket timeout: a hung server fails requests instead of hanging the run
REQUEST_TIMEOUT_S = 30.0


def run(job: dict) -> dict:
    parts = urlsplit(job["url"])
    path = parts.path.rstrip("/") + f"/v2/models/{quote(job['model'], safe='')}/infer"
    body = job["body"].encode()
    headers = {"Content-Type": "application/json", **job.get("headers", {})}
    seconds = float(job["seconds"])
    latencies: list[float] = []
    errors: list[str] = []
    failures = [0]
    lock = threading.Lock()
    start = time.monotonic()
    deadline = start + seconds

    def client() -> None:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=REQUEST_TIMEOUT_S)
        mine: list[float] = []
        while time.monotonic() < deadline:
            sent = time.perf_counter()
            try:
                conn.request("POST", path, body, headers)
                resp = conn.getresponse()
                data = resp.read()
                ok = resp.status == 200
            except (OSError, http.client.HTTPException) as err:
                conn.close()
                conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=REQUEST_TIMEOUT_S)
                ok, data = False, str(err).encode()
            if ok:
                mine.append((time.perf_counter() - sent) * 1000)
            else:
                with lock:
                    failures[0] += 1
                    if len(errors) < 5:
                        errors.append(data[:300].decode("utf-8", "replace"))
        conn.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(int(job["concurrency"]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + REQUEST_TIMEOUT_S + 5)
    return {"latencies_ms": latencies, "failures": failures[0], "errors": errors,
            "elapsed_s": time.monotonic() - start}


if __name__ == "__main__":
    json.dump(run(json.load(sys.stdin)), sys.stdout)
