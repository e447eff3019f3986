"""The peer: the benchmark's model served by PyTriton (tritonserver + a Python @batch function).

Run by run.py with the interpreter of PyTriton's own venv (it pins numpy<2, so it stays out of
the project's venv):

    PYTRITON_VENV/bin/python benchmarks/pytriton_peer.py --http-port P --grpc-port G --workspace DIR

Serves ``matmul_pytriton`` (models.py's y = x·W with the same W, max_batch_size and queue
delay) on 127.0.0.1 until SIGTERM or SIGINT.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import sysconfig
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import FEATURES, MAX_BATCH_SIZE, QUEUE_DELAY_US, weights  # noqa: E402

MODEL = "matmul_pytriton"
# Not "statistics": perf_analyzer reads them without PyTriton's access token (0.7.0 restricts
# them by default and perf_analyzer stops with "This API is restricted").
RESTRICTED = ["shared-memory", "model-repository", "trace", "logging"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--workspace", type=Path, required=True,
                        help="a path that does not exist yet (PyTriton creates it)")
    args = parser.parse_args()

    # The bundled triton_python_backend_stub links libpython3.X.so.1.0 by soname: with a
    # non-system interpreter (pyenv) the loader may pick the system's libpython of another
    # patch release, and the stub dies at start. This interpreter's own comes first.
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    os.environ["LD_LIBRARY_PATH"] = ":".join(p for p in (libdir, os.environ.get("LD_LIBRARY_PATH")) if p)

    import numpy as np
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

    w = weights()

    @batch
    def infer(INPUT0: np.ndarray) -> dict[str, np.ndarray]:  # noqa: N803 (the tensor's name)
        return {"OUTPUT0": INPUT0 @ w}

    config = TritonConfig(http_address="127.0.0.1", http_port=args.http_port,
                          grpc_address="127.0.0.1", grpc_port=args.grpc_port,
                          allow_metrics=False, exit_on_error=True)
    stop = threading.Event()
    # Started in the background, the process may inherit SIGINT ignored: both signals are
    # mapped to a clean stop, which also ends tritonserver and its stub.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with Triton(config=config, workspace=args.workspace,
                security_config=TritonSecurityConfig(restricted_endpoints=RESTRICTED)) as triton:
        triton.bind(
            model_name=MODEL, infer_func=infer,
            inputs=[Tensor(name="INPUT0", dtype=np.float32, shape=(FEATURES,))],
            outputs=[Tensor(name="OUTPUT0", dtype=np.float32, shape=(FEATURES,))],
            config=ModelConfig(max_batch_size=MAX_BATCH_SIZE,
                               batcher=DynamicBatcher(max_queue_delay_microseconds=QUEUE_DELAY_US)))
        triton.run()
        print(f"pytriton_peer: serving {MODEL} (HTTP {args.http_port}, gRPC {args.grpc_port})", flush=True)
        while not stop.wait(0.5):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
