"""What the tests/mpi check scripts share: the failures found so far, a decorator that runs
one check and records what it raised, a tolerance compare of arrays or tensors, and the
report that ends the script (one line per failure, prefixed by the rank; exit 1 if any)."""
import sys
import traceback

import numpy as np

FAILS = []


def check(label):
    def deco(fn):
        try:
            fn()
        except Exception:
            FAILS.append(f"{label}: raised\n{traceback.format_exc()}")
        return fn
    return deco


def as_array(x):
    """numpy, torch (detached) or TensorFlow values as a float64 array."""
    return np.asarray(x.detach() if hasattr(x, "detach") else x, dtype=np.float64)


def close(label, a, b, atol=1e-6):
    a, b = as_array(a), as_array(b)
    if a.shape != b.shape:
        FAILS.append(f"{label}: shape {a.shape} != {b.shape}")
    elif not np.allclose(a, b, atol=atol, rtol=0):
        FAILS.append(f"{label}: max diff {np.abs(a - b).max():.3g} > {atol}\n{a}\n{b}")


def finish(hvd):
    """Wait for every rank, report this rank's failures, shut down, exit."""
    hvd.barrier()
    rank = hvd.rank()
    for f in FAILS:
        print(f"[rank {rank}] FAIL {f}", flush=True)
    print(f"[rank {rank}] done, {len(FAILS)} failures", flush=True)
    hvd.shutdown()
    sys.exit(1 if FAILS else 0)
