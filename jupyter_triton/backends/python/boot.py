"""The first code of a python backend process, run as a script (``python boot.py ROLE FD
PACKAGE_DIR PARENT_PID PATHS``): the template the server forks workers from, or a worker
run by a model's own packed environment (``EXECUTION_ENV_PATH``), whose python has not got
this package installed.

The package's outer ``__init__`` modules (the server's backends, protobuf, the engine's
imports) are not run: only the worker's own modules are imported, and the template stays
small. ``PATHS`` (JSON) go at the end of ``sys.path``: the server's, so that a model finds
what the server has, after whatever the environment has. ``TRACKER_FD``: the server's
``multiprocessing`` resource tracker, which python 3.11's ``SharedMemory`` tells of every
segment it maps (as a spawned child would share it): one of its own would unlink the
server's segments when the worker exits.
"""
import json
import os
import sys
import types

_PACKAGES = ("jupyter_triton", "jupyter_triton.backends", "jupyter_triton.backends.python")
#: BLAS thread counts the template's numpy must not read at load: its workers set their own
_BLAS_KEYS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")


def main(argv: list) -> None:
    role, fd, package_dir, parent_pid, paths = argv[1], int(argv[2]), argv[3], int(argv[4]), argv[5]
    tracker_fd = int(argv[6])
    if tracker_fd >= 0:
        from multiprocessing import resource_tracker
        resource_tracker._resource_tracker._fd = tracker_fd
    del sys.path[0]   # this script's folder: the backend's modules are not top-level modules
    sys.path.extend(p for p in json.loads(paths) if p not in sys.path)
    for depth, name in enumerate(_PACKAGES):
        module = types.ModuleType(name)
        module.__path__ = [os.path.join(package_dir, *name.split(".")[1:depth + 1])]
        module.__package__ = name
        sys.modules[name] = module
    if role == "template":
        for key in _BLAS_KEYS:
            os.environ.pop(key, None)
        from jupyter_triton.backends.python.worker_main import template_main
        template_main(fd, parent_pid)
    else:
        from jupyter_triton.backends.python.worker_main import worker_main
        worker_main(fd, int(argv[7]), int(argv[8]), parent_pid)


if __name__ == "__main__":
    main(sys.argv)
