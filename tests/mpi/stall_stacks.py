"""Ranks that wait on different collectives, or that compute in C holding the GIL.

``mismatch``: rank 0 waits for allreduce 'grad.weight' (submitted asynchronously one line
before) while rank 1 waits in allreduce 'grad.bias'. The stall check (HOROVOD_STALL_CHECK_TIME_SECONDS, short in the test) must show
where each rank waits and both stacks; the stall shutdown
(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS) then ends both calls with StallError.

``gil``: rank 0 waits in an allreduce while rank 1 runs one long C call (6 s or so) that
never releases the GIL nor looks for signals (a sum over a range); rank 1's stack must still come.

``usr1``: ``mismatch`` printing READY first; the test sends SIGUSR1 to hvdrun then.
"""
import sys
import time

import numpy as np

import hvd_magic.collectives as hvd

mode = sys.argv[1]
hvd.init()
r = hvd.rank()
x = np.ones(4)


def spin_in_c():
    # sum() over a range is one C loop that holds the GIL and never looks for signals (re's
    # matcher does: a Python handler runs inside it). About 6 s: the stacks are asked for
    # during that call, when only an answer from C can come in time.
    t0 = time.monotonic()
    sum(range(10**7))
    per_item = max(time.monotonic() - t0, 1e-9) / 10**7
    sum(range(int(6.0 / per_item)))                     # SPIN-IN-C


if mode in ("mismatch", "usr1"):
    print(f"READY {r}", flush=True)
    try:
        if r == 0:
            h = hvd.allreduce_async(x, name="grad.weight")    # SUBMIT-WEIGHT
            hvd.synchronize(h)                            # WAIT-WEIGHT
        else:
            hvd.allreduce(x, name="grad.bias")            # WAIT-BIAS
    except (hvd.StallError, hvd.ShutdownError):   # the stall shutdown ends both
        pass
elif mode == "gil":
    if r == 1:
        spin_in_c()
    hvd.allreduce(x, name="after")                        # WAIT-AFTER
print(f"stall_stacks OK {r}", flush=True)
