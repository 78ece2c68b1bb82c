"""The response cache (hvd_magic.collectives.response_cache) on real ranks: a loop's steady
state goes by bits alone, and everything the full messages do still holds when a request
is cached: ranks submitting in any order, a mismatch after caching, a stalled cached
request named with its missing rank, a join and a shutdown while cached requests wait,
process sets, a full cache. Exits nonzero with one line per failed check."""
import os
import time

import numpy as np

import hvd_magic.collectives as hvd
from hvd_magic.collectives import state
from checklib import FAILS, check, close, finish

os.environ["HOROVOD_STALL_CHECK_TIME_SECONDS"] = "1"
os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
hvd.init()
r, n = hvd.rank(), hvd.size()
tri = n * (n - 1) / 2          # the sum of the ranks


def step_loop(steps, names, tag):
    for step in range(steps):
        hs = {k: hvd.allreduce_async(np.full(k, float(r + step)), name=f"{tag}.{k}", op=hvd.Sum)
              for k in names}
        b = hvd.broadcast(np.full(3, float(r + step)), root_rank=n - 1, name=f"{tag}.b")
        close(f"{tag} step {step} broadcast", b, np.full(3, float(n - 1 + step)))
        rs = hvd.reducescatter(np.full(2 * n, float(r + step)), name=f"{tag}.rs", op=hvd.Sum)
        close(f"{tag} step {step} reducescatter", rs, np.full(2, tri + n * step))
        for k, h in hs.items():
            close(f"{tag} step {step} allreduce {k}", hvd.synchronize(h),
                  np.full(k, tri + n * step))


@check("steady state by bits alone")
def _():
    eng = state.engine()
    step_loop(3, (1, 7, 300, 5000), "loop")            # negotiated, then cached
    hits, exchanges = eng.cache.hits, eng.exchanges
    step_loop(10, (1, 7, 300, 5000), "loop")
    if eng.cache.hits - hits != 10 * 6:
        FAILS.append(f"{eng.cache.hits - hits} requests from the response cache, not 60")
    if eng.exchanges != exchanges:
        FAILS.append(f"{eng.exchanges - exchanges} full-message cycles in the steady state")
    if eng.cache.words() != 2:
        FAILS.append(f"bit vector of {eng.cache.words()} words for {len(eng.cache.slots)} slots")


@check("cached requests submitted in other orders on each rank")
def _():
    names = [f"loop.{k}" for k in (1, 7, 300, 5000)]
    order = names if r % 2 == 0 else names[::-1]
    for step in range(3):
        hs = {nm: hvd.allreduce_async(np.full(int(nm.split(".")[1]), float(r)), name=nm,
                                      op=hvd.Sum) for nm in order}
        if r == n - 1:
            time.sleep(0.05)                 # one rank late
        for nm, h in hs.items():
            close(f"order step {step} {nm}", hvd.synchronize(h), np.full(int(nm.split(".")[1]), tri))


@check("a mismatch after caching")
def _():
    for _ in range(2):
        hvd.allreduce(np.ones(3), name="mm", op=hvd.Sum)
    shape = 4 if r == n - 1 else 3
    try:
        hvd.allreduce(np.ones(shape), name="mm", op=hvd.Sum)
        FAILS.append("a shape that differs across ranks reduced without an error")
    except hvd.TensorMismatchError as e:
        msg = str(e)
        if "'mm'" not in msg or "shape differs" not in msg or f"{n - 1}" not in msg:
            FAILS.append(f"mismatch message: {msg}")
    close("the same name again, alike", hvd.allreduce(np.ones(3), name="mm", op=hvd.Sum),
          np.full(3, float(n)))
    close("and cached again", hvd.allreduce(np.ones(3), name="mm", op=hvd.Sum), np.full(3, float(n)))


@check("unnamed calls, several of one shape in flight")
def _():
    eng = state.engine()
    hits = eng.cache.hits
    for step in range(6):
        close(f"unnamed blocking step {step}", hvd.allreduce(np.full(3, float(r + step)), op=hvd.Sum),
              np.full(3, tri + n * step))
        hs = [hvd.allreduce_async(np.full(5, float(r * k)), op=hvd.Sum) for k in range(4)]
        for k, h in enumerate(hs):
            close(f"unnamed async step {step} #{k}", hvd.synchronize(h), np.full(5, tri * k))
    if eng.cache.hits - hits < 5 * 5:
        FAILS.append(f"only {eng.cache.hits - hits} unnamed calls from the response cache")


@check("blocking calls on the short path, beside ranks on the general one or late")
def _():
    eng = state.engine()
    x = np.linspace(0.1, 1.7, 33, dtype=np.float32) * np.float32((r + 1) / 3)  # inexact sums
    y = x.copy()
    for _ in range(2):                 # negotiated, then cached
        hvd.allreduce(x, name="sp")
        hvd.allreduce_(y, name="sp.inplace")
        hvd.synchronize(hvd.allreduce_async(np.ones(2), name="sp.other", op=hvd.Sum))
    hits, outs = eng.cache.hits, []
    for step in range(12):
        other = None
        if r == 0 and step % 2:        # something else under way here: the general path
            other = hvd.allreduce_async(np.ones(2), name="sp.other", op=hvd.Sum)
        if r == n - 1 and step % 3 == 2:
            time.sleep(0.05)           # a late rank: the others' cycle waits for it
        y[:] = x
        outs += [hvd.allreduce(x, name="sp"), hvd.allreduce_(y, name="sp.inplace").copy()]
        if other is None:
            other = hvd.allreduce_async(np.ones(2), name="sp.other", op=hvd.Sum)
        close(f"short path step {step} other", hvd.synchronize(other), np.full(2, float(n)))
    want = np.linspace(0.1, 1.7, 33, dtype=np.float32) * sum(np.float32((k + 1) / 3) for k in range(n)) / n
    for i, got in enumerate(outs):
        close(f"short path result {i}", got, want, atol=1e-5)
    every = hvd.allgather(np.concatenate(outs)[None, :])
    if any(every[k].tobytes() != every[0].tobytes() for k in range(n)):
        FAILS.append("the short path's results differ in their bits across ranks")
    if eng.cache.hits - hits < 12 * 3:
        FAILS.append(f"only {eng.cache.hits - hits} requests from the response cache, not 36")


@check("mismatches after caching are reported at once")
def _():
    hvd.shutdown()
    os.environ["HOROVOD_STALL_CHECK_TIME_SECONDS"] = "60"      # (no demotion to help)
    hvd.init()
    for kind in ("named", "unnamed"):
        name = "mm2" if kind == "named" else None
        for _ in range(3):
            hvd.allreduce(np.ones(3), name=name, op=hvd.Sum)
        t0 = time.monotonic()
        try:
            hvd.allreduce(np.ones(4 if r == n - 1 else 3), name=name, op=hvd.Sum)
            FAILS.append(f"{kind}: a shape that differs across ranks reduced without an error")
        except hvd.TensorMismatchError as e:
            if "shape differs" not in str(e):
                FAILS.append(f"{kind} mismatch message: {e}")
        if time.monotonic() - t0 > 10:
            FAILS.append(f"{kind}: the mismatch took {time.monotonic() - t0:.1f} s")
        hvd.barrier()
    hvd.shutdown()
    os.environ["HOROVOD_STALL_CHECK_TIME_SECONDS"] = "1"
    hvd.init()


@check("a stalled cached request is named with its missing rank")
def _():
    for _ in range(2):
        hvd.allreduce(np.ones(5), name="slowc", op=hvd.Sum)
    if r == n - 1:
        time.sleep(2.5)
        got = hvd.allreduce(np.ones(5), name="slowc", op=hvd.Sum)
    else:
        h = hvd.allreduce_async(np.ones(5), name="slowc", op=hvd.Sum)
        deadline, seen = time.monotonic() + 2.0, None
        while time.monotonic() < deadline and seen is None:
            seen = next((p for p in hvd.pending() if p["name"] == "slowc"
                         and p["missing_ranks"] is not None), None)
            time.sleep(0.02)
        if seen is None or seen["missing_ranks"] != [n - 1]:
            FAILS.append(f"pending() never named the missing rank of 'slowc': {seen}")
        got = hvd.synchronize(h)
    close("slowc result", got, np.full(5, float(n)))
    hvd.barrier()


@check("a join while cached requests wait")
def _():
    for _ in range(2):
        hvd.allreduce(np.ones(4), name="jc", op=hvd.Sum)
    if r == n - 1:
        last = hvd.join()
    else:
        close("jc with a joined rank", hvd.allreduce(np.ones(4), name="jc", op=hvd.Sum),
              np.full(4, float(n - 1)))
        last = hvd.join()
    if last != n - 1 and r != n - 1 and n > 1:
        pass       # (which rank joined last depends on timing: only that join returns)
    close("jc after the join", hvd.allreduce(np.ones(4), name="jc", op=hvd.Sum), np.full(4, float(n)))


@check("process sets keep their own cache")
def _():
    ps = hvd.add_process_set([0, 1]) if n > 2 else None
    for step in range(4):
        close(f"global step {step}", hvd.allreduce(np.full(2, float(r)), name="pc", op=hvd.Sum),
              np.full(2, tri))
        if ps is not None and r in (0, 1):
            close(f"set step {step}", hvd.allreduce(np.full(2, float(r)), name="pc", op=hvd.Sum,
                                                    process_set=ps), np.full(2, 1.0))
    if ps is not None:
        hvd.remove_process_set(ps)


@check("a cache that fills up starts again")
def _():
    hvd.shutdown()
    os.environ["HOROVOD_CACHE_CAPACITY"] = "3"
    hvd.init()
    for step in range(4):
        for k in range(5):
            close(f"full cache step {step} name {k}",
                  hvd.allreduce(np.full(2, float(r * k)), name=f"fc.{k}", op=hvd.Sum),
                  np.full(2, tri * k))
    if len(state.engine().cache.by_name) > 3:
        FAILS.append(f"{len(state.engine().cache.by_name)} slots in a cache of 3")
    os.environ.pop("HOROVOD_CACHE_CAPACITY")


@check("a shutdown while a cached request waits names the rank")
def _():
    hvd.shutdown()
    hvd.init()
    for _ in range(2):
        hvd.allreduce(np.ones(2), name="sd", op=hvd.Sum)
    if r == n - 1:
        time.sleep(0.3)
        hvd.shutdown()
    else:
        try:
            hvd.allreduce(np.ones(2), name="sd", op=hvd.Sum)
            FAILS.append("'sd' finished without the rank that shut down")
        except hvd.HvdError as e:
            if f"rank(s) {n - 1} called shutdown()" not in str(e):
                FAILS.append(f"shutdown message: {e}")
        hvd.shutdown()
    hvd.init()


finish(hvd)
