"""Lineage (issue 37, item 3) through a real in-kernel server: each version served from a
notebook keeps what it was served from (cell or function source, execution count, Python,
packages and their hash, git commit, golden set's hash) as ``<version>/.lineage.json``;
``handle.lineage(v)`` and ``%triton history`` read it back; only the model-repository scope
reads it; an oversized one is refused; a version without one reads as None; export skips it."""
from __future__ import annotations

import hashlib
import inspect
import json
import platform
import subprocess
import urllib.error
import urllib.request

import numpy as np
import pytest
from tornado.httpclient import HTTPClientError

import jupyter_triton as jt
from conftest import INFER_KEY, TOKEN
from jupyter_triton.kernel import api
from jupyter_triton.kernel.client import TritonHTTP
from jupyter_triton.protocol.errors import InvalidArgument
from jupyter_triton.repository.export import export_repository
from jupyter_triton.repository.lineage import LINEAGE_FILENAME, MAX_LINEAGE_BYTES
from test_tune import kernel_server  # noqa: F401 -- the fixture: a server in this kernel

pytestmark = pytest.mark.timeout(240)

X = np.arange(8, dtype=np.float32).reshape(2, 4)
GOLDEN = [(X, X * 2)]


def double(x):
    return x * 2


def twice(x):
    return x + x


def head_commit() -> str | None:
    done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def test_each_served_function_keeps_its_lineage(kernel_server, tmp_path, monkeypatch):
    first = jt.serve(double, "scale", example=X)
    second = jt.serve(twice, "scale", example=X, golden=GOLDEN)
    assert (first.version, second.version) == (1, 2)
    one, two = first.lineage(1), second.lineage()          # the handle's own version
    assert one["function_source"] == inspect.getsource(double)
    assert two["function_source"] == inspect.getsource(twice)
    for record in (one, two):
        assert record["python"] == platform.python_version()
        assert record["git_commit"] == head_commit()
        assert record["packages_hash"] == hashlib.sha256(json.dumps(
            record["packages"], sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        assert any(p.startswith("numpy==") for p in record["packages"])
        assert record["execution_count"] is None and record["cell_source"] is None  # no cell
    assert one["packages_hash"] == two["packages_hash"]    # the same environment, the same hash
    assert one["golden_hash"] is None and len(two["golden_hash"]) == 64
    assert api.lineage("scale") == two and api.lineage("scale", 1) == one
    # kept beside the version, hidden: the export leaves it out
    repo = tmp_path / "repo"
    assert json.loads((repo / "scale" / "2" / LINEAGE_FILENAME).read_text()) == two
    report = export_repository(repo, tmp_path / "exported", progress=False)
    assert report.models[0].versions == [2]
    assert (tmp_path / "exported" / "scale" / "2").is_dir()
    assert not list((tmp_path / "exported").rglob(LINEAGE_FILENAME))

    monkeypatch.chdir(tmp_path)                            # no git work tree here
    assert jt.serve(double, "scale", example=X).lineage()["git_commit"] is None


def test_the_serve_cell_and_triton_history_show_it(kernel_server, capsys):
    from IPython.testing.globalipapp import get_ipython
    ip = get_ipython()
    ip.run_line_magic("load_ext", "jupyter_triton")
    ip.user_ns["X"] = X
    cell = "%%serve cells --example X\ndef f(x):\n    return x * 5\nf\n"
    result = ip.run_cell(cell, store_history=True)
    result.raise_error()
    handle = result.result
    record = handle.lineage(handle.version)
    assert record["execution_count"] == result.execution_count
    assert record["cell_source"] == cell.rstrip("\n")        # as IPython keeps it
    assert record["python"] == platform.python_version()

    # a version loaded with no lineage (another client's upload) reads as None
    client = TritonHTTP(kernel_server)
    files = {k: v for k, v in api.uploaded["cells"].files.items() if LINEAGE_FILENAME not in k}
    client.load("cells", api.uploaded["cells"].config_json(), files)
    assert handle.lineage(handle.version + 1) is None
    capsys.readouterr()
    ip.run_line_magic("triton", "history cells")
    out = capsys.readouterr().out
    assert "lineage:" in out, out
    assert f"version {handle.version}: " in out and f"cell [{result.execution_count}]" in out
    assert f"Python {platform.python_version()}" in out and record["packages_hash"][:12] in out
    assert f"version {handle.version + 1}: no lineage" in out


@pytest.mark.parametrize("lineage,words", [
    (b"{" + b" " * MAX_LINEAGE_BYTES + b"}", f"a lineage is at most {MAX_LINEAGE_BYTES}"),
    (b"[1, 2]", "must be a JSON object"),
    (b"not json", "is not JSON"),
])
def test_a_bad_lineage_is_refused_and_writes_nothing(kernel_server, tmp_path, lineage, words):
    served = jt.serve(double, "scale", example=X)
    client = TritonHTTP(kernel_server)
    files = {**api.uploaded["scale"].files, f"1/{LINEAGE_FILENAME}": lineage}
    with pytest.raises(InvalidArgument, match=words):
        client.load("scale", api.uploaded["scale"].config_json(), files)
    assert sorted(p.name for p in (tmp_path / "repo" / "scale").iterdir() if p.name.isdigit()) == ["1"]
    assert served.lineage()["function_source"] == inspect.getsource(double)


def test_only_the_model_repository_scope_reads_it(kernel_server):
    jt.serve(double, "scale", example=X)
    for headers in ({}, {"Authorization": "token wrong"}):
        request = urllib.request.Request(kernel_server.url + "v2/models/scale/versions/1/lineage",
                                         headers=headers)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=30)
        assert err.value.code in (401, 403)


async def test_an_inference_key_cannot_read_lineage_on_jupyter(jp_triton, jp_fetch):
    key, token = {"Authorization": f"Bearer {INFER_KEY}"}, {"Authorization": f"token {TOKEN}"}
    for path in (("v2", "models", "linear", "lineage"),
                 ("v2", "models", "linear", "versions", "1", "lineage")):
        with pytest.raises(HTTPClientError) as err:
            await jp_fetch(*path, headers=key)
        assert err.value.code == 403
        read = json.loads((await jp_fetch(*path, headers=token)).body)
        assert read == {"name": "linear", "version": "1", "lineage": None}   # served without one
    for path in (("v2", "models", "linear", "versions", "9", "lineage"),
                 ("v2", "models", "missing", "lineage")):
        with pytest.raises(HTTPClientError) as err:
            await jp_fetch(*path, headers=token)
        assert err.value.code == 404
