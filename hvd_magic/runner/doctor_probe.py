"""Rank side of ``%hvd doctor``: ``mpiexec ... python -m hvd_magic.runner.doctor_probe``.

Every rank reports its host, Python and package versions (from package metadata, nothing
heavy imported), its network addresses and GPU visibility; the first rank of each pair of
hosts ping-pongs a sweep of message sizes with mpi4py; all ranks run a short allreduce
sweep. Rank 0 prints one line ``HVD_DOCTOR {json}`` that :func:`.doctor.analyse` reads.
"""
from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
from typing import Any, Dict, List, Optional

PREFIX = "HVD_DOCTOR "
PINGPONG_SIZES = (8, 1 << 16, 1 << 20, 4 << 20)
ALLREDUCE_SIZES = (1 << 12, 1 << 16, 1 << 20, 4 << 20)
ALLREDUCE_REPS = {1 << 12: 30, 1 << 16: 20, 1 << 20: 8, 4 << 20: 4}
BUDGET_S = 0.6                 # per message size, after the minimum repeats


def _version(dist: str) -> Optional[str]:
    from importlib import metadata
    names = {"hvd_magic": ("hvd_magic", "hvd-magic"), "tensorflow": ("tensorflow",
                                                                      "tensorflow-cpu")}
    for name in names.get(dist, (dist,)):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _addresses() -> Dict[str, str]:
    """Interface name -> IPv4 address (Linux ioctl; empty elsewhere)."""
    out: Dict[str, str] = {}
    try:
        import fcntl
        import struct
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                out[name] = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])
            except OSError:
                continue
        s.close()
    except (ImportError, OSError):
        pass
    return out


def _route(peer_ip: str, mine: Dict[str, str]) -> str:
    """The local interface traffic to ``peer_ip`` leaves by (the kernel's route choice)."""
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.connect((peer_ip, 9))
        src = s.getsockname()[0]
        s.close()
    except OSError:
        return "?"
    return next((f"{name} ({ip})" for name, ip in mine.items() if ip == src), src)


def _gpus() -> str:
    seen = []
    try:
        seen = sorted(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        pass
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not seen:
        return "none" if cvd is None else f"none (CUDA_VISIBLE_DEVICES={cvd})"
    return f"{len(seen)} NVIDIA GPU(s)" + ("" if cvd is None else f", CUDA_VISIBLE_DEVICES={cvd}")


def _timed(fn, reps_min: int, budget: float) -> float:
    times: List[float] = []
    t_end = time.perf_counter() + budget
    while len(times) < reps_min or (time.perf_counter() < t_end and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def _pingpong(comm: Any, me: int, a: int, b: int) -> Dict[str, Any]:
    """Ranks a and b exchange each size; the others wait. Median one-way times."""
    import numpy as np
    out: List[float] = []
    for size in PINGPONG_SIZES:
        buf = np.zeros(size, dtype=np.uint8)
        reps = 3 if size >= (1 << 20) else 20
        # both sides loop the same number of times: a decides, then tells b
        if me == a:
            for _ in range(2):                              # warm up
                comm.Send(buf, dest=b, tag=7)
                comm.Recv(buf, source=b, tag=7)
            count, t0, times = 0, time.perf_counter(), []
            while count < reps or (time.perf_counter() - t0 < BUDGET_S and count < 200):
                comm.send(True, dest=b, tag=8)
                s = time.perf_counter()
                comm.Send(buf, dest=b, tag=7)
                comm.Recv(buf, source=b, tag=7)
                times.append((time.perf_counter() - s) / 2)
                count += 1
            comm.send(False, dest=b, tag=8)
            times.sort()
            out.append(times[len(times) // 2])
        elif me == b:
            for _ in range(2):
                comm.Recv(buf, source=a, tag=7)
                comm.Send(buf, dest=a, tag=7)
            while comm.recv(source=a, tag=8):
                comm.Recv(buf, source=a, tag=7)
                comm.Send(buf, dest=a, tag=7)
    return {"sizes": list(PINGPONG_SIZES), "one_way_s": out}


def main() -> int:
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    me, n = comm.Get_rank(), comm.Get_size()
    mine = _addresses()
    info = {"rank": me, "host": socket.gethostname(), "python": platform.python_version(),
            "packages": {p: _version(p) for p in ("hvd_magic", "torch", "tensorflow",
                                                   "mpi4py", "numpy")},
            "addresses": mine, "gpus": _gpus(), "pid": os.getpid()}
    ranks = comm.allgather(info)
    leaders: Dict[str, int] = {}
    for r in ranks:
        leaders.setdefault(r["host"], r["rank"])
    hosts = list(leaders)
    pairs = []
    for i in range(len(hosts)):
        for j in range(i + 1, len(hosts)):
            a, b = leaders[hosts[i]], leaders[hosts[j]]
            comm.Barrier()
            res = _pingpong(comm, me, a, b)
            if me == a:
                peer = [ip for name, ip in ranks[b]["addresses"].items() if name != "lo"]
                res.update(a=hosts[i], b=hosts[j],
                           interface=_route(peer[0], mine) if peer else "?")
            pairs.append(comm.bcast(res if me == a else None, root=a))
    sweep: Dict[str, List[float]] = {"sizes": [], "times_s": []}
    if n > 1:
        for size in ALLREDUCE_SIZES:
            x = np.ones(size // 4, dtype=np.float32)
            y = np.empty_like(x)
            comm.Barrier()
            # a fixed count: every rank must make the same number of calls
            t = _timed(lambda: comm.Allreduce(x, y), ALLREDUCE_REPS[size], 0.0)
            t = comm.allreduce(t, op=MPI.MAX)
            sweep["sizes"].append(size)
            sweep["times_s"].append(t)
    if me == 0:
        record = {"ranks": ranks, "pairs": pairs, "allreduce": sweep,
                  "mpi_interface": _mpi_interface(),
                  "tcp_eager_limit": os.environ.get("OMPI_MCA_btl_tcp_eager_limit", "")}
        sys.stdout.write(PREFIX + json.dumps(record) + "\n")
        sys.stdout.flush()
    return 0


def _mpi_interface() -> str:
    """What restricts MPI's network, as the launcher set it (else: Open MPI's choice)."""
    parts = []
    for var in ("OMPI_MCA_btl_tcp_if_include", "OMPI_MCA_btl", "PRTE_MCA_prte_if_include"):
        if os.environ.get(var):
            parts.append(f"{var}={os.environ[var]}")
    return "; ".join(parts) or "Open MPI's own choice (every interface that routes)"


if __name__ == "__main__":
    sys.exit(main())
