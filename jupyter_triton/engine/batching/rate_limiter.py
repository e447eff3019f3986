"""Triton's rate limiter: an instance executes only while the resources it names are free.

``instance_group { rate_limiter { resources [{name, global, count}] priority } }`` names
what one execution of an instance holds. One ``RateLimiter`` is shared by every model of
the engine, so instances of different models compete for the same resources. A per-device
resource is counted per GPU (key ``"<name>:<device_id>"``), a global one once (``"<name>"``).

Available counts come from the server's ``--rate-limit-resource``-style limits (a key
``"name"`` applies to every device, ``"name:<device>"`` to one); a resource with no limit
gets, like Triton, the largest count any registered instance needs, so every instance can
run at least alone.

Waiters are served first-come-first-served among those whose resources fit; a lower
``priority`` value goes first (Triton weights turns by priority; we only order them).

As in tritonserver, the limiter is off unless the server is started with
``--rate-limit=execution_count`` (``EngineOptions.rate_limit``): off, instances run whenever
they are free and the config's ``rate_limiter`` blocks are ignored (``enabled``).
"""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

from tritonclient.grpc import model_config_pb2 as mc

from ...protocol.errors import InvalidArgument


def instance_resources(group: mc.ModelInstanceGroup, device_id: int = 0) -> dict[str, int]:
    """What one instance of ``group`` holds while executing, keyed as the limiter counts it."""
    needs: dict[str, int] = {}
    for res in group.rate_limiter.resources:
        key = res.name if getattr(res, "global") else f"{res.name}:{device_id}"
        needs[key] = needs.get(key, 0) + res.count
    return needs


@dataclass(order=True)
class _Waiter:
    priority: int
    seq: int
    needs: dict[str, int] = field(compare=False)
    future: asyncio.Future = field(compare=False)


RATE_LIMIT_MODES = ("off", "execution_count")


def resource_limits(values: list[str]) -> dict[str, int]:
    """``--rate-limit-resource`` values, ``<name>:<count>[:<device>]``, as the limiter's
    explicit limits: ``name`` (every device, and the global resource) or ``name:<device>``."""
    limits: dict[str, int] = {}
    for value in values:
        parts = value.split(":")
        try:
            if len(parts) not in (2, 3) or not parts[0]:
                raise ValueError
            count = int(parts[1])
            device = int(parts[2]) if len(parts) == 3 else None
            if count < 0 or (device is not None and device < 0):
                raise ValueError
        except ValueError:
            raise InvalidArgument(
                f"--rate-limit-resource '{value}': expected <name>:<count>[:<device>] with a "
                f"count and device of 0 or more") from None
        limits[parts[0] if device is None else f"{parts[0]}:{device}"] = count
    return limits


class RateLimiter:
    @classmethod
    def from_options(cls, options) -> "RateLimiter":
        """The engine's limiter from ``EngineOptions.rate_limit`` and ``rate_limit_resources``."""
        if options.rate_limit not in RATE_LIMIT_MODES:
            raise InvalidArgument(f"--rate-limit '{options.rate_limit}': expected one of "
                                  f"{', '.join(RATE_LIMIT_MODES)}")
        return cls(resource_limits(options.rate_limit_resources),
                   enabled=options.rate_limit == "execution_count")

    def __init__(self, resource_limits: dict[str, int] | None = None, *, enabled: bool = False) -> None:
        self.enabled = enabled
        self._explicit = dict(resource_limits or {})
        self._limits: dict[str, int] = {}
        self._in_use: dict[str, int] = {}
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()

    def limit(self, key: str) -> int | None:
        if key in self._explicit:
            return self._explicit[key]
        return self._explicit.get(key.split(":", 1)[0])

    def register(self, resources: dict[str, int], model: str = "") -> None:
        """Account for an instance that will need ``resources``; called once per instance at load."""
        for key, count in resources.items():
            limit = self.limit(key)
            if limit is not None and limit < count:
                raise InvalidArgument(
                    f"Resource count for \"{key}\" is limited to {limit} which will prevent "
                    f"scheduling of one or more model instances of '{model}', the minimum "
                    f"required count is {count}")
            self._limits[key] = max(self._limits.get(key, 0), limit or count)

    def _fits(self, needs: dict[str, int]) -> bool:
        return all(self._in_use.get(k, 0) + n <= self._limits.get(k, n) for k, n in needs.items())

    async def acquire(self, resources: dict[str, int], priority: int = 0) -> None:
        """Wait until ``resources`` are free and hold them."""
        if not self._waiters and self._fits(resources):
            self._take(resources)
            return
        waiter = _Waiter(priority, next(self._seq), resources, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._waiters.sort()
        try:
            await waiter.future
        except BaseException:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif waiter.future.done() and not waiter.future.cancelled():
                self.release(resources)   # granted just as we were cancelled
            raise

    def release(self, resources: dict[str, int]) -> None:
        for key, n in resources.items():
            self._in_use[key] = self._in_use.get(key, 0) - n
        for waiter in list(self._waiters):
            if self._fits(waiter.needs):
                self._waiters.remove(waiter)
                self._take(waiter.needs)
                waiter.future.set_result(None)

    def _take(self, needs: dict[str, int]) -> None:
        for key, n in needs.items():
            self._in_use[key] = self._in_use.get(key, 0) + n

    def in_use(self) -> dict[str, int]:
        return {k: v for k, v in self._in_use.items() if v}
