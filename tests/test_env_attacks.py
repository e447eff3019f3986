"""Packed environments (``EXECUTION_ENV_PATH``) attacked (issue 32): another local user plants
the folder the server would unpack into; an archive's members reach outside the folder, or
declare more bytes than a disk holds. Against a real ``jupyter-triton serve`` process whose
``$TMPDIR`` is the test's: the planted code never runs, a hostile archive's load is a 400 and
touches nothing outside, the server stays up and serves a legitimate model; a legitimate
environment is reused, and the cache keeps only a few environments nobody runs."""
from __future__ import annotations

import fcntl
import hashlib
import io
import os
import stat
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable

import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import build_repository
from hostile import legit_infer, start_standalone
from jupyter_triton.backends.python import envs
from test_python_env import ask, packed_env, write  # noqa: F401 - packed_env: a fixture (a venv-pack archive)

NOBODY = 65534
UID = os.getuid()
WAIT_S = 60.0


# -- a server whose $TMPDIR is the test's ------------------------------------------------------

def start(repo: Path, tmp: Path, monkeypatch) -> tuple:
    monkeypatch.setenv("TMPDIR", str(tmp))
    server = start_standalone(repo, extra_args=("--model-control-mode", "explicit",
                                                "--load-model", "linear"))
    return server, httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")


def repository(tmp_path: Path) -> Path:
    return build_repository(tmp_path / "models")


def assert_alive(server, client) -> None:
    assert server.alive(), server.log_tail()
    legit_infer(server, timeout=30.0)


def entries(cache: Path) -> set[Path]:
    return {p for p in cache.iterdir() if not p.name.startswith(".")}


def wait_released(entry: Path) -> None:
    """Until no server holds ``entry`` (its instances unloaded): the server's lock is gone."""
    deadline = time.monotonic() + WAIT_S
    fd = os.open(entry / envs.MARKER, os.O_RDONLY)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                assert time.monotonic() < deadline, f"{entry} still held after unload"
                time.sleep(0.05)
    finally:
        os.close(fd)


# -- (a) a planted environment --------------------------------------------------------------------

def old_entry_name(archive: Path) -> str:
    """Where the server before issue 32 looked for ``archive``'s unpacked environment."""
    archive = archive.resolve()
    st = archive.stat()
    key = hashlib.sha256(f"{archive}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:20]
    return f"{archive.name.split('.')[0]}-{key}"


def plant(folder: Path, names: list[str], marker: Path) -> None:
    """What another user leaves: an environment whose python runs its own code first."""
    for name in names:
        bin_dir = folder / name / "bin"
        bin_dir.mkdir(parents=True)
        for python in ("python3", "python"):
            (bin_dir / python).write_text(f'#!/bin/sh\necho planted >> "{marker}"\n'
                                          f'exec "{sys.executable}" "$@"\n')
            (bin_dir / python).chmod(0o755)
        for path in [folder / name, *(folder / name).rglob("*")]:
            os.lchown(path, NOBODY, NOBODY)


def foreign_folder(tmp: Path) -> Path:
    folder = tmp / f"jupyter_triton_envs_{UID}"
    folder.mkdir(0o755)
    os.chown(folder, NOBODY, NOBODY)
    return folder


def writable_folder(tmp: Path) -> Path:
    folder = tmp / f"jupyter_triton_envs_{UID}"
    folder.mkdir()
    folder.chmod(0o777)
    return folder


def linked_folder(tmp: Path) -> Path:
    real = tmp / "theirs"
    real.mkdir(0o755)
    os.chown(real, NOBODY, NOBODY)
    (tmp / f"jupyter_triton_envs_{UID}").symlink_to(real)
    return real


def private_folder(tmp: Path) -> Path:
    folder = tmp / f"jupyter_triton_envs_{UID}"
    folder.mkdir(0o700)
    return folder


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's files are made with chown (root)")
@pytest.mark.parametrize("make_folder", [foreign_folder, writable_folder, linked_folder, private_folder],
                         ids=["foreign-folder", "writable-folder", "symlinked-folder", "foreign-entry"])
def test_a_planted_environment_never_runs(tmp_path, monkeypatch, packed_env,
                                          make_folder: Callable[[Path], Path]):
    repo = repository(tmp_path)
    write(repo, "in_env", "$$TRITON_MODEL_DIRECTORY/tiny_env.tar.gz", packed_env)
    archive = repo / "in_env" / packed_env.name
    tmp, marker = tmp_path / "tmp", tmp_path / "planted_ran"
    tmp.mkdir()
    folder = make_folder(tmp)
    planted = [old_entry_name(archive), envs.entry_name(archive)]
    plant(folder, planted, marker)
    server, client = start(repo, tmp, monkeypatch)
    try:
        client.load_model("in_env")
        info = ask(client, "in_env", 2.0)
        assert info["magic"] == "packed env says 2"
        assert not marker.exists(), "the planted python ran"
        root = Path(info["prefix"])
        assert root.name == envs.entry_name(archive)
        st = os.lstat(root)
        assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
        assert (root / envs.MARKER).is_file()
        if make_folder is private_folder:   # ours: the foreign entry was thrown away
            assert root.parent == folder
        else:                               # not ours: a fresh private folder of the server's
            assert root.parent.name.startswith(f"jupyter_triton_envs_{UID}-")
            assert _private(root.parent)
        assert_alive(server, client)
        assert not marker.exists()
    finally:
        server.close()


def _private(folder: Path) -> bool:
    st = os.lstat(folder)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


# -- (b) hostile archives ---------------------------------------------------------------------------

def add(tar: tarfile.TarFile, name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"",
        linkname: str = "", size: int | None = None) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, linkname, 0o644
    if kind == tarfile.CHRTYPE:
        info.devmajor, info.devminor = 1, 3
    if size is None:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    else:   # a header that declares ``size`` bytes, and no data
        info.size = size
        buf = info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")
        tar.fileobj.write(buf)
        tar.offset += len(buf)


def hostile(legit: Path, out: Path, extra: Callable[[tarfile.TarFile], None]) -> Path:
    """The legitimate environment (the load would succeed but for ``extra``) plus ``extra``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(legit) as src, tarfile.open(out, "w:gz", format=tarfile.GNU_FORMAT) as dst:
        for member in src:
            dst.addfile(member, src.extractfile(member) if member.isreg() else None)
        extra(dst)
    return out


def test_hostile_archives_are_refused_and_touch_nothing_outside(tmp_path, monkeypatch, packed_env):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("the user's file")
    before = victim.stat()
    attacks = {
        # a hard link to a file outside, then a member of its name: written through the link
        "hardlink_out": (lambda t: (add(t, "lib/victim", tarfile.LNKTYPE, linkname=str(victim)),
                                    add(t, "lib/victim", data=b"overwritten")), "hard link"),
        "symlink_out": (lambda t: add(t, "lib/secrets", tarfile.SYMTYPE, linkname=str(outside)),
                        "outside the folder"),
        "symlink_up": (lambda t: add(t, "lib/up", tarfile.SYMTYPE, linkname="../../.."),
                       "outside the folder"),
        # each link alone stays inside; followed together they leave it
        "symlink_chain": (lambda t: (add(t, "here", tarfile.SYMTYPE, linkname="."),
                                     add(t, "lib/x/out", tarfile.SYMTYPE, linkname="../../here/..")),
                          "outside the folder"),
        "write_through_link": (lambda t: (add(t, "lib/dir", tarfile.SYMTYPE, linkname=str(outside)),
                                          add(t, "lib/dir/planted.txt", data=b"planted")),
                               "inside 'lib/dir', a symlink"),
        "dotdot": (lambda t: add(t, "../../outside/dotdot.txt", data=b"x"), "'..'"),
        "absolute": (lambda t: add(t, str(outside / "absolute.txt"), data=b"x"), "absolute"),
        "device": (lambda t: add(t, "lib/null", tarfile.CHRTYPE), "special file"),
        "oversized": (lambda t: add(t, "lib/huge.bin", size=1 << 40), "bytes"),
    }
    repo = repository(tmp_path)
    for name, (extra, _) in attacks.items():
        write(repo, name, "$$TRITON_MODEL_DIRECTORY/env.tar.gz")
        hostile(packed_env, repo / name / "env.tar.gz", extra)
    write(repo, "in_env", "$$TRITON_MODEL_DIRECTORY/tiny_env.tar.gz", packed_env)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    server, client = start(repo, tmp, monkeypatch)
    try:
        for name, (_, why) in attacks.items():
            try:
                client.load_model(name)
                answer = "200: loaded"
            except InferenceServerException as err:
                answer = f"{err.status()}: {err}"
            assert victim.read_text() == "the user's file", name
            assert victim.stat().st_mtime_ns == before.st_mtime_ns, name
            assert sorted(p.name for p in outside.iterdir()) == ["victim.txt"], name
            assert answer.startswith("400:") and "EXECUTION_ENV_PATH" in answer, (name, answer)
            assert "cannot unpack" in answer and why in answer, (name, answer)
            assert_alive(server, client)
        cache = tmp / f"jupyter_triton_envs_{UID}"
        assert not list(cache.iterdir()), "a refused archive left files in the cache"
        assert not (tmp_path / "dotdot.txt").exists()
        client.load_model("in_env")
        assert ask(client, "in_env", 7.0)["magic"] == "packed env says 7"
    finally:
        server.close()


# -- (c) a legitimate environment: reused; the cache bounded -----------------------------------------

def variant(legit: Path, out: Path, i: int) -> Path:
    """Another environment: the legitimate one and a file of its own."""
    return hostile(legit, out, lambda t: add(t, f"extra_{i}.txt", data=str(i).encode()))


def test_an_environment_is_reused_and_the_cache_keeps_few_unused(tmp_path, monkeypatch, packed_env):
    repo = repository(tmp_path)
    write(repo, "in_env", "$$TRITON_MODEL_DIRECTORY/tiny_env.tar.gz", packed_env)
    # the same bytes under another path and time: the same environment
    copy = tmp_path / "elsewhere" / packed_env.name
    copy.parent.mkdir()
    copy.write_bytes(packed_env.read_bytes())
    os.utime(copy, (1, 1))
    write(repo, "same_bytes", str(copy))
    variants = [f"v{i}" for i in range(envs.MAX_UNUSED_ENVS + 1)]
    for i, name in enumerate(variants):
        write(repo, name, "$$TRITON_MODEL_DIRECTORY/tiny_env.tar.gz")
        variant(packed_env, repo / name / "tiny_env.tar.gz", i)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    server, client = start(repo, tmp, monkeypatch)
    try:
        client.load_model("in_env")
        root = Path(ask(client, "in_env", 1.0)["prefix"])
        inode = root.stat().st_ino
        client.load_model("same_bytes")
        assert ask(client, "same_bytes", 2.0)["prefix"] == str(root)
        client.unload_model("same_bytes")

        roots = []
        for name in variants:   # in_env stays loaded and holds its environment
            client.load_model(name)
            roots.append(Path(ask(client, name, 3.0)["prefix"]))
            client.unload_model(name)
            wait_released(roots[-1])
        assert len(set(roots)) == len(variants) and root not in roots
        # a load cleans up: of the environments nobody runs, the most recent few stay
        client.unload_model("in_env")
        wait_released(root)
        client.load_model("in_env")
        assert ask(client, "in_env", 4.0)["prefix"] == str(root)
        assert root.stat().st_ino == inode, "unpacked again"
        assert entries(root.parent) == {root, *roots[-envs.MAX_UNUSED_ENVS:]}
        assert_alive(server, client)
    finally:
        server.close()
    # another server of the same user: the same environment, not unpacked again
    server, client = start(repo, tmp, monkeypatch)
    try:
        client.load_model("in_env")
        assert ask(client, "in_env", 5.0)["prefix"] == str(root)
        assert root.stat().st_ino == inode
    finally:
        server.close()


# -- the member checks, alone ----------------------------------------------------------------------

def members_of(build: Callable[[tarfile.TarFile], None]) -> list[str]:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        build(tar)
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tar:
        return [m.name for m in envs._checked_members(tar)]


def test_links_inside_the_folder_and_a_venvs_interpreter_are_kept():
    def env(t):
        add(t, "./", tarfile.DIRTYPE)
        add(t, "./bin/python3.11", tarfile.SYMTYPE, linkname=sys.executable)
        add(t, "bin/python3", tarfile.SYMTYPE, linkname="python3.11")
        add(t, "lib/libz.so.1.3", data=b"elf")
        add(t, "lib/libz.so", tarfile.SYMTYPE, linkname="libz.so.1.3")
        add(t, "lib64", tarfile.SYMTYPE, linkname="lib")
        add(t, "share/copy", tarfile.LNKTYPE, linkname="lib/libz.so.1.3")
        add(t, "pyvenv.cfg", data=b"a")
        add(t, "pyvenv.cfg", data=b"b")   # venv-pack rewrites it at the end
    assert members_of(env) == ["bin/python3.11", "bin/python3", "lib/libz.so.1.3", "lib/libz.so",
                               "lib64", "share/copy", "pyvenv.cfg", "pyvenv.cfg"]


@pytest.mark.parametrize("build, why", [
    (lambda t: (add(t, "bin/python3.11", tarfile.SYMTYPE, linkname=sys.executable),
                add(t, "bin/python3.11", data=b"x")), "already has a symlink"),
    (lambda t: (add(t, "lib/a", data=b"x"), add(t, "lib", tarfile.SYMTYPE, linkname="/")),
     "already has a dir"),
    (lambda t: add(t, "lib/sh", tarfile.SYMTYPE, linkname="/bin/sh"), "outside the folder"),
    (lambda t: add(t, "bin/python", tarfile.SYMTYPE, linkname="/nonexistent/python"), "outside"),
    (lambda t: (add(t, "a", tarfile.SYMTYPE, linkname="b"), add(t, "b", tarfile.SYMTYPE, linkname="a")),
     "outside the folder"),   # a loop
    (lambda t: add(t, "lib/h", tarfile.LNKTYPE, linkname="lib/missing"), "hard link"),
    (lambda t: add(t, envs.MARKER, data=b"0" * 64), "keeps for itself"),
    (lambda t: add(t, "fifo", tarfile.FIFOTYPE), "special file"),
])
def test_member_checks_refuse(build, why):
    with pytest.raises(envs.RefusedArchive, match=why):
        members_of(build)


def test_member_count_is_bounded_as_headers_are_read(monkeypatch):
    monkeypatch.setattr(envs, "MAX_MEMBERS", 10)
    with pytest.raises(envs.RefusedArchive, match="more than 10 members"):
        members_of(lambda t: [add(t, f"f{i}") for i in range(11)])
    assert len(members_of(lambda t: [add(t, f"f{i}") for i in range(10)])) == 10


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's files are made with chown (root)")
def test_the_cache_folder_is_checked_at_every_use(tmp_path, monkeypatch):
    """Removed while the server runs (a temporary-files cleaner) and made again by another
    user: the server takes a fresh folder of its own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(envs, "_ROOT", [])
    shared = envs.cache_dir()
    assert shared == tmp_path / f"jupyter_triton_envs_{UID}" and _private(shared)
    assert envs.cache_dir() == shared
    shared.rmdir()
    foreign_folder(tmp_path)
    own = envs.cache_dir()
    assert own != shared and own.parent == tmp_path and _private(own)
