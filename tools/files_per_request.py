"""How many of the package's files one inference calls into, in the server process.

Starts a standalone server on loopback in this process with a profile hook on
every thread, sends a few warm-up requests, then records the package files
(``jupyter_triton/**.py``) whose functions run while one request is answered:
a binary HTTP inference on an ONNX model, the same over gRPC, and a binary
HTTP inference on a python ``model.py``. The python model's own process is not
counted (it is the model's, not the server's).

    python tools/files_per_request.py [--list]
"""

from __future__ import annotations

import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

PACKAGE = str(Path(__file__).resolve().parents[1] / "jupyter_triton")

ADD_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x + 1)]))
        return out
'''

CONFIG = '''name: "{name}"
backend: "{backend}"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
dynamic_batching {{ }}
'''


def build_repository(root: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], "identity",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    for name, backend, filename, data in (
            ("onnx_id", "onnxruntime", "model.onnx", model.SerializeToString()),
            ("py_add", "python", "model.py", ADD_PY.encode())):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / filename).write_bytes(data)
        (root / name / "config.pbtxt").write_text(CONFIG.format(name=name, backend=backend))
    return root


class Recorder:
    def __init__(self) -> None:
        self.on = False
        self.files: set[str] = set()

    def __call__(self, frame, event, arg):
        if self.on and event == "call":
            filename = frame.f_code.co_filename
            if filename.startswith(PACKAGE):
                self.files.add(filename[len(PACKAGE) + 1:])

    def measure(self, send) -> set[str]:
        for _ in range(5):
            send()
        self.files = set()
        self.on = True
        send()
        self.on = False
        return self.files


def main(argv: list[str]) -> int:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    recorder = Recorder()
    sys.setprofile(recorder)
    threading.setprofile(recorder)
    from jupyter_triton.engine.options import EngineOptions
    from jupyter_triton.standalone import start_in_thread

    with tempfile.TemporaryDirectory() as tmp:
        repo = build_repository(Path(tmp))
        server = start_in_thread(
            EngineOptions(model_repository=repo, model_control_mode="explicit", load_models=["*"]),
            host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0, access_log=False)
        try:
            http = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
            grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
            x = np.ones((1, 4), np.float32)

            def over(client, module, model):
                def send():
                    tensor = module.InferInput("INPUT0", [1, 4], "FP32")
                    if module is httpclient:
                        tensor.set_data_from_numpy(x, binary_data=True)
                        out = [module.InferRequestedOutput("OUTPUT0", binary_data=True)]
                    else:
                        tensor.set_data_from_numpy(x)
                        out = [module.InferRequestedOutput("OUTPUT0")]
                    client.infer(model, [tensor], outputs=out)
                return send

            rows = [("binary HTTP, ONNX model", over(http, httpclient, "onnx_id"), 10),
                    ("gRPC, ONNX model", over(grpc, grpcclient, "onnx_id"), 10),
                    ("binary HTTP, python model.py", over(http, httpclient, "py_add"), 13)]
            worst = 0
            for label, send, target in rows:
                files = recorder.measure(send)
                print(f"{label}: {len(files)} files (target <= {target})")
                if "--list" in argv:
                    for name in sorted(files):
                        print("   ", name)
                worst = max(worst, len(files) - target)
        finally:
            server.close()
    return 1 if worst > 0 else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
