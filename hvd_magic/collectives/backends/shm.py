"""Allreduce of a buffer of at most 1 MiB through a memory segment that every rank of one
host maps (CPU tensors, :class:`~.mpi.MPIBackend`).

Why: at 2 ranks on one host, Open MPI's in-place ``Allreduce`` of 256 KiB to 1 MiB takes
about 1.4 to 1.8 times as long as this data path; at 4 MiB the two are even, so bigger
buffers stay with MPI (the measurements: ``benchmarks/README.md``, collectives).

For rank ``r`` of ``n``, with one slot of the segment per rank::

    copy this rank's buffer (times ``pre``) into slot r       barrier
    result := slot 0 (op) slot 1 (op) ... slot n-1, in rank order, then averaged /
    post-scaled in place                                        barrier

Every rank computes the result from the same slots in the same order, so all ranks hold
bit-identical results. The second barrier keeps a slot from being overwritten by the next
call while another rank still reads it. Example, 2 ranks, Sum of 4 elements::

    rank 0: [1, 2, 3, 4]    rank 1: [10, 20, 30, 40]
    slot 0 := [1, 2, 3, 4]  slot 1 := [10, 20, 30, 40]      barrier
    both ranks: slot 0 + slot 1 = [11, 22, 33, 44]          barrier

The segment is a file in ``/dev/shm`` that rank 0 creates and removes as soon as every
rank has mapped it, so nothing is left behind whatever happens to the processes later.
A rank that dies mid-call leaves the others in an MPI barrier, which ends as any MPI
collective does when a rank dies.
"""
from __future__ import annotations

import mmap
import os
import secrets
import tempfile
from typing import Any, Callable, Optional

import numpy as np

#: Buffers from this size up to one slot go through the segment (smaller: MPI is as fast).
SHM_MIN = 64 * 1024


class ShmAllreduce:
    """One slot of ``slot`` bytes per rank of ``comm``, all ranks on one host."""

    def __init__(self, comm: Any, mm: mmap.mmap, slot: int):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.slot = slot
        self._mm = mm
        self.mem = np.frombuffer(mm, dtype=np.uint8)
        int(self.mem[::mmap.PAGESIZE].sum())     # map every page now, not in the first calls
        self._views: dict = {}
        self.calls = 0            # allreduces done this way (tests read it)

    @classmethod
    def open(cls, comm: Any, slot: int) -> Optional["ShmAllreduce"]:
        """Map one segment on every rank of ``comm`` (collective; all ranks on one host).
        None on every rank when any rank could not map it (then MPI carries the data)."""
        total = comm.Get_size() * slot
        path, fd = None, -1
        if comm.Get_rank() == 0:
            base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            try:
                path = os.path.join(base, f"hvd_magic-{os.getpid()}-{secrets.token_hex(4)}")
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                os.ftruncate(fd, total)
                # reserve the memory now: a full /dev/shm is then this error, not a SIGBUS
                os.posix_fallocate(fd, 0, total)
            except OSError:
                if fd >= 0:
                    os.close(fd)
                    fd = -1
                    os.unlink(path)
                path = None
        path = comm.bcast(path, root=0)
        mm = None
        if path is not None:
            try:
                if fd < 0:
                    fd = os.open(path, os.O_RDWR)
                mm = mmap.mmap(fd, total)
            except OSError:
                mm = None
            finally:
                if fd >= 0:
                    os.close(fd)
        ok = all(comm.allgather(mm is not None))
        if comm.Get_rank() == 0 and path is not None:
            try:
                os.unlink(path)           # every rank has mapped it (or given up)
            except OSError:
                pass
        if not ok:
            if mm is not None:
                mm.close()
            return None
        return cls(comm, mm, slot)

    def _slots(self, dt: np.dtype, m: int) -> tuple:
        """Every rank's slot as ``m`` elements of ``dt`` (views made once: ~0.5 us each)."""
        key = (dt.str, m)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 64:
                self._views.clear()
            nbytes = m * dt.itemsize
            views = self._views[key] = tuple(
                self.mem[k * self.slot:k * self.slot + nbytes].view(dt) for k in range(self.size))
        return views

    def allreduce(self, work: np.ndarray, src: np.ndarray, ufunc: Callable,
                  finish: Optional[Callable[[np.ndarray], None]], pre: float = 1.0) -> None:
        """``work`` := ``finish``(reduction by ``ufunc`` of every rank's ``src * pre``).

        ``work`` and ``src``: contiguous, one dtype, at most ``slot`` bytes; ``src`` may be
        ``work`` (in place). ``finish(out)`` averages and post-scales in place (None: no)."""
        w = work.reshape(-1)
        s = src.reshape(-1)
        slots = self._slots(w.dtype, w.size)
        r = self.rank
        if pre != 1.0:
            np.multiply(s, pre, out=slots[r], casting="unsafe")
        else:
            slots[r][...] = s
        self.comm.Barrier()
        # this rank's own operand is read from ``src`` (in cache) rather than its slot,
        # unless it was scaled there or, at ranks 2 and up in place, ``w`` overwrote it
        own = pre == 1.0 and (r < 2 or not np.may_share_memory(w, s))
        ufunc(s if own and r == 0 else slots[0], s if own and r == 1 else slots[1], out=w)
        for k in range(2, self.size):
            ufunc(w, s if own and k == r else slots[k], out=w)
        if finish is not None:
            finish(w)
        self.comm.Barrier()
        self.calls += 1

    def close(self) -> None:
        self._views.clear()
        self.mem = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass          # a view still alive: the mapping goes with it
