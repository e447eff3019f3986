"""Load/unload soak: does a long session of re-running %%serve cells leak anything?

Starts a real ``jupyter-triton serve`` (explicit mode, 127.0.0.1, free ports) and, through
tritonclient.http, runs N cycles of load_model(config=..., files=...) + one checked infer +
unload_model, alternating an ONNX model and a python-backend model.py (process mode: every
load starts a worker process, every unload must stop it and unlink its shared memory). Every
``--sample-every`` cycles it samples the server's whole process tree from /proc (RSS, fds,
threads, child processes), the server's /dev/shm segments and the repository on disk, and at
the end says, per column, whether the last sample is within a stated tolerance of the first
sample after warm-up. It measures leaks, not speed: other load on the host only slows it.

    .venv/bin/python benchmarks/soak.py --cycles 1000
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import onnx_models  # noqa: E402  (the tests' builders: the model is made here, never downloaded)

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "jt_"          # jupyter_triton.backends.python.shm.PREFIX: jt_<server pid>_<ns>_<rand>
ONNX_NAME, PY_NAME = "soak_onnx", "soak_py"
W = np.arange(12, dtype=np.float32).reshape(4, 3) / 10

ONNX_CONFIG = {
    "name": ONNX_NAME, "platform": "onnxruntime_onnx", "max_batch_size": 8,
    "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]}],
    "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [3]}],
}
PY_CONFIG = {
    "name": PY_NAME, "backend": "python", "max_batch_size": 8,
    "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [4]}],
    "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [4]}],
    "instance_group": [{"kind": "KIND_CPU", "count": 1}],
}
PY_MODEL = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
                    "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2 + 1)])
                for r in requests]
'''

# Tolerances, last sample against the first sample after warm-up. Memory may settle a little
# (allocator arenas, import caches); a leak of 20 KiB per cycle is 20 MiB over 1,000 cycles.
# Between cycles nothing is loaded, so fds, threads, children and segments must come back to
# exactly where they were, give or take one fd/thread that a timer or connection holds briefly.
TOLERANCE = {"rss_mib": ("max(+16 MiB, +10 %)", lambda base, last: last - base <= max(16, 0.10 * base)),
             "fds": ("+2", lambda base, last: last - base <= 2),
             "threads": ("+2", lambda base, last: last - base <= 2),
             "children": ("+0", lambda base, last: last <= base),
             "shm_files": ("+0", lambda base, last: last <= base),
             "shm_bytes": ("+0", lambda base, last: last <= base),
             "repo_other": ("+0", lambda base, last: last <= base)}


@dataclass
class Sample:
    cycle: int
    elapsed_s: float
    server_cpu_s: float       # utime+stime of the server process, cumulative (not its workers)
    rss_mib: float            # the whole process tree
    server_rss_mib: float
    fds: int                  # the whole process tree
    threads: int
    children: int             # descendants of the server
    shm_files: int            # this server's jt_<pid>_ segments
    shm_bytes: int
    shm_all_jt: int           # every jt_ segment on the host (other servers' included)
    shm_total_files: int      # everything in /dev/shm
    repo_versions: int        # version directories on disk, all models
    repo_other: int           # non-version dirs: staging, .failed, .history
    repo_kib: float
    # while the python model was loaded, in the last python cycle before this sample: proof
    # that each load really starts a worker and maps a region (which the unload must undo)
    loaded_children: int = -1
    loaded_shm_files: int = -1
    server_fd_kinds: dict = field(default_factory=dict)
    server_thread_names: dict = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        parents[ppid].append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def status_field(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fd_kind(target: str) -> str:
    if target.startswith(("socket:", "pipe:")):
        return target.split(":")[0]
    if target.startswith("anon_inode:"):
        return target.strip("[]").replace("[", "")
    if target.startswith(str(SHM_DIR)):
        return "/dev/shm"
    return "file:" + (target if target.startswith("/dev/") else os.path.splitext(target)[1] or "?")


def fd_list(pid: int) -> list[str]:
    out = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                pass
    except OSError:
        pass
    return out


def thread_names(pid: int) -> dict[str, int]:
    names: collections.Counter[str] = collections.Counter()
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                names[Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()] += 1
            except OSError:
                pass
    except OSError:
        pass
    return dict(sorted(names.items()))


def repo_size(repo: Path) -> tuple[int, int, float]:
    """Version dirs; other dirs (upload staging, .failed, .history: none should pile up); KiB."""
    versions = other = 0
    for m in repo.iterdir():
        if not m.is_dir():
            continue
        if m.name.startswith("."):
            other += 1
            continue
        for v in m.iterdir():
            if v.is_dir():
                versions += v.name.isdigit()
                other += not v.name.isdigit()
    size = sum(f.stat().st_size for f in repo.rglob("*") if f.is_file())
    return versions, other, size / 1024


def sample(cycle: int, started: float, pid: int, repo: Path) -> Sample:
    tree = [pid] + descendants(pid)
    rss = [status_field(p, "VmRSS") for p in tree]
    own = f"{SHM_PREFIX}{pid}_"
    shm = [e for e in os.scandir(SHM_DIR)]
    mine = [e for e in shm if e.name.startswith(own)]
    versions, other, kib = repo_size(repo)
    return Sample(
        cycle=cycle, elapsed_s=round(time.monotonic() - started, 1),
        server_cpu_s=round(cpu_seconds(pid), 1), rss_mib=round(sum(rss) / 1024, 1), server_rss_mib=round(rss[0] / 1024, 1),
        fds=sum(len(fd_list(p)) for p in tree), threads=sum(status_field(p, "Threads") for p in tree),
        children=len(tree) - 1, shm_files=len(mine),
        shm_bytes=sum(e.stat().st_blocks * 512 for e in mine),
        shm_all_jt=sum(1 for e in shm if e.name.startswith(SHM_PREFIX)), shm_total_files=len(shm),
        repo_versions=versions, repo_other=other, repo_kib=round(kib, 1),
        server_fd_kinds=dict(sorted(collections.Counter(fd_kind(t) for t in fd_list(pid)).items())),
        server_thread_names=thread_names(pid))


def start_server(repo: Path, log_path: Path, keep_versions: int, ready_s: float
                 ) -> tuple[subprocess.Popen, int, list[str]]:
    exe = Path(sys.executable).with_name("jupyter-triton")
    http, grpc, metrics = free_port(), free_port(), free_port()
    cmd = [str(exe), "serve", "--model-repository", str(repo), "--model-control-mode", "explicit",
           "--http-address", "127.0.0.1", "--http-port", str(http),
           "--grpc-address", "127.0.0.1", "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    if keep_versions:
        cmd += ["--keep-versions", str(keep_versions)]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    client = httpclient.InferenceServerClient(f"127.0.0.1:{http}", connection_timeout=2,
                                              network_timeout=2)
    deadline = time.monotonic() + ready_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"server exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
            try:
                if client.is_server_ready():
                    return proc, http, cmd
            except Exception:       # not listening yet
                pass
            time.sleep(0.2)
    finally:
        client.close()
    proc.kill()
    raise SystemExit(f"server not ready in {ready_s} s:\n{log_path.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen, pid: int) -> dict:
    """SIGTERM, bounded; then what it left behind: live descendants and its segments."""
    tree = descendants(pid)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
        clean = True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        clean = False
    stop_s = time.monotonic() - t0
    time.sleep(0.5)
    alive = [p for p in tree if Path(f"/proc/{p}").exists()
             and "Z" not in Path(f"/proc/{p}/stat").read_text().split(")")[-1].split()[0]]
    left = sorted(e.name for e in os.scandir(SHM_DIR) if e.name.startswith(f"{SHM_PREFIX}{pid}_"))
    for p in alive:                 # the soak's own mess: never leave workers behind
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    return {"stopped_by_sigterm": clean, "stop_s": round(stop_s, 2), "orphans": alive,
            "segments_left": left}


def cycle_once(client: httpclient.InferenceServerClient, i: int, onnx_bytes: bytes,
               probe=None) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4) + i
    if i % 2 == 0:
        name, cfg, files, in_name, out_name, want = (
            ONNX_NAME, ONNX_CONFIG, {"file:1/model.onnx": onnx_bytes}, "INPUT0", "OUTPUT0", x @ W)
    else:
        name, cfg, files, in_name, out_name, want = (
            PY_NAME, PY_CONFIG, {"file:1/model.py": PY_MODEL.encode()}, "X", "Y", x * 2 + 1)
    client.load_model(name, config=json.dumps(cfg), files=files)
    inp = httpclient.InferInput(in_name, list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    got = client.infer(name, [inp]).as_numpy(out_name)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    if probe is not None:
        probe()
    client.unload_model(name)


def verdicts(samples: list[Sample], warmup: int) -> dict[str, dict]:
    after = [s for s in samples if s.cycle >= warmup]
    if len(after) < 2:
        return {}
    base, last = after[0], after[-1]
    out = {}
    for col, (tol, ok) in TOLERANCE.items():
        b, l = getattr(base, col), getattr(last, col)
        peak = max(getattr(s, col) for s in after)
        out[col] = {"base": b, "last": l, "peak": peak, "tolerance": tol,
                    "verdict": "flat" if ok(b, l) else "GROWS"}
    if len(after) >= 3:     # per-cycle server CPU, first interval after warm-up against the last
        def per_cycle(a: Sample, b: Sample) -> float:
            return round(1000 * (b.server_cpu_s - a.server_cpu_s) / max(1, b.cycle - a.cycle), 2)
        first, final = per_cycle(after[0], after[1]), per_cycle(after[-2], after[-1])
        out["server_cpu_ms_per_cycle"] = {
            "base": first, "last": final, "peak": max(per_cycle(a, b) for a, b in zip(after, after[1:])),
            "tolerance": "x1.5", "verdict": "flat" if final <= 1.5 * first else "GROWS"}
    dv = last.repo_versions - base.repo_versions
    out["repo_versions"] = {"base": base.repo_versions, "last": last.repo_versions,
                            "peak": last.repo_versions, "tolerance": "by design",
                            "verdict": f"grows {dv / max(1, last.cycle - base.cycle):.2f}/cycle"
                                       if dv else "flat"}
    return out


COLUMNS = [("cycle", "cycle"), ("elapsed_s", "s"), ("server_cpu_s", "server CPU s"), ("rss_mib", "rss MiB"),
           ("server_rss_mib", "server MiB"), ("fds", "fds"), ("threads", "threads"),
           ("children", "children"), ("shm_files", "shm files"), ("shm_bytes", "shm bytes"),
           ("repo_versions", "repo dirs"), ("repo_other", "other dirs"), ("repo_kib", "repo KiB"),
           ("loaded_children", "children loaded"), ("loaded_shm_files", "shm loaded")]


def table(samples: list[Sample]) -> str:
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |",
             "|" + "---:|" * len(COLUMNS)]
    for s in samples:
        lines.append("| " + " | ".join(str(getattr(s, k)) for k, _ in COLUMNS) + " |")
    return "\n".join(lines)


def report(meta: dict, samples: list[Sample], verdict: dict, stop: dict) -> str:
    lines = [f"# Load/unload soak: {meta['cycles_done']} of {meta['cycles']} cycles",
             "", f"`{meta['command']}`  ", f"server: `{' '.join(meta['server_cmd'])}`  ",
             f"{meta['started']} · {meta['wall_s']} s · {meta['failures']} failed cycles"
             f"{' · STOPPED: ' + meta['stopped'] if meta['stopped'] else ''}", "",
             "Each cycle: load_model(config, files) + one checked infer + unload_model, alternating "
             "an ONNX model and a python model.py (process mode: a worker per load). Samples are "
             "taken between cycles (nothing loaded), over the server's whole process tree; shm = "
             "this server's `jt_<pid>_` segments (bytes allocated). Cycle 0 is before the first "
             "load. The last two columns are taken inside the last python cycle before the "
             "sample, with its worker up (-1: not probed).", "", table(samples), "",
             f"Verdicts (last sample against cycle {meta['warmup']}, after warm-up):", "",
             "| column | base | last | peak | tolerance | verdict |", "|---|---:|---:|---:|---|---|"]
    for col, v in verdict.items():
        lines.append(f"| {col} | {v['base']} | {v['last']} | {v['peak']} | {v['tolerance']} | "
                     f"{v['verdict']} |")
    lines += ["", f"Retention: {meta['retention']}", "",
              f"Server fds by kind at the first and last sample: "
              f"`{samples[0].server_fd_kinds}` → `{samples[-1].server_fd_kinds}`  ",
              f"Server threads by name, first → last: "
              f"`{samples[0].server_thread_names}` → `{samples[-1].server_thread_names}`", "",
              f"Stop (SIGTERM): {'clean' if stop['stopped_by_sigterm'] else 'needed SIGKILL'} in "
              f"{stop['stop_s']} s; orphan processes {stop['orphans'] or 'none'}; segments left "
              f"{stop['segments_left'] or 'none'}."]
    if meta["errors"]:
        lines += ["", "First errors:", ""] + [f"- cycle {c}: {e}" for c, e in meta["errors"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--sample-every", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=None,
                    help="the sample verdicts compare against (default: --sample-every)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--name", default="soak", help="writes <out>/<name>.md and <name>.json")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="per request")
    ap.add_argument("--max-seconds", type=float, default=3000.0, help="cap on the whole soak")
    ap.add_argument("--max-failures", type=int, default=20)
    ap.add_argument("--keep-versions", type=int, default=0,
                    help="pass --keep-versions N to the server (only if its CLI has the flag)")
    args = ap.parse_args(argv)
    warmup = args.sample_every if args.warmup is None else args.warmup

    exe = Path(sys.executable).with_name("jupyter-triton")
    has_keep = "--keep-versions" in subprocess.run([str(exe), "serve", "--help"], capture_output=True,
                                                   text=True, timeout=60).stdout
    keep = args.keep_versions if has_keep else 0
    if args.keep_versions and not has_keep:
        print("note: `jupyter-triton serve` has no --keep-versions; every version stays on disk",
              file=sys.stderr)
    retention = (f"--keep-versions {keep} (the server keeps the newest {keep} versions)" if keep else
                 ("the CLI has --keep-versions; not used in this run (default 0: nothing deleted)"
                  if has_keep else "`jupyter-triton serve` does not expose EngineOptions.keep_versions, "
                  "so every load with files stores a new version and the repository grows"))

    work = Path(tempfile.mkdtemp(prefix="jt-soak-"))
    repo = work / "models"
    repo.mkdir()
    onnx_bytes = onnx_models.linear(W)
    proc, http, server_cmd = start_server(repo, work / "server.log", keep, ready_s=120)
    pid = proc.pid
    client = httpclient.InferenceServerClient(f"127.0.0.1:{http}", connection_timeout=args.timeout_s,
                                              network_timeout=args.timeout_s)
    started = time.monotonic()
    samples = [sample(0, started, pid, repo)]
    print(table(samples), flush=True)
    failures, errors, stopped, done = 0, [], "", 0
    loaded: dict[str, int] = {}
    try:
        for i in range(1, args.cycles + 1):
            if time.monotonic() - started > args.max_seconds:
                stopped = f"time cap {args.max_seconds:.0f} s reached"
                break
            if proc.poll() is not None:
                stopped = f"server exited with {proc.returncode}"
                break
            probe = None
            if i % 2 == 1 and args.sample_every - i % args.sample_every <= 2:
                def probe() -> None:
                    loaded["children"] = len(descendants(pid))
                    loaded["shm"] = sum(1 for e in os.scandir(SHM_DIR)
                                        if e.name.startswith(f"{SHM_PREFIX}{pid}_"))
            try:
                cycle_once(client, i, onnx_bytes, probe)
            except Exception as err:      # a failed cycle is a finding: count it, keep going
                failures += 1
                if len(errors) < 10:
                    errors.append((i, f"{type(err).__name__}: {str(err)[:300]}"))
                if failures >= args.max_failures:
                    stopped = f"{failures} failed cycles"
                    done = i
                    break
            done = i
            if i % args.sample_every == 0:
                samples.append(sample(i, started, pid, repo))
                samples[-1].loaded_children = loaded.pop("children", -1)
                samples[-1].loaded_shm_files = loaded.pop("shm", -1)
                print(table(samples).splitlines()[-1], flush=True)
    finally:
        client.close()
        if samples[-1].cycle != done and proc.poll() is None:
            samples.append(sample(done, started, pid, repo))
        stop = stop_server(proc, pid) if proc.poll() is None else {
            "stopped_by_sigterm": False, "stop_s": 0, "orphans": [], "segments_left": []}
    verdict = verdicts(samples, warmup)
    meta = {"command": "python benchmarks/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "server_cmd": [Path(server_cmd[0]).name] + server_cmd[1:3] + ["<tmp>/models"] + server_cmd[4:],
            "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cycles": args.cycles, "cycles_done": done, "warmup": warmup, "failures": failures,
            "errors": errors, "stopped": stopped, "wall_s": round(time.monotonic() - started, 1),
            "retention": retention, "host_cpus": os.cpu_count()}
    text = report(meta, samples, verdict, stop)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(text)
    (args.out / f"{args.name}.json").write_text(json.dumps(
        {"meta": meta, "samples": [asdict(s) for s in samples], "verdicts": verdict, "stop": stop},
        indent=1) + "\n")
    print(text)
    if failures or stopped:
        print(f"server log tail ({work / 'server.log'}):\n" + (work / "server.log").read_text()[-2000:])
    else:
        shutil.rmtree(work, ignore_errors=True)
    grows = [c for c, v in verdict.items() if v["verdict"] == "GROWS"]
    return 1 if failures or stopped or grows else 0


if __name__ == "__main__":
    raise SystemExit(main())
