"""Under `hvdrun --min-np`: both ranks allreduce and finish; then rank 0 SIGKILLs the launcher
(its parent, prterun), as Open MPI's launcher can die in its own teardown after a job grew
onto added hosts. With an argument, every rank raises after the allreduce instead.

usage: elastic_launcher_dies.py [raise]"""
import atexit
import os
import signal
import sys
import time


def kill_launcher():
    time.sleep(0.5)              # the ranks' exit lines reach hvdrun first
    os.kill(os.getppid(), signal.SIGKILL)


if os.environ.get("OMPI_COMM_WORLD_RANK") == "0" and len(sys.argv) < 2:
    atexit.register(kill_launcher)    # registered before hvd_magic's: runs after it

import torch  # noqa: E402

import hvd_magic.torch as hvd  # noqa: E402

hvd.init()
print("SUM", hvd.allreduce(torch.ones(1), op=hvd.Sum).item(), flush=True)
if len(sys.argv) > 1:
    raise ValueError("this rank's training failed")
