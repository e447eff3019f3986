"""Where a hub's users reach this server (``jupyter_triton.hub``), and a gRPC port that cannot
be bound said where the user looks: the runtime file and the handle's notes, not only the log.
The same against a real JupyterHub: tests/test_jupyterhub.py."""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
from tornado.httpclient import HTTPClientError

from conftest import TOKEN, in_thread
from jupyter_triton import hub
from jupyter_triton.kernel import discovery
from jupyter_triton.kernel.handle import ServedModel

HUB = {"JUPYTERHUB_API_TOKEN": "t", "JUPYTERHUB_SERVICE_PREFIX": "/jhub/user/alice/",
       "JUPYTERHUB_BASE_URL": "/jhub/"}


def test_the_hubs_public_url_when_it_says_it():
    got = hub.public_address({**HUB, "JUPYTERHUB_PUBLIC_URL": "https://hub.example.org/jhub/user/alice/"})
    assert (got.url, got.source) == ("https://hub.example.org/jhub/user/alice/", "JUPYTERHUB_PUBLIC_URL")
    # an older hub says only its host
    got = hub.public_address({**HUB, "JUPYTERHUB_PUBLIC_URL": "", "JUPYTERHUB_HOST": "https://hub.example.org"})
    assert (got.url, got.source) == ("https://hub.example.org/jhub/user/alice/", "JUPYTERHUB_HOST")


def test_the_operators_public_url_comes_first_with_the_servers_own_path():
    got = hub.public_address({**HUB, "JUPYTERHUB_PUBLIC_URL": "http://inside:8000/jhub/user/alice/"},
                             "https://hub.example.org/anything/")
    assert got.url == "https://hub.example.org/jhub/user/alice/"
    assert hub.public_address({}, "http://lab.example.org:8888", "/base/").url == \
        "http://lab.example.org:8888/base/"
    bad = hub.public_address(HUB, "hub.example.org")
    assert not bad.url and "ignored" in bad.note


def test_a_hub_that_does_not_say_its_address_is_said_plainly():
    got = hub.public_address({**HUB, "JUPYTERHUB_PUBLIC_URL": "", "JUPYTERHUB_HOST": ""})
    assert not got.url and "JupyterHub.public_url" in got.note and "/jhub/user/alice/" in got.note
    assert hub.public_address({}).url == "" and hub.public_address({}).note == ""


def test_the_credential_a_hub_kernel_has():
    env = {**HUB, "JUPYTERHUB_PUBLIC_HUB_URL": "https://hub.example.org/jhub/hub/"}
    assert hub.token_page(env) == "https://hub.example.org/jhub/hub/token"
    assert "$JUPYTERHUB_API_TOKEN" in hub.credential_note(env)
    assert hub.token_page(HUB) == "/jhub/hub/token" and hub.credential_note({}) == ""


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def jp_server_config(jp_server_config, taken_port):
    return {**jp_server_config, "JupyterTriton": {**jp_server_config["JupyterTriton"],
                                                   "grpc_port": taken_port}}


async def test_a_grpc_port_that_cannot_be_bound_is_said_in_the_runtime_file_and_the_handle(
        jp_triton, jp_fetch, taken_port, monkeypatch):
    (ext,) = jp_triton.extension_manager.extension_apps["jupyter_triton"]
    # the rest of the extension started: its HTTP routes serve
    assert (await jp_fetch("v2/health/ready", headers={"Authorization": f"token {ext.server_token}"})).code == 200
    info = json.loads(Path(ext.runtime_file).read_text())
    assert info["grpc_port"] is None and f":{taken_port}" in info["grpc_error"]
    monkeypatch.delenv("JUPYTERHUB_API_TOKEN", raising=False)
    conn = await in_thread(discovery.from_runtime_files, Path(ext.runtime_file).parent)
    assert conn is not None and conn.grpc_url == ""
    shown = await in_thread(repr, ServedModel("linear", 1, conn))
    assert f"note     could not bind the gRPC server to 127.0.0.1:{taken_port}" in shown, shown


@pytest.fixture
def hub_env(monkeypatch, jp_base_url):
    """The environment of a hub's single-user server whose hub does not say its address."""
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "a token of alice's server")
    monkeypatch.setenv("JUPYTERHUB_SERVICE_PREFIX", jp_base_url)
    for name in ("JUPYTERHUB_PUBLIC_URL", "JUPYTERHUB_HOST", "JUPYTERHUB_PUBLIC_HUB_URL", hub.ENV_PUBLIC_URL):
        monkeypatch.delenv(name, raising=False)
    yield
    os.environ.pop(hub.ENV_PUBLIC_URL, None)


async def test_a_hub_that_says_no_address_is_reached_where_its_users_requests_came(
        hub_env, jp_triton, jp_fetch, jp_base_url):
    (ext,) = jp_triton.extension_manager.extension_apps["jupyter_triton"]

    def advertised() -> dict:
        return json.loads(Path(ext.runtime_file).read_text())
    assert advertised()["public_url"] == "" and "JupyterHub.public_url" in advertised()["public_url_note"]
    through_proxy = {"X-Forwarded-For": "10.0.0.9", "X-Forwarded-Proto": "https,http",
                     "X-Forwarded-Host": "hub.example.org"}
    # anyone can send these headers: a request that is not the user's teaches nothing
    with pytest.raises(HTTPClientError):
        await jp_fetch("api/contents", headers={**through_proxy, "X-Forwarded-Host": "evil.example",
                                                "Authorization": "token not-alices"})
    # nor does the user's own request that did not come through a proxy
    await jp_fetch("api/status", headers={"Authorization": f"token {TOKEN}"})
    assert advertised()["public_url"] == ""
    await jp_fetch("api/status", headers={**through_proxy, "Authorization": f"token {TOKEN}"})
    public = f"https://hub.example.org{jp_base_url}"
    assert advertised()["public_url"] == public and advertised()["public_url_note"] == ""
    assert os.environ[hub.ENV_PUBLIC_URL] == public        # for kernels started from now on
    # learned once: later requests change nothing
    await jp_fetch("api/status", headers={**through_proxy, "X-Forwarded-Host": "other.example",
                                          "Authorization": f"token {TOKEN}"})
    assert advertised()["public_url"] == public
    conn = await in_thread(discovery.from_runtime_files, Path(ext.runtime_file).parent)
    shown = await in_thread(repr, ServedModel("linear", 1, conn))
    assert f"URL      {public}v2/models/linear" in shown and "$JUPYTERHUB_API_TOKEN" in shown, shown
    assert "https://hub.example.org/hub/token" in shown
