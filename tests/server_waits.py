"""Waits for what a server shows, for tests that must act once a request reached it (queued,
or running) rather than after a sleep, which a busy machine can outlast."""
from __future__ import annotations

import asyncio
import time

import tritonclient.http as httpclient


def started(client: httpclient.InferenceServerClient, model: str) -> int:
    """Requests of ``model`` that left its queue for an instance (Triton counts a request's
    queue time when its batch starts)."""
    return client.get_inference_statistics(model)["model_stats"][0]["inference_stats"]["queue"]["count"]


def wait_for_start(client: httpclient.InferenceServerClient, model: str, before: int,
                   seconds: float = 30) -> None:
    """Until a request beyond the ``before`` counted is running."""
    deadline = time.monotonic() + seconds
    while started(client, model) <= before:
        assert time.monotonic() < deadline, f"no request of {model} started within {seconds:g} s"
        time.sleep(0.02)


def served_model(engine, model: str):
    """The in-process engine's loaded version of ``model``."""
    (found,) = [mv for mv in engine.models() if mv.name == model]
    return found


def wait_for_queued(model_version, count: int, seconds: float = 10) -> None:
    """Until ``count`` requests of an in-process model wait in its queue (or sequence
    backlog), not yet handed to an instance: Triton's pending request count."""
    deadline = time.monotonic() + seconds
    while model_version.pending_count < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert model_version.pending_count == count, \
        f"{model_version.name}: {model_version.pending_count} requests queued, not {count}"


def wait_for_inferences(client: httpclient.InferenceServerClient, model: str, count: int,
                        seconds: float = 30) -> dict:
    """Until ``model``'s statistics count ``count`` inferences (a stream's last response can
    reach its caller before the model that sent it has counted it); returns those statistics."""
    deadline = time.monotonic() + seconds
    while True:
        stats = client.get_inference_statistics(model)["model_stats"][0]
        if stats["inference_count"] >= count or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def wait_until(condition, what: str, seconds: float = 30):
    """Until ``condition()`` returns something true (returned): for what a server shows that
    no helper above reads, such as an in-process engine's statistics."""
    deadline = time.monotonic() + seconds
    while not (found := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {seconds:g} s"
        time.sleep(0.02)
    return found


async def until(condition, what: str, seconds: float = 30):
    """``wait_until`` for a test that shares its event loop with the server (a Jupyter
    server's fixtures): waits without blocking the loop that must make the change."""
    deadline = time.monotonic() + seconds
    while not (found := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {seconds:g} s"
        await asyncio.sleep(0.01)
    return found
