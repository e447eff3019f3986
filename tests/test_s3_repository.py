"""A model repository in S3 (``s3://host:port/bucket/path``, Triton's syntax), against a real S3
API on loopback (moto's server): served from the local cache it is mirrored into, a version
that appears in the bucket is served after a poll, an upload through the repository API
becomes a new version in the bucket (never over one there), and a restart on the same cache
downloads nothing it has."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import W, build_repository, serve
from jupyter_triton.protocol.errors import InvalidArgument, Unavailable
from jupyter_triton.repository.remote import RemoteRepository, S3Location, is_remote, open_repository
from onnx_models import linear

pytestmark = pytest.mark.timeout(120)

BUCKET = "team-models"


@pytest.fixture(scope="module")
def moto_endpoint():
    from moto.server import ThreadedMotoServer
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"{host}:{port}"
    server.stop()


@pytest.fixture
def bucket(moto_endpoint: str, monkeypatch, tmp_path: Path):
    """An empty bucket holding the tests' repository under models/; AWS credentials as a user
    sets them (moto accepts any)."""
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TRITON_AWS_MOUNT_DIRECTORY", raising=False)
    import s3fs
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": f"http://{moto_endpoint}"},
                           use_listings_cache=False, skip_instance_cache=True)
    if fs.exists(BUCKET):
        fs.rm(BUCKET, recursive=True)
    fs.mkdir(BUCKET)
    fs.put(str(build_repository(tmp_path / "seed")) + "/", f"{BUCKET}/models/", recursive=True)
    yield fs
    fs.invalidate_cache()


def _url(endpoint: str) -> str:
    return f"s3://{endpoint}/{BUCKET}/models"


def _infer_linear(client: httpclient.InferenceServerClient, version: str = "") -> np.ndarray:
    x = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    x.set_data_from_numpy(np.ones((1, 16), np.float32))
    return client.infer("linear", [x], model_version=version).as_numpy("OUTPUT0")


def _wait(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while True:
        got = condition()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what} within {seconds} s"
        time.sleep(0.2)


def test_triton_s3_paths_parse():
    assert S3Location.parse("s3://bucket/path/to/repo") == S3Location("bucket", "path/to/repo", None)
    assert S3Location.parse("s3://127.0.0.1:9000/bucket/repo/") == S3Location("bucket", "repo", "http://127.0.0.1:9000")
    assert S3Location.parse("s3://https://minio.local:443/models") == S3Location("models", "", "https://minio.local:443")
    assert is_remote("s3://bucket/x") and is_remote("gs://bucket/x") and not is_remote("/models")
    with pytest.raises(InvalidArgument, match="Google Cloud Storage"):
        S3Location.parse("gs://bucket/models")
    with pytest.raises(InvalidArgument, match="not an S3 path"):
        S3Location.parse("s3://Bad_Bucket/models")


def test_a_missing_bucket_or_endpoint_fails_the_start_with_the_reason(moto_endpoint: str, bucket, tmp_path: Path):
    with pytest.raises(Unavailable, match="bucket 'no-such-bucket' not found"):
        RemoteRepository(f"s3://{moto_endpoint}/no-such-bucket/models", tmp_path / "a").start()
    started = time.monotonic()
    with pytest.raises(Unavailable, match="model repository s3://127.0.0.1:9/"):   # nothing listens there
        RemoteRepository(f"s3://127.0.0.1:9/{BUCKET}/models", tmp_path / "b").start()
    assert time.monotonic() - started < 60


def test_poll_mode_serves_a_version_that_appears_in_the_bucket(moto_endpoint: str, bucket, tmp_path: Path):
    assert open_repository(tmp_path / "local") is None           # a directory is served as it is
    mirror = open_repository(_url(moto_endpoint), poll_secs=0.3, cache_dir=tmp_path / "cache")
    try:
        assert sorted(p.name for p in mirror.path.iterdir() if not p.name.startswith(".")) == [
            "identity_int32", "linear", "simple"]
        server, client = serve(mirror.path, model_control_mode="poll", repository_poll_secs=0.5)
        try:
            np.testing.assert_allclose(_infer_linear(client), np.ones((1, 16)) @ W, rtol=1e-5)
            # a team member publishes version 2 straight to the bucket
            bucket.pipe(f"{BUCKET}/models/linear/2/model.onnx", linear(3 * W))

            def served_v2():
                try:
                    return client.is_model_ready("linear", "2")
                except InferenceServerException:
                    return False
            _wait(served_v2, 30, "version 2 served after it appeared in the bucket")
            np.testing.assert_allclose(_infer_linear(client, "2"), np.ones((1, 16)) @ (3 * W), rtol=1e-5)
            # and a version removed from the bucket leaves the cache, then the server
            bucket.rm(f"{BUCKET}/models/linear/2", recursive=True)
            _wait(lambda: not (mirror.path / "linear" / "2").exists(), 30, "version 2 removed from the cache")
        finally:
            server.close()
    finally:
        mirror.close()


def test_uploads_become_new_versions_in_the_bucket(moto_endpoint: str, bucket, tmp_path: Path):
    url = _url(moto_endpoint)
    with RemoteRepository(url, tmp_path / "cache", interval=0.3) as mirror:
        server, client = serve(mirror.path, model_control_mode="explicit")
        try:
            client.load_model("linear")
            config = ('{"name": "linear", "backend": "onnxruntime", "max_batch_size": 4, '
                      '"input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]}], '
                      '"output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}]}')
            client.load_model("linear", config=config, files={"file:1/model.onnx": linear(2 * W)})
            np.testing.assert_allclose(_infer_linear(client), np.ones((1, 16)) @ (2 * W), rtol=1e-5)
            key = f"{BUCKET}/models/linear/2/model.onnx"
            _wait(lambda: bucket.exists(key), 20, "the upload written to the bucket as version 2")
            assert bucket.cat(key) == (mirror.path / "linear" / "2" / "model.onnx").read_bytes()
            assert bucket.cat(f"{BUCKET}/models/linear/1/model.onnx") == linear(W)   # untouched
            assert "max_batch_size: 4" in bucket.cat(f"{BUCKET}/models/linear/config.pbtxt").decode()
            # a new model uploaded here
            client.load_model("doubled", config=config.replace('"linear"', '"doubled"'),
                              files={"file:1/model.onnx": linear(2 * W)})
            _wait(lambda: bucket.exists(f"{BUCKET}/models/doubled/1/model.onnx"), 20,
                  "a new model written to the bucket")
            assert not [k for k in bucket.find(f"{BUCKET}/models") if "/." in k]   # no history, no staging
        finally:
            server.close()

    # another server, a fresh cache: it serves what was uploaded
    with RemoteRepository(url, tmp_path / "other-cache") as other:
        server, client = serve(other.path, model_control_mode="explicit", load_models=["*"])
        try:
            np.testing.assert_allclose(_infer_linear(client), np.ones((1, 16)) @ (2 * W), rtol=1e-5)
        finally:
            server.close()

    # the first cache again: nothing is downloaded twice
    again = RemoteRepository(url, tmp_path / "cache")
    assert again.sync().pulled == []
    again.close()


def test_a_version_the_bucket_already_has_is_never_overwritten(moto_endpoint: str, bucket, tmp_path: Path):
    mirror = RemoteRepository(_url(moto_endpoint), tmp_path / "cache")
    mirror.sync()
    # someone else publishes version 2 while this cache writes its own version 2
    bucket.pipe(f"{BUCKET}/models/linear/2/model.onnx", linear(5 * W))
    (mirror.path / "linear" / "2").mkdir()
    (mirror.path / "linear" / "2" / "model.onnx").write_bytes(linear(7 * W))
    report = mirror.sync()
    assert report.refused == ["linear/2"] and report.pushed == []
    assert bucket.cat(f"{BUCKET}/models/linear/2/model.onnx") == linear(5 * W)
    mirror.close()


def test_serve_command_takes_an_s3_repository(moto_endpoint: str, bucket, tmp_path: Path):
    """`jupyter-triton serve --model-repository s3://host:port/bucket/path`, as tritonserver
    is started, with the credentials in the environment."""
    import os
    import re
    import subprocess
    import sys
    env = dict(os.environ, TRITON_AWS_MOUNT_DIRECTORY=str(tmp_path / "mount"))
    exe = Path(sys.executable).parent / "jupyter-triton"
    process = subprocess.Popen(
        [str(exe), "serve", "--model-repository", _url(moto_endpoint), "--model-control-mode", "poll",
         "--repository-poll-secs", "0.5", "--http-address", "127.0.0.1", "--http-port", "0",
         "--allow-grpc", "false", "--allow-metrics", "false"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines: list[str] = []

        def url_line():
            line = process.stdout.readline()
            lines.append(line)
            assert line or process.poll() is None, "".join(lines)
            return re.search(r"HTTP http://([0-9.]+:[0-9]+)", line)
        found = _wait(url_line, 60, "the server's address")
        client = httpclient.InferenceServerClient(found.group(1))
        np.testing.assert_allclose(_infer_linear(client), np.ones((1, 16)) @ W, rtol=1e-5)
        assert (tmp_path / "mount" / "linear" / "1" / "model.onnx").exists()   # Triton's cache variable
        bucket.pipe(f"{BUCKET}/models/linear/2/model.onnx", linear(3 * W))

        def served_v2():
            try:
                return client.is_model_ready("linear", "2")
            except InferenceServerException:
                return False
        _wait(served_v2, 30, "version 2 served after it appeared in the bucket")
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def test_the_cache_follows_the_bucket_and_keeps_what_the_server_decided(moto_endpoint: str, bucket, tmp_path: Path):
    from jupyter_triton.repository import JOURNAL_FILENAME
    mirror = RemoteRepository(_url(moto_endpoint), tmp_path / "cache")
    mirror.sync()
    # a model deleted from the bucket leaves the cache
    bucket.rm(f"{BUCKET}/models/simple", recursive=True)
    assert "simple" in mirror.sync().removed and not (mirror.path / "simple").exists()
    # a version this server deleted (--keep-versions) is not downloaded again...
    bucket.pipe(f"{BUCKET}/models/linear/2/model.onnx", linear(3 * W))
    assert mirror.sync().pulled == ["linear/2/model.onnx"]
    import shutil
    shutil.rmtree(mirror.path / "linear" / "1")
    assert mirror.sync().pulled == [] and not (mirror.path / "linear" / "1").exists()
    # ...unless it changes in the bucket
    bucket.pipe(f"{BUCKET}/models/linear/1/model.onnx", linear(4 * W))
    assert mirror.sync().pulled == ["linear/1/model.onnx"]
    # an upload whose load has not succeeded yet (its journal is there) is not pushed
    (mirror.path / "linear" / "3").mkdir()
    (mirror.path / "linear" / "3" / "model.onnx").write_bytes(linear(5 * W))
    (mirror.path / "linear" / JOURNAL_FILENAME).write_text("{}")
    assert mirror.sync().pushed == [] and not bucket.exists(f"{BUCKET}/models/linear/3/model.onnx")
    (mirror.path / "linear" / JOURNAL_FILENAME).unlink()
    assert mirror.sync().pushed == ["linear/3/model.onnx"]
    mirror.close()


def test_a_version_the_bucket_replaces_answers_as_itself_not_from_the_cache(
        moto_endpoint: str, bucket, tmp_path: Path):
    """A version this mirror pulled and the bucket then replaces under the same number: the
    mirror renames the new files into place, which changes the version's identity
    (repository/identity.py), so the poll loads it anew and the response cache never answers
    it with the earlier files' answers."""
    config = 'name: "cached"\nbackend: "onnxruntime"\nmax_batch_size: 8\nresponse_cache { enable: true }\n'
    bucket.pipe(f"{BUCKET}/models/cached/config.pbtxt", config.encode())
    bucket.pipe(f"{BUCKET}/models/cached/1/model.onnx", linear(W))
    mirror = open_repository(_url(moto_endpoint), poll_secs=0.3, cache_dir=tmp_path / "cache")
    try:
        server, client = serve(mirror.path, model_control_mode="poll", repository_poll_secs=0.3,
                               response_cache_size=1 << 20)
        try:
            def answer() -> np.ndarray:
                x = httpclient.InferInput("INPUT0", [1, 16], "FP32")
                x.set_data_from_numpy(np.ones((1, 16), np.float32))
                return client.infer("cached", [x]).as_numpy("OUTPUT0")

            def hits() -> int:
                [stats] = client.get_inference_statistics("cached")["model_stats"]
                return stats["inference_stats"]["cache_hit"]["count"]
            for _ in range(2):
                np.testing.assert_allclose(answer(), np.ones((1, 16)) @ W, rtol=1e-5)
            assert hits() == 1
            bucket.pipe(f"{BUCKET}/models/cached/1/model.onnx", linear(3 * W))
            # the reload starts the version's statistics anew
            _wait(lambda: hits() == 0, 30, "version 1 loaded again after the bucket replaced it")
            for _ in range(2):
                np.testing.assert_allclose(answer(), np.ones((1, 16)) @ (3 * W), rtol=1e-5)
            assert hits() == 1
        finally:
            server.close()
    finally:
        mirror.close()
