"""Ports for servers a test starts with an explicit port (a command line, tritonserver)."""
from __future__ import annotations

import random
import socket

_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range, never one handed out before
    in this run. A port from bind(0) is an ephemeral one: between the check and the server's
    bind, any outgoing connection may take it as its source port, or any bind(0) may be given
    it again (CI: "address already in use" on a port free_port had just returned)."""
    low = _ephemeral_low()
    for _ in range(1000):
        port = random.randrange(10_000, low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in 10000-{low}")
