"""The bytes of one negotiation cycle on the wire (:class:`SlotExchange`).

Every rank's message is allgathered through a fixed slot per rank: its length (8 bytes)
and then the message where it fits; when one rank's does not, every rank's message goes
again in a second round (an allgatherv of the exact lengths)."""
from __future__ import annotations

import struct
from typing import Callable

import numpy as np
from mpi4py import MPI

SLOT = 2048            # bytes per rank in the first negotiation round (more: a second round)


class SlotExchange:
    """Allgathers one message (bytes) per rank each cycle over ``comm``."""

    def __init__(self, comm: MPI.Comm, slot: int):
        self.comm = comm
        self.size = comm.Get_size()
        self.slot = slot
        self._send = np.zeros(slot, dtype=np.uint8)
        self._recv = np.zeros((self.size, slot), dtype=np.uint8)
        self._send_mv = memoryview(self._send)
        self._recv_mv = memoryview(self._recv.reshape(-1))
        # every rank's message length, read in one call (8 bytes at the start of each slot)
        self._lens = struct.Struct("<" + f"Q{slot - 8}x" * self.size)
        self._sent_data = b""        # what the send buffer holds now (written again if not)

    def post(self, data: bytes) -> MPI.Request:
        """Start the first round for this rank's message ``data``."""
        if data != self._sent_data:      # (a loop sends the same bytes every step)
            self._load_send(data)
        return self.comm.Iallgather(self._send, self._recv)

    def _load_send(self, data: bytes) -> None:
        """Put ``data`` in the send buffer: its length, then itself where it fits (what
        does not fit goes in a second round, :meth:`received`)."""
        n = len(data)
        self._send_mv[:8] = n.to_bytes(8, "little")
        if n <= self.slot - 8:
            self._send_mv[8:8 + n] = data
        self._sent_data = data

    def received(self, data: bytes, as_bytes: bool,
                 wait: Callable[[MPI.Request], None]) -> tuple:
        """After the first round of ``post(data)`` completed: (every rank's message in
        rank order, whether that is a tuple of bytes). Messages that all fit come as
        bytes where ``as_bytes`` (a cache key), else as memoryviews of the receive buffer;
        otherwise a second round runs (``wait`` waits for its request)."""
        slot = self.slot
        mv = self._recv_mv
        lens = list(self._lens.unpack_from(mv))
        if max(lens) > slot - 8:      # a second round for what did not fit
            displs = np.cumsum([0] + lens[:-1]).tolist()
            big = np.empty(sum(lens), dtype=np.uint8)
            wait(self.comm.Iallgatherv(np.frombuffer(data, dtype=np.uint8),
                                       [big, lens, displs, MPI.BYTE]))
            return [big[d:d + c] for d, c in zip(displs, lens)], False
        views = [mv[r * slot + 8:r * slot + 8 + n] for r, n in enumerate(lens)]
        if as_bytes:
            return tuple([v.tobytes() for v in views]), True
        return views, False


class BitExchange:
    """The response cache's bit vector of each cycle (:mod:`.response_cache`): one
    allreduce (bitwise AND) of ``words`` 64-bit words over ``comm``, a persistent one where
    the communicator has them (MPI; its set-up is made once instead of on every call).

    MPI matches a persistent collective only with the same persistent collective of the
    other ranks, made in the same order, so every cycle of every rank starts this one
    request, and a new one is made when the vector's length changes: at the same cycle on
    every rank, since every rank's response cache changes alike."""

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.persistent = hasattr(comm, "Allreduce_init")
        self.words = 0
        self.send = self.recv = np.zeros(0, dtype=np.uint64)
        self.send_bytes = memoryview(b"")
        self._req = None

    def buffer(self, words: int) -> np.ndarray:
        """The send vector of the next cycle, of ``words`` words (filled by the caller)."""
        if words != self.words:
            self.free()
            self.words = words
            self.send = np.zeros(words, dtype=np.uint64)
            self.recv = np.zeros(words, dtype=np.uint64)
            self.send_bytes = memoryview(self.send).cast("B")
            if self.persistent:
                self._req = self.comm.Allreduce_init(self.send, self.recv, op=MPI.BAND)
        return self.send

    def start(self) -> MPI.Request:
        """Start the cycle's allreduce of the send vector into :attr:`recv`."""
        req = self._req
        if req is None:
            return self.comm.Iallreduce(self.send, self.recv, op=MPI.BAND)
        req.Start()
        return req

    def free(self) -> None:
        """Let the persistent request go (none may be in flight)."""
        req, self._req = self._req, None
        if req is not None:
            try:
                req.Free()
            except Exception:  # noqa: BLE001 - best effort (the communicator may be gone)
                pass
