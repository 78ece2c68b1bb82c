"""Allreduce through a memory segment every rank of one host maps (CPU tensors).

Why: Open MPI's ``Allreduce`` of 1 MiB between two processes on this 2-core VM takes
110-125 us (about 9 GB/s) while a core copies 1 MiB in ~24 us. Through shared memory the
same reduction is a few copies and one pass of arithmetic split between the ranks, with
two barriers; measured side by side in one 2-rank job (``benchmarks/README.md``): 1 MiB
64-77 us against 112-124 us, 400 KiB 50-60 us against 76-88 us, 64 KiB about equal;
3 ranks on the 2 cores, 1 MiB 259 us against 559 us.

The algorithm, for rank ``r`` of ``n``: the buffer is cut into chunks of at most ``slot``
bytes (``chunk_plan``) and each chunk into ``n`` contiguous parts (``part_bounds``); rank
``r`` reduces part ``r`` of every chunk. For chunk ``i``::

    in(i)   copy the parts other ranks reduce into bank i%2 of this rank's slot
            (rank r's own part stays where it is)
    red(i)  part r of bank i%2 of the result := own part (op) every other rank's slot
    out(i)  copy the whole chunk of the result out, finishing it on the way (Average's
            1/n, postscale)

pipelined with one barrier per chunk plus one at the end::

    in(0) | B | red(0) in(1) | B | out(0) red(1) in(2) | B | ... | B | out(k-1)

Each step only touches what the barriers before it made safe: red(i) reads the other
ranks' in(i) (a barrier between them), out(i) reads every rank's red(i) (likewise), and a
bank is written again two chunks later, after a barrier that every reader of its last
contents passed. The next call starts the same way and is safe for the same reason.

Each rank reduces only its own part, and every rank finishes the same values the same
way, so all ranks hold bit-identical results.

Example, 2 ranks, Sum of 4 elements::

    rank 0: [1, 2, 3, 4]    rank 1: [10, 20, 30, 40]
    slot 0 := [3, 4] (part 1)           slot 1 := [10, 20] (part 0)
    rank 0 reduces part 0: [11, 22]     rank 1 reduces part 1: [33, 44]
    both: [11, 22, 33, 44]

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


def part_bounds(m: int, n: int) -> list:
    """Boundaries of ``n`` contiguous parts of ``m`` elements, as even as they come.

    >>> part_bounds(10, 3)
    [0, 3, 6, 10]
    >>> part_bounds(1, 3)
    [0, 0, 0, 1]
    """
    return [m * i // n for i in range(n + 1)]


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


def _copy_into(dst: np.ndarray, res: np.ndarray) -> None:
    dst[...] = res


class ShmAllreduce:
    """A segment of ``n`` slots and one result region of ``slot`` bytes each."""

    def __init__(self, comm: Any, mm: mmap.mmap, slot: int, path: str):
        self.comm = comm
        self.path = path          # where the segment was (removed once every rank mapped it)
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.slot = slot
        self.mem = np.frombuffer(mm, dtype=np.uint8)
        int(self.mem[::mmap.PAGESIZE].sum())     # map every page now, not in the first calls
        self._layouts: dict = {}
        self.calls = 0            # allreduces done this way (tests read it)

    def _layout(self, dt: np.dtype, m: int, bank: int) -> tuple:
        """Views of the segment for a chunk of ``m`` elements of ``dt`` in ``bank``, made
        once (views cost ~0.5 us each; a chunk needs 2n of them): (this rank's slot parts
        for the others as (lo, hi, view), own part's lo, hi, the whole result, the result's
        own part, the others' slot parts for this rank's part)."""
        key = (dt.str, m, bank)
        lay = self._layouts.get(key)
        if lay is not None:
            return lay
        n, r, slot, it = self.size, self.rank, self.slot, dt.itemsize
        base = bank * (n + 1) * slot
        mem = self.mem

        def view(k: int, a: int, b: int) -> np.ndarray:
            off = base + k * slot
            return mem[off + a * it:off + b * it].view(dt)

        b = part_bounds(m, n)
        p0, p1 = b[r], b[r + 1]
        ins = [(b[k], b[k + 1], view(r, b[k], b[k + 1])) for k in range(n)
               if k != r and b[k] != b[k + 1]]
        others = [view(k, p0, p1) for k in range(n) if k != r]
        lay = (ins, p0, p1, view(n, 0, m), view(n, p0, p1), others)   # result region: slot n
        if len(self._layouts) >= 64:
            self._layouts.clear()
        self._layouts[key] = lay
        return lay

    @staticmethod
    def segment_bytes(size: int, slot: int) -> int:
        """Two banks of a slot per rank and of a result region."""
        return 2 * (size + 1) * slot

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
                  pre: float = 1.0) -> None:
        """``work`` := ``finish_into``(reduction by ``ufunc`` of every rank's ``src * pre``).

        ``work`` and ``src`` are contiguous and of one dtype; ``src`` may be ``work`` (in
        place). ``finish_into(dst, res)`` writes ``res`` averaged and post-scaled to ``dst``
        (None: a plain copy): the finishing rides on the copy out, so an Average costs no
        pass of its own."""
        w = work.reshape(-1)
        s = src.reshape(-1)
        if finish_into is None:
            finish_into = _copy_into
        chunks = (((0, w.size),) if w.nbytes <= self.slot
                  else chunk_plan(w.size, w.dtype.itemsize, self.slot))
        layout = self._layout
        barrier = self.comm.Barrier
        prev = None
        for i, (lo, hi) in enumerate(chunks):
            lay = layout(w.dtype, hi - lo, i % 2)
            # in(i): the parts the other ranks reduce, into this rank's slot
            for a, b, dst in lay[0]:
                if pre != 1.0:
                    np.multiply(s[lo + a:lo + b], pre, out=dst, casting="unsafe")
                else:
                    dst[...] = s[lo + a:lo + b]
            barrier()
            if prev is not None:       # out(i-1): every rank's red(i-1) is done
                plo, phi, play = prev
                finish_into(w[plo:phi], play[3])
            # red(i): this rank's part of the result, from its own input and every other slot
            p0, p1, out, others = lay[1], lay[2], lay[4], lay[5]
            if p1 > p0:
                acc = s[lo + p0:lo + p1]
                if pre != 1.0:
                    np.multiply(acc, pre, out=out, casting="unsafe")
                    acc = out
                for other in others:       # (one dtype throughout: no casting rule needed)
                    ufunc(acc, other, out=out)
                    acc = out
            prev = (lo, hi, lay)
        barrier()
        plo, phi, play = prev
        finish_into(w[plo:phi], play[3])
        self.calls += 1
