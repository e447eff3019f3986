"""The S3 mirror attacked by another writer of the bucket, against a real S3 API on loopback
(moto's server) and a server serving the mirror's cache: a version uploaded here is never
deleted, overwritten or mixed with the bucket's files; keys that cannot be a model's file,
listings and objects over their bounds are refused while the rest of the sync goes on and
the server keeps serving."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from conftest import W, serve
from jupyter_triton.protocol.errors import Unavailable
from jupyter_triton.repository.remote import RemoteRepository
from onnx_models import linear
from test_s3_repository import BUCKET, _infer_linear, _url, _wait, bucket, moto_endpoint  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(120)

MODELS = f"{BUCKET}/models"
CONFIG = ('{"name": "linear", "backend": "onnxruntime", "max_batch_size": 4, '
          '"input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]}], '
          '"output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}]}')


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")}


def _serves(client, version: str, weights: np.ndarray) -> None:
    client.load_model("linear")          # reads the cache again: what is on disk now
    assert client.is_model_ready("linear", version)
    np.testing.assert_allclose(_infer_linear(client, version), np.ones((1, 16)) @ weights, rtol=1e-5)


def test_a_local_upload_survives_another_writers_version_of_its_number(moto_endpoint, bucket, tmp_path: Path):
    """The reproduction: an upload became linear/2 here; before a sync pushed it, another
    writer put its own linear/2 in the bucket, then deleted it."""
    mirror = RemoteRepository(_url(moto_endpoint), tmp_path / "cache")
    mirror.sync()
    server, client = serve(mirror.path, model_control_mode="explicit")
    try:
        client.load_model("linear", config=CONFIG, files={"file:1/model.onnx": linear(2 * W)})
        ours = mirror.path / "linear" / "2"
        written = _files(ours)
        assert written["model.onnx"] == linear(2 * W)
        bucket.pipe(f"{MODELS}/linear/2/model.onnx", linear(5 * W))
        bucket.pipe(f"{MODELS}/linear/2/NOTES.txt", b"the other writer's")

        report = mirror.sync()
        assert report.refused == ["linear/2"] and report.pulled == []
        assert not [rel for rel in report.pushed if rel.startswith("linear/2/")]
        assert _files(ours) == written                 # none of the other writer's files
        assert bucket.cat(f"{MODELS}/linear/2/model.onnx") == linear(5 * W)   # nor ours over theirs

        bucket.rm(f"{MODELS}/linear/2", recursive=True)
        report = mirror.sync()
        assert report.removed == [] and _files(ours) == written
        # the bucket has no version 2 any more: ours is pushed now, never lost
        assert sorted(report.pushed) == sorted(f"linear/2/{name}" for name in written)
        assert bucket.cat(f"{MODELS}/linear/2/model.onnx") == linear(2 * W)
        assert not bucket.exists(f"{MODELS}/linear/2/NOTES.txt")
        _serves(client, "2", 2 * W)
        assert mirror.sync() == type(report)()         # settled: nothing to do
    finally:
        server.close()
        mirror.close()


def test_the_mirror_changes_only_versions_it_pulled_as_it_pulled_them(moto_endpoint, bucket, tmp_path: Path):
    mirror = RemoteRepository(_url(moto_endpoint), tmp_path / "cache")
    mirror.sync()
    server, client = serve(mirror.path, model_control_mode="explicit")
    try:
        client.load_model("linear", config=CONFIG, files={"file:1/model.onnx": linear(2 * W)})
        assert "linear/2/model.onnx" in mirror.sync().pushed
        # another writer replaces a file of the version pushed from here: not pulled over it
        bucket.pipe(f"{MODELS}/linear/2/model.onnx", linear(5 * W))
        assert mirror.sync().refused == ["linear/2"]
        assert (mirror.path / "linear" / "2" / "model.onnx").read_bytes() == linear(2 * W)
        # ...and when it deletes that version, the one uploaded here stays (and is not pushed again)
        bucket.rm(f"{MODELS}/linear/2", recursive=True)
        report = mirror.sync()
        assert report.removed == [] and report.pushed == []
        assert (mirror.path / "linear" / "2" / "model.onnx").read_bytes() == linear(2 * W)

        # a version pulled from the bucket and changed here is not the mirror's to remove
        bucket.pipe(f"{MODELS}/other/1/model.onnx", linear(3 * W))
        bucket.pipe(f"{MODELS}/other/config.pbtxt", CONFIG.replace('"linear"', '"other"').encode())
        assert "other/1/model.onnx" in mirror.sync().pulled
        (mirror.path / "other" / "1" / "labels.txt").write_text("written here")
        bucket.rm(f"{MODELS}/other/1", recursive=True)
        assert mirror.sync().removed == []
        assert sorted(_files(mirror.path / "other" / "1")) == ["labels.txt", "model.onnx"]
        # while one pulled and left as it was follows the bucket out
        bucket.rm(f"{MODELS}/linear/1", recursive=True)
        assert mirror.sync().removed == ["linear/1"] and not (mirror.path / "linear" / "1").exists()
        _serves(client, "2", 2 * W)
    finally:
        server.close()
        mirror.close()


def test_a_bucket_version_never_takes_a_number_used_here(moto_endpoint, bucket, tmp_path: Path):
    """Uploads whose load failed are set aside with their numbers: a version another writer
    puts in the bucket under one of them is refused, so no number means two sets of files."""
    mirror = RemoteRepository(_url(moto_endpoint), tmp_path / "cache")
    mirror.sync()
    server, client = serve(mirror.path, model_control_mode="explicit")
    try:
        fresh = CONFIG.replace('"linear"', '"fresh"')
        for name, config in (("linear", CONFIG), ("fresh", fresh)):
            with pytest.raises(InferenceServerException):
                client.load_model(name, config=config, files={"file:1/model.onnx": b"not a model"})
        assert (mirror.path / ".failed" / "fresh").is_dir() and not (mirror.path / "linear" / "2").exists()
        bucket.pipe(f"{MODELS}/linear/2/model.onnx", linear(5 * W))
        bucket.pipe(f"{MODELS}/fresh/1/model.onnx", linear(5 * W))
        bucket.pipe(f"{MODELS}/fresh/config.pbtxt", fresh.encode())
        report = mirror.sync()
        assert sorted(report.refused) == ["fresh/1", "linear/2"] and report.pulled == []
        assert not (mirror.path / "linear" / "2").exists() and not (mirror.path / "fresh").exists()
        # the next upload takes the next unused number, and is pushed under it
        client.load_model("linear", config=CONFIG, files={"file:1/model.onnx": linear(2 * W)})
        assert "linear/3/model.onnx" in mirror.sync().pushed
        _serves(client, "3", 2 * W)
    finally:
        server.close()
        mirror.close()


def test_a_restart_knows_its_own_pushed_versions(moto_endpoint, bucket, tmp_path: Path):
    """A version pushed by the last sync (at close) or by a sync that died before its
    manifest was written is the server's own after a restart, not another writer's."""
    url = _url(moto_endpoint)
    mirror = RemoteRepository(url, tmp_path / "cache")
    mirror.sync()
    server, client = serve(mirror.path, model_control_mode="explicit")
    try:
        client.load_model("linear", config=CONFIG, files={"file:1/model.onnx": linear(2 * W)})
        mirror.close()                               # its last push
        assert bucket.cat(f"{MODELS}/linear/2/model.onnx") == linear(2 * W)
        again = RemoteRepository(url, tmp_path / "cache")
        assert again.sync().refused == []
        (mirror.path / ".remote-manifest.json").unlink()
        report = RemoteRepository(url, tmp_path / "cache").sync()
        assert report.refused == [] and report.pushed == [] and report.pulled == []
        _serves(client, "2", 2 * W)
    finally:
        server.close()


def test_keys_that_are_no_model_file_are_refused_and_the_sync_goes_on(moto_endpoint, bucket, tmp_path: Path):
    mirror = RemoteRepository(_url(moto_endpoint), tmp_path / "place" / "cache")
    mirror.sync()
    server, client = serve(mirror.path, model_control_mode="poll", repository_poll_secs=0.5)
    try:
        hostile = {
            "evil/1/model.onnx": linear(W),                  # a file where a folder is needed...
            "evil/1/model.onnx/x": b"x",                     # ...by this key
            f"linear/{'9' * 20}/model.onnx": linear(9 * W),  # past int64: no version folder
            "linear/3": b"a file named as a version",
            "linear//x": b"empty component",
            "linear/1/" + "a" * 300: b"name too long",
            "linear/../../escaped": b"..",                  # (a hidden name: left quietly)
            "/absolute/1/x": b"absolute",
            "a..b/1/model.onnx": linear(W),                  # no model name (check_model_name)
        }
        for key, data in hostile.items():
            bucket.pipe(f"{MODELS}/{key}", data)
        bucket.pipe(f"{MODELS}/linear/2/model.onnx", linear(3 * W))   # and the team's new version
        report = mirror.sync()
        assert report.pulled == ["linear/2/model.onnx"]
        assert len(report.skipped) == len(hostile) - 1 and not (mirror.path / "evil").exists()
        assert sorted(p.name for p in (mirror.path / "linear").iterdir() if not p.name.startswith(".")) == [
            "1", "2", "config.pbtxt"]
        assert _files(mirror.path / "linear" / "1") == {"model.onnx": linear(W)}
        assert [p.name for p in (tmp_path / "place").iterdir()] == ["cache"]   # nothing beside it
        assert not list(tmp_path.rglob("escaped")) and not list(tmp_path.rglob("absolute"))
        # the server sees the team's version
        _wait_ready(client, "2")
        np.testing.assert_allclose(_infer_linear(client, "2"), np.ones((1, 16)) @ (3 * W), rtol=1e-5)
        assert mirror.sync().pulled == []        # refused again, quietly, nothing pulled twice
    finally:
        server.close()
        mirror.close()


def test_a_listing_over_its_bound_syncs_nothing_and_removes_nothing(moto_endpoint, bucket, tmp_path: Path):
    mirror = RemoteRepository(_url(moto_endpoint), tmp_path / "cache", max_objects=20)
    mirror.sync()
    server, client = serve(mirror.path, model_control_mode="poll", repository_poll_secs=0.5)
    try:
        for i in range(21):
            bucket.pipe(f"{MODELS}/junk/1/f{i}", b"x")
        bucket.rm(f"{MODELS}/linear/1", recursive=True)      # in a listing cut short: absent
        with pytest.raises(Unavailable, match="more than 20 objects"):
            mirror.sync()
        assert (mirror.path / "linear" / "1" / "model.onnx").read_bytes() == linear(W)
        assert not (mirror.path / "junk").exists()
        np.testing.assert_allclose(_infer_linear(client), np.ones((1, 16)) @ W, rtol=1e-5)
        bucket.rm(f"{MODELS}/junk", recursive=True)
        assert mirror.sync().removed == ["linear/1"]           # a listing within it syncs again
    finally:
        server.close()
        mirror.close()


def test_an_object_over_the_size_bound_is_not_pulled(moto_endpoint, bucket, tmp_path: Path):
    mirror = RemoteRepository(_url(moto_endpoint), tmp_path / "cache", max_object_bytes=1 << 20)
    mirror.sync()
    server, client = serve(mirror.path, model_control_mode="poll", repository_poll_secs=0.5)
    try:
        bucket.pipe(f"{MODELS}/big/1/model.onnx", bytes(2 << 20))
        bucket.pipe(f"{MODELS}/linear/2/model.onnx", bytes(2 << 20))
        bucket.pipe(f"{MODELS}/linear/3/model.onnx", linear(3 * W))
        report = mirror.sync()
        assert report.pulled == ["linear/3/model.onnx"] and len(report.skipped) == 2
        assert not (mirror.path / "big").exists() and not (mirror.path / "linear" / "2").exists()
        assert not [p for p in mirror.path.iterdir() if p.name.startswith(".remote-staging")]
        _wait_ready(client, "3")
        np.testing.assert_allclose(_infer_linear(client, "3"), np.ones((1, 16)) @ (3 * W), rtol=1e-5)
    finally:
        server.close()
        mirror.close()



def _wait_ready(client, version: str) -> None:
    def ready():
        try:
            return client.is_model_ready("linear", version)
        except InferenceServerException:
            return False
    _wait(ready, 30, f"linear version {version} served")
