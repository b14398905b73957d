"""Ports on 127.0.0.1 for the tests that start servers (Flower's SuperLink and SuperNodes)."""

from __future__ import annotations

import random
import socket

# Ray's worker processes listen on 10002-19999 by default.
_LOWEST = 20000


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free right now (all held open together, then released).

    They are drawn below the kernel's ephemeral range: a port from ``bind(0)`` lies inside it,
    where any process's outgoing connection may take it in the seconds before the server
    binds it (a SuperLink in CI once failed with "address already in use" that way)."""
    low, _ = _ephemeral_range()
    pool = list(range(_LOWEST, low)) if low - _LOWEST >= 1000 else []
    random.SystemRandom().shuffle(pool)
    sockets: list[socket.socket] = []
    try:
        for port in pool:
            if len(sockets) == count:
                break
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            sockets.append(s)
        while len(sockets) < count:  # no room below the ephemeral range: the kernel's choice
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def listening(port: int) -> bool:
    """Whether something accepts connections on ``port``."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False
