"""How many threads the BLAS libraries of a worker process use (numpy's OpenBLAS, MKL).

OpenBLAS's pool threads spin after every call until a timeout (about 0.1 s), and the
calling thread spins while they wake: the small matrix products a dynamic batcher forms
(tens of rows) then cost milliseconds of CPU each on cores the front end needs. The
library's own timeout (``OPENBLAS_THREAD_TIMEOUT``) is read once, when the library loads,
which in a worker happens before any of our code runs; its thread count can be changed at
any time, which is what is done here.
"""
from __future__ import annotations

import ctypes
import os

#: environment variables a user sets to choose BLAS threads; where one is set, it wins
ENV_KEYS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")

# Spellings of the setters: OpenBLAS, numpy 2's scipy-openblas (ILP64 with a suffix), MKL.
_SETTERS = ("openblas_set_num_threads", "openblas_set_num_threads64_",
            "scipy_openblas_set_num_threads", "scipy_openblas_set_num_threads64_",
            "MKL_Set_Num_Threads")
_GETTERS = ("openblas_get_num_threads", "openblas_get_num_threads64_",
            "scipy_openblas_get_num_threads", "scipy_openblas_get_num_threads64_",
            "MKL_Get_Max_Threads")
_LIBRARY_MARKS = ("openblas", "libmkl_rt")


def user_chose() -> bool:
    """Whether the environment already says how many threads BLAS gets."""
    return any(os.environ.get(key, "").strip() for key in ENV_KEYS)


def env_threads() -> int:
    """The thread count the environment asks for, in the order OpenBLAS reads it; 0: none."""
    for key in ENV_KEYS:
        try:
            count = int(os.environ.get(key, "").strip())
        except ValueError:
            continue
        if count > 0:
            return count
    return 0


def _loaded_libraries() -> list[str]:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {line.split(None, 5)[-1].strip() for line in maps if ".so" in line}
    except OSError:   # no procfs (macOS: Accelerate has no such pool to tame)
        return []
    return sorted(p for p in paths if any(m in os.path.basename(p).lower() for m in _LIBRARY_MARKS))


def _functions(names: tuple[str, ...]) -> list:
    found = []
    for path in _loaded_libraries():
        try:
            lib = ctypes.CDLL(path)   # already mapped: the same handle, nothing loads again
        except OSError:
            continue
        for name in names:
            fn = getattr(lib, name, None)
            if fn is not None:
                found.append(fn)
                break
    return found


def set_threads(count: int) -> int:
    """``count`` threads for every BLAS library loaded in this process, and for those loaded
    later (through the environment, which they read when they load). Returns how many
    loaded libraries were set."""
    for key in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[key] = str(count)
    setters = _functions(_SETTERS)
    for fn in setters:
        fn.argtypes = [ctypes.c_int]
        fn.restype = None
        fn(count)
    return len(setters)


def threads() -> list[int]:
    """Threads of each loaded BLAS library (what a model or a test can check)."""
    out = []
    for fn in _functions(_GETTERS):
        fn.argtypes = []
        fn.restype = ctypes.c_int
        out.append(int(fn()))
    return out
