"""Which NVIDIA GPUs this process may use, found without loading CUDA.

Asking CUDA (or onnxruntime's CUDA provider, or torch.cuda) on a machine without a GPU
loads large libraries and, for onnxruntime-gpu, prints library errors; so we ask the
driver instead: NVML when ``pynvml`` is installed, else the driver's /proc entries, else
``nvidia-smi -L``. The physical list is cached; ``CUDA_VISIBLE_DEVICES`` is applied on
every call, as CUDA applies it when it starts.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from ..protocol.errors import InvalidArgument, Unavailable

_PROC_GPUS = Path("/proc/driver/nvidia/gpus")


@functools.cache
def _physical_gpu_names() -> tuple[str, ...]:
    for probe in (_names_from_nvml, _names_from_proc, _names_from_nvidia_smi):
        try:
            names = probe()
        except Exception:  # a broken driver install means "no usable GPU", not a crash
            names = None
        if names is not None:
            return tuple(names)
    return ()


def _names_from_nvml() -> list[str] | None:
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    try:
        names = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        return names
    finally:
        pynvml.nvmlShutdown()


def _names_from_proc() -> list[str] | None:
    if not _PROC_GPUS.is_dir():
        return None
    names = []
    # one directory per GPU, named by PCI bus id; CUDA's default order is by bus id too
    for entry in sorted(_PROC_GPUS.iterdir()):
        name = "NVIDIA GPU"
        info = entry / "information"
        if info.exists():
            for line in info.read_text(errors="replace").splitlines():
                if line.startswith("Model:"):
                    name = line.split(":", 1)[1].strip()
        names.append(name)
    return names


def _names_from_nvidia_smi() -> list[str] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    done = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10, check=False)
    if done.returncode != 0:
        return None
    # "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-...)"
    names = []
    for line in done.stdout.splitlines():
        if line.startswith("GPU ") and ":" in line:
            names.append(line.split(":", 1)[1].split("(UUID")[0].strip())
    return names


def _visible(physical: tuple[str, ...]) -> list[str]:
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return list(physical)
    visible: list[str] = []
    for item in (s.strip() for s in spec.split(",")):
        if item.startswith(("GPU-", "MIG-")):
            # a UUID we cannot map without NVML: it names some present device
            if len(visible) < len(physical):
                visible.append(item)
            continue
        try:
            index = int(item)
        except ValueError:
            break
        # CUDA stops at the first entry that names no device
        if index < 0 or index >= len(physical):
            break
        visible.append(physical[index])
    return visible


def gpu_names() -> list[str]:
    """Names of the GPUs this process may use, in CUDA's device order."""
    return _visible(_physical_gpu_names())


def gpu_count() -> int:
    """How many GPUs this process may use; 0 on a machine without an NVIDIA driver."""
    return len(gpu_names())


def resolve_kind(kind: str | int) -> str:
    """An instance group's kind as the engine places it: KIND_AUTO becomes KIND_GPU when a
    GPU is present and KIND_CPU otherwise (Triton's rule); KIND_MODEL runs where the
    backend puts it, which for ours is the CPU unless the model moves itself."""
    name = mc.ModelInstanceGroup.Kind.Name(kind) if isinstance(kind, int) else kind
    if name == "KIND_AUTO":
        return "KIND_GPU" if gpu_count() > 0 else "KIND_CPU"
    if name not in mc.ModelInstanceGroup.Kind.keys():
        raise InvalidArgument(f"unknown instance group kind '{name}'")
    return name


def require_gpu(model: str, device_id: int) -> None:
    """Raise Unavailable unless GPU ``device_id`` exists here (Triton refuses such a group)."""
    count = gpu_count()
    if count == 0:
        raise Unavailable(
            f"model '{model}': instance group kind KIND_GPU needs an NVIDIA GPU, and there is "
            f"no NVIDIA GPU on this machine (use KIND_CPU or KIND_AUTO)")
    if not 0 <= device_id < count:
        raise InvalidArgument(
            f"model '{model}': instance group specifies GPU {device_id} but only {count} "
            f"GPU(s) are visible (CUDA_VISIBLE_DEVICES / driver)")
