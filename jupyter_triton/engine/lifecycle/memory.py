"""What each loaded model version holds in memory: Triton's ``memory_usage`` statistics
(a list of ``{"type": "CPU" | "GPU", "id": <device>, "byte_size": <bytes>}``) and the
``nv_model_memory_bytes{model,version,kind}`` gauge.

Where a model runs decides how we can know:

- in worker processes of its own (python models in process mode): each worker's RSS,
  and that of anything it started, read live at every statistics call (a worker that
  restarted is the new process), plus what NVML says those processes hold on each GPU;
- in the server's process (onnxruntime, pytorch, tensorrt, python in thread mode): nothing
  can split one process's heap between models, so we measure what the process gained
  while the version loaded and warmed up (RSS growth; on a GPU torch's allocator growth for
  pytorch, NVML's per-process growth otherwise), once, at load. Arenas that grow later, on
  bigger batches, are not counted, and another model loading at the same moment blurs the
  figure; it is an honest measurement of the load, not an accounting of the heap. The
  allocator may give a reloaded model the memory an unloaded one freed, so on the CPU the
  figure is at least the bytes of the version's files (its weights): the residency budget
  (engine/lifecycle/residency.py) sums these figures.

Nothing here runs on the data path: the probe runs once per load, and the live readings
only when someone asks for statistics or metrics.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable, Iterable

import psutil

#: what ``ModelStatistics.memory`` holds: a function returning Triton's memory_usage list
MemoryReader = Callable[[], list[dict]]


#: seconds a python model's live reading is reused: dashboards poll statistics every second
LIVE_TTL_S = 1.0


def descendants(pid: int) -> list[int]:
    """Every process ``pid`` started, from /proc/<pid>/task/*/children (Linux): a few small
    reads, where psutil's children() scans every process of the machine."""
    found, todo = [], [pid]
    while todo and len(found) < 4096:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except (OSError, ValueError):
                continue
            found += kids
            todo += kids
    return found


def rss(pid: int, children: bool = True) -> int:
    """Resident bytes of ``pid`` (and, by default, of every process it started); 0 when gone."""
    total = 0
    for p in [pid] + (descendants(pid) if children else []):
        try:
            total += psutil.Process(p).memory_info().rss
        except psutil.Error:
            pass
    return total


class _Nvml:
    """NVML per-process GPU memory; empty when pynvml is missing or there is no GPU."""

    _lock = threading.Lock()
    _handles: list[Any] | None = None

    @classmethod
    def handles(cls) -> list[Any]:
        with cls._lock:
            if cls._handles is None:
                try:
                    import pynvml
                    pynvml.nvmlInit()
                    cls._handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                                    for i in range(pynvml.nvmlDeviceGetCount())]
                except Exception:       # no driver, no library, no GPU: no GPU readings
                    cls._handles = []
            return cls._handles

    @classmethod
    def used_by(cls, pids: Iterable[int]) -> dict[int, int]:
        """GPU index -> bytes the given processes hold there (only GPUs where they hold any)."""
        handles = cls.handles()
        if not handles:
            return {}
        import pynvml
        wanted = set(pids)
        used: dict[int, int] = {}
        for index, handle in enumerate(handles):
            for fn in (pynvml.nvmlDeviceGetComputeRunningProcesses,
                       pynvml.nvmlDeviceGetGraphicsRunningProcesses):
                try:
                    procs = fn(handle)
                except Exception:
                    continue
                for p in procs:
                    if p.pid in wanted and p.usedGpuMemory:
                        used[index] = used.get(index, 0) + int(p.usedGpuMemory)
        return used


def _torch_allocated(devices: Iterable[int]) -> dict[int, int]:
    """torch's CUDA allocator, per device, when torch is already loaded and CUDA started."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {d: 0 for d in devices}
    return {d: int(torch.cuda.memory_allocated(d)) for d in devices}


def files_bytes(backends: Iterable[Any]) -> int:
    """Bytes of the version directory the backends loaded from (once, however many instances)."""
    dirs = {str(b.files.version_dir) for b in backends if getattr(b, "files", None) is not None}
    total = 0
    for d in dirs:
        for dirpath, dirnames, filenames in os.walk(d):
            dirnames[:] = [n for n in dirnames if n != "__pycache__"]
            for name in filenames:
                try:
                    total += os.stat(os.path.join(dirpath, name)).st_size
                except OSError:
                    pass
    return total


def worker_pids(backends: Iterable[Any]) -> list[int]:
    """The worker processes serving these instances (python models in process mode)."""
    pids = []
    for backend in backends:
        pid = getattr(backend, "worker_pid", None)
        if pid:
            pids.append(pid)
    return pids


class LoadProbe:
    """Started just before a version's instances are created, finished once they are loaded
    and warmed up; ``finish`` returns the version's ``MemoryReader``."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._rss = rss(self._pid, children=False)
        self._nvml = _Nvml.used_by([self._pid])
        self._torch = _torch_allocated(range(len(_Nvml.handles())))

    def finish(self, backends: list[Any]) -> MemoryReader:
        backends = list(backends)
        out_of_process = bool(backends) and all(getattr(b, "worker_pid", None) for b in backends)
        if out_of_process:
            return _Live(backends)
        gpus = sorted({b.instance.device_id for b in backends if b.instance.kind == "KIND_GPU"})
        cpu = max(0, rss(self._pid, children=False) - self._rss)
        if not gpus:
            # the allocator reuses what an unloaded model freed (glibc raises its mmap
            # threshold after the first large free), so a reload can grow RSS by nothing;
            # a model on the CPU holds at least its files' bytes (its weights)
            cpu = max(cpu, files_bytes(backends))
        usage = [{"type": "CPU", "id": 0, "byte_size": cpu}]
        if gpus:
            if any(getattr(b, "backend_name", "") == "pytorch" for b in backends):
                now = _torch_allocated(gpus)
                grown = {d: now[d] - self._torch.get(d, 0) for d in gpus}
            else:
                now = _Nvml.used_by([self._pid])
                grown = {d: now.get(d, 0) - self._nvml.get(d, 0) for d in gpus}
            usage += [{"type": "GPU", "id": d, "byte_size": max(0, grown[d])} for d in gpus]
        return lambda: [dict(u) for u in usage]


class _Live:
    """A python model's memory, read from its worker processes (reused for LIVE_TTL_S)."""

    def __init__(self, backends: list[Any]) -> None:
        self._backends = backends
        self._lock = threading.Lock()
        self._at = -LIVE_TTL_S
        self._usage: list[dict] = []

    def __call__(self) -> list[dict]:
        with self._lock:
            now = time.monotonic()
            if now - self._at >= LIVE_TTL_S:
                self._usage, self._at = _worker_usage(self._backends), now
            return [dict(u) for u in self._usage]


def _worker_usage(backends: list[Any]) -> list[dict]:
    pids = worker_pids(backends)
    tree = pids + [c for pid in pids for c in descendants(pid)]
    cpu = 0
    for pid in tree:
        try:
            cpu += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    usage = [{"type": "CPU", "id": 0, "byte_size": cpu}]
    usage += [{"type": "GPU", "id": d, "byte_size": n} for d, n in sorted(_Nvml.used_by(tree).items())]
    return usage


def metric_samples(stats_labels: Iterable[tuple[Any, dict]]) -> list[tuple[dict, int]]:
    """``nv_model_memory_bytes`` samples: per version and kind (CPU, GPU summed over devices)."""
    samples = []
    for stats, labels in stats_labels:
        reader = getattr(stats, "memory", None)
        if reader is None:
            continue
        per_kind: dict[str, int] = {}
        for u in reader():
            per_kind[u["type"]] = per_kind.get(u["type"], 0) + int(u["byte_size"])
        samples += [({**labels, "kind": kind}, n) for kind, n in sorted(per_kind.items())]
    return samples
