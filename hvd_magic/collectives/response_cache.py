"""The response cache: requests every rank has carried out before, each under a slot number
every rank gives it alike, so that a training loop's steady state costs one small allreduce
of bits per cycle whatever the number of ranks. Pure: no I/O, no threads.

Every rank adds the same decisions in the same order (:meth:`ResponseCache.add` after each
negotiated cycle), so slot ``i`` names the same request everywhere. A cycle then starts with
one allreduce (bitwise AND) of a vector of 64-bit words (see :meth:`vector`)::

    word 0      1 when this rank has nothing to say beyond its cached requests
    word 1..    bit i set: this rank has submitted the request of slot i and waits for it

After the AND, a set bit means every rank has submitted that request: it is ready, with the
decision it had before (:meth:`ready`, in slot order). Word 0 is 0 when any rank has
something else (a new or changed request, a join, a shutdown, a cancel, timeline events, an
autotune setting, an invalidation): then the full messages follow (:mod:`.exchange`) and are
negotiated as before. Example, 2 ranks, slots 0 ``grad.w`` and 1 ``grad.b``::

    rank 0: [1, 0b11]   (both submitted)    rank 1: [1, 0b01]   (grad.w only)
    AND:    [1, 0b01]   -> grad.w is ready on both; grad.b stays set on rank 0

Only requests whose metadata every rank must share are kept (allreduce, reducescatter,
broadcast): a rank's own metadata equal to the kept one then means every rank's is. An
unnamed call (``allreduce.noname.N``) is kept without its number, so the next unnamed call
of the same shape finds it; a rank has at most one request waiting per slot, later ones of
the same slot wait their turn in submission order (the same order on every rank).

A request that some rank announces in full while another holds it by its bit (its
metadata differ there: another shape, dtype, op, ...) goes back to the full messages on
that other rank too, so the negotiation compares them and names the mismatch. A cached
request that waits longer than half the stall check time is sent as an invalidation:
every rank drops its slot and announces what it still waits for in full, so that the stall
check names the missing ranks. A decision kept under a name already kept replaces it.
"""
from __future__ import annotations

import heapq
from typing import Optional

import numpy as np

from .codec import split_noname
from .negotiation import Ann, Response

KEPT_KINDS = frozenset(("allreduce", "reducescatter", "broadcast"))


class ResponseCache:
    """Slot ``i`` -> a decision every rank made; at most ``cap`` slots in use."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.slots: list = []                  # slot -> Response (None: free)
        self.keys: list = []                   # slot -> its key
        self.by_ann: dict = {}                 # key (see :meth:`key`) -> slot
        self.by_name: dict = {}                # name -> slot (named requests)
        self._free: list = []                  # free slots below len(slots), lowest first
        self.version = 0                       # moves on every change (plans keyed by it)
        self.hits = 0                          # requests carried out from the cache

    @staticmethod
    def keeps(resp: Response) -> bool:
        """Whether every rank keeps this decision (depends on the decision alone)."""
        return resp.error is None and resp.kind in KEPT_KINDS and not resp.joined

    @staticmethod
    def key(ann: Ann) -> tuple:
        """What a request is kept under: itself, or for an unnamed call the same request
        without its number (``allreduce.noname.7.2`` -> ``allreduce.noname`` + ``.2``)."""
        name = ann[0]
        if ".noname." not in name:
            return ann
        head, _, num = name.rpartition(".")
        if num.isdigit() and head.endswith(".noname") and ".noname." not in head:
            key = head + "\0"                            # (the usual kind.noname.N)
        else:
            head, _, rest = split_noname(name)           # (kind.noname.N.suffix)
            key = f"{head}\0{rest}"
        return (key,) + ann[1:]          # (a plain tuple: a key, not a request)

    def slot(self, ann: Ann) -> Optional[int]:
        """The slot this request is announced by, or None. (A named request is its own key:
        one dict look-up, without :meth:`key`'s parsing.)"""
        slot = self.by_ann.get(ann)
        if slot is None and ".noname." in ann[0]:
            slot = self.by_ann.get(self.key(ann))
        return slot

    def add(self, responses: list) -> bool:
        """Keep the decisions of one negotiated cycle that every rank keeps. False when the
        cache was full and started again: every slot was dropped (the caller's waiting
        requests go back to the full messages), then these were added."""
        fresh = True
        for resp in responses:
            if not self.keeps(resp):
                continue
            key = self.key(resp.first)
            if key in self.by_ann:
                continue
            named = key is resp.first
            old = self.by_name.get(resp.name) if named else None
            if old is not None:
                self.drop(old)
            if len(self.by_ann) >= self.cap:
                self.clear()
                fresh = False
            slot = heapq.heappop(self._free) if self._free else len(self.slots)
            if slot == len(self.slots):
                self.slots.append(None)
                self.keys.append(None)
            self.slots[slot], self.keys[slot] = resp, key
            self.by_ann[key] = slot
            if named:
                self.by_name[resp.name] = slot
            self.version += 1
        return fresh

    def drop(self, slot: int) -> None:
        resp = self.slots[slot]
        if resp is None:
            return
        self.slots[slot] = None
        del self.by_ann[self.keys[slot]]
        if self.by_name.get(resp.name) == slot:
            del self.by_name[resp.name]
        heapq.heappush(self._free, slot)
        self.version += 1

    def clear(self) -> None:
        self.slots, self.keys, self.by_ann, self.by_name, self._free = [], [], {}, {}, []
        self.version += 1

    def words(self) -> int:
        """Length of this cycle's vector: word 0 and one word per 64 slots in use."""
        return 1 + (len(self.slots) + 63) // 64

    def vector(self, quiet: bool, slots, out: Optional[np.ndarray] = None) -> np.ndarray:
        """This rank's vector: ``quiet`` (nothing to say beyond ``slots``, the slots of its
        waiting cached requests)."""
        n = self.words()
        vec = out if out is not None and len(out) == n else np.empty(n, dtype=np.uint64)
        bits = 0
        for s in slots:
            bits |= 1 << s
        vec[0] = 1 if quiet else 0
        vec[1:] = np.frombuffer(bits.to_bytes(8 * (n - 1), "little"), dtype=np.uint64)
        return vec

    @staticmethod
    def quiet(vec: np.ndarray) -> bool:
        """After the AND: no rank has anything beyond its cached requests to say."""
        return bool(vec[0])

    def ready(self, vec: np.ndarray) -> list:
        """After the AND: ``[(slot, Response)]`` of the requests every rank submitted."""
        slots = self.slots
        set_bits = np.flatnonzero(np.unpackbits(vec[1:].view(np.uint8), bitorder="little"))
        return [(slot, slots[slot]) for slot in set_bits.tolist()]
