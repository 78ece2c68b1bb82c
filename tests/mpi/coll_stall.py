"""Stall warning and stall shutdown.

Phase A (HOROVOD_STALL_CHECK_TIME_SECONDS=1, no shutdown): rank 1 submits 'slow' 2.5 s after
the others; rank 0 must print a stall warning naming 'slow' and rank 1 (the pytest side
checks stderr), hvd.pending() must show it waiting, and the result must be right.

Phase B (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=2): the last rank never submits 'never'; the
other ranks get hvd.StallError naming it and the missing rank, and the runtime stays usable.

Exits nonzero with one line per failed check, prefixed by the rank."""
import os
import sys
import time
import traceback

import numpy as np

import hvd_magic.collectives as hvd

FAILS = []


def fail(msg):
    FAILS.append(msg)


def wait_pending(name, timeout=5.0):
    """hvd.pending() entry for ``name`` once the negotiation knows who is missing."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in hvd.pending():
            if p["name"] == name and p["missing_ranks"] is not None:
                return p
        time.sleep(0.02)
    return None


# ---------------------------------------------------------------- phase A
os.environ["HOROVOD_STALL_CHECK_TIME_SECONDS"] = "1"
os.environ.pop("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", None)
hvd.init()
r, n = hvd.rank(), hvd.size()
try:
    if r == 1:
        time.sleep(2.5)
        got = hvd.allreduce(np.full(5, float(r)), name="slow")
    else:
        h = hvd.allreduce_async(np.full(5, float(r)), name="slow")
        p = wait_pending("slow")
        if p is None:
            fail(f"pending() never showed 'slow': {hvd.pending()}")
        elif p["missing_ranks"] != [1] or r not in p["submitted_by"] or p["kind"] != "allreduce":
            fail(f"pending() entry for 'slow': {p}")
        got = hvd.synchronize(h)
    if not np.allclose(got, (n - 1) / 2):
        fail(f"'slow' result {got}")
    if any(p["name"] == "slow" for p in hvd.pending()):
        fail(f"'slow' still pending after it finished: {hvd.pending()}")
except Exception:
    fail(f"phase A raised\n{traceback.format_exc()}")
hvd.shutdown()

# ---------------------------------------------------------------- phase B
os.environ["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = "2"
hvd.init()
missing = n - 1
try:
    for rep in range(2):        # the same name stalls twice: both times StallError, no hang
        if r != missing:
            h = hvd.allreduce_async(np.ones(5000), name="never")
            p = wait_pending("never")
            if p is None or p["missing_ranks"] != [missing]:
                fail(f"rep {rep}: pending() for 'never': {p}")
            t0 = time.monotonic()
            try:
                hvd.synchronize(h, timeout=30)
                fail(f"rep {rep}: 'never' finished without the missing rank")
            except hvd.StallError as e:
                msg = str(e)
                if not isinstance(e, RuntimeError):
                    fail("StallError is not a RuntimeError")
                for s in ("'never'", f"not yet by rank(s) {missing}", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"):
                    if s not in msg:
                        fail(f"rep {rep}: StallError message lacks {s!r}: {msg}")
            except TimeoutError:
                fail(f"rep {rep}: no StallError within 30 s")
            print(f"rank {r}: rep {rep}: StallError after {time.monotonic() - t0:.1f} s", flush=True)
        else:
            # Wait (without submitting 'never') until the others have given up on it.
            p = wait_pending("never")
            if p is None or p["missing_ranks"] != [missing]:
                fail(f"rep {rep}: pending() on the missing rank for 'never': {p}")
            deadline = time.monotonic() + 30
            while any(q["name"] == "never" for q in hvd.pending()) and time.monotonic() < deadline:
                time.sleep(0.05)
            if time.monotonic() >= deadline:
                fail(f"rep {rep}: 'never' still pending on the missing rank after 30 s")
        hvd.barrier(name=f"stall rep {rep}")
    # the runtime is still usable on every rank
    got = hvd.allreduce(np.full(5000, float(r)), name="after stall")
    if not np.allclose(got, (n - 1) / 2):
        fail(f"allreduce after stall: {got[:3]}")
    got = hvd.allreduce(np.full(3, float(r)), name="never")     # the name is free again
    if not np.allclose(got, (n - 1) / 2):
        fail(f"reusing 'never': {got}")
except Exception:
    fail(f"phase B raised\n{traceback.format_exc()}")
hvd.shutdown()

if FAILS:
    for f in FAILS:
        print(f"rank {r}: FAIL {f}", file=sys.stderr)
    print(f"rank {r}: {len(FAILS)} failures", file=sys.stderr)
    sys.exit(1)
print(f"rank {r}: coll_stall OK")
