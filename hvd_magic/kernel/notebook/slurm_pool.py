"""Runs in the notebook kernel.

The pool's Slurm allocation over the notebook's life: asked for by the first
``%%hvd --slurm`` cell, kept while cells reuse it, released by ``%hvd stop``, by the idle
timeout (``HVD_MAGIC_SLURM_IDLE_TIMEOUT``), at kernel exit, or replaced when it failed."""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, Mapping, Optional

from ... import config
from ...runner.slurm import SlurmRequest
from ...runner.slurm_alloc import Allocation, IdleReaper

#: ``%%hvd --slurm`` options -> :class:`SlurmRequest` fields.
OPTIONS = ("partition", "time", "nodes", "gpus_per_node")


def request_of(options: Mapping[str, Any]) -> SlurmRequest:
    """The salloc request of ``--slurm``'s options (None values: Slurm's defaults)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown Slurm option(s) {unknown}; use {', '.join(OPTIONS)}")
    given = {k: v for k, v in options.items() if v is not None}
    return SlurmRequest(**given) if given else SlurmRequest()


class SlurmKeeper:
    """Holds at most one :class:`Allocation` for the pool manager."""

    def __init__(self, stop_pool: Callable[[], Any]) -> None:
        self.allocation: Optional[Allocation] = None
        self.stop_pool = stop_pool
        self._reaper: Optional[IdleReaper] = None
        self.busy = 0                                # cells (or a pool start) under way
        self.last_used = time.monotonic()

    def allocation_for(self, options: Mapping[str, Any], np: int, sink: Any = None,
                       environ: Optional[Mapping[str, str]] = None) -> Allocation:
        """An allocation for ``np`` ranks with these options: the one held when it still
        serves them, else a new one (``salloc``), or the job this kernel runs inside."""
        env = dict(os.environ if environ is None else environ)
        status = (lambda text: sink.status(text)) if sink is not None else print
        request = request_of(options)
        inside = Allocation.from_env(env)
        use_inside = inside is not None and not any(v is not None for v in options.values())
        held = self.allocation
        if held is not None:
            want = None if use_inside else request
            if held.matches(want, np) and held.usable():
                return held
            why = held.failure()
            self.release(sink, why=why or "the request changed")
        if use_inside and inside is not None:
            if np > sum(h.slots for h in inside.hosts):
                raise ValueError(f"-np {np} but this Slurm job ({inside.job_id}) has "
                                 f"{sum(h.slots for h in inside.hosts)} task slots; lower -np "
                                 "or ask salloc/sbatch for more tasks (-n)")
            status(f"hvd: using the Slurm job this kernel runs in ({inside.job_id}): "
                   + ", ".join(f"{h.name}:{h.slots}" for h in inside.hosts))
            self.allocation = inside
        else:
            for key in ("SLURM_JOB_ID", "SLURM_JOBID"):   # salloc would nest in that job
                env.pop(key, None)
            self.allocation = Allocation.acquire(request, np, env, status=status)
        idle = config.get("HVD_MAGIC_SLURM_IDLE_TIMEOUT", env)
        if idle and idle > 0 and self.allocation.owned:
            self.last_used = time.monotonic()
            self._reaper = IdleReaper(self._idle_s, idle, self._idle_stop)
        return self.allocation

    def _idle_stop(self) -> None:
        alloc = self.allocation
        self.stop_pool()
        if alloc is not None:
            print(f"hvd: Slurm job {alloc.job_id} released after "
                  f"{config.get('HVD_MAGIC_SLURM_IDLE_TIMEOUT'):g} s without a cell "
                  "(HVD_MAGIC_SLURM_IDLE_TIMEOUT)")

    def touch(self, busy: bool) -> None:
        """A cell (or a pool start) begins (``busy``) or ends: the idle clock starts again."""
        self.busy = max(0, self.busy + (1 if busy else -1))
        self.last_used = time.monotonic()

    def _idle_s(self) -> Optional[float]:
        return None if self.busy else time.monotonic() - self.last_used

    def failure(self) -> str:
        """Why the held allocation cannot run the pool any more (naming nodes), or ``""``."""
        return self.allocation.failure() if self.allocation is not None else ""

    def release(self, sink: Any = None, why: str = "") -> None:
        """Cancel the held allocation (if this kernel made it) and forget it."""
        alloc, self.allocation = self.allocation, None
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        if alloc is not None and alloc.release():
            text = f"hvd: Slurm job {alloc.job_id} released" + (f" ({why})" if why else "")
            if sink is not None:
                sink.status(text)
            else:
                print(text)

    def info(self) -> Dict[str, Any]:
        """For ``%hvd status``."""
        alloc = self.allocation
        if alloc is None:
            return {}
        return {"job_id": alloc.job_id, "owned": alloc.owned,
                "nodes": [f"{h.name}:{h.slots}" for h in alloc.hosts]}
