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


def replay_fails(model, steps, X, Y, seed, epochs, lr=0.05):
    """An elastic run's failures against one process replaying it: ``steps`` holds
    ``(epoch, [each rank's sample indices])`` per global step. Every sample of each epoch
    must be trained exactly once, and ``model`` (a Linear) must equal a Linear seeded with
    ``seed`` and trained by SGD(lr) on the same global batches (the mean of the ranks' equal-sized
    batch means)."""
    import torch
    fails = []
    n = X.shape[0]
    for e in range(epochs):
        seen = sorted(i for ep, step in steps if ep == e for part in step for i in part)
        if seen != list(range(n)):
            fails.append(f"epoch {e}: samples trained {len(seen)}, distinct {len(set(seen))} of {n}")
    torch.manual_seed(seed)
    ref = torch.nn.Linear(X.shape[1], 1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for _e, step in steps:
        ref_opt.zero_grad()
        sum(torch.nn.functional.mse_loss(ref(X[p]), Y[p]) for p in step).div(len(step)).backward()
        ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        if not torch.allclose(a, b, atol=1e-5):
            fails.append(f"weights differ from the replay: {a.ravel()[:3]} vs {b.ravel()[:3]}")
    return fails
