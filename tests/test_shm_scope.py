"""Shared memory is not in an inference key's scope: registering a region opens any /dev/shm
object the Jupyter server's user can open (for a model to read, for outputs to overwrite).
A key still infers with its tensors inline; the Jupyter token registers regions."""
from __future__ import annotations

import asyncio
import uuid

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from conftest import INFER_KEY, TOKEN

KEY = {"Authorization": f"Bearer {INFER_KEY}"}
AUTH = {"Authorization": f"token {TOKEN}"}


@pytest.fixture
def jp_server_config(jp_server_config):
    return {**jp_server_config,
            "JupyterTriton": {**jp_server_config["JupyterTriton"], "grpc_port": 0}}


@pytest.fixture
def region():
    tag = uuid.uuid4().hex[:10]
    name, key = f"region_{tag}", f"/test_scope_{tag}"
    handle = shm.create_shared_memory_region(name, key, 64)
    yield name, key
    shm.destroy_shared_memory_region(handle)


async def test_an_inference_key_cannot_register_shared_memory(jp_triton, jp_http_port, jp_base_url,
                                                              region):
    name, key = region
    (ext,) = jp_triton.extension_manager.extension_apps["jupyter_triton"]

    def story() -> None:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{jp_http_port}{jp_base_url.rstrip('/')}",
                                             network_timeout=60)
        g = grpcclient.InferenceServerClient(f"127.0.0.1:{ext.bound_grpc_port}")
        try:
            with pytest.raises(InferenceServerException) as err:
                c.register_system_shared_memory(name, key, 64, headers=dict(KEY))
            assert err.value.status() == "403"
            assert "'shared-memory' API" in err.value.message()
            with pytest.raises(InferenceServerException) as err:
                c.get_system_shared_memory_status(headers=dict(KEY))
            assert err.value.status() == "403"
            with pytest.raises(InferenceServerException) as err:
                g.register_system_shared_memory(name, key, 64,
                                                headers={"authorization": f"Bearer {INFER_KEY}"})
            assert err.value.status() == str(grpc.StatusCode.PERMISSION_DENIED)
            assert "'shared-memory' API" in err.value.message()
            assert c.get_system_shared_memory_status(headers=dict(AUTH)) == []   # nothing registered

            # the key still infers, inline
            inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
            inp.set_data_from_numpy(np.ones((1, 16), np.float32))
            assert c.infer("linear", [inp], headers=dict(KEY)).as_numpy("OUTPUT0").shape == (1, 4)
            # and the Jupyter token registers regions
            c.register_system_shared_memory(name, key, 64, headers=dict(AUTH))
            assert [r["name"] for r in c.get_system_shared_memory_status(headers=dict(AUTH))] == [name]
        finally:
            c.unregister_system_shared_memory(headers=dict(AUTH))
            c.close()
            g.close()

    await asyncio.to_thread(story)
