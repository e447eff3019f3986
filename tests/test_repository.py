"""A Triton model repository on disk: discovery, version policies, uploads that never
overwrite, config history, and the names that must never escape the root."""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from jupyter_triton.config import config_to_json, parse_config
from jupyter_triton.protocol.errors import Internal, InvalidArgument, NotFound
from jupyter_triton.repository import Repository

CONFIG = {"name": "adder", "backend": "onnxruntime", "max_batch_size": 8,
          "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
          "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [4]}]}


def make_model(root: Path, name: str, versions=(1,), config: str | None = None) -> Path:
    model = root / name
    model.mkdir(parents=True)
    for v in versions:
        (model / str(v)).mkdir()
        (model / str(v) / "model.onnx").write_bytes(f"v{v}".encode())
    if config is not None:
        (model / "config.pbtxt").write_text(config)
    return model


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def repo(tmp_path) -> Repository:
    return Repository(tmp_path / "models")


# ---- discovery ---------------------------------------------------------------------

def test_models_and_versions(repo):
    make_model(repo.root, "b", versions=(1, 2, 10))
    make_model(repo.root, "a", versions=(3,))
    (repo.root / ".ipynb_checkpoints").mkdir()
    (repo.root / "README.md").write_text("not a model")
    for ignored in ("01", "0", "latest", ".5"):
        (repo.root / "b" / ignored).mkdir()
    (repo.root / "b" / "7").write_text("a file, not a version")
    assert repo.model_names() == ["a", "b"]
    assert repo.versions_on_disk("b") == [1, 2, 10]
    assert repo.version_dir("b", 10) == repo.root / "b" / "10"
    with pytest.raises(NotFound):
        repo.version_dir("b", 7)


def test_missing_root_has_no_models(tmp_path):
    assert Repository(tmp_path / "nowhere").model_names() == []


def test_unknown_model_is_not_found(repo):
    repo.root.mkdir()
    with pytest.raises(NotFound, match="model 'ghost'"):
        repo.model_dir("ghost")


@pytest.mark.parametrize("name", ["../etc", "a/b", "..", ".hidden", "a..b", "x\0y", "", "a\\b"])
def test_names_that_escape_the_root_are_refused(repo, name):
    make_model(repo.root, "ok")
    for call in (lambda: repo.model_dir(name),
                 lambda: repo.write_upload(name, json.dumps({}), {"file:1/model.onnx": b"x"}),
                 lambda: repo.write_config(name, parse_config("", name or "x"))):
        with pytest.raises(InvalidArgument):
            call()
    assert sorted(p.name for p in repo.root.iterdir()) == ["ok"]


# ---- configs and version policies ----------------------------------------------------

def test_read_config(repo):
    make_model(repo.root, "noconf")
    assert repo.read_config("noconf").name == "noconf"
    make_model(repo.root, "bad", config='name: "bad"\nmax_batch_size: -3\n')
    with pytest.raises(InvalidArgument, match="model 'bad'.*max_batch_size"):
        repo.read_config("bad")
    make_model(repo.root, "renamed", config='name: "other"\n')
    with pytest.raises(InvalidArgument, match="directory name must equal model name"):
        repo.read_config("renamed")


@pytest.mark.parametrize("policy, expected", [
    ("", [5]),
    ("version_policy { latest { num_versions: 2 } }", [3, 5]),
    ("version_policy { all { } }", [1, 3, 5]),
    ("version_policy { specific { versions: [ 1, 5 ] } }", [1, 5]),
])
def test_version_policies(repo, policy, expected):
    make_model(repo.root, "m", versions=(1, 3, 5), config=f'name: "m"\n{policy}\n')
    assert repo.select_versions("m", repo.read_config("m")) == expected


def test_specific_version_missing_on_disk(repo):
    make_model(repo.root, "m", versions=(1,),
               config='version_policy { specific { versions: [ 1, 4 ] } }\n')
    with pytest.raises(InvalidArgument, match=r"model 'm'.*\[4\]"):
        repo.select_versions("m", repo.read_config("m"))


def test_no_version_at_all(repo):
    make_model(repo.root, "m", versions=())
    with pytest.raises(InvalidArgument, match="at least one version must be available"):
        repo.select_versions("m", repo.read_config("m"))


# ---- fingerprints ------------------------------------------------------------------------

def test_fingerprint_sees_model_changes_but_not_hidden_or_cache(repo):
    model = make_model(repo.root, "m", versions=(1,))
    make_model(repo.root, "other")
    first = repo.fingerprint("m")
    assert repo.fingerprints() == {"m": first, "other": repo.fingerprint("other")}
    (model / ".ipynb_checkpoints").mkdir()
    (model / "1" / "__pycache__").mkdir()
    (model / "1" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"cache")
    assert repo.fingerprint("m") == first
    (model / "2").mkdir()
    second = repo.fingerprint("m")
    assert second != first
    (model / "2" / "model.onnx").write_bytes(b"new")
    third = repo.fingerprint("m")
    assert third != second
    (model / "config.pbtxt").write_text("max_batch_size: 1\n")
    assert repo.fingerprint("m") != third


# ---- uploads -----------------------------------------------------------------------------

def test_upload_creates_a_model(repo):
    written = repo.write_upload("adder", json.dumps(CONFIG), {"file:1/model.onnx": b"onnx"})
    assert written == [1]
    model = repo.root / "adder"
    assert tree(model / "1") == {"model.onnx": b"onnx", "config.pbtxt": (model / "config.pbtxt").read_bytes()}
    config = repo.read_config("adder")
    assert config_to_json(config)["input"][0]["dims"] == [4]
    assert repo.select_versions("adder", config) == [1]
    assert not any(p.name.startswith(".upload") for p in model.iterdir())


def test_upload_never_overwrites_a_version(repo):
    make_model(repo.root, "adder", versions=(1, 2))
    before = tree(repo.root / "adder")
    written = repo.write_upload("adder", None, {"file:1/model.onnx": b"new one"})
    assert written == [3]
    after = tree(repo.root / "adder")
    assert {k: v for k, v in after.items() if k in before} == before
    assert after["3/model.onnx"] == b"new one"
    assert repo.select_versions("adder", repo.read_config("adder")) == [3]


def test_colliding_upload_is_renumbered_in_order(repo):
    make_model(repo.root, "adder", versions=(1, 2))
    files = {"file:2/model.onnx": b"second", "file:1/model.onnx": b"first",
             "file:1/sub/dir/vocab.txt": b"words"}
    assert repo.write_upload("adder", None, files) == [3, 4]
    assert (repo.root / "adder/3/model.onnx").read_bytes() == b"first"
    assert (repo.root / "adder/3/sub/dir/vocab.txt").read_bytes() == b"words"
    assert (repo.root / "adder/4/model.onnx").read_bytes() == b"second"


def test_upload_without_collision_keeps_numbers(repo):
    make_model(repo.root, "adder", versions=(1,))
    assert repo.write_upload("adder", None, {"file:5/model.onnx": b"v5"}) == [5]


def test_specific_policy_follows_the_renumbering(repo):
    make_model(repo.root, "adder", versions=(1,))
    config = dict(CONFIG, version_policy={"specific": {"versions": [1]}})
    assert repo.write_upload("adder", json.dumps(config), {"file:1/model.onnx": b"x"}) == [2]
    stored = repo.read_config("adder")
    assert list(stored.version_policy.specific.versions) == [2]
    assert repo.select_versions("adder", stored) == [2]
    # the copy kept with the version says the same
    assert repo.read_version_config("adder", 2) == stored


def test_config_history_is_preserved(repo):
    make_model(repo.root, "adder", versions=(1,), config='name: "adder"\nmax_batch_size: 2\n')
    original = (repo.root / "adder/config.pbtxt").read_text()
    repo.write_upload("adder", json.dumps(CONFIG), {"file:1/model.onnx": b"x"})
    assert repo.read_config("adder").max_batch_size == 8
    history = repo.history("adder")
    assert [p.read_text() for p in history] == [original]
    assert history[0].parent.name == ".history"
    # writing the same config again keeps no duplicate
    repo.write_config("adder", repo.read_config("adder"))
    assert len(repo.history("adder")) == 1
    # the old version still carries no config, the new one carries its own
    assert repo.read_version_config("adder", 1) is None
    assert repo.read_version_config("adder", 2).max_batch_size == 8
    # .history is hidden: not a model, not a version, not part of the fingerprint
    assert repo.versions_on_disk("adder") == [1, 2]


def test_config_only_upload_replaces_config(repo):
    make_model(repo.root, "adder", versions=(1,), config='name: "adder"\nmax_batch_size: 2\n')
    assert repo.write_upload("adder", CONFIG, {}) == []
    assert repo.read_config("adder").max_batch_size == 8
    assert repo.versions_on_disk("adder") == [1]
    assert len(repo.history("adder")) == 1


def test_rollback_by_write_config(repo):
    repo.write_upload("adder", json.dumps(dict(CONFIG, max_batch_size=2)), {"file:1/model.onnx": b"a"})
    repo.write_upload("adder", json.dumps(CONFIG), {"file:1/model.onnx": b"b"})
    old = repo.read_version_config("adder", 1)
    old.version_policy.specific.versions.append(1)
    repo.write_config("adder", old)
    config = repo.read_config("adder")
    assert config.max_batch_size == 2
    assert repo.select_versions("adder", config) == [1]
    assert len(repo.history("adder")) == 2


def test_upload_copies_existing_config_into_the_version(repo):
    make_model(repo.root, "adder", versions=(1,), config='name: "adder"\nmax_batch_size: 2\n')
    repo.write_upload("adder", None, {"file:1/model.onnx": b"x"})
    assert repo.read_version_config("adder", 2).max_batch_size == 2


@pytest.mark.parametrize("files", [
    {"file:1/../../escape.txt": b"x"},
    {"file:1//etc/passwd": b"x"},
    {"file:/etc/passwd": b"x"},
    {"file:1/": b"x"},
    {"file:1": b"x"},
    {"file:01/model.onnx": b"x"},
    {"file:0/model.onnx": b"x"},
    {"file:x/model.onnx": b"x"},
    {"model.onnx": b"x"},
    {"file:1/a/./b": b"x"},
    {"file:1/model.onnx": "text, not bytes"},
    {"file:1/a": b"x", "file:1/a/b": b"y"},
    {"file:1/good.onnx": b"x", "file:2/../bad": b"y"},
])
def test_bad_uploads_write_nothing(repo, files):
    make_model(repo.root, "adder", versions=(1,), config='name: "adder"\n')
    before = tree(repo.root)
    with pytest.raises(InvalidArgument):
        repo.write_upload("adder", json.dumps(CONFIG), files)
    assert tree(repo.root) == before
    assert not (repo.root.parent / "escape.txt").exists()
    assert sorted(p.name for p in (repo.root / "adder").iterdir()) == ["1", "config.pbtxt"]


def test_bad_config_writes_nothing(repo):
    with pytest.raises(InvalidArgument, match="model 'adder'"):
        repo.write_upload("adder", '{"max_batch_size": -1}', {"file:1/model.onnx": b"x"})
    with pytest.raises(InvalidArgument, match="max_batch_size"):
        repo.write_upload("adder", '{"max_batch_size": "many"}', {"file:1/model.onnx": b"x"})
    assert not (repo.root / "adder").exists()


def test_oversized_upload_is_refused(tmp_path):
    repo = Repository(tmp_path / "models", max_upload_bytes=10)
    with pytest.raises(InvalidArgument, match="exceed"):
        repo.write_upload("big", None, {"file:1/a": b"123456", "file:1/b": b"123456"})
    assert not (repo.root / "big").exists()


def test_failing_write_leaves_no_partial_version(repo, monkeypatch):
    make_model(repo.root, "adder", versions=(1,))
    import jupyter_triton.repository as repository
    real_write = repository._write_file
    calls = []

    def flaky(path, data):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_write(path, data)

    monkeypatch.setattr(repository, "_write_file", flaky)
    with pytest.raises(Internal, match="model 'adder'.*No space left"):
        repo.write_upload("adder", None, {"file:1/a.onnx": b"a", "file:1/b.onnx": b"b"})
    assert sorted(p.name for p in (repo.root / "adder").iterdir()) == ["1"]


def test_rename_onto_a_number_taken_meanwhile_moves_on(repo, monkeypatch):
    make_model(repo.root, "adder", versions=(1,))
    import jupyter_triton.repository as repository
    real_claim = repository._claim

    def racing_claim(staged, model_dir, version):
        # another process takes our number between the scan and the rename
        (model_dir / str(version)).mkdir()
        (model_dir / str(version) / "theirs.onnx").write_bytes(b"theirs")
        return real_claim(staged, model_dir, version)

    monkeypatch.setattr(repository, "_claim", racing_claim)
    config = dict(CONFIG, version_policy={"specific": {"versions": [1]}})
    assert repo.write_upload("adder", json.dumps(config), {"file:1/model.onnx": b"ours"}) == [3]
    assert (repo.root / "adder/2/theirs.onnx").read_bytes() == b"theirs"
    assert (repo.root / "adder/3/model.onnx").read_bytes() == b"ours"
    assert list(repo.read_config("adder").version_policy.specific.versions) == [3]
    assert list(repo.read_version_config("adder", 3).version_policy.specific.versions) == [3]


def test_upload_files_are_durable_plain_files(repo):
    repo.write_upload("adder", None, {"file:1/model.onnx": memoryview(b"bytes-like")})
    path = repo.root / "adder/1/model.onnx"
    assert path.read_bytes() == b"bytes-like"
    assert not path.is_symlink() and os.stat(path).st_nlink == 1


# ---- uncommitted uploads: commit, abort, recover after a crash -------------------------

def test_an_upload_not_committed_is_taken_back_at_the_next_start(repo):
    repo.write_upload("adder", json.dumps(CONFIG), {"file:1/model.onnx": b"v1"})
    before = (repo.root / "adder" / "config.pbtxt").read_text()
    pending = repo.stage_upload("adder", json.dumps(dict(CONFIG, max_batch_size=2)),
                                {"file:1/model.onnx": b"v2", "file:2/model.onnx": b"v3"})
    assert pending.versions == [2, 3] and repo.versions_on_disk("adder") == [1, 2, 3]
    # the server dies here; the next one starts on the same repository
    fresh = Repository(repo.root)
    assert fresh.recover() == ["adder"]
    assert fresh.versions_on_disk("adder") == [1]
    assert (repo.root / "adder" / "config.pbtxt").read_text() == before
    aside = fresh.set_aside("adder")
    assert sorted(v for v, _, _ in aside) == [2, 3]
    assert all("stopped before" in reason for _, reason, _ in aside)
    assert all((repo.root / where / "model.onnx").is_file() for _, _, where in aside)
    assert fresh.recover() == []                      # nothing left to take back


def test_a_committed_upload_leaves_no_journal_or_marker(repo):
    pending = repo.stage_upload("adder", json.dumps(CONFIG), {"file:1/model.onnx": b"v1"})
    pending.commit()
    assert sorted(p.name for p in (repo.root / "adder").iterdir()) == ["1", "config.pbtxt"]
    assert sorted(p.name for p in (repo.root / "adder" / "1").iterdir()) == ["config.pbtxt", "model.onnx"]
    assert Repository(repo.root).recover() == []
    assert repo.versions_on_disk("adder") == [1]


def test_abort_of_a_new_model_leaves_no_model_behind(repo):
    pending = repo.stage_upload("fresh", json.dumps(dict(CONFIG, name="fresh")),
                                {"file:1/model.onnx": b"x"})
    moved = pending.abort("it did not load")
    assert not (repo.root / "fresh").exists() and repo.model_names() == []
    assert [(v, r) for v, r, _ in repo.set_aside("fresh")] == [(1, "it did not load")]
    assert moved and (repo.root / moved[0] / "model.onnx").read_bytes() == b"x"


def test_abort_never_touches_versions_it_did_not_write(repo):
    make_model(repo.root, "adder", versions=(1,))
    pending = repo.stage_upload("adder", None, {"file:1/model.onnx": b"mine"})
    make_model(repo.root / "elsewhere", "x")          # unrelated
    (repo.root / "adder" / "9").mkdir()               # a user's version written meanwhile
    (repo.root / "adder" / "9" / "model.onnx").write_bytes(b"user")
    pending.abort("failed")
    assert repo.versions_on_disk("adder") == [1, 9]


def test_recover_leaves_a_live_servers_load_alone(repo):
    pending = repo.stage_upload("adder", json.dumps(CONFIG), {"file:1/model.onnx": b"v1"})
    journal = repo.root / "adder" / ".pending-load.json"
    data = json.loads(journal.read_text())
    journal.write_text(json.dumps(dict(data, pid=os.getppid())))   # a live process's load
    assert Repository(repo.root).recover() == []
    assert repo.versions_on_disk("adder") == [1]
    pending.commit()
    assert not journal.exists()


def test_staging_left_by_a_crash_is_swept(repo):
    make_model(repo.root, "adder", versions=(1,))
    stale = repo.root / "adder" / f".upload-{uuid.uuid4().hex}" / "2"
    stale.mkdir(parents=True)
    (stale / "model.onnx").write_bytes(b"half")
    (repo.root / "adder" / f".config.pbtxt.{uuid.uuid4().hex}.tmp").write_bytes(b"torn")
    # hidden files of the user's own, whatever they look like, are not the server's to sweep
    (repo.root / "adder" / ".upload-notes").mkdir()
    (repo.root / "adder" / ".draft.tmp").write_bytes(b"mine")
    assert repo.recover() == ["adder"]
    assert sorted(p.name for p in (repo.root / "adder").iterdir()) == [
        ".draft.tmp", ".upload-notes", "1"]


def test_a_version_identity_is_its_files_config_and_the_models_own_files(repo):
    """Repository.version_identity: what a reload compares and the response cache keys on."""
    make_model(repo.root, "m", versions=(1, 2), config='name: "m"\nbackend: "onnxruntime"\n')
    config = repo.read_config("m")
    first = repo.version_identity("m", 1, config)
    assert (first.model, first.number) == ("m", 1)
    assert first != repo.version_identity("m", 2, config)
    # bytecode, hidden files and the server's own records are not the model
    (repo.root / "m" / "1" / "__pycache__").mkdir()
    (repo.root / "m" / "1" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
    (repo.root / "m" / "1" / ".jupyter-triton-upload").write_bytes(b"id")
    (repo.root / "m" / ".lifecycle-history.jsonl").write_bytes(b"{}")
    # config.pbtxt counts by what it says, not by its file: rewritten the same, no change
    (repo.root / "m" / "config.pbtxt").write_bytes((repo.root / "m" / "config.pbtxt").read_bytes())
    assert repo.version_identity("m", 1, repo.read_config("m")) == first
    changed = mc.ModelConfig()
    changed.CopyFrom(config)
    changed.max_batch_size += 1
    assert repo.version_identity("m", 1, changed) != first
    # a file of the version, or one the model's versions share (a label file), is a change
    (repo.root / "m" / "labels.txt").write_bytes(b"cat\n")
    with_labels = repo.version_identity("m", 1, config)
    assert with_labels != first and with_labels.key != first.key
    (repo.root / "m" / "1" / "extra.txt").write_bytes(b"data")
    assert repo.version_identity("m", 1, config) not in (first, with_labels)


def test_model_names_with_control_characters_are_refused(repo):
    for name in ("a\nb", "a\rb", "tab\there", "bell\x07", "del\x7f"):
        with pytest.raises(InvalidArgument, match="control characters"):
            repo.write_upload(name, None, {"file:1/model.onnx": b"x"})
    assert not repo.root.exists() or repo.model_names() == []
