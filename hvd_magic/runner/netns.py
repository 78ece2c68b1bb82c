"""Run a command in a fresh network namespace that has only loopback, up.

``python -m hvd_magic.runner.netns -- COMMAND...`` unshares the network namespace (as root;
otherwise together with a user namespace that maps the caller's uid), brings ``lo`` up with
an ioctl (no ``ip`` binary needed) and execs COMMAND. Every socket COMMAND and its children
open then lives in that namespace: nothing is reachable from, or can reach, other hosts.
``--probe`` only checks that this works here (exit 0) or says why not (exit 1).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import socket
import struct
import sys
from typing import List, Optional

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1


def _unshare(flags: int) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare: {os.strerror(err)}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def enter_loopback_namespace() -> None:
    """Move this process into a new network namespace and bring its ``lo`` up.

    Raises OSError when the kernel, the container or missing privileges forbid it.
    """
    if os.geteuid() == 0:
        _unshare(CLONE_NEWNET)
    else:
        uid, gid = os.geteuid(), os.getegid()
        _unshare(CLONE_NEWUSER | CLONE_NEWNET)
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        req = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(sock.fileno(), SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point: ``--probe`` or ``-- COMMAND...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    probe = argv[:1] == ["--probe"]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not probe and not argv:
        sys.stderr.write("usage: python -m hvd_magic.runner.netns [--probe | -- COMMAND...]\n")
        return 2
    try:
        enter_loopback_namespace()
    except OSError as exc:
        sys.stderr.write(f"hvd_magic: cannot make a loopback-only network namespace here ({exc}); "
                         "set HVD_MAGIC_NETNS=0 to run without one\n")
        return 1
    if probe:
        with socket.create_server(("127.0.0.1", 0)):
            pass
        return 0
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.stderr.write(f"hvd_magic: cannot run {argv[0]!r}: {exc}\n")
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
