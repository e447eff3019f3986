"""The README's Quickstart runs as written: its curl lines and its tritonclient snippet, against
the out-of-the-box Jupyter server (the demo repository, nothing configured), with only the
placeholders a reader fills in (the token, the port) filled by the test."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from traitlets.config import Config

from conftest import TOKEN, in_thread

README = Path(__file__).resolve().parent.parent / "README.md"


def blocks(section: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block under the README heading ``section``."""
    text = README.read_text()
    start = text.index(f"\n{section}\n")
    end = text.find("\n## ", start + 1)
    body = text[start:end if end >= 0 else None]
    return re.findall(r"```(\w+)\n(.*?)```", body, re.S)


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"jupyter_triton": True}, "token": TOKEN},
            "IdentityProvider": {"token": TOKEN}}


@pytest.fixture
def jp_base_url() -> str:
    return "/"          # the README's URLs are a plain `./dev lab`'s


def _fill(code: str, port: int) -> str:
    assert "localhost:8888" in code and ("TOKEN" in code)
    code = code.replace("localhost:8888", f"localhost:{port}")
    return re.sub(r"^TOKEN=\.\.\..*$", f"TOKEN={TOKEN}", code, flags=re.M)


def _json_values(text: str) -> list:
    decoder, values, at = json.JSONDecoder(), [], 0
    while at < len(text.rstrip()):
        value, at = decoder.raw_decode(text, at)
        values.append(value)
        while at < len(text) and text[at].isspace():
            at += 1
    return values


async def test_quickstart_blocks_run_as_written(jp_triton, jp_http_port):
    found = blocks("## Quickstart")
    assert [lang for lang, _ in found] == ["bash", "python"]
    (_, shell), (_, python) = found

    done = await in_thread(lambda: subprocess.run(
        ["bash", "-euo", "pipefail", "-c", _fill(shell, jp_http_port)],
        capture_output=True, text=True, timeout=60))
    assert done.returncode == 0, done.stderr
    metadata, answer = _json_values(done.stdout)       # curl prints the two bodies back to back
    assert metadata["name"] == "demo" and metadata["versions"] == ["1"]
    assert answer["outputs"][0]["shape"] == [1, 4]

    printed: list[str] = []
    namespace = {"TOKEN": TOKEN, "print": lambda *a: printed.append(" ".join(map(str, a)))}
    code = compile(_fill(python, jp_http_port), str(README), "exec")

    def run():      # tritonclient.http's client lives on the thread that made it (gevent)
        exec(code, namespace)
        return namespace["client"].get_model_metadata("mine", headers=namespace["auth"]())

    mine = await in_thread(run)
    assert printed[0].count("[") == 3                         # the demo's (2, 4) answer
    assert printed[-1] == "True"                              # the model it loaded is served
    assert mine["versions"] == ["1"] and mine["platform"] == "onnxruntime_onnx"


def test_extension_configuration_block_is_valid_config():
    # Every trait the README's configuration block sets exists, with a value of its type.
    from jupyter_triton.serverext import JupyterTriton
    (lang, code), = blocks("## Configuration of the server extension")
    assert lang == "python"
    c = Config()
    exec(compile(code, str(README), "exec"), {"c": c})
    app = JupyterTriton(config=c)
    for name, value in c.JupyterTriton.items():
        assert app.trait_has_value(name) or name in app.trait_names(), name
        assert getattr(app, name) == value, name
