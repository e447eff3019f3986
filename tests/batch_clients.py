"""Clients that send at once, for tests that watch requests batch together: a standalone server
with HTTP, gRPC and metrics ports, a client of either protocol per thread, and one call per
thread, all started together."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import HTTP_FRONT
from jupyter_triton.engine import EngineOptions


def start_server(repo: Path, models: list[str]):
    """A standalone server on 127.0.0.1 (free HTTP, gRPC and metrics ports), ``models`` loaded."""
    from jupyter_triton.standalone import start_in_thread
    return start_in_thread(EngineOptions(model_repository=repo, model_control_mode="explicit",
                                         load_models=models),
                           host="127.0.0.1", http_port=0, metrics_port=0, grpc_port=0,
                           http_front=HTTP_FRONT)


def client(server, grpc: bool = False):
    """A tritonclient of the server, for one thread."""
    return (grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") if grpc
            else httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}"))


def together(fn: Callable[[int], Any], count: int, timeout_s: float = 300) -> list:
    """``fn(0) ... fn(count - 1)``, each on a thread of its own, started together; their
    results in order (the first error raised)."""
    results: list = [None] * count

    def run(i: int) -> None:
        try:
            results[i] = fn(i)
        except Exception as err:        # handed back to the test
            results[i] = err
    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results
