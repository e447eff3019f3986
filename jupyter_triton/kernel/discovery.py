"""Which inference server this kernel talks to.

In order, the first one that answers ``GET v2/health/ready``:

1. ``JUPYTER_TRITON_URL`` / ``JUPYTER_TRITON_TOKEN``, set by the server extension in the
   Jupyter server's environment, which its kernels inherit;
2. the runtime file ``jupyter_triton-<pid>.json`` of a running server (its own parent
   first), for kernels started with a clean environment;
3. JupyterHub's single-user server (``JUPYTERHUB_SERVICE_URL`` + ``JUPYTERHUB_API_TOKEN``);
4. a server started inside this kernel (``standalone.start_in_thread``, 127.0.0.1, a free
   port, a temporary repository): plain IPython, nbval, front ends without the extension.
   Loading a model runs code, and any local user (or a web page, or a DNS-rebinding host)
   can reach a loopback port: this server takes only its own random token, checks the Host
   header and takes only JSON / octet-stream bodies; its metrics port (model names and
   counts) takes the same token and checks the Host header too. The token is in this kernel's
   environment (``JUPYTER_TRITON_TOKEN``, with ``JUPYTER_TRITON_URL``), so the kernel's own
   subprocesses (``!curl``, scripts) find and reach it, and nobody else does.

Models live in the server, not the kernel, so in modes 1-3 they survive a kernel restart.
A connection's ``public_url`` is where other hosts reach the same server (a JupyterHub's
public address, ``hub.public_address``): what handles show; the kernel itself calls ``url``.
"""
from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import tempfile
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import hub

ENV_URL, ENV_TOKEN = "JUPYTER_TRITON_URL", "JUPYTER_TRITON_TOKEN"
SERVER_EXTENSION, RUNTIME_FILE, JUPYTERHUB, IN_KERNEL = (
    "server-extension", "runtime-file", "jupyterhub", "in-kernel")
READY_TIMEOUT = 3.0
_IN_KERNEL: dict[str, "Connection"] = {}      # url -> the servers this process started


@dataclass
class Connection:
    url: str                      # server root, ending in "/": v2 routes are {url}v2/...
    token: str = field(default="", repr=False)       # a secret: never in a repr or a log
    mode: str = SERVER_EXTENSION
    metrics_url: str = ""         # Prometheus text reachable with ``headers``; "" when none is
    repository: str = ""          # the model repository on disk, when known
    server: Any = field(default=None, repr=False, compare=False)   # the in-kernel server
    grpc_url: str = ""            # "host:port" of a gRPC port taking the same ``headers``; "" when none
    public_url: str = ""          # the server root as other hosts reach it; "" when unknown
    notes: list[str] = field(default_factory=list, compare=False)   # what handles should say

    @property
    def shown_url(self) -> str:
        """The server root to show a user: the public one when known."""
        return self.public_url or self.url

    def __post_init__(self) -> None:
        if not self.url.endswith("/"):
            self.url += "/"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"} if self.token else {}

    @property
    def grpc_headers(self) -> dict[str, str]:
        """``headers`` as gRPC metadata (its keys are lower case)."""
        return {k.lower(): v for k, v in self.headers.items()}

    def model_url(self, name: str) -> str:
        return f"{self.url}v2/models/{name}"

    def public_model_url(self, name: str) -> str:
        return f"{self.shown_url}v2/models/{name}"

    def describe(self) -> str:
        if self.mode == IN_KERNEL:
            return (f"no Jupyter server extension found: serving from this kernel at {self.url} "
                    f"(credential: 'Authorization: token ${ENV_TOKEN}', set in this kernel's "
                    "environment)")
        return f"serving from the Jupyter server at {self.shown_url} ({self.mode})"


def is_ready(url: str, token: str = "", timeout: float = READY_TIMEOUT) -> bool:
    headers = {"Authorization": f"token {token}"} if token else {}
    req = urllib.request.Request(url.rstrip("/") + "/v2/health/ready", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def from_environment(environ: dict[str, str] | None = None) -> Connection | None:
    env = os.environ if environ is None else environ
    url, token = env.get(ENV_URL), env.get(ENV_TOKEN, "")
    if url and is_ready(url, token):
        # this process's own in-kernel server advertises itself the same way
        own = _IN_KERNEL.get(url)
        if own is not None:
            return own
        info = _runtime_info(url)
        # the runtime file first: it is rewritten when the server learns its public address
        public = info.get("public_url") or env.get(hub.ENV_PUBLIC_URL) or ""
        return Connection(url, token, SERVER_EXTENSION, grpc_url=_grpc_of(info),
                          public_url=public, notes=_notes(info, env))
    return None


def _runtime_info(url: str, runtime_dir: str | Path | None = None) -> dict:
    """What the server at ``url`` advertises in its runtime file ({} when none)."""
    try:
        infos = runtime_files(runtime_dir)
    except OSError:
        return {}
    return next((info for info in infos if info.get("url") == url), {})


def _notes(info: dict, environ: dict | os._Environ) -> list[str]:
    """What a server's runtime file and this kernel's environment say a user should know."""
    notes = [str(info[key]) for key in ("grpc_error", "public_url_note")
             if isinstance(info.get(key), str) and info[key]]
    credential = hub.credential_note(environ, str(info.get("public_url") or ""))
    return notes + [credential] if credential else notes


def _grpc_of(info: dict) -> str:
    port = info.get("grpc_port")
    if not isinstance(port, int) or port <= 0:
        return ""
    host = info.get("grpc_address") or "127.0.0.1"
    # a port bound on every address is reached on loopback from this machine
    return f"{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"


def _alive(pid: int) -> bool:
    try:
        import psutil
        return psutil.pid_exists(pid)
    except ImportError:
        try:
            os.kill(pid, 0)
        except PermissionError:
            return True
        except OSError:
            return False
        return True


def _ancestors() -> list[int]:
    try:
        import psutil
        return [p.pid for p in psutil.Process().parents()]
    except Exception:  # psutil missing or the process table unreadable: no preference
        return [os.getppid()]


def runtime_files(runtime_dir: str | Path | None = None) -> list[dict]:
    """Live servers' runtime files, the kernel's own ancestors first, then the newest."""
    if runtime_dir is None:
        from jupyter_core.paths import jupyter_runtime_dir
        runtime_dir = jupyter_runtime_dir()
    found = []
    for path in Path(runtime_dir).glob("jupyter_triton-*.json"):
        try:
            info = json.loads(path.read_text())
            pid, mtime = int(info["pid"]), path.stat().st_mtime
            if info.get("url") and _alive(pid):
                found.append((info, mtime))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    ancestors = _ancestors()
    rank = {pid: i for i, pid in enumerate(ancestors)}
    found.sort(key=lambda item: (rank.get(int(item[0]["pid"]), len(ancestors)), -item[1]))
    return [info for info, _ in found]


def from_runtime_files(runtime_dir: str | Path | None = None) -> Connection | None:
    for info in runtime_files(runtime_dir):
        if is_ready(info["url"], info.get("token", "")):
            return Connection(info["url"], info.get("token", ""), RUNTIME_FILE,
                              repository=info.get("model_repository", ""), grpc_url=_grpc_of(info),
                              public_url=str(info.get("public_url") or ""),
                              notes=_notes(info, os.environ))
    return None


def from_jupyterhub(environ: dict[str, str] | None = None) -> Connection | None:
    env = os.environ if environ is None else environ
    url, token = env.get("JUPYTERHUB_SERVICE_URL"), env.get("JUPYTERHUB_API_TOKEN", "")
    if url and token:
        prefix = env.get("JUPYTERHUB_SERVICE_PREFIX", "/")
        root = url.rstrip("/") + "/"
        if prefix.strip("/") and not root.rstrip("/").endswith(prefix.rstrip("/")):
            root = root.rstrip("/") + "/" + prefix.strip("/") + "/"
        if is_ready(root, token):
            address = hub.public_address(env)
            return Connection(root, token, JUPYTERHUB, public_url=address.url,
                              notes=[n for n in (address.note, hub.credential_note(env, address.url))
                                     if n])
    return None


def start_in_kernel(repository: str | Path | None = None) -> Connection:
    """Start the standalone server in a daemon thread of this process (explicit mode)."""
    # The kernel side never talks to the engine: it only starts the standalone wiring and
    # then speaks HTTP to it like any other client.
    from .. import standalone
    if repository:
        repo = Path(repository)
    else:
        repo = Path(tempfile.mkdtemp(prefix="jupyter_triton-"))
        atexit.register(shutil.rmtree, repo, ignore_errors=True)   # it dies with the kernel
    from ..frontends.admission import GROUPS, AccessPolicy
    token = secrets.token_urlsafe(32)
    access = AccessPolicy(tokens={token: GROUPS})
    server = standalone.start_in_thread(
        standalone.EngineOptions(model_repository=repo, model_control_mode="explicit",
                                 load_models=[]),
        host="127.0.0.1", http_port=0, metrics_port=0, grpc_port=0, access_log=False,
        access=access, grpc_access=access, check_host=True, strict_content_type=True)
    conn = Connection(server.url, token, IN_KERNEL,
                      metrics_url=f"http://127.0.0.1:{server.metrics_port}/metrics",
                      repository=str(repo), server=server,
                      grpc_url=f"127.0.0.1:{server.grpc_port}" if server.grpc_port else "")
    os.environ[ENV_URL], os.environ[ENV_TOKEN] = conn.url, token
    _IN_KERNEL[conn.url] = conn
    return conn


_LOCK = threading.Lock()
_CONNECTION: Connection | None = None


def discover(start_server: bool = True) -> Connection | None:
    """The first server that answers, in the order of the module docstring."""
    for find in (from_environment, from_runtime_files, from_jupyterhub):
        found = find()
        if found is not None:
            return found
    return start_in_kernel() if start_server else None


def connection(refresh: bool = False) -> Connection:
    """This kernel's server, found once per process (``refresh`` looks again, e.g. after the
    Jupyter server restarted). An in-kernel server is kept while it answers."""
    global _CONNECTION
    with _LOCK:
        current = _CONNECTION
        if current is not None and refresh and current.mode != IN_KERNEL:
            current = None
        if current is not None and refresh and not is_ready(current.url, current.token):
            current = None
        if current is None:
            current = _CONNECTION = discover()
        return current


def reset() -> None:
    """Forget the cached connection (tests; a kernel that moved to another server)."""
    global _CONNECTION
    with _LOCK:
        _CONNECTION = None


def stop_in_kernel() -> None:
    """Stop the servers this process started (``start_in_kernel``) and forget them."""
    global _CONNECTION
    with _LOCK:
        for url, conn in list(_IN_KERNEL.items()):
            conn.server.close()
            del _IN_KERNEL[url]
            if os.environ.get(ENV_URL) == url:
                os.environ.pop(ENV_URL, None)
                os.environ.pop(ENV_TOKEN, None)
            if _CONNECTION is conn:
                _CONNECTION = None
