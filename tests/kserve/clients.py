"""KServe's own clients (pip kserve, in a venv of its own) against a v2 server, as a KServe
user would call it: python clients.py HTTP_BASE_URL GRPC_HOST:PORT TOKEN. Prints one JSON line."""
import asyncio
import json
import sys

import numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig


def request() -> InferRequest:
    x = InferInput(name="INPUT0", shape=[2, 16], datatype="FP32")
    x.set_data_from_numpy(np.ones((2, 16), np.float32), binary_data=False)
    return InferRequest(model_name="linear", infer_inputs=[x])


async def main(base: str, grpc_url: str, token: str) -> dict:
    headers = {"Authorization": f"Bearer {token}"}
    rest = InferenceRESTClient(RESTConfig(protocol="v2", retries=0))
    out = {"rest_live": await rest.is_server_live(base, headers=headers),
           "rest_ready": await rest.is_server_ready(base, headers=headers),
           "rest_model_ready": await rest.is_model_ready(base, "linear", headers=headers),
           "rest_unknown_ready": await rest.is_model_ready(base, "nothing_here", headers=headers)}
    answer = await rest.infer(base, request(), model_name="linear", headers=headers)
    out["rest_infer"] = answer.outputs[0].as_numpy().tolist()
    await rest.close()
    grpc = InferenceGRPCClient(grpc_url, retries=2)
    metadata = (("authorization", f"Bearer {token}"),)
    out["grpc_live"] = await grpc.is_server_live(headers=metadata)
    out["grpc_ready"] = await grpc.is_server_ready(headers=metadata)
    out["grpc_model_ready"] = await grpc.is_model_ready("linear", headers=metadata)
    answer = await grpc.infer(request(), headers=metadata)
    out["grpc_infer"] = answer.outputs[0].as_numpy().tolist()
    await grpc.close()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:4]))))
