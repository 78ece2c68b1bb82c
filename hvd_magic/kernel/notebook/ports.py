"""TCP ports for a pool's controller, chosen before it starts and bound by it a little later.

A port that is free now can be taken before the controller binds it. A port from the range
the OS hands out for ``bind(("", 0))`` and ``connect()`` (``ip_local_port_range``) is taken
that way by chance: the MPI launcher and the ranks, which start beside the controller,
listen on such ports. So the ports come from below that range, where only a process that
names the port can take it, and each is checked free by binding it.
"""
from __future__ import annotations

import random
import socket
from typing import List, Sequence, Tuple

RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
#: How many ports below the OS's range the controller's ports come from.
SPAN = 10000
FIRST_UNPRIVILEGED = 1024


def os_range(path: str = RANGE_FILE) -> Tuple[int, int]:
    """The OS's range for ports it picks itself (Linux's default when unreadable)."""
    try:
        with open(path) as fh:
            lo, hi = (int(x) for x in fh.read().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def candidates(lo: int, hi: int) -> Sequence[int]:
    """Ports outside ``lo..hi`` to choose from: up to :data:`SPAN` below it, else (a range
    that starts low) above it.

    >>> r = candidates(32768, 60999); (r[0], r[-1])
    (22768, 32767)
    >>> r = candidates(1024, 60999); (r[0], r[-1])
    (61000, 65535)
    """
    below = range(max(FIRST_UNPRIVILEGED, lo - SPAN), lo)
    above = range(hi + 1, min(65536, hi + 1 + SPAN))
    return below if len(below) >= len(above) else above


def controller_ports(n: int, rng: random.Random = random.SystemRandom()) -> List[int]:
    """``n`` distinct ports, free now, that the OS does not hand out by itself."""
    pool = candidates(*os_range())
    out: List[int] = []
    for port in rng.sample(pool, len(pool)):
        if _free(port):
            out.append(port)
            if len(out) == n:
                return out
    raise RuntimeError(f"no {n} free TCP ports in {pool[0]}-{pool[-1]}: close what listens "
                       "there, or widen the OS's port range")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True
