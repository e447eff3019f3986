"""A model instance's worker process, both ends of it.

``worker_main`` runs in the child (spawned, never forked: the server is threaded) and
serves one ``ModelStub``. ``WorkerProcess`` is the server's handle: it moves tensors
through shared memory and small metadata through a pipe, and every wait also watches the
process sentinel, so a worker that dies (segfault, ``os._exit``, the OOM killer) is
noticed at once instead of hanging the instance.

Pipe protocol, one exchange at a time:
    server -> worker  ("execute", in_region, out_region, [request meta])  ("out", region)  ("finalize",)
    worker -> server  ("ready", pid)  ("result", [("ok", refs) | ("error", code, msg)])
                      ("grow", nbytes)  ("error", StubError tuple)  ("done",)
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import sys
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

from .shm import ShmRegion, stage
from .stub import ModelStub, RequestData, ResponseError, StubError, run_auto_complete_config

log = logging.getLogger(__name__)

_CONTEXT = multiprocessing.get_context("spawn")


class WorkerDied(Exception):
    def __init__(self, exitcode: int | None) -> None:
        super().__init__(f"worker died (exit code {exitcode})")
        self.exitcode = exitcode


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "exit code unknown"
    if exitcode < 0:
        try:
            sig = signal.Signals(-exitcode).name
        except ValueError:
            sig = f"signal {-exitcode}"
        hint = "; the system may have run out of memory" if sig == "SIGKILL" else ""
        return f"exit code {exitcode}, {sig}{hint}"
    return f"exit code {exitcode}"


# ----------------------------------------------------------------------------- child side

def worker_main(conn: Connection, job: str, model_py: str, payload: Any) -> None:
    """Entry point of the child. ``job`` is "serve" (payload: Triton's args) or
    "auto_complete" (payload: (module name, config JSON))."""
    # Ctrl-C in the server's terminal reaches the whole process group; the server decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s [python backend worker %(process)d] %(levelname)s %(message)s")
    if job == "auto_complete":
        try:
            conn.send(("ok", run_auto_complete_config(model_py, *payload)))
        except StubError as err:
            conn.send(("error", err.to_tuple()))
        return
    try:
        stub = ModelStub(model_py, payload)
    except StubError as err:
        conn.send(("error", err.to_tuple()))
        return
    conn.send(("ready", os.getpid()))
    regions: dict[str, ShmRegion] = {}
    try:
        _serve(conn, stub, regions)
    finally:
        for region in regions.values():
            region.close()


def _region(regions: dict[str, ShmRegion], name: str) -> ShmRegion:
    if name not in regions:
        regions[name] = ShmRegion.attach(name)
    return regions[name]


def _serve(conn: Connection, stub: ModelStub, regions: dict[str, ShmRegion]) -> None:
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):   # the server went away: nothing left to serve
            return
        if msg[0] == "finalize":
            try:
                stub.finalize()
                conn.send(("done",))
            except StubError as err:
                conn.send(("error", err.to_tuple()))
            return
        _, in_name, out_name, metas = msg
        for stale in [n for n in regions if n not in (in_name, out_name)]:
            regions.pop(stale).close()
        in_region = _region(regions, in_name) if in_name else None
        requests = [RequestData(inputs=in_region.read(refs) if in_region and refs else {},
                                request_id=rid, correlation_id=cid, parameters=params,
                                requested_output_names=names, flags=flags)
                    for refs, rid, cid, params, names, flags in metas]
        try:
            results = stub.execute(requests)
        except StubError as err:
            conn.send(("error", err.to_tuple()))
            continue
        _send_results(conn, regions, out_name, results)


def _send_results(conn: Connection, regions: dict[str, ShmRegion], out_name: str,
                  results: list[dict | ResponseError]) -> None:
    layouts: list[Any] = []
    end = 0
    for result in results:
        if isinstance(result, ResponseError):
            layouts.append(("error", result.code, result.message))
            continue
        try:
            staged, end = stage(result, end)
        except Exception as err:   # e.g. an output whose dtype Triton has no name for
            layouts.append(("error", 1, f"cannot return outputs: {type(err).__name__}: {err}"))
            continue
        layouts.append(("ok", staged))
    out_region = _region(regions, out_name)
    if end > out_region.size:
        conn.send(("grow", end))
        _, out_name = conn.recv()
        regions.pop(out_region.name).close()
        out_region = _region(regions, out_name)
    reply = [(kind, out_region.write(rest[0])) if kind == "ok" else (kind, *rest)
             for kind, *rest in layouts]
    conn.send(("result", reply))


# ---------------------------------------------------------------------------- server side

_LIVE: "weakref.WeakSet[WorkerProcess]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    # Runs before multiprocessing's own exit hook, which would otherwise wait forever on
    # non-daemon workers still blocked reading their pipe.
    for worker in list(_LIVE):
        worker.close()


class WorkerProcess:
    """The server's handle on one worker process and the two regions it reads and writes."""

    def __init__(self, model_py: str, args: dict[str, str], label: str) -> None:
        self.model_py = model_py
        self.args = args
        self.label = label
        self.ready = False
        self._conn: Connection | None = None
        self._process: Any = None
        self._in: ShmRegion | None = None
        self._out: ShmRegion | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> "WorkerProcess":
        """Spawn the process; ``wait_ready`` waits for ``initialize`` to finish."""
        self._conn, child = _CONTEXT.Pipe(duplex=True)
        # Not a daemon: a model may start processes of its own (DataLoader workers...).
        self._process = _CONTEXT.Process(target=worker_main, name=f"triton-python-{self.label}",
                                         args=(child, "serve", self.model_py, self.args))
        self._process.start()
        child.close()   # so the pipe reports EOF when the worker goes
        _LIVE.add(self)
        return self

    def wait_ready(self) -> None:
        msg = self._recv()
        if msg[0] == "error":
            raise StubError(*msg[1])
        self.ready = True

    def execute(self, requests: list[RequestData]) -> list[dict | ResponseError]:
        """Run one batch; raises ``StubError`` when execute raised, ``WorkerDied`` on death."""
        staged, end, layout = [], 0, []
        for req in requests:
            s, end = stage(req.inputs, end)
            staged.extend(s)
            layout.append(([x.ref for x in s], req.request_id, req.correlation_id,
                           req.parameters, req.requested_output_names, req.flags))
        if staged and (self._in is None or self._in.size < end):
            self._replace("_in", end)
        if self._in is not None and staged:
            self._in.write(staged)
        if self._out is None:
            self._replace("_out", 0)
        self._send(("execute", self._in.name if self._in else "", self._out.name, layout))
        msg = self._recv()
        if msg[0] == "grow":
            self._replace("_out", msg[1])
            self._send(("out", self._out.name))
            msg = self._recv()
        if msg[0] == "error":
            raise StubError(*msg[1])
        results: list[dict | ResponseError] = []
        for kind, *rest in msg[1]:
            if kind == "ok":
                results.append(self._out.read(rest[0]))
            else:
                results.append(ResponseError(rest[0], rest[1]))
        return results

    def _replace(self, attr: str, nbytes: int) -> None:
        old = getattr(self, attr)
        setattr(self, attr, ShmRegion.create(nbytes))
        if old is not None:
            old.close()   # unlinks the name; the worker's mapping lives until it detaches

    def _send(self, msg: Any) -> None:
        try:
            self._conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            raise WorkerDied(self._reap()) from None

    def _recv(self) -> Any:
        while True:
            ready = wait([self._conn, self._process.sentinel])
            if self._conn in ready or self._conn.poll(0):
                try:
                    return self._conn.recv()
                except (EOFError, OSError):
                    raise WorkerDied(self._reap()) from None
            raise WorkerDied(self._reap())

    def _reap(self) -> int | None:
        self._process.join(5)
        if self._process.is_alive():   # closed its pipe but lives on: not ours to trust
            self._process.kill()
            self._process.join(5)
        return self._process.exitcode

    def stop(self, timeout: float = 30.0) -> StubError | None:
        """Run ``finalize`` (bounded by ``timeout``), then end the process and free its regions."""
        error = None
        try:
            if self.ready and self._process.is_alive():
                self._send(("finalize",))
                if wait([self._conn, self._process.sentinel], timeout):
                    msg = self._recv()
                    if msg[0] == "error":
                        error = StubError(*msg[1])
                else:
                    log.warning("python worker %s: finalize did not return within %.0f s",
                                self.label, timeout)
        except WorkerDied:
            pass
        finally:
            self.close()
        return error

    def close(self) -> None:
        """End the process (politely, then not) and unlink both regions. Idempotent."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._process is not None:
            self._process.join(2)
            if self._process.is_alive():
                self._process.terminate()
                self._process.join(2)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(2)
            self._process = None
        for attr in ("_in", "_out"):
            region = getattr(self, attr)
            if region is not None:
                region.close()
                setattr(self, attr, None)
        _LIVE.discard(self)


def auto_complete_in_worker(model_py: str, module: str, config_json: str) -> dict:
    """Run ``auto_complete_config`` in a short-lived worker, so model.py's imports and
    side effects stay out of the server process."""
    conn, child = _CONTEXT.Pipe(duplex=True)
    process = _CONTEXT.Process(target=worker_main, name="triton-python-autocomplete",
                               args=(child, "auto_complete", model_py, (module, config_json)))
    process.start()
    child.close()
    try:
        wait([conn, process.sentinel])
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            process.join(5)
            raise WorkerDied(process.exitcode) from None
        if msg[0] == "error":
            raise StubError(*msg[1])
        return msg[1]
    finally:
        conn.close()
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join(2)
