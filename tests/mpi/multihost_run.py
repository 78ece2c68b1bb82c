"""Driver of the multi-host hvd_magic.run test, run on host A:
``python multihost_run.py HOSTS SHARED_DIR``.

Prints one ``RESULT {json}`` line: the ranks' reports from a good run, what a run in which
the rank on the other host raises gave (both with TMPDIR=SHARED_DIR, which both hosts see),
and what a run with the temporary directory in this host's own /tmp gave.
"""
import json
import socket
import sys
import tempfile
import time

import hvd_magic
from hvd_magic.runner.api import RankError


def report(base):
    import numpy as np

    import hvd_magic.collectives as hvd
    total = hvd.allreduce(np.array([float(hvd.rank() + base)]), op=hvd.Sum)
    return {"host": socket.gethostname(), "rank": hvd.rank(), "local_size": hvd.local_size(),
            "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
            "sum": float(total[0])}


def fail_on(rank):
    import hvd_magic.collectives as hvd
    if hvd.rank() == rank:
        raise ValueError(f"boom on {socket.gethostname()}")
    return hvd.rank()


hosts, shared = sys.argv[1:3]
res = {}
tempfile.tempdir = shared
t0 = time.monotonic()
res["good"] = hvd_magic.run(report, args=(10,), np=2, hosts=hosts, timeout=25, stream=False)
res["good_s"] = time.monotonic() - t0
try:
    hvd_magic.run(fail_on, args=(1,), np=2, hosts=hosts.split(","), timeout=25, stream=False)
    res["failed"] = None
except RankError as exc:
    res["failed"] = {"rank": exc.rank, "message": str(exc), "traceback": exc.traceback}

tempfile.tempdir = "/tmp"                      # host B has its own /tmp
try:
    hvd_magic.run(report, args=(0,), np=2, hosts=hosts, timeout=25, stream=False)
    res["unshared"] = None
except Exception as exc:  # noqa: BLE001 - reported to the test
    res["unshared"] = f"{type(exc).__name__}: {exc}"
print("RESULT " + json.dumps(res), flush=True)
