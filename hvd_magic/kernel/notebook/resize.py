"""Runs in the notebook kernel. ``%hvd resize N`` on an elastic pool (``%%hvd --min-np M``);
which ranks go on after a lost one is decided in :mod:`.liveness`.

Growing runs the same path as a script under ``hvdrun --host-discovery-script``: every rank
calls :func:`hvd_magic.collectives.elastic.resize`, which spawns the new engines with
``MPI_Comm_spawn`` and merges them in; each new engine joins the runtime as it starts, then
registers with the pool's controller under a new engine id. A new rank has an empty
namespace, so it runs the pool's earlier cells and pushes first (``catch_up``: output hidden,
``hvd.elastic.run`` calls skipped), as a new worker of a script runs the script from its
start; the next ``hvd.elastic.run`` call then gives it the others' state by ``sync()`` and
runs every rank's reset callbacks. Shrinking: ranks ``N`` and up leave (their engines exit).
"""
from __future__ import annotations

import time
from typing import Any, List, Optional

from ... import config
from .output import OutputSink, PoolError, n_ranks
from .procs import descendants

#: Seconds a new rank may take to run the pool's earlier cells (imports, data, the model).
CATCH_UP_TIMEOUT = 600.0


def resize(pool: Any, n: int, sink: Optional[OutputSink] = None) -> str:
    """Grow or shrink the elastic ``pool`` to ``n`` ranks between cells; a sentence saying
    what happened. Raises ValueError for a request that cannot work, PoolError when the new
    ranks could not join (the pool then keeps its old size, or is stopped if it cannot)."""
    from ..ranks.calls import catch_up, info, resize as resize_ranks
    old = pool.size
    if not pool.elastic():
        raise ValueError(f"%hvd resize {n}: this pool has a fixed size; only an elastic pool "
                         "(%%hvd --min-np M) changes size while it runs. %hvd restart -np "
                         f"{n} starts a new pool of {n_ranks(n)}")
    if n < max(1, pool.config.min_np):
        raise ValueError(f"%hvd resize {n}: the pool's --min-np is {pool.config.min_np}; "
                         "ask for at least that many ranks")
    if n == old:
        return f"hvd: the pool has {n_ranks(n)} already"
    timeout = config.get("HVD_MAGIC_START_TIMEOUT")
    top = pool.top_engine
    ar = pool.view(list(range(old))).apply_async(resize_ranks, n)
    if n < old:
        replies = ar.get(timeout)
        pool.set_members(list(range(n)))
        return (f"hvd: the pool shrank from {old} to {n_ranks(n)} (rank(s) "
                f"{', '.join(str(r) for r, w in enumerate(replies) if w == 'leaves')} left)")
    if sink is not None:
        sink.status(f"hvd: growing the pool from {old} to {n_ranks(n)} ...")
    deadline = time.monotonic() + timeout
    new: List[int] = []
    while len(new) < n - old:
        if ar.ready() and not ar.successful():
            ar.get()                             # the ranks' error, as it is
        if time.monotonic() > deadline:
            pool.stop()
            raise PoolError(f"%hvd resize {n}: {len(new)} of {n - old} new rank(s) registered "
                            f"within {timeout:g} s (HVD_MAGIC_START_TIMEOUT); the pool was "
                            "stopped, the next %%hvd cell starts a new one")
        time.sleep(0.02)
        new = sorted(i for i in pool.client.ids if i > top)
    ar.get(max(1.0, deadline - time.monotonic()))
    ranks = pool.client[new].apply_async(info).get(timeout)
    joined = [e for _, e in sorted(zip((r["rank"] for r in ranks), new))]
    pool.set_members(list(range(old)), joined=joined,
                     where={r["rank"]: (r["host"], r["pid"]) for r in ranks})
    pool.known += [p for p in descendants(pool.mpiexec.pid) if p not in pool.known]
    if pool.history:
        if sink is not None:
            sink.status(f"hvd: rank(s) {old}..{n - 1} run the pool's {len(pool.history)} "
                        "earlier cell(s) and push(es) ...")
        failed = [f for f in pool.client[joined].apply_async(catch_up, pool.history).get(
            CATCH_UP_TIMEOUT) if f]
        if failed:
            resize(pool, old)
            raise PoolError(f"%hvd resize {n}: a new rank could not run {failed[0]}; the new "
                            f"rank(s) left again and the pool goes on with {n_ranks(old)}. A "
                            "new rank runs the pool's earlier cells to define what they "
                            "defined: collectives there outside hvd.elastic.run, or code "
                            "that needs data only the first ranks have, fail on it")
    return (f"hvd: the pool grew from {old} to {n_ranks(n)}; the next hvd.elastic.run call "
            "gives the new rank(s) the state of rank 0 by sync() and runs the reset callbacks")
