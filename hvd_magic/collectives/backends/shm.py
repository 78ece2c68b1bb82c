"""Allreduce through a memory segment every rank of one host maps (CPU tensors).

Why: Open MPI's ``Allreduce`` of 1 MiB between two processes on this 2-core VM takes
120-650 us depending on the launch, while a core copies 1 MiB in ~24 us. Through shared
memory the same reduction is one copy, one barrier and one pass of arithmetic.

The algorithm, for rank ``r`` of ``n``: the buffer is cut into chunks of at most ``slot``
bytes (``chunk_plan``). For chunk ``i``, in bank ``b`` (0 for the first chunk of every
call, then alternating from chunk to chunk)::

    in(i)   copy this rank's chunk (times ``pre``) into its slot of bank b
    B       barrier: every rank's slot of bank b is written
    red(i)  the result's chunk := slot 0 (op) slot 1 (op) ... slot n-1, in rank order,
            then finished in place if needed (integer Average, postscale)

Every rank computes the whole result from the same slots in the same order, so all ranks
hold bit-identical results, and no rank waits for another's arithmetic. Within a call a
bank is written again two chunks later, after a barrier that every reader of its last
contents passed (they read it before reaching the barrier in between), so one barrier per
chunk suffices. A call whose last chunk was in bank 0 ends with one more barrier, so the
next call may start there. Starting every call in bank 0 keeps a buffer of one slot in one
bank, whose lines are still in cache from the last call: 1 MiB in place at 2 ranks, five
calls after other work, interleaved in one job, three launches: 98-107, 66-69, 60-63 us
for calls 1-5, against 142-165, 98-112, 67-84 us alternating banks from call to call
(raw MPI: 227-254, 127-138, 112-123 us).

Example, 2 ranks, Sum of 4 elements::

    rank 0: [1, 2, 3, 4]    rank 1: [10, 20, 30, 40]
    slot 0 := [1, 2, 3, 4]  slot 1 := [10, 20, 30, 40]      barrier
    both ranks: slot 0 + slot 1 = [11, 22, 33, 44]

Each rank reads ``n - 1`` other slots: at 2-3 ranks per host that is the traffic of a
reduce-scatter plus allgather through the segment (the scheme this replaced) without its
second barrier and its extra copy. In place at 2 ranks, interleaved in one job, four
launches of this VM: 1 MiB 137-317 us against 160-384 for reduce-scatter + allgather and
239-601 for one MPI call; 256 KiB 18-20 / 27-31 / 44-51 us; 4 MiB 550-566 / 777-785 /
848-851 us. 3 ranks on the 2 cores, 1 MiB: 516-529 / 514-537 / 1,049-1,117 us. With many
ranks per host the reads grow with ``n`` and the tuner (``tune.py``) settles on MPI calls
where they are faster.

The segment is a file in ``/dev/shm`` that rank 0 creates and removes as soon as every
rank mapped it, so nothing is left behind, whatever happens to the processes later.
"""
from __future__ import annotations

import mmap
import os
import secrets
import tempfile
from typing import Any, Callable, Optional

import numpy as np

from .common import chunk_spans

try:    # streaming copies (``_stream.c``), built by pip where there is a C compiler
    from ._stream import STREAMING, copy as _stream_copy
except ImportError:  # pragma: no cover - a build without the extension
    STREAMING, _stream_copy = 0, None


def chunk_plan(n_elems: int, itemsize: int, slot: int) -> list:
    """The chunks ``[lo, hi)`` an ``n_elems`` buffer is reduced in: at most ``slot``
    bytes each (at least one element), so each one fits a rank's slot of the segment.

    >>> chunk_plan(10, 4, 16)
    [(0, 4), (4, 8), (8, 10)]
    >>> chunk_plan(3, 8, 4)
    [(0, 1), (1, 2), (2, 3)]
    """
    return chunk_spans(n_elems, itemsize, max(slot, itemsize))


def _segment_dir() -> str:
    """``HVD_MAGIC_SHM_DIR`` (rank 0's), else ``/dev/shm``, else the temporary directory."""
    return (os.environ.get("HVD_MAGIC_SHM_DIR")
            or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()))


class ShmAllreduce:
    """A segment of two banks of ``n`` slots of ``slot`` bytes each."""

    def __init__(self, comm: Any, mm: mmap.mmap, slot: int, path: str):
        self.comm = comm
        self.path = path          # where the segment was (removed once every rank mapped it)
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.slot = slot
        self.mem = np.frombuffer(mm, dtype=np.uint8)
        int(self.mem[::mmap.PAGESIZE].sum())     # map every page now, not in the first calls
        self._views: dict = {}
        self.calls = 0            # allreduces done this way (tests read it)

    def _slots(self, dt: np.dtype, m: int, bank: int) -> tuple:
        """Every rank's slot of ``bank`` as ``m`` elements of ``dt``, made once (a view
        costs ~0.5 us)."""
        key = (dt.str, m, bank)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 64:
                self._views.clear()
            nbytes, base = m * dt.itemsize, bank * self.size * self.slot
            views = self._views[key] = tuple(
                self.mem[base + k * self.slot:base + k * self.slot + nbytes].view(dt)
                for k in range(self.size))
        return views

    @staticmethod
    def segment_bytes(size: int, slot: int) -> int:
        """Two banks of a slot per rank."""
        return 2 * size * slot

    @classmethod
    def open(cls, comm: Any, slot: int) -> Optional["ShmAllreduce"]:
        """Map one segment on every rank of ``comm`` (collective; all ranks must share a
        host). Returns None on every rank when any rank could not map it."""
        total = cls.segment_bytes(comm.Get_size(), slot)
        path, fd = None, -1
        if comm.Get_rank() == 0:
            try:
                path = os.path.join(_segment_dir(), f"hvd_magic-{os.getpid()}-{secrets.token_hex(4)}")
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                os.ftruncate(fd, total)
                # reserve the memory now: a full /dev/shm is then an error here (and MPI
                # calls carry the data) instead of a SIGBUS at the first touch
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
        return cls(comm, mm, slot, path)

    def allreduce(self, work: np.ndarray, src: np.ndarray, ufunc: Callable,
                  finish_into: Optional[Callable[[np.ndarray, np.ndarray], None]],
                  pre: float = 1.0, stream: bool = False) -> None:
        """``work`` := ``finish_into``(reduction by ``ufunc`` of every rank's ``src * pre``).

        ``work`` and ``src`` are contiguous and of one dtype; ``src`` may be ``work`` (in
        place). ``finish_into(dst, res)`` (called with ``dst is res``) averages and
        post-scales a chunk in place while it is in cache; None: nothing to finish. Scale
        there rather than with ``pre`` where the op allows (a float Sum or Average): a
        scaling copy into the segment costs ~3x a plain one at 1 MiB here (``mpi.py``).
        ``stream`` (with ``pre`` 1, and where ``STREAMING``): this rank's input goes into
        the segment with streaming stores, so the other ranks read it from memory rather
        than from this core's cache (faster in the VM's slow launches, see ``_stream.c``)."""
        w = work.reshape(-1)
        s = src.reshape(-1)
        dt = w.dtype
        chunks = (((0, w.size),) if w.nbytes <= self.slot
                  else chunk_plan(w.size, dt.itemsize, self.slot))
        r, rest = self.rank, range(2, self.size)
        bank = 0
        # This rank's own operand is read from ``src`` rather than from its slot (1 MiB in
        # place at 2 ranks, one job: 89-95 us against 140-163), unless it is scaled there
        # or, in place at ranks 2 and up, ``work`` was overwritten before its turn.
        own = pre == 1.0 and (r < 2 or not np.may_share_memory(w, s))
        barrier = self.comm.Barrier
        for lo, hi in chunks:
            slots = self._slots(dt, hi - lo, bank)
            bank ^= 1
            mine = s[lo:hi]
            if pre != 1.0:
                np.multiply(mine, pre, out=slots[r], casting="unsafe")
            elif stream:
                _stream_copy(slots[r], mine)
            else:
                slots[r][...] = mine
            barrier()
            out = w[lo:hi]          # (one dtype throughout: no casting rule needed)
            ufunc(mine if own and r == 0 else slots[0], mine if own and r == 1 else slots[1], out=out)
            for k in rest:
                ufunc(out, mine if own and k == r else slots[k], out=out)
            if finish_into is not None:
                finish_into(out, out)
        if bank:
            # the last chunk was in bank 0, where the next call starts: wait until every
            # rank has read it
            barrier()
        self.calls += 1
